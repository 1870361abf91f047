"""Sources: what a tfray dataset reads, and how each epoch of it starts.

A source knows its element spec, cardinality and channel capacity, and opens
a stream per epoch (see feeder.py for what a stream is). Without an
element_spec, refs and generators learn it from a first batch: generators run
one producer to its first batch and stop it (a paused producer task would
keep its CPU from every other dataset's producers). Ray Data takes it from
the dataset's schema, as ``to_tf`` does, and starts nothing until read.
"""

import collections
import itertools
import logging
import numbers
import threading

import ray

from tfray._internal import ray_data, resume
from tfray._internal.generators import (
    GeneratorShards,
    check_generator_function,
    concurrency,
    stable_name,
)
from tfray._internal.runtime import ray_errors, spec
from tfray._internal.runtime.lookahead import START, LookAhead
from tfray._internal.runtime.resolver import RefList, RefResolver
from tfray._internal.runtime.status import BatchError, Code

logger = logging.getLogger("tfray")

UNKNOWN_CARDINALITY = -2


def ensure_ray():
    """Starts a local Ray if none is running, and says so."""
    if not ray.is_initialized():
        ray.init()
        logger.warning(
            "tfray: Ray was not initialized; started a local Ray instance "
            "(call ray.init() first to choose its resources)."
        )


def positive_int(name, value):
    """``value`` as an int >= 1 (numpy ints too), or a TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return int(value)


class Source:
    """What every source has: a spec, a bound, and its recent epochs' feeders."""

    cardinality = UNKNOWN_CARDINALITY
    replays = False  # Every epoch has the same batches: the next may start early.
    kind = "tfray.Dataset"  # What the user built, for messages.
    # A tf function from the op's dense element (``wire_spec``) to the
    # source's (``element_spec``), mapped over the op; None: they are one.
    decode = None

    def __init__(self, element_spec, capacity):
        self.session = ray_errors.session()  # Its refs and producers live in this one.
        self._element_spec = element_spec  # None: learned on first use.
        self._flat_spec = None
        self.capacity = capacity  # Batches each epoch's channel holds.
        self.epochs = 0  # Epochs started; the dispatcher's alone.
        self._lock = threading.Lock()
        self._feeders = collections.deque(maxlen=256)  # For stats(); guarded by _lock.
        self._offered = None  # The feeder of an epoch offered ahead; guarded by _lock.

    @property
    def element_spec(self):
        self._learn_spec()
        return self._element_spec

    @property
    def wire_spec(self):
        """The spec of what the op carries: dense tensors only."""
        self._learn_spec()
        return self._wire_spec()

    def _wire_spec(self):
        return self._element_spec

    @property
    def flat_spec(self):
        return self._learn_spec()

    def _learn_spec(self):
        if self._flat_spec is None:
            if self._element_spec is None:
                self._element_spec = self._infer_spec()
            self._flat_spec = spec.FlatSpec(self._wire_spec())  # Checks it, too.
        return self._flat_spec

    def _infer_spec(self):
        raise NotImplementedError

    def open_epoch(self, *, deterministic, skip=0):
        """A stream of one epoch, past its first ``skip`` items (see resume.py)."""
        raise NotImplementedError

    def shard(self, num_shards, index):
        """A source of this one's share ``index`` of ``num_shards``."""
        raise TypeError(
            f"{type(self).__name__} cannot be sharded at the source; shard the "
            "data before it reaches tfray (for Ray Data: Ray Train's "
            "get_dataset_shard, or Dataset.split)."
        )

    def work_units(self):
        """For ``sharding="dynamic"``: ``(key, count, at_once)`` of its work units."""
        raise TypeError(
            f"sharding='dynamic' hands out refs or generator shards; {type(self).__name__} "
            "has neither (for Ray Data: Ray Train's get_dataset_shard, or "
            "Dataset.streaming_split, already hands out blocks on demand)."
        )

    def lookahead(self):
        """The look-ahead of a new epoch: fixed, at the channel's capacity."""
        return LookAhead(fixed=self.capacity)

    def record(self, feeder):
        with self._lock:
            self._feeders.append(feeder)

    def has_offer(self):
        with self._lock:
            return self._offered is not None

    def offer(self, feeder, publish):
        """Offers the epoch ``feeder`` fills to the next iterator, via ``publish()``.

        False if there is an offer already or ``publish()`` fails. Under the
        lock, so the dispatcher cannot see the offer taken before it is kept.
        """
        with self._lock:
            if self._offered is not None or not publish():
                return False
            self._offered = feeder
            return True

    def take_offered(self):
        """An iterator took the offered epoch: it counts from now on."""
        with self._lock:
            feeder, self._offered = self._offered, None
            if feeder is not None:
                self._feeders.append(feeder)

    def feeders(self):
        with self._lock:
            feeders, offered = list(self._feeders), self._offered
        # An offer taken, but not yet known to the dispatcher, is an epoch too.
        if offered is not None and offered.channel.stats()["get_next_calls"]:
            feeders.append(offered)
        return feeders

    def close(self):
        """Forgets an epoch no iterator took (the dataset is gone)."""
        with self._lock:
            self._offered = None  # Unregistering cancelled its channel.


