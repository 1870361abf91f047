"""``from_generators``: its source, and its producers, one streaming-generator Ray task per shard.

Each shard's generator runs as a Ray task whose batches go straight into the
object store, in bundles of consecutive batches (producer.py). Ray pauses a
generator once ``max_inflight_per_producer`` of its bundles wait unconsumed
(``_generator_backpressure_num_objects``; by default a count that follows
the bundles' bytes, inflight.py), so a slow trainer stalls the producers
instead of filling the store.

At most ``concurrency`` shards of an epoch run at once, the rest start as
running ones finish. Round-robin over more shards than the cluster can run
would deadlock: the order would wait on a shard that cannot start while the
running ones sit paused by backpressure.

Producers reserve no CPU from Ray (``num_cpus=0``): a producer paused by
backpressure keeps its reservation, and epochs read in lockstep (zip, a
validation set between training steps) would each wait for CPUs the other
epoch's paused producers hold, forever. The ``num_cpus`` a user asks for
sets instead how many of an epoch's producers run at once (the cluster's
CPUs over it), and tfray places producers on the nodes that offer CPUs, in
proportion to them (placement.py): Ray's scheduler, seeing no CPU asked,
would place them on a node that offers none. Other resources (GPUs, custom
ones) are reserved as asked.
"""

import collections
import functools
import inspect
import logging
import numbers
import time

import ray
from ray import cloudpickle

from tfray._internal.runtime import ray_api, spec
from tfray._internal.runtime.lookahead import START, LookAhead
from tfray._internal.runtime.progress import Progress
from tfray._internal.runtime.resolver import RefResolver
from tfray._internal.runtime.status import EpochError
from tfray._internal.runtime.streams import Wrapped
from tfray._internal.sources import inflight, placement, producer, resume, stops
from tfray._internal.sources.base import Source, default_budget, positive_int
from tfray._internal.sources.bundles import Bundle, BundledRefs, Shard, Unbundled

# By value: by reference, every producer process would import tfray and
# TensorFlow (seconds and hundreds of MB each) just to find this function.
cloudpickle.register_pickle_by_value(producer)
_remote_run_shard = ray.remote(producer.run_shard)


logger = logging.getLogger("tfray")

# Ray's private option that pauses a streaming generator (present in Ray 2.33-2.60).
BACKPRESSURE_OPTION = "_generator_backpressure_num_objects"


def with_backpressure(remote_fn, options, max_inflight_per_producer):
    """``remote_fn.options(**options)``, its generator paused at ``max_inflight_per_producer``.

    Ray refuses options it does not know. Should a Ray drop the private
    backpressure option, producers run unpaused, with a warning: tfray's own
    look-ahead stays bounded, but batches the producers make beyond it wait in
    the object store (which spills to disk when full) instead of the producers
    pausing.
    """
    try:
        return remote_fn.options(**options, **{BACKPRESSURE_OPTION: max_inflight_per_producer})
    except ValueError as e:
        if BACKPRESSURE_OPTION not in str(e):
            raise
        logger.warning(
            "from_generators: this Ray (%s) has no %s, so producers are not paused "
            "while their batches wait unconsumed: a slow trainer lets them fill the "
            "object store (Ray spills to disk). tfray is tested with Ray 2.59 and newer.",
            ray.__version__,
            BACKPRESSURE_OPTION,
        )
        return remote_fn.options(**options)


# How long close() pauses between its reads.
_DRAIN_PAUSE_S = 0.01
# How long close() reads what stopping producers still make.
_DRAIN_S = 2.0


def _check_ray():
    """Raises the shutdown error once Ray is down.

    A streaming generator touched after ``ray.shutdown()`` makes Ray's core
    worker end the process, so every call on one checks first (ray.shutdown
    marks Ray down before it stops the core worker).
    """
    if not ray_api.ray_running():
        raise ray_api.shutdown_error()


NOT_A_GENERATOR = (
    "from_generators: fn must be a generator function (use `yield`), so that each "
    "producer yields its shard's batches one at a time; {what}"
)


def check_generator_function(fn):
    """Refuses a ``def`` that returns instead of yielding, at construction.

    Its result would be iterated as if it were the batches (an array's rows,
    a dict's keys). A lambda or a callable object may return a generator:
    the producer checks what it returns (see producer.py).
    """
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    inner = getattr(inner, "__func__", inner)  # A bound method's function.
    if (
        inspect.isfunction(inner)
        and inner.__name__ != "<lambda>"
        and not inspect.isgeneratorfunction(inner)
    ):
        raise TypeError(NOT_A_GENERATOR.format(what=f"{inner.__qualname__} returns instead."))


