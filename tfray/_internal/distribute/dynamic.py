"""``sharding="dynamic"``: each worker takes work units from a shared coordinator as it goes.

The work units are a ``from_refs`` dataset's refs (one unit each) or a
``from_generators`` dataset's shards. Every worker process that builds the
dataset (same refs, or same generator function and shards; or the same
``DynamicSharding(name=...)``) reads from one coordinator actor
(coordinator.py), which hands each unit of an epoch to one worker, on
demand: a worker that consumes slowly asks less often, so it takes less.

A unit is finished when TensorFlow has taken every batch of it from tfray
(not merely resolved or queued them), so a worker that dies or drops its
iterator leaves its unfinished units, and the batches it had queued, to the
others. Batches that tf.data transformations after the source hold (a
prefetch buffer, a shuffle buffer) count as taken: a dying worker loses
those with its process. A unit whose worker was taken for dead while it was
only slow may be read twice; with no failure, each unit is read once.

A worker reads ahead (the look-ahead adapts for refs), but holds at most half
its fair share of an epoch's units (coordinator.py), so a fast worker cannot
take everything before a slower one asks.
"""

import collections
import functools
import hashlib
import uuid

import ray

from tfray._internal.distribute import coordinator, position
from tfray._internal.runtime.resolver import RefResolver
from tfray._internal.runtime.streams import Unplaced
from tfray._internal.runtime.status import BatchError, Code
from tfray._internal.sources import UNKNOWN_CARDINALITY, Source
from tfray._internal.sources.bundles import BundledRefs, batches_in, unbundle

# A coordinator no worker has called for this long ends itself.
_IDLE_S = 600.0


class DynamicSource(Source):
    """Reads the units of ``whole`` that the coordinator hands this worker.

    Args:
        whole: the source every worker builds (refs or generators).
        options: a DynamicSharding.
        heartbeat: the runtime's Heartbeat, which renews this worker's leases.
    """

    cardinality = UNKNOWN_CARDINALITY  # The share is decided as it is read.
    # Never started ahead of an iterator: it would lease units that no
    # iterator may come to read.
    replays = False

    def __init__(self, whole, options, heartbeat):
        key, num_units, self._at_once = whole.work_units()
        if options.name is None and key is None:
            raise ValueError(
                "sharding='dynamic': this dataset's generator function (a lambda or a "
                "callable object) has no name that is the same in every worker process, "
                "so the workers cannot find one coordinator by it. Name the dataset: "
                "sharding=tfray.DynamicSharding(name='...'), the same name on every worker."
            )
        digest = hashlib.sha256((options.name or key).encode()).hexdigest()[:24]
        name = options.name or "tfray-dynamic-" + digest
        self._whole = whole
        self._num_units = num_units
        # The job's position, for a whole whose batches carry their units.
        self._position = position.Client("tfray-position-" + digest, worker=None, workers=None) if whole.has_units else None
        self.client = coordinator.Client(
            name,
            worker=uuid.uuid4().hex,
            num_units=num_units,
            lease_s=float(options.lease_timeout_s),
            idle_s=_IDLE_S,
            heartbeat=heartbeat,
        )
        super().__init__(whole.spec_only(), capacity=whole.capacity)

    def open_epoch(self, *, deterministic, skip=0, progress=None, resume_info=None, taken=None):
        """A worker's epoch of the units the coordinator hands it.

        A restored one resumes the job's position (position.py), which every
        worker's iterator records as it reads: a new coordinator epoch hands
        out every unit again, those begun first, and each starts where the
        job left it. Its units are a generator's shards; refs carry no units
        to record.
        """
        restored = (resume_info or {}).get("job")
        if skip and (self._position is None or not restored):
            raise BatchError(
                Code.FAILED_PRECONDITION,
                "tfray: an iterator of a sharding='dynamic' dataset of refs cannot be "
                "restored from a checkpoint: which units each worker read is "
                "decided as it reads, and refs do not record it. Checkpoint the "
                "model and start a new epoch, or read the refs from producers "
                "(from_generators).",
            )
        unit_refs = self._whole.unit_refs
        if skip:
            generation, units = self._position.open(restored, skip, must_know=True)
            progress = position.progress_of(units, set(range(self._num_units)))
            order = sorted(progress.units) + [u for u in range(self._num_units) if u not in progress.units]
            epoch = self.client.begin(generation, order)
            unit_refs = functools.partial(unit_refs, progress=progress)
        else:
            epoch = self.client.begin()
            generation = None
            if self._position is not None:
                generation, _ = self._position.open(None, 0, fresh=f"e{epoch}")
        units = UnitRefs(self.client, epoch, unit_refs, self._at_once)
        # Adaptive for refs (unless max_inflight fixes it): a consumer that
        # waits for input asks for more units at a time, a slow one does not.
        stream = DynamicEpoch(units, self._whole.lookahead(), taken)
        if generation is not None:
            stream = self._position.recorded(stream, generation)
            stream.resume_info = {"job": generation}  # What its checkpoints save (registry.py).
        return stream