class RefsSource(Source):
    """ObjectRefs: a sequence (replayable) or an iterator (read once)."""

    kind = "from_refs"

    def __init__(self, refs, *, element_spec, max_inflight, max_inflight_bytes):
        self._options = dict(max_inflight=max_inflight, max_inflight_bytes=max_inflight_bytes)
        self._max_inflight = None if max_inflight is None else positive_int("max_inflight", max_inflight)
        self._budget = None if max_inflight_bytes is None else positive_int("max_inflight_bytes", max_inflight_bytes)
        self._learned = START  # The adaptive look-ahead the last epoch reached.
        if isinstance(refs, ray.ObjectRef):
            refs = [refs]
        if isinstance(refs, (list, tuple)):
            self._refs, self._iterator = list(refs), None
            self.replays = True
            self.cardinality = len(self._refs)
            first = self._refs[0] if self._refs else None
        else:
            try:
                iterator = iter(refs)
            except TypeError:
                raise TypeError(
                    "from_refs: expected a list of ray.ObjectRef or an iterator of "
                    f"them, got {type(refs).__name__}"
                ) from None
            first = next(iterator, None)
            self._refs = None
            self._iterator = iterator if first is None else _prepend(first, iterator)
        for ref in self._refs if self._refs is not None else [first] * (first is not None):
            if not isinstance(ref, ray.ObjectRef):
                raise TypeError(f"from_refs: expected ray.ObjectRef items, got {type(ref).__name__}")
        if element_spec is None:
            if first is None:
                raise ValueError("from_refs: cannot infer element_spec from no refs; pass element_spec.")
            element_spec = spec.infer(ray.get(first))
        super().__init__(element_spec, capacity=self._max_inflight or START)

    def work_units(self):
        """For ``sharding="dynamic"``: ``(key, count, at_once)``, a unit per ref.

        ``key`` is the same in every process that holds the same refs;
        ``at_once`` is None: as many units as refs are wanted.
        """
        if self._refs is None:
            raise TypeError("sharding='dynamic' needs a list of refs; a one-shot iterator cannot be handed out")
        return "refs:" + ",".join(ref.hex() for ref in self._refs), len(self._refs), None

    def unit_refs(self, unit):
        """The ref stream of work unit ``unit``: its one ref."""
        return RefList([self._refs[unit]], start=unit)

    def shard(self, num_shards, index):
        if self._refs is None:
            raise TypeError("a one-shot iterator of refs cannot be sharded; pass a list of refs")
        return RefsSource(
            self._refs[index::num_shards], element_spec=self.element_spec, **self._options
        )

    def open_epoch(self, *, deterministic, skip=0):
        if self._refs is not None:
            refs = self._refs[skip:]
        elif self._iterator is not None:
            refs, self._iterator = itertools.islice(self._iterator, skip, None), None
        else:
            raise BatchError(
                Code.FAILED_PRECONDITION,
                "tfray: this dataset was built from a one-shot iterator of refs and "
                "has been read once already. Pass a list of refs to from_refs to "
                "read it again (each iterator is a new epoch).",
            )
        return RefResolver(RefList(refs, start=skip), lookahead=self.lookahead())

    def _remember(self, limit):
        self._learned = limit

    def lookahead(self):
        """Fixed at ``max_inflight``, or adapting from where the last epoch got to."""
        if self._max_inflight is None and self._budget is None:
            self._budget = _default_budget()  # Once: it asks the cluster.
        return LookAhead(
            fixed=self._max_inflight,
            budget_bytes=self._budget,
            start=self._learned,
            on_change=self._remember,
        )