def takes_start(fn):
    """Whether ``fn`` takes ``start=``: the index of the shard's first batch to yield.

    A resumed epoch asks such a function to begin each shard where the
    checkpoint left it; any other is run from the shard's start and its
    batches before that point are passed over in the producer.
    """
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # A builtin or a callable without a signature.
        return False
    start = parameters.get("start")
    return start is not None and start.kind in (start.POSITIONAL_OR_KEYWORD, start.KEYWORD_ONLY)


def stable_name(fn):
    """A name for ``fn`` that is the same in every process, or None.

    A function's module and qualified name; for a ``functools.partial``, its
    function's and its arguments' reprs. A lambda or a callable object has
    none that tells it apart from others of its kind.
    """
    if isinstance(fn, functools.partial):
        inner = stable_name(fn.func)
        return None if inner is None else f"{inner}{fn.args!r}{sorted(fn.keywords.items())!r}"
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str) or "<lambda>" in qualname:
        return None
    return f"{getattr(fn, '__module__', None)}.{qualname}"


def concurrency(num_shards, ray_remote_args):
    """How many producers of one epoch run at once: the cluster's CPUs over each one's."""
    cpus = (ray_remote_args or {}).get("num_cpus", 1)
    if not cpus:
        return num_shards
    total = ray.cluster_resources().get("CPU", 1)
    return max(1, min(num_shards, int(total // cpus)))


def producer_options(ray_remote_args):
    """The Ray task options of a producer (see the module's docstring), but backpressure."""
    options = dict(ray_remote_args or {})
    options["num_cpus"] = 0
    options.setdefault("scheduling_strategy", "SPREAD")
    options["num_returns"] = "streaming"
    return options


class GeneratorShards(BundledRefs):
    """The ref stream of one epoch: every shard's generator, interleaved.

    ``deterministic`` (set before the first ``take``): round-robin over the
    running shards, a shard that ends replaced in its place by the next one,
    so the order is the same every epoch for deterministic generators on the
    same cluster; else whichever bundle is ready first.

    ``shard_numbers`` label each shard's batches (default 0, 1, ...): the
    units a checkpoint counts. Its refs are bundles (bundles.py):
    ``deterministic`` takes turns a bundle at a time. ``plan``: a
    resume.Plan, for an epoch restored from a checkpoint; ``asks_start``:
    whether ``fn`` takes ``start=`` (producer.run_shard). ``inflight``
    (inflight.py) gives each producer its backpressure as it starts, within
    ``share_bytes`` of the store, and learns from the epoch's first bundle.
    """

    def __init__(
        self,
        fn,
        shards,
        *,
        inflight,
        share_bytes,
        ray_remote_args,
        concurrency,
        board,
        producers_on,
        name,
        placement_timeout_s,
        shard_numbers=None,
        plan=None,
        asks_start=False,
    ):
        self._inflight = inflight
        # The epoch's first ref, until its bundle's size is learned; None
        # before it is taken, and once learned.
        self._first = None
        self._learning = inflight.fixed is None
        self._share = share_bytes
        self._options = producer_options(ray_remote_args)
        self._runners = {}  # (Backpressure, node) -> the producer task with them.
        self._fn = fn
        self._shards = list(shards)
        self._numbers = list(range(len(self._shards)) if shard_numbers is None else shard_numbers)
        # Shard indexes to start, in order, as running ones end.
        self._pending = collections.deque(range(len(self._shards)) if plan is None else plan.pending)
        self._starts = {} if plan is None else dict(plan.starts)  # Shard index -> resume.Start.
        self._offsets = {} if plan is None else dict(plan.offsets)  # For its first bundle's label.
        self._asks_start = asks_start
        self._labels = {}  # Shard index -> its Shard, which labels its batches.
        self._running = []  # (shard index, generator), in rotation order.
        self._nodes = {}  # Shard index -> the node placement chose for it (None: Ray's choice).
        self._turn = 0  # Index into _running of the next round-robin shard.
        self.deterministic = True
        self._pace = ray_api.Pace()  # How _next_ready's polls start.
        # What close() posts to stop this epoch's producers (see stops.py).
        _check_ray()  # Making the board after ray.shutdown() would start a new Ray.
        self._board = board()
        self._token = stops.new_token()
        self._placement = placement.Placement(producers_on, ray_remote_args, name)
        self._watch = placement.Watch(name, ray_remote_args, placement_timeout_s)
        self._progress_at = time.monotonic()  # When a producer was last found ready.
        if plan is None:
            for _ in range(min(concurrency, len(self._pending))):
                self._running.append(self._start_next())
        else:
            self._running = [self._start(shard) for shard in plan.running]
            self._turn = plan.turn
        self.done = not self._running

    def take(self, n, timeout):
        """Up to n ``(Bundle, ref)`` pairs; waits at most ``timeout`` for the first."""
        out = []
        while len(out) < n and self._running:
            # Once one is taken, the epoch progressed: the rest need no watch.
            position = self._next_ready(0) if out else self._watched_ready(timeout)
            if position is None:
                break
            shard, generator = self._running[position]
            try:
                ref = ray_api.call(next, generator)  # Ready: it does not wait.
            except StopIteration:
                self._replace(position)
                continue
            out.append((Bundle(self._labels[shard], self._offsets.pop(shard, 0)), ref))
            if self._learning and self._first is None:
                self._first = ref
            if self.deterministic:
                self._turn = (position + 1) % len(self._running)
        self.done = not self._running
        self._learn()
        return out

    def _learn(self):
        """Tells ``inflight`` the size of the epoch's first bundle once it is here; never waits for it."""
        if self._first is None:
            return
        ready, _ = ray_api.wait([self._first], num_returns=1, timeout=0, fetch_local=True)
        if not ready:
            return  # Asked again at the next take, and at close.
        first, self._first, self._learning = self._first, None, False
        try:
            self._inflight.learn(ray_api.get(first))
        except Exception:  # noqa: S110 - a producer's error, which the resolver reports.
            pass

    def close(self):
        """Stops the running producers: asked on the stop board, never ``ray.cancel``-ed.

        Reads and drops what they have ready, for a while, so that a producer
        paused by backpressure resumes and sees the stop (see stops.py);
        one still running after that returns at its next batch.
        """
        if ray_api.ray_running():  # An epoch of one bundle tells it too.
            self._learn()
        running = [g for _, g in self._running]
        with ray_api.held():  # Dropping a generator calls into Ray.
            self._running = []
        self._pending.clear()
        self.done = True
        try:
            if running and ray_api.ray_running():
                stops.stop(self._board, self._token)
                self._drain(running)
        except EpochError:  # Ray went meanwhile, and the producers with it.
            pass
        finally:
            with ray_api.held():
                running.clear()

    @staticmethod
    def _drain(running):
        """Reads and drops what ``running`` generators have ready, for up to _DRAIN_S."""
        deadline = time.monotonic() + _DRAIN_S
        while running and time.monotonic() < deadline:
            # Polls (see _next_ready): no Ray call may wait.
            ready, _ = ray_api.wait(running, num_returns=len(running), timeout=0, fetch_local=False)
            if not ready:
                time.sleep(_DRAIN_PAUSE_S)
            for generator in ready:
                try:
                    ray_api.call(next, generator)
                except StopIteration:  # It returned.
                    running.remove(generator)
                except ray.exceptions.RayError:  # It failed: it is not running either.
                    running.remove(generator)
            del ready

    def _start_next(self):
        return self._start(self._pending.popleft())

    def _start(self, shard):
        """``(shard, generator)``: shard index ``shard``'s producer, started where its resume.Start says."""
        start = self._starts.pop(shard, None)
        self._labels[shard] = Shard(self._numbers[shard], 0 if start is None else start.batch)
        count = self._inflight.count(self._share)
        where, self._nodes[shard] = self._placement.place()
        key = (count, self._nodes[shard])
        if key not in self._runners:
            self._runners[key] = with_backpressure(_remote_run_shard, {**self._options, **where}, count)
        return shard, ray_api.call(
            self._runners[key].remote,
            self._fn,
            self._shards[shard],
            self._board,
            self._token,
            self._inflight.pair_limit(self._share),
            None if start is None else (*start, self._asks_start),
        )

    def _replace(self, position):
        """The shard at ``position`` ended: the next shard takes its place."""
        self._placement.release(self._nodes.pop(self._running[position][0]))
        if self._pending:
            self._running[position] = self._start_next()
            return
        self._running.pop(position)
        if position < self._turn:
            self._turn -= 1
        self._turn = self._turn % len(self._running) if self._running else 0

    @property
    def unplaced(self):
        """The watch's Unplaced, unless a producer was ready since."""
        unplaced = self._watch.unplaced
        return unplaced if unplaced is not None and unplaced.since == self._progress_at else None

    def _watched_ready(self, timeout):
        """``_next_ready``, telling the placement watch when it found none, at least every CHECK_S."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = placement.CHECK_S if deadline is None else max(0.0, deadline - time.monotonic())
            position = self._next_ready(min(left, placement.CHECK_S))
            if position is not None:
                self._progress_at = time.monotonic()
                return position
            self._watch.waited(len(self._running), self._progress_at)  # Raises once it times out.
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _next_ready(self, timeout):
        """The position of a running shard whose next ref (or end) is ready.

        None if none is within ``timeout``. Polls (ray_api.poll), paced
        by the epoch's last waits: latency only, as producers run ahead
        meanwhile, up to their backpressure.
        A generator is ready once its producer reported its next object, as
        for Ray's own ``next``: asking whether that object is local too
        would cost every poll a round trip to the raylet (the resolver's
        get fetches it).
        """
        if self.deterministic:
            ready = ray_api.poll([self._running[self._turn][1]], timeout, fetch_local=False, pace=self._pace)
            return self._turn if ready else None
        generators = [g for _, g in self._running]
        ready = ray_api.poll(generators, timeout, fetch_local=False, pace=self._pace)
        return generators.index(ready[0]) if ready else None


def _reserves_resources(ray_remote_args):
    """Whether a producer reserves resources, which it keeps while paused: any a node must offer, or a group's."""
    return bool(placement.asks(ray_remote_args)) or bool((ray_remote_args or {}).get("placement_group"))


def _spec_of(first):
    label, ref = first
    try:
        return spec.infer(ray.get(ref)[0])  # The bundle's first batch.
    except ray.exceptions.RayTaskError as e:
        raise ValueError(f"from_generators: {label} raised while inferring element_spec: {e}") from e


class _Begun(Wrapped):
    """A RefStream that spec learning began: the refs it took come first."""

    def __init__(self, stream, taken):
        super().__init__(stream)
        self._taken = list(taken)

    @property
    def done(self):
        return not self._taken and self._stream.done

    def take(self, n, timeout):
        out, self._taken = self._taken[:n], self._taken[n:]
        if len(out) < n:
            out += self._stream.take(n - len(out), 0 if out else timeout)
        return out


# Dataset.from_generators' options, as GeneratorSource takes them (``shards`` required).
OPTIONS = (
    "shards",
    "max_inflight_per_producer",
    "deterministic",
    "ray_remote_args",
    "producers_on",
    "placement_timeout_s",
)


def shard_list(kind, shards):
    """``shards`` as a list: ``0..N-1`` for an int N; a TypeError / ValueError naming ``kind`` if neither."""
    if isinstance(shards, bool) or not isinstance(shards, (numbers.Integral, list, tuple)):
        raise TypeError(f"{kind}: shards must be an int or a list, got {type(shards).__name__}")
    if isinstance(shards, numbers.Integral):
        shards = range(positive_int("shards", shards))
    if not shards:
        raise ValueError(f"{kind}: shards is empty")
    return list(shards)


class GeneratorSource(Source):
    """``fn(shard)`` generators, each run as a streaming Ray task per epoch."""

    kind = "from_generators"
    has_units = True

    def __init__(
        self,
        fn,
        shards,
        *,
        session_actor,
        element_spec=None,
        max_inflight_per_producer=None,
        deterministic=None,
        ray_remote_args=None,
        producers_on="cluster",
        placement_timeout_s=None,
        shard_numbers=None,
        whole_shards=None,
    ):
        if not callable(fn):
            raise TypeError(f"{self.kind}: fn must be callable, got {type(fn).__name__}")
        check_generator_function(fn)
        self._shards = shard_list(self.kind, shards)
        # Each shard's number in the whole dataset: a worker's share keeps
        # them, so its checkpoint names the shards as every worker does.
        self._numbers = list(range(len(self._shards)) if shard_numbers is None else shard_numbers)
        self._whole_shards = len(self._shards) if whole_shards is None else whole_shards
        self._asks_start = takes_start(fn)
        if deterministic not in (None, True, False):
            raise TypeError(f"deterministic: expected None or a bool, got {deterministic!r}")
        if ray_remote_args is not None and not isinstance(ray_remote_args, dict):
            raise TypeError(f"ray_remote_args: expected a dict, got {type(ray_remote_args).__name__}")
        if ray_remote_args:  # Refused now, not as producers start.
            try:
                ray.remote(**ray_remote_args)(_run_nothing)
            except (TypeError, ValueError) as e:
                raise type(e)(f"ray_remote_args: {e}") from None
        self._fn = fn
        self._per_producer = (
            None
            if max_inflight_per_producer is None
            else positive_int("max_inflight_per_producer", max_inflight_per_producer)
        )
        self._inflight = inflight.Inflight(self._per_producer)
        self._deterministic = deterministic
        self._ray_remote_args = ray_remote_args
        self._producers_on = placement.check(producers_on)
        self._placement_timeout_s = placement.check_timeout(placement_timeout_s)
        self._session_actor = session_actor  # The runtime's: where the stop board lives.
        # Without element_spec, it is learned when first asked for: by then a
        # worker's share is known, and only the share's producers run.
        super().__init__(element_spec, capacity=self._window(self._per_producer or inflight.MOST))
        self._early = None  # The epoch learning the spec began; guarded by _lock.

    def work_units(self):
        """For ``sharding="dynamic"``: ``(key, count, at_once)``, a unit per shard.

        ``key`` names the function and the shards, the same in every process
        (None if the function has no such name); ``at_once`` is how many
        producers can run together.
        """
        name = stable_name(self._user_fn())
        key = None if name is None else f"{self.kind}:{name}:{self._shards!r}"
        return key, len(self._shards), self._at_once()

    def _user_fn(self):
        """The function the user passed, whose name messages give."""
        return self._fn

    def _name(self):
        """The dataset, as messages name it: ``from_generators(read_shard)``."""
        fn = self._user_fn()
        while isinstance(fn, functools.partial):
            fn = fn.func
        return f"{self.kind}({getattr(fn, '__qualname__', type(fn).__name__)})"

    def _at_once(self):
        """How many of an epoch's producers run at once."""
        return concurrency(len(self._shards), self._ray_remote_args)

    def _window(self, per_producer):
        """The most batches resolved ahead: as many bundles per running producer as each may have waiting."""
        return per_producer * producer.BUNDLE_BATCHES * self._at_once()

    def _share(self):
        """A running producer's share of a quarter of the store (inflight.py)."""
        return inflight.share(default_budget(), self._at_once())

    def unit_refs(self, unit, progress=None):
        """The ref stream of work unit ``unit``: shard ``unit``'s producer.

        ``progress`` (a runtime.progress.Progress): where a restored epoch
        starts the shard.
        """
        number, plan = self._numbers[unit], None
        if progress is not None and number in progress.units:
            partial = {number: progress.partial[number]} if number in progress.partial else {}
            plan = resume.plan([number], 1, Progress({number: progress.units[number]}, partial), in_order=False)
        return self._producer(unit, self._inflight, plan)

    def _producer(self, number, per_producer, plan=None):
        """The ref stream of shard ``number`` alone (from where ``plan``, a resume.Plan, starts it)."""
        return GeneratorShards(
            self._fn,
            [self._shards[number]],
            inflight=per_producer,
            share_bytes=self._share(),
            ray_remote_args=self._ray_remote_args,
            concurrency=1,
            board=self._board,
            producers_on=self._producers_on,
            name=self._name(),
            placement_timeout_s=self._placement_timeout_s,
            shard_numbers=[self._numbers[number]],
            plan=plan,
            asks_start=self._asks_start,
        )

    def shard(self, num_shards, index):
        return self._remake(self._shards[index::num_shards], self._numbers[index::num_shards])

    def _remake(self, shards, shard_numbers):
        """This source over ``shards`` (numbered ``shard_numbers``) instead, with its options."""
        return GeneratorSource(
            self._fn,
            shards,
            shard_numbers=shard_numbers,
            whole_shards=self._whole_shards,
            element_spec=self._element_spec,
            max_inflight_per_producer=self._per_producer,
            deterministic=self._deterministic,
            ray_remote_args=self._ray_remote_args,
            producers_on=self._producers_on,
            placement_timeout_s=self._placement_timeout_s,
            session_actor=self._session_actor,
        )

    def _start(self, plan=None):
        return GeneratorShards(
            self._fn,
            self._shards,
            shard_numbers=self._numbers,
            plan=plan,
            asks_start=self._asks_start,
            inflight=self._inflight,
            share_bytes=self._share(),
            ray_remote_args=self._ray_remote_args,
            concurrency=self._at_once(),
            board=self._board,
            producers_on=self._producers_on,
            name=self._name(),
            placement_timeout_s=self._placement_timeout_s,
        )

    def _board(self):
        """This process's stop board in the current Ray session (stops.py)."""
        return stops.board(self._session_actor)

    def spec_only(self):
        if self._element_spec is None:
            self._element_spec = self._infer_spec(keep_epoch=False)
        return self.element_spec

    def _infer_spec(self, keep_epoch=True):
        """The spec of the first batch, from a first epoch then kept for the first iterator.

        Producers reserve no CPU, so an epoch started here and left unread
        holds none from other datasets' producers (a validation set's, say).
        Producers that reserve other resources (GPUs, custom ones) would:
        for those, one producer at a time runs to its first batch and stops,
        and that batch is made again in the first epoch; likewise without
        ``keep_epoch`` (see spec_only).
        """
        try:
            return self._first_spec(keep_epoch)
        except EpochError as e:  # Its producers waited past placement_timeout_s.
            raise TimeoutError(
                f"{e.message} (while learning element_spec: pass element_spec to run no producer for it)"
            ) from None

    def _first_spec(self, keep_epoch):
        if not keep_epoch or _reserves_resources(self._ray_remote_args):
            for number in range(len(self._shards)):
                stream = self._producer(number, inflight.Inflight(1))
                try:
                    first = stream.take(1, timeout=None)
                    if first:
                        return _spec_of(first[0])
                finally:
                    stream.close()
        else:
            stream = self._start()
            try:
                first = stream.take(1, timeout=None)
                if first:
                    learned = _spec_of(first[0])
                    with self._lock:
                        self._early, stream = _Begun(stream, first), None
                    return learned
            finally:
                if stream is not None:
                    stream.close()
        raise ValueError("from_generators: no shard yielded a batch; pass element_spec.")

    def close(self):
        """Also stops the epoch spec learning began, if no iterator took it."""
        with self._lock:
            early, self._early = self._early, None
        if early is not None:
            early.close()
            with ray_api.held():  # Dropping it drops its refs and generators.
                del early
        super().close()

    def open_epoch(self, *, deterministic, skip=0, progress=None, resume_info=None, taken=None):
        deterministic = deterministic if self._deterministic is None else self._deterministic
        restored = resume_info or {}
        generation = None
        if self.job is not None:  # A worker's share: the job's position is the whole job's.
            # Known, or this worker's share at the chief's position of its own epoch
            # (below) is the job's position only if the job has as many workers.
            must_know = restored.get("workers", 1) != self.job.workers
            generation, units = self.job.open(restored.get("job"), skip, must_know=must_know)
            if units is not None:
                progress = self.job.progress(units, self._numbers)
        with self._lock:
            early, self._early = self._early, None
        if early is not None and skip:  # A resumed epoch starts afresh.
            early.close()
            early = None
        if progress is not None and resume.of_another_share(progress, self._numbers, self._whole_shards):
            # Every worker restores the chief's checkpoint (MultiWorkerMirroredStrategy,
            # Ray Train), and the job's position is not known: in a synchronous job this
            # worker's share stands at the same position of its own epoch, which it passes over.
            logger.info("tfray: %s resumes its share at item %d of its epoch", self._name(), skip)
            progress = None
        layout = {"workers": 1 if self.job is None else self.job.workers, "rotation": self._at_once()}
        if progress is not None:  # Each shard starts where the checkpoint left it.
            # In the order an uninterrupted epoch has, if its shards interleaved as these will.
            in_order = deterministic and all(restored.get(k) == v for k, v in layout.items())
            shards = self._start(resume.plan(self._numbers, self._at_once(), progress, in_order=in_order))
            skip = 0
        else:
            shards = early or self._start()
        shards.deterministic = deterministic
        epoch = Unbundled(RefResolver(shards, lookahead=self.lookahead()))
        if skip:
            if not shards.deterministic:
                resume.warn_inexact("from_generators", skip, "its shards interleave first-ready (deterministic=False)")
            # A bundle's batches are counted once it is read.
            epoch = resume.SkippedItems(epoch, skip)
        if generation is not None:
            epoch = self.job.recorded(epoch, generation)
        epoch.resume_info = dict(layout, job=generation)  # What its checkpoints save (registry.py).
        return epoch

    def lookahead(self):
        """Adaptive, as from_refs' is, within the window and a quarter of the store.

        It starts small and grows only while TF waits: what an epoch pins
        ahead stays bounded whatever the batches' size.
        """
        window = self._window(self._inflight.count(self._share()))
        return LookAhead(budget_bytes=default_budget(), start=min(START, window), cap=window)


def _run_nothing():
    """What ``ray_remote_args`` are tried on: ray.remote checks them at once."""
