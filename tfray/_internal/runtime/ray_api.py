"""tfray's only door to Ray: calls a shutdown cannot overtake, and Ray's errors as TF's.

1. **No call is overtaken.** Ray's core worker ends the whole process when
   ``ray.shutdown()`` (the user's, Ray's ``atexit``, a context manager)
   shuts it down under a call another thread is already inside ("The core
   worker has already been shutdown ... The process will exit"). Ray's
   ``shutdown`` and ``init`` run holding Ray's connect/shutdown lock
   (``ray._private.worker._connect_or_shutdown_lock``, an ``RLock``, in Ray
   2.59 and 2.60). Every Ray call of tfray's threads is made here, holding
   that lock, after checking under it that Ray is up (``entered``): a
   shutdown waits for the call to return, and tfray's next call raises
   ``shutdown_error``. So no call made under it may block: waits are polls
   (``poll``), a get reads refs already ready, and a drop of refs or
   generators that may call into Ray is made under it too (``held``).
   Should a Ray no longer have that lock, tfray uses one of its own: its
   threads then keep out of each other's way only, and the race is as
   open as Ray leaves it.
2. **No new Ray behind the user's back.** Ray's ``ray.get`` and
   ``ray.wait`` start a new local Ray when called after ``ray.shutdown()``;
   the calls here are Ray's own, without that auto-init (``__wrapped__``).
3. **Errors a user can act on.** ``translate`` turns what Ray raised while
   reading a batch into the ``BatchError`` (or ``EpochError``) that
   ``next()`` raises.
"""

import contextlib
import re
import threading
import time

import ray
import ray.exceptions
import ray.experimental

from tfray._internal.runtime.status import BatchError, Code, EpochError

# How poll's polls back off; a Pace's first pause is at most _PACED_PAUSE_S.
_FIRST_PAUSE_S = 0.0005
_LAST_PAUSE_S = 0.01
_PACED_PAUSE_S = 0.05

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _ray_lock():
    lock = getattr(getattr(ray, "_private", None) and ray._private.worker, "_connect_or_shutdown_lock", None)
    return lock if hasattr(lock, "acquire") and hasattr(lock, "release") else threading.RLock()


_LOCK = _ray_lock()


def _direct(api):
    # Ray wraps its public calls with functools.wraps, which keeps the call.
    return getattr(api, "__wrapped__", api)


_get = _direct(ray.get)
_wait = _direct(ray.wait)
_get_runtime_context = _direct(ray.get_runtime_context)


def ray_running():
    return ray.is_initialized()


@contextlib.contextmanager
def entered():
    """Ray is up, and stays up until the block ends; else the shutdown error.

    Everything in the block must return promptly: a ``ray.shutdown()`` waits
    for it.
    """
    with _LOCK:
        if not ray.is_initialized():
            raise shutdown_error()
        yield


@contextlib.contextmanager
def held():
    """No shutdown starts or runs during the block, whether or not Ray is up.

    For dropping refs and generators, and closing streams, which call into
    Ray's core worker while it is up and do nothing once it is gone.
    """
    with _LOCK:
        yield


# The calls below spell ``entered()`` out: they run per window of batches,
# where each Python call counts (tests/runtime/test_per_window.py).


def call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, a prompt call into Ray (a ``.remote()``, a ready generator's ``next``)."""
    with _LOCK:
        if not ray.is_initialized():
            raise shutdown_error()
        return fn(*args, **kwargs)


def get(refs, *, timeout=None):
    """``ray.get`` of refs that are ready (``timeout=0`` raises ``GetTimeoutError`` if one is not)."""
    with _LOCK:
        if not ray.is_initialized():
            raise shutdown_error()
        return _get(refs, timeout=timeout)


def get_decoded(refs, decoder, *, timeout=None):
    """``get``, each object read by ``decoder`` (a decoder.BatchDecoder) where it can.

    The core worker's get hands back each object's buffer and metadata; the
    decoder reads the objects it has a template for without Ray's Python
    deserialization and has Ray's deserialize the rest. Where Ray has no
    such get (a private name, in Ray 2.59 and 2.60), or the decoder cannot
    read the window, this is Ray's ``get``.
    """
    with _LOCK:
        if not ray.is_initialized():
            raise shutdown_error()
        worker = ray._private.worker.global_worker
        core_get = getattr(getattr(worker, "core_worker", None), "get_objects", None)
        deserialize = getattr(worker, "deserialize_objects", None)
        if core_get is None or deserialize is None:
            return _get(refs, timeout=timeout)
        timeout_ms = -1 if timeout is None or timeout == -1 else int(timeout * 1000)
        serialized = core_get(refs, timeout_ms)
        try:
            values = decoder.decode(serialized, refs, deserialize)
        except BaseException as e:
            # No frame of the traceback may keep an object's buffer past the
            # lock: dropping one calls into Ray's core worker.
            serialized = None
            raise e.with_traceback(None)  # noqa: B904
        serialized = None
        return _get(refs, timeout=timeout) if values is None else values


def wait(refs, *, num_returns=1, timeout=None, fetch_local=True):
    with _LOCK:
        if not ray.is_initialized():
            raise shutdown_error()
        return _wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)