class UnitRefs(BundledRefs):
    """The ref stream of one worker's epoch: refs of the units it is handed (a generator unit's are bundles).

    Args:
        client: the worker's coordinator.Client.
        epoch: the epoch number the coordinator gave this iterator.
        unit_refs: ``unit_refs(unit)``: the ref stream of one unit.
        at_once: units read at once (generator shards: the producers that
            run together), or None for one per ref wanted (refs).
    """

    def __init__(self, client, epoch, unit_refs, at_once):
        self._client = client
        self.epoch = epoch
        self._unit_refs = unit_refs
        self._at_once = at_once
        if at_once is None:  # Units of plain refs: a batch each, nothing to count.
            self.batches_held = None
        self._open = collections.OrderedDict()  # unit -> its ref stream, not yet ended.
        self._unit_of = {}  # label -> unit, for refs handed on and not yet taken by TF.
        # unit -> its refs handed on and not yet taken by TF; a key for each
        # unit leased and not finished.
        self._left = collections.Counter()
        self._finished = []  # Units TF took whole; not yet reported.
        self._over = False
        self.done = False

    def take(self, n, timeout):
        """Up to n ``(label, ref)`` pairs; asks for units when it runs short."""
        out = self._take_open(n, 0)
        wanted = n - len(out) if self._at_once is None else self._at_once - len(self._open)
        if not self._over and (wanted > 0 or self._finished):
            units, self._over = self._client.acquire(
                self.epoch, max(wanted, 0), self._report(), 0 if out else timeout
            )
            for unit in units:
                self._open[unit] = self._unit_refs(unit)
                self._left[unit] = 0
            out += self._take_open(n - len(out), 0 if out else timeout)
        self.done = self._over and not self._open
        return out

    @property
    def unplaced(self):
        """The open units' producers that cannot be placed, as one Unplaced (or None)."""
        # Read by stats() from another thread: list() copies the values at once.
        streams = list(self._open.values())
        waiting = [u for u in (getattr(s, "unplaced", None) for s in streams) if u is not None]
        if not waiting:
            return None
        return Unplaced(sum(u.producers for u in waiting), min(u.since for u in waiting))

    def taken_by_tf(self, labels):
        """Notes that TensorFlow took the batches of ``labels``."""
        for label in labels:
            unit = self._unit_of.pop(label)
            self._left[unit] -= 1
            self._check_finished(unit)

    def close(self):
        """Gives back this epoch's units TF did not take whole (an early end)."""
        for stream in self._open.values():
            stream.close()
        self._open.clear()
        unfinished = list(self._left)
        if (unfinished or self._finished) and ray.is_initialized():
            try:
                self._client.release(self.epoch, self._report(), unfinished)
            except ray.exceptions.RayError:
                pass  # The coordinator is gone: nobody waits for these units.
        self._left.clear()
        self.done = True

    def _take_open(self, n, timeout):
        out = []
        for unit, stream in list(self._open.items()):
            if len(out) >= n:
                break
            # Waits only on the first unit, and only when nothing is ready.
            for label, ref in stream.take(n - len(out), timeout if not out else 0):
                self._unit_of[label] = unit
                self._left[unit] += 1
                out.append((label, ref))
            timeout = 0
            if stream.done:
                del self._open[unit]
                self._check_finished(unit)
        return out

    def _check_finished(self, unit):
        if unit not in self._open and self._left.get(unit) == 0:
            del self._left[unit]
            self._finished.append(unit)

    def _report(self):
        finished, self._finished = self._finished, []
        return finished


class DynamicEpoch:
    """One worker's epoch: its units' refs, resolved ahead in bulk.

    A RefResolver over UnitRefs that, before each read, tells the units which
    batches TensorFlow has taken since: ``taken()`` counts the items (batches
    and errors) TF took from the epoch's channel, which leave it in the order
    they were handed on. A batch the feeder refuses (it does not match the
    element spec) goes on as an error in its place, so it is counted too.
    """

    def __init__(self, units, lookahead, taken):
        self._units = units
        self._resolver = RefResolver(units, lookahead=lookahead)
        self._taken_now = taken
        # (label, items) of the refs handed on and not yet all taken, in order.
        self._handed = collections.deque()
        self._taken = 0  # Items TensorFlow took so far.

    @property
    def lookahead(self):
        return self._resolver.lookahead

    @property
    def in_flight(self):
        return self._resolver.in_flight

    @property
    def unplaced(self):
        return self._resolver.unplaced

    def next_ready(self, timeout):
        self._note_taken()
        items = self._resolver.next_ready(timeout)
        if not items:
            return items
        # A unit's ref is taken once TF took every batch it holds.
        self._handed.extend((label, batches_in(label, value)) for label, value, _ in items)
        return unbundle(items)

    def close(self):
        self._note_taken()
        self._resolver.close()  # Closes the units too: any not taken go back.

    def _note_taken(self):
        taken = self._taken_now()
        count, self._taken = taken - self._taken, taken
        labels = []
        while count:
            label, left = self._handed[0]
            if count < left:
                self._handed[0] = (label, left - count)
                break
            count -= left
            labels.append(self._handed.popleft()[0])
        self._units.taken_by_tf(labels)
