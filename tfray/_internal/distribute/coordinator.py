"""The coordinator of ``sharding="dynamic"``: one Ray actor per dataset that hands out work.

Every worker process that builds the same dataset finds the same actor, by
name, in the ``tfray`` namespace (so drivers of separate jobs, e.g. the
processes of a ``MultiWorkerMirroredStrategy`` cluster, share it too). Each
epoch it hands the dataset's work units (a ref, or a generator shard) to
whichever worker asks next: a slow worker asks less often, so takes less.

Leases: a worker holds the units it took until it reports them finished. A
worker not heard from for longer than ``lease_s`` (its process is gone, or
so stalled that its heartbeat thread cannot run) loses its unfinished units;
they go back to the front of the epoch's queue for the others. Each call
renews, and a heartbeat thread in each process renews while its workers
wait on TensorFlow. The first worker to make the coordinator sets
``lease_s`` for all.

Epochs: each worker counts its own. A worker's epoch ends when all of that
epoch's units were handed out and finished, so a worker that runs dry waits
for the others' units (and takes them over if their leases run out).
"""

import asyncio
import collections
import logging
import sys
import time

import ray
from ray import cloudpickle

from tfray._internal.runtime import ray_api

# By value, like the producers (generators.py): by reference, the actor's
# process would import tfray, and with it TensorFlow (seconds, hundreds of MB).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

logger = logging.getLogger("tfray")

NAMESPACE = "tfray"
# Epochs of state kept for workers still behind the newest one.
_EPOCHS_KEPT = 8


class _Epoch:
    """One epoch's units: waiting, and leased (unit -> worker); the rest are finished."""

    def __init__(self, num_units, order=None):
        self.waiting = collections.deque(range(num_units) if order is None else order)
        self.leased = {}
        self.taken = collections.defaultdict(list)  # worker -> units handed to it.

    @property
    def over(self):
        return not self.waiting and not self.leased