def session():
    """Which Ray session this process is in: its objects and tasks belong to it."""
    with entered():
        context = _get_runtime_context()
        return context.get_node_id(), context.get_job_id()


def spilled(ref):
    """Whether ``ref``'s object went to disk, as this process knows (its owner does); False if it does not."""
    with _LOCK:
        if not ray.is_initialized():
            raise shutdown_error()
        info = _local_locations([ref]).get(ref)  # No RPC: the core worker's own table.
    return bool(info and info.get("did_spill"))


_local_locations = ray.experimental.get_local_object_locations
_nodes = _direct(ray.nodes)
_capacity = {}  # session() -> this node's object-store bytes.


def store_capacity():
    """This node's object-store capacity in bytes (0 if Ray does not say), asked once per session."""
    key = session()
    if key not in _capacity:
        with entered():
            nodes = _nodes()
        _capacity[key] = next(
            (int(n["Resources"].get("object_store_memory", 0)) for n in nodes if n.get("NodeID") == key[0]), 0
        )
    return _capacity[key]


class Pace:
    """How long a poller's ``poll`` pauses: half of what its last poll that had to wait waited.

    Each pause costs the polling thread a wake-up and an ask (20 to 80 us of
    CPU, and the GIL). Producers deliver at a steady pace: a feeder whose
    polls each started at 0.5 ms asked about four times a batch of 38 MB,
    paced about twice. Where batches come slower than one in 20 ms (a
    producer on another node), its pauses stay at that half too, instead
    of 10 ms: 10 ms pauses asked about 28 times a batch that came every
    140 ms (2.2 ms of the trainer's CPU in the asks alone), these about 8.
    A wait that grows or shrinks moves it within a few polls; it stays
    within 0.5 to 50 ms, so an item is seen within 10 ms or half the last
    wait, whichever is longer.

    A wait outlasts its poller's timeout (the feeder's 0.1 s) when items come
    slower than that: a poll that starts right after the last one gave up
    goes on with that wait, so that the wait is learned whole.
    """

    def __init__(self):
        self.first = _FIRST_PAUSE_S
        self._since = None  # When the wait a poll gave up on began,
        self._gave_up = None  # and when it gave up.

    def waited(self, seconds):
        self.first = min(max(seconds / 2, _FIRST_PAUSE_S), _PACED_PAUSE_S)

    def resume(self, now):
        """When the wait of a poll starting ``now`` began: earlier if it goes on with one given up."""
        if self._since is not None and now - self._gave_up <= _LAST_PAUSE_S:
            return self._since
        return now

    def gave_up(self, since, now):
        self._since, self._gave_up = since, now

    def found(self, since, now, paused):
        if paused or since < now - _LAST_PAUSE_S:  # It had to wait, in this poll or the last.
            self.waited(now - since)
        self._since = None


def poll(refs, timeout, *, fetch_local=True, pace=None):
    """Those of ``refs`` (ObjectRefs or streaming generators) ready within ``timeout`` s.

    [] if none was; None: no limit. Each poll asks Ray without waiting
    (``_ready_now``, so a shutdown never waits on one), and raises the
    shutdown error once Ray is down; the polls back off from 0.5 ms to 10
    ms, or with ``pace`` (a Pace that learns from this poll) from
    ``pace.first`` to the longer of 10 ms and ``pace.first``.
    ``fetch_local`` as ``ray.wait``'s: with it, every poll of an object
    that exists asks the raylet (an IPC round trip) whether it is local.
    """
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    pause = _FIRST_PAUSE_S if pace is None else pace.first
    longest = _LAST_PAUSE_S if pace is None else max(_LAST_PAUSE_S, pace.first)
    since = start if pace is None else pace.resume(start)
    paused = False
    while True:
        with _LOCK:  # entered(), spelled out (see get).
            if not ray.is_initialized():
                raise shutdown_error()
            ready = _ready_now(refs, fetch_local)
        now = time.monotonic()
        left = None if deadline is None else deadline - now
        if pace is not None and ready:
            pace.found(since, now, paused)
        elif pace is not None and paused and left is not None and left <= 0:
            pace.gave_up(since, now)
        if ready or (left is not None and left <= 0):
            return ready
        time.sleep(pause if left is None else min(pause, left))
        paused = True
        pause = min(2 * pause, longest)


