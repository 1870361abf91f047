"""The job's position: what every worker of a multi-worker job handed out of each shard.

Under ``MultiWorkerMirroredStrategy`` and Ray Train every worker restores
the chief's checkpoint, so a checkpoint must say where the whole job was,
not one worker. One Ray actor per dataset (``JobPosition``, found by name
like the dynamic-sharding coordinator) keeps, for each *generation* of an
epoch, what each worker's iterator handed on, item by item, in the order TF
takes them: each worker's feeder reports a window's items (their shard and
place in its bundle) before it pushes them, and waits for the record, so
the record is never behind what TF took. A checkpoint saves the
generation's name with the iterator's position ``P`` (the native op's);
the job's position is then, per shard, what the first ``P`` items of every
worker of the generation held, on top of what the generation began with.

Synchronous training, checkpointed between steps, is what makes ``P`` the
position of every worker: each took as many items as the chief. A
generation begins with an epoch (``e<k>-n<n>``: this process's k-th epoch
of the dataset among ``n`` workers) or with a restore (``<parent>/<P>-n<m>``):
every restoring worker names the same one, and the first to ask makes it,
its start the job's position at ``P`` of its parent. A worker's record at
an item replaces what its index recorded there before, so a job started
afresh writes over its predecessor's generation of the same name.
"""

import asyncio
import collections
import sys
import time
import uuid

import ray
from ray import cloudpickle

from tfray._internal.runtime import ray_api
from tfray._internal.runtime.progress import Progress
from tfray._internal.runtime.status import BatchError, Code
from tfray._internal.runtime.streams import Wrapped

# By value, as coordinator.py: the actor's process never imports tfray.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NAMESPACE = "tfray"
# Generations kept: a restore names one of the recent ones.
_GENERATIONS_KEPT = 64
# A JobPosition no worker has called for this long ends itself: long enough
# for a preempted job to come back.
IDLE_S = 24 * 3600.0


class _Generation:
    """One generation: the job's position it began at, and each worker's record since.

    ``records[worker]`` lists ``(unit, index, count, size)`` runs in item
    order: ``count`` consecutive items of ``unit``, a bundle of ``size``
    batches from its ``index``-th (unit -1: an error, no batch), and
    ``lengths[worker]`` their running item totals.
    """

    def __init__(self, base, start):
        # {unit: (batches, bundles, done, size)}, the last two of a bundle
        # handed out in part; None if its parent was not known.
        self.base = base
        self.start = start  # The op's position when it began.
        self.records = collections.defaultdict(list)
        self.lengths = collections.defaultdict(list)

    def record(self, worker, at, runs):
        """``worker``'s runs from its item ``at`` on, replacing what it recorded from there."""
        records, lengths = self.records[worker], self.lengths[worker]
        while lengths and lengths[-1] > at:
            records.pop()
            lengths.pop()
        total = lengths[-1] if lengths else 0
        if total < at:  # A gap: the worker's items in between were not reported.
            raise ValueError(f"worker {worker} recorded up to item {total}, then from {at}")
        for run in runs:
            total += run[2]
            records.append(run)
            lengths.append(total)

    def at(self, position):
        """The job's position once each worker handed out ``position`` items (see the module doc).

        None if the generation began from a position not known.
        """
        if self.base is None:
            return None
        units = {unit: list(state) for unit, state in self.base.items()}
        items = max(0, position - self.start)
        for records in self.records.values():
            left = items
            for unit, index, count, size in records:
                if left <= 0:
                    break
                taken = min(count, left)
                left -= taken
                if unit < 0:
                    continue
                state = units.setdefault(unit, [0, 0, 0, 0])
                state[0] += taken
                if index == 0:
                    state[1] += 1
                done = index + taken
                state[2], state[3] = (done, size) if done < size else (0, 0)
        return {unit: tuple(state) for unit, state in units.items()}


@ray.remote(num_cpus=0)
class JobPosition:
    """One dataset's job position, generation by generation (see the module doc).

    An async actor: its methods never await, so they run one at a time and
    its state needs no lock.
    """

    def __init__(self, idle_s):
        self._generations = collections.OrderedDict()  # name -> _Generation.
        self._idle_s = idle_s
        self._last_call = None  # time.monotonic() of the latest call; None before the first.

    def _touch(self):
        if self._last_call is None:  # The first call: the actor's loop runs.
            asyncio.get_running_loop().create_task(self._exit_when_idle())
        self._last_call = time.monotonic()

    async def _exit_when_idle(self):
        # Detached (it must outlive the job's workers), so it ends itself
        # once none has called for idle_s.
        while time.monotonic() - self._last_call < self._idle_s:
            await asyncio.sleep(min(self._idle_s, 60.0))
        ray.actor.exit_actor()

    async def begin(self, name, parent=None, position=0):
        """Makes generation ``name`` (if new); from ``parent`` at ``position``, or afresh.

        Returns the job's position it begins at, or None if ``parent`` (or
        where it began) is not known.
        """
        self._touch()
        if name not in self._generations:
            if parent is None:
                base = {}
            elif parent in self._generations:
                base = self._generations[parent].at(position)
            else:
                base = None
            self._generations[name] = _Generation(base, position)
            while len(self._generations) > _GENERATIONS_KEPT:
                self._generations.popitem(last=False)
        return self._generations[name].base

    async def record(self, name, worker, at, runs):
        self._touch()
        self._generations[name].record(worker, at, runs)

    async def at(self, name, position):
        """The job's position in generation ``name`` at ``position``, or None if it is unknown."""
        self._touch()
        generation = self._generations.get(name)
        return None if generation is None else generation.at(position)