def _default_budget():
    """A quarter of this node's object store."""
    return int(ray.cluster_resources().get("object_store_memory", 0) // 4) or None


def _prepend(first, iterator):
    yield first
    yield from iterator


class GeneratorSource(Source):
    """``fn(shard)`` generators, each run as a streaming Ray task per epoch."""

    kind = "from_generators"

    def __init__(
        self, fn, shards, *, element_spec, max_inflight_per_producer, deterministic, ray_remote_args
    ):
        if not callable(fn):
            raise TypeError(f"from_generators: fn must be callable, got {type(fn).__name__}")
        check_generator_function(fn)
        if isinstance(shards, bool) or not isinstance(shards, (numbers.Integral, list, tuple)):
            raise TypeError(
                f"from_generators: shards must be an int or a list, got {type(shards).__name__}"
            )
        if isinstance(shards, numbers.Integral):
            shards = range(positive_int("shards", shards))
        self._shards = list(shards)
        if not self._shards:
            raise ValueError("from_generators: shards is empty")
        if deterministic not in (None, True, False):
            raise TypeError(f"deterministic: expected None or a bool, got {deterministic!r}")
        if ray_remote_args is not None and not isinstance(ray_remote_args, dict):
            raise TypeError(f"ray_remote_args: expected a dict, got {type(ray_remote_args).__name__}")
        self._fn = fn
        self._per_producer = positive_int("max_inflight_per_producer", max_inflight_per_producer)
        self._deterministic = deterministic
        self._ray_remote_args = ray_remote_args
        # The most batches resolved ahead: as many per running producer as
        # each may have waiting in Ray.
        self._window = self._per_producer * concurrency(len(self._shards), ray_remote_args)
        # Without element_spec, it is learned when first asked for: by then a
        # worker's share is known, and only the share's producers run.
        super().__init__(element_spec, capacity=self._window)

    def work_units(self):
        """For ``sharding="dynamic"``: ``(key, count, at_once)``, a unit per shard.

        ``key`` names the function and the shards, the same in every process
        (None if the function has no such name); ``at_once`` is how many
        producers can run together.
        """
        name = stable_name(self._fn)
        key = None if name is None else f"generators:{name}:{self._shards!r}"
        return key, len(self._shards), concurrency(len(self._shards), self._ray_remote_args)

    def unit_refs(self, unit):
        """The ref stream of work unit ``unit``: shard ``unit``'s producer."""
        return self._producer(unit, self._per_producer)

    def _producer(self, number, max_inflight):
        """The ref stream of shard ``number`` alone."""
        return GeneratorShards(
            self._fn,
            [self._shards[number]],
            max_inflight_per_producer=max_inflight,
            ray_remote_args=self._ray_remote_args,
            concurrency=1,
            shard_numbers=[number],
        )

    def shard(self, num_shards, index):
        return GeneratorSource(
            self._fn,
            self._shards[index::num_shards],
            element_spec=self._element_spec,
            max_inflight_per_producer=self._per_producer,
            deterministic=self._deterministic,
            ray_remote_args=self._ray_remote_args,
        )

    def _start(self):
        return GeneratorShards(
            self._fn,
            self._shards,
            max_inflight_per_producer=self._per_producer,
            ray_remote_args=self._ray_remote_args,
            concurrency=concurrency(len(self._shards), self._ray_remote_args),
        )

    def _infer_spec(self):
        # Runs one producer at a time, only to its first batch, and stops it:
        # an epoch started here and left unread would hold its CPUs, and the
        # next dataset's producers (a validation set, say) could never start.
        for number in range(len(self._shards)):
            stream = self._producer(number, 1)
            try:
                first = stream.take(1, timeout=None)
                if first:
                    label, ref = first[0]
                    try:
                        return spec.infer(ray.get(ref))
                    except ray.exceptions.RayTaskError as e:
                        raise ValueError(
                            f"from_generators: {label} raised while inferring element_spec: {e}"
                        ) from e
            finally:
                stream.close()
        raise ValueError("from_generators: no shard yielded a batch; pass element_spec.")

    def open_epoch(self, *, deterministic, skip=0):
        shards = self._start()
        shards.deterministic = deterministic if self._deterministic is None else self._deterministic
        if skip:
            if not shards.deterministic:
                resume.warn_inexact("from_generators", skip, "its shards interleave first-ready (deterministic=False)")
            shards = resume.SkippedRefs(shards, skip)
        # Starts small and grows only while TF waits, within the window and
        # a quarter of the store, as from_refs' does: what an epoch pins
        # ahead stays bounded whatever the batches' size.
        lookahead = LookAhead(
            budget_bytes=_default_budget(), start=min(START, self._window), cap=self._window
        )
        return RefResolver(shards, lookahead=lookahead)


class RayDataSource(Source):
    """A Ray Data Dataset or DataIterator, streamed once per epoch.

    Nothing runs until an iterator reads: the spec comes from the schema
    (see ``ray_data.layout``), and each epoch starts at its first read.
    """

    kind = "from_ray_data"

    def __init__(self, data, *, layout, capacity, iter_batches_args):
        self._data = data
        self._layout = layout
        self._capacity = capacity
        self._iter_batches_args = iter_batches_args
        if not layout.dense:
            self.decode = layout.decode
        super().__init__(layout.element_spec, capacity=capacity)

    def _wire_spec(self):
        return self._layout.wire_spec

    def _start(self):
        import ray.data

        elements = ray_data.Elements(self._layout)
        args = self._iter_batches_args
        if isinstance(self._data, ray.data.Dataset) and args["local_shuffle_buffer_size"] is None:
            return ray_data.BlockBatches(
                self._data,
                elements,
                batch_size=args["batch_size"],
                drop_last=args["drop_last"],
                columns=self._layout.read(),
                max_inflight=self._capacity,
            )
        return ray_data.IterBatches(self._data, elements, args)

    def open_epoch(self, *, deterministic, skip=0):
        stream = self._start()
        if skip:
            if not ray_data.preserves_order(self._data, self._iter_batches_args):
                resume.warn_inexact(
                    "from_ray_data",
                    skip,
                    "Ray Data may order blocks differently each run (set "
                    "DataContext.get_current().execution_options.preserve_order = True, "
                    "and seed any shuffle)",
                )
            stream = resume.SkippedItems(stream, skip)
        return stream