@ray.remote(num_cpus=0)
class Coordinator:
    """Hands out one dataset's work units, epoch by epoch (see the module doc).

    An async actor: its methods run one at a time on one event loop and never
    await while they change state, so the state needs no lock.
    """

    def __init__(self, num_units, lease_s, idle_s):
        self._num_units = num_units
        self._lease_s = lease_s
        self._idle_s = idle_s
        self._epochs = {}  # epoch -> _Epoch.
        self._next_epoch = {}  # worker -> the epoch its next iterator reads.
        self._restored = {}  # generation restored (position.py) -> its epoch.
        self._seen = {}  # worker -> time.monotonic() of its latest call.
        self._changed = None  # asyncio.Event, set on a change; made on the actor's loop.
        self._last_call = time.monotonic()

    async def join(self, worker):
        """Registers ``worker``; returns the number of units handed out."""
        self._touch(worker)
        return self._num_units

    async def begin(self, worker, generation=None, order=None):
        """Starts an iterator of ``worker``; returns the number of its epoch.

        That is the epoch after the last one this worker saw end, so an
        iterator dropped early (Keras may drop one unread at an epoch's end) leaves
        its epoch to the worker's next iterator. A worker new to the dataset
        joins the oldest epoch not over, to help the others finish it.

        A restored iterator names the ``generation`` of the job's position
        it resumes (position.py): its epoch is a new one, the same for every
        worker that restores it, which hands out its units in ``order``.
        """
        self._touch(worker)
        if generation is not None:
            if generation not in self._restored:
                self._restored[generation] = max(self._epochs, default=-1) + 1
                self._epoch(self._restored[generation], order)
            self._next_epoch[worker] = self._restored[generation]
        if worker not in self._next_epoch:
            running = [e for e, state in self._epochs.items() if not state.over]
            self._next_epoch[worker] = min(running, default=max(self._epochs, default=-1) + 1)
        epoch = self._next_epoch[worker]
        self._epoch(epoch)
        return epoch

    async def acquire(self, worker, epoch, n, finished, wait_s):
        """Reports ``finished`` units and leases up to ``n`` more.

        Waits up to ``wait_s`` while none is free but the epoch is not over.

        Returns:
            ``(units, over)``: the units now leased to ``worker``, and whether
            the epoch is over (every unit finished).
        """
        self._touch(worker)
        state = self._epoch(epoch)
        self._finish(state, worker, finished)
        deadline = time.monotonic() + wait_s
        while True:
            self._expire()
            units = []
            # However far ahead it reads, a worker holds at most half its fair
            # share of the epoch: a fast one must not take what a slower one,
            # or one that starts a moment later, would have read meanwhile.
            share = -(-self._num_units // (2 * len(self._seen)))
            held = sum(1 for w in state.leased.values() if w == worker)
            while state.waiting and len(units) < min(n, share - held):
                unit = state.waiting.popleft()
                state.leased[unit] = worker
                state.taken[worker].append(unit)
                units.append(unit)
            left = deadline - time.monotonic()
            if state.over:
                self._next_epoch[worker] = max(self._next_epoch.get(worker, 0), epoch + 1)
            if units or state.over or left <= 0:
                return units, state.over
            try:
                # Set when a unit is finished or returned; the leases need
                # checking meanwhile too, hence the cap.
                await asyncio.wait_for(self._changed.wait(), min(left, self._lease_s / 4))
            except asyncio.TimeoutError:
                pass

    async def release(self, worker, epoch, finished, unfinished):
        """``worker`` stops reading ``epoch``: ``unfinished`` go to the others."""
        self._touch(worker)
        state = self._epoch(epoch)
        self._finish(state, worker, finished)
        returned = sorted(u for u in unfinished if state.leased.get(u) == worker)
        for unit in reversed(returned):
            del state.leased[unit]
            state.waiting.appendleft(unit)
        if returned:
            self._notify()

    async def renew(self, workers):
        """Keeps the leases of ``workers`` (alive, waiting on TensorFlow)."""
        for worker in workers:
            self._touch(worker)

    async def taken(self):
        """``{epoch: {worker: [units handed to it]}}`` for the epochs kept."""
        return {e: dict(state.taken) for e, state in self._epochs.items()}

    def _epoch(self, epoch, order=None):
        if epoch not in self._epochs:
            self._epochs[epoch] = _Epoch(self._num_units, order)
            for old in [e for e in self._epochs if e <= epoch - _EPOCHS_KEPT]:
                del self._epochs[old]
        return self._epochs[epoch]

    def _finish(self, state, worker, units):
        for unit in units:
            # A unit whose lease ran out and went to another worker stays
            # with that worker; this one finished it anyway.
            if state.leased.get(unit) == worker or unit in state.waiting:
                state.leased.pop(unit, None)
                if unit in state.waiting:
                    state.waiting.remove(unit)
        if units:
            self._notify()

    def _expire(self):
        now = time.monotonic()
        gone = {w for w, seen in self._seen.items() if now - seen > self._lease_s}
        if not gone:
            return
        for worker in gone:
            del self._seen[worker]
        for epoch, state in self._epochs.items():
            returned = sorted(u for u, w in state.leased.items() if w in gone)
            for unit in reversed(returned):  # To the front: they are the oldest.
                del state.leased[unit]
                state.waiting.appendleft(unit)
            if returned:
                logger.warning(
                    "tfray: epoch %d: %d unit(s) of worker(s) that stopped renewing "
                    "their lease go to the others",
                    epoch,
                    len(returned),
                )
        self._notify()

    def _touch(self, worker):
        self._seen[worker] = self._last_call = time.monotonic()
        if self._changed is None:  # The first call: the actor's loop runs.
            self._changed = asyncio.Event()
            asyncio.get_running_loop().create_task(self._exit_when_idle())

    def _notify(self):
        # Wakes the waiters of the current event; later ones wait on a new one.
        self._changed.set()
        self._changed = asyncio.Event()

    async def _exit_when_idle(self):
        # Detached (it must outlive whichever worker made it), so it ends
        # itself once no worker has called for idle_s.
        while time.monotonic() - self._last_call < self._idle_s:
            await asyncio.sleep(min(self._idle_s, 10.0))
        ray.actor.exit_actor()


def connect(name, *, num_units, lease_s, idle_s):
    """The coordinator named ``name``, made by the first worker to ask."""
    return Coordinator.options(
        name=name,
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        # Waiting workers park in acquire() calls: let many wait at once.
        max_concurrency=1000,
    ).remote(num_units, lease_s, idle_s)


class Client:
    """One worker's side of a coordinator: its id, handle and lease renewal."""

    def __init__(self, name, *, worker, num_units, lease_s, idle_s, heartbeat):
        self.name = name
        self.worker = worker
        self.lease_s = lease_s
        self._args = dict(num_units=num_units, lease_s=lease_s, idle_s=idle_s)
        self._handle = connect(name, **self._args)
        theirs = self._call("join", self.worker)
        if theirs != num_units:
            raise ValueError(
                f"sharding='dynamic': this dataset has {num_units} work units, but the "
                f"coordinator named {name!r} hands out {theirs}: the workers built "
                "different datasets under one name. Give each dataset its own name "
                "(tfray.DynamicSharding(name=...)), or build the same dataset everywhere."
            )
        heartbeat.add(self)  # Renews its leases.

    def begin(self, generation=None, order=None):
        return self._call("begin", self.worker, generation, order)

    def acquire(self, epoch, n, finished, wait_s):
        return self._call("acquire", self.worker, epoch, n, list(finished), wait_s)

    def release(self, epoch, finished, unfinished):
        return self._call("release", self.worker, epoch, list(finished), list(unfinished))

    def renew(self):
        ray_api.call(self._handle.renew.remote, [self.worker])

    def _call(self, method, *args):
        try:
            return self._result(ray_api.call(getattr(self._handle, method).remote, *args))
        except ray.exceptions.ActorDiedError:
            # It ended itself after a long idle spell: a fresh one (with no
            # history) takes its place under the same name.
            self._handle = connect(self.name, **self._args)
            return self._result(ray_api.call(getattr(self._handle, method).remote, *args))

    @staticmethod
    def _result(ref):
        ray_api.poll([ref], None)  # Never blocks in Ray (ray_api).
        return ray_api.get(ref)