def connect(name):
    """The JobPosition named ``name``, made by the first worker to ask."""
    return JobPosition.options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote(IDLE_S)


class Client:
    """One worker's side of its dataset's JobPosition: how epochs are named and recorded.

    Args:
        name: the actor's name (from the dataset's stable key).
        worker: this worker's index in the job (its share), or None for an
            anonymous one (dynamic sharding's).
        workers: how many workers share the dataset (None: any number).
    """

    def __init__(self, name, *, worker, workers):
        self.name = name
        self.worker = uuid.uuid4().hex if worker is None else worker
        self.workers = workers
        self._handle = None  # Connected when first needed.
        self._fresh = 0  # Epochs begun afresh in this process.

    def open(self, restored, position, fresh=None, must_know=False):
        """``(generation, job position)`` of a new epoch's stream.

        ``restored``: the checkpoint's generation, if the epoch is restored
        (at ``position``); the job's position is then
        ``{unit: (batches, bundles, done, size)}``, or None if the actor no
        longer knows that generation (the Ray cluster that kept it is gone).
        A lone worker's fresh epoch is not recorded (generation None): its
        own checkpoints say where it is. ``fresh``: the name of a fresh
        generation, when workers agree on one otherwise (dynamic sharding's
        coordinator epoch); by default this process's epochs are counted.
        ``must_know``: a job position not known raises a FAILED_PRECONDITION
        BatchError instead.
        """
        if self.workers == 1 and not restored:
            return None, None
        suffix = "" if self.workers is None else f"-n{self.workers}"
        if restored:
            name = f"{restored}/{position}{suffix}"
            units = self._call("begin", name, restored, position)
            if units is None and must_know:
                raise BatchError(
                    Code.FAILED_PRECONDITION,
                    f"tfray: the job's position of the checkpoint's epoch ({restored}) is gone: "
                    "the Ray cluster that kept it was shut down, and each worker restores the "
                    "chief's checkpoint, which holds only the chief's share. Restore on the Ray "
                    "cluster the job ran on, with as many workers as it had, or start a new epoch.",
                )
            return name, units
        name = fresh or f"e{self._fresh}{suffix}"
        self._fresh += 1
        self._call("begin", name)
        return name, None

    def record(self, generation, at, runs):
        self._call("record", generation, self.worker, at, runs)

    def recorded(self, stream, generation):
        """``stream``, its items recorded in ``generation`` as the feeder takes them."""
        return Recorded(stream, self, generation)

    @staticmethod
    def progress(units, own):
        """The Progress of job position ``units`` over this worker's shards ``own``."""
        return progress_of(units, own)

    def _call(self, method, *args):
        if self._handle is None:
            self._handle = connect(self.name)
        ref = ray_api.call(getattr(self._handle, method).remote, *args)
        ray_api.poll([ref], None)  # Never blocks in Ray (ray_api).
        return ray_api.get(ref)


def runs_of(items):
    """The ``(unit, index, count, size)`` runs of ``items`` (see _Generation), in order."""
    runs = []
    for label, _, _ in items:
        unit, index, size = getattr(label, "origin", (-1, 0, 1))
        last = runs[-1] if runs else None
        if last is not None and last[0] == unit and unit >= 0 and last[1] + last[2] == index and last[3] == size:
            runs[-1] = (unit, last[1], last[2] + 1, size)
        else:
            runs.append((unit, index, 1, size))
    return runs


class Recorded(Wrapped):
    """An ItemStream whose items are recorded in the job's position (generation ``generation``) before the feeder pushes them."""

    def __init__(self, stream, client, generation):
        super().__init__(stream)
        self._client = client
        self._generation = generation
        self._items = 0  # Items recorded so far.

    def next_ready(self, timeout):
        items = self._stream.next_ready(timeout)
        if items:
            self._client.record(self._generation, self._items, runs_of(items))
            self._items += len(items)
        return items


def progress_of(units, own):
    """The Progress of job position ``units`` (``{unit: (batches, bundles, done, size)}``) over shards ``own``."""
    mine = {unit: state for unit, state in units.items() if unit in own}
    return Progress(
        {unit: (batches, bundles) for unit, (batches, bundles, _, _) in mine.items()},
        {unit: (done, size) for unit, (_, _, done, size) in mine.items() if size},
    )