def _ready_now(refs, fetch_local):
    """Those of ``refs`` ready now: a ``wait`` with no wait, made holding ``_LOCK`` with Ray up.

    Streaming generators without ``fetch_local`` are read from the core
    worker's stream instead: whether each one's next item (or its end, or
    its error) is reported, as Ray's own ``wait`` and ``next`` ask it first
    (``peek_object_ref_stream``; private names in Ray 2.59 and 2.60). It
    costs about 2 us against ``wait``'s 30 to 60, and a feeder waiting on
    producers polls several times a batch. ``wait`` where Ray has no peek.
    """
    peek = not fetch_local and getattr(
        getattr(ray._private.worker.global_worker, "core_worker", None), "peek_object_ref_stream", None
    )
    if peek:
        # Loops, not comprehensions: each of those is a Python call per poll.
        ready = []
        for ref in refs:
            stream = getattr(ref, "_generator_ref", None)
            if stream is None:  # An ObjectRef: Ray's wait tells.
                break
            if peek(stream)[1]:
                ready.append(ref)
        else:
            return ready
    ready, _ = _wait(refs, num_returns=len(refs), timeout=0, fetch_local=fetch_local)
    return ready


# Refs and producers die with the Ray session that made them: a new
# ray.init() cannot bring them back, so the advice is to rebuild.
_REBUILD = (
    "Its objects and producers went with that Ray session: after ray.init(), "
    "build a new tfray.Dataset from new refs, producers or Ray Data dataset, "
    "and iterate that."
)


def shutdown_error(where="this iterator", *, reading=True):
    """The error of an epoch that finds Ray shut down; ``where`` names its dataset."""
    when = "while it was reading" if reading else "before it started"
    return EpochError(Code.UNAVAILABLE, f"tfray: {where}: Ray was shut down {when}. {_REBUILD}")


def stale_session_error(where):
    """The error of a new epoch of a dataset built before Ray was restarted."""
    return EpochError(
        Code.UNAVAILABLE,
        f"tfray: {where}: this dataset was built in a Ray session that has since "
        f"been shut down. {_REBUILD}",
    )


def translate(error, where):
    """A BatchError (or EpochError) for ``error`` raised while reading ``where``."""
    if not ray_running():
        return shutdown_error()
    if isinstance(error, EpochError):
        return error
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause if error.cause is not None else error
        details = _ANSI.sub("", str(error))
        return BatchError(
            Code.UNKNOWN,
            f"tfray: {where}: the Ray task that produced it raised "
            f"{type(cause).__name__}: {cause}\n{details}",
        )
    if isinstance(error, ray.exceptions.ObjectLostError):
        return BatchError(
            Code.DATA_LOSS,
            f"tfray: {where}: its Ray object is lost or was freed "
            f"({type(error).__name__}): {_ANSI.sub('', str(error)).strip()}",
        )
    if isinstance(error, ray.exceptions.RaySystemError) and isinstance(
        error.client_exc, Exception
    ):  # Ray wraps what unpickling the object raised: this batch is bad, not Ray.
        cause = error.client_exc
        return BatchError(
            Code.INVALID_ARGUMENT,
            f"tfray: {where}: its Ray object cannot be deserialized in this process "
            f"({type(cause).__name__}: {cause}). A batch is a numpy array or a dict / "
            "tuple / list nest of them; anything else it holds must be importable here.",
        )
    if isinstance(error, ray.exceptions.RaySystemError):
        return EpochError(
            Code.UNAVAILABLE,
            f"tfray: {where}: Ray failed ({type(error).__name__}): {error}",
        )
    return BatchError(
        Code.UNKNOWN,
        f"tfray: {where}: reading it from Ray raised {type(error).__name__}: {error}",
    )
