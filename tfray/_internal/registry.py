"""The source registry and the dispatcher that starts a feeder per iterator.

Each tfray dataset registers its source under an integer key; the dataset
graph carries only that key. A TF iterator asks for an epoch by posting a
channel to the native registry (no GIL needed); the dispatcher thread here
takes the request and starts a feeder on it.
"""

import atexit
import functools
import itertools
import logging
import threading

from tfray._internal import native, pins, ray_errors
from tfray._internal.feeder import Feeder, start as start_feeder, stop_all as stop_feeders
from tfray._internal.status import BatchError, Code

logger = logging.getLogger("tfray")

_lock = threading.Lock()
_sources = {}  # key -> source; guarded by _lock.
_keys = itertools.count(1)
_dispatcher = None  # guarded by _lock.
_stop = threading.Event()


def register(source):
    """Registers ``source``; returns the key its dataset graph carries."""
    key = next(_keys)
    native.load().lib.register_source(key, source.cardinality, source.capacity)
    with _lock:
        _sources[key] = source
    _ensure_dispatcher()
    return key


def unregister(key):
    native.load().lib.unregister_source(key)
    with _lock:
        source = _sources.pop(key, None)
    if source is not None:
        source.close()


def _ensure_dispatcher():
    global _dispatcher
    with _lock:
        if _dispatcher is None:
            _dispatcher = threading.Thread(target=_dispatch, name="tfray-dispatch", daemon=True)
            _dispatcher.start()


def _dispatch():
    lib = native.load().lib
    while not _stop.is_set():
        for key, channel, deterministic, skip, offered in lib.wait_requests(0.2):  # Without the GIL.
            _start_epoch(key, channel, deterministic, skip, offered)


def _start_epoch(key, channel, deterministic, skip, offered):
    # A function of its own so that no frame keeps the source alive while
    # the dispatcher waits: a collected dataset must free its refs.
    with _lock:
        source = _sources.get(key)
    if offered:  # An iterator took the epoch offered to it: its feeder runs.
        if source is not None:
            source.epochs += 1
            source.take_offered()
        return
    if source is None:
        channel.push_error(
            int(Code.NOT_FOUND),
            f"tfray source {key} was unregistered: its tfray.Dataset was garbage collected.",
        )
        channel.close()
        return
    try:
        _check_session(key, source)
        stream = source.open_epoch(deterministic=deterministic, skip=skip)
    except BatchError as e:
        channel.push_error(int(e.code), e.message)
        channel.close()
        return
    except Exception as e:  # Never leave an iterator waiting.
        logger.exception("tfray: starting an epoch failed")
        channel.push_error(int(Code.INTERNAL), f"tfray: starting an epoch failed: {e}")
        channel.close()
        return
    feeder = _feeder(key, source, stream, channel)
    source.epochs += 1
    source.record(feeder)
    start_feeder(feeder)


def _check_session(key, source):
    """Raises, for a new epoch, if the Ray that ``source`` was built in is gone."""
    where = _describe(key, source)
    if not ray_errors.ray_running():
        raise ray_errors.shutdown_error(where, reading=False)
    if ray_errors.session() != source.session:
        raise ray_errors.stale_session_error(where)


def _offer_next_epoch(key):
    """Starts the next epoch of a source that replays, as the last one ends.

    Its feeder resolves the first window into a channel the native registry
    offers to the source's next iterator, which then finds batches queued with
    no Python (so no GIL) between it and them: a new epoch no longer waits for
    the dispatcher and a feeder thread to get the GIL, which a busy Python
    thread in the trainer can make slow. Only for a source read more than
    once; the offer pins that window (within the look-ahead's bounds) until
    an iterator takes it or the dataset is collected.
    """
    with _lock:
        source = _sources.get(key)
    if source is None or not source.replays or source.epochs < 2 or source.has_offer():
        return
    lib = native.load().lib
    channel = lib.Channel(source.capacity)
    stream = source.open_epoch(deterministic=True)
    feeder = _feeder(key, source, stream, channel)
    if source.offer(feeder, lambda: lib.offer_epoch(key, channel)):
        start_feeder(feeder)
    else:  # Another epoch's end offered first, or the source is gone.
        stream.close()


def _feeder(key, source, stream, channel):
    """A feeder of ``stream`` into ``channel`` that, at the epoch's end, offers the next."""
    return Feeder(
        stream,
        source.flat_spec,
        channel,
        alignment=native.load().lib.TENSOR_ALIGNMENT,
        on_end=functools.partial(_offer_next_epoch, key),
        name=_describe(key, source),
    )


def _describe(key, source):
    return f"{source.kind} dataset (source {key})"


@atexit.register
def _shutdown():
    # Python ends daemon threads that try to retake the GIL during
    # finalization, which unwinds through C++ and aborts. So every tfray
    # thread leaves its native waits here, before finalization starts.
    _stop.set()
    with _lock:
        dispatcher = _dispatcher
    if dispatcher is not None:
        dispatcher.join(timeout=5)
    stop_feeders(timeout=5)
    pins.stop()
