"""Sources of batches, and the dispatcher that starts a feeder per iterator.

Each tfray dataset registers a source under an integer key; the dataset graph
carries only that key. A TF iterator asks for an epoch by posting a channel
to the native registry (no GIL needed); the dispatcher thread here takes the
request and starts a feeder on it.
"""

import atexit
import collections
import itertools
import logging
import threading

import ray

from tfray._internal import native, pins, spec
from tfray._internal.feeder import Feeder, stop_all as stop_feeders
from tfray._internal.status import Code

logger = logging.getLogger("tfray")

UNKNOWN_CARDINALITY = -2

_lock = threading.Lock()
_sources = {}  # key -> source; guarded by _lock.
_keys = itertools.count(1)
_dispatcher = None  # guarded by _lock.
_stop = threading.Event()


class OneShotError(Exception):
    pass


class RefsSource:
    """Batches that are ObjectRefs: a sequence (replayable) or an iterator (once).

    Args:
        refs: a list / tuple of ObjectRefs, or an iterator of them.
        element_spec: a nest of tf.TensorSpec, or None to infer it from the
            first batch.
        max_inflight: refs resolved ahead of the consumer per iterator; also
            the number of batches each iterator's channel holds.
    """

    def __init__(self, refs, *, element_spec, max_inflight):
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int):
            raise TypeError(f"max_inflight: expected an int, got {type(max_inflight).__name__}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight: expected >= 1, got {max_inflight}")
        self.max_inflight = max_inflight
        if isinstance(refs, ray.ObjectRef):
            refs = [refs]
        if isinstance(refs, (list, tuple)):
            self._refs = list(refs)
            self._iterator = None
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
            self._iterator = itertools.chain([first], iterator) if first is not None else iterator
            self.cardinality = UNKNOWN_CARDINALITY
        for ref in self._refs or ([first] if first is not None else []):
            if not isinstance(ref, ray.ObjectRef):
                raise TypeError(
                    f"from_refs: expected ray.ObjectRef items, got {type(ref).__name__}"
                )
        if element_spec is None:
            if first is None:
                raise ValueError(
                    "from_refs: cannot infer element_spec from no refs; pass element_spec."
                )
            element_spec = spec.infer(ray.get(first))
        self.element_spec = element_spec
        self.flat_spec = spec.FlatSpec(element_spec)
        self._feeders = collections.deque(maxlen=256)  # Recent epochs, for stats.

    def epoch_refs(self):
        """The refs of a new epoch, as an iterator."""
        if self._refs is not None:
            return iter(self._refs)
        if self._iterator is None:
            raise OneShotError(
                "tfray: this dataset was built from a one-shot iterator of refs "
                "and has been read once already. Pass a list of refs to "
                "from_refs to read it again (each iterator is a new epoch)."
            )
        iterator, self._iterator = self._iterator, None
        return iterator

    def start_epoch(self, channel):
        try:
            refs = self.epoch_refs()
        except OneShotError as e:
            channel.push_error(int(Code.FAILED_PRECONDITION), str(e))
            channel.close()
            return
        feeder = Feeder(
            refs,
            self.flat_spec,
            channel,
            max_inflight=self.max_inflight,
            alignment=native.load().lib.TENSOR_ALIGNMENT,
        )
        self._feeders.append(feeder)
        feeder.start()

    def feeders(self):
        return list(self._feeders)


def register(source):
    """Registers ``source``; returns the key its dataset graph carries."""
    key = next(_keys)
    capacity = source.max_inflight
    native.load().lib.register_source(key, source.cardinality, capacity)
    with _lock:
        _sources[key] = source
    _ensure_dispatcher()
    return key


def unregister(key):
    native.load().lib.unregister_source(key)
    with _lock:
        _sources.pop(key, None)


def _ensure_dispatcher():
    global _dispatcher
    with _lock:
        if _dispatcher is None:
            _dispatcher = threading.Thread(target=_dispatch, name="tfray-dispatch", daemon=True)
            _dispatcher.start()


def _dispatch():
    lib = native.load().lib
    while not _stop.is_set():
        for key, channel in lib.wait_requests(0.2):  # Waits without the GIL.
            _start_epoch(key, channel)


def _start_epoch(key, channel):
    # A function of its own so that no frame keeps the source alive while
    # the dispatcher waits: a collected dataset must free its refs.
    with _lock:
        source = _sources.get(key)
    if source is None:
        channel.push_error(
            int(Code.NOT_FOUND),
            f"tfray source {key} was unregistered: its tfray.Dataset was "
            "garbage collected.",
        )
        channel.close()
        return
    try:
        source.start_epoch(channel)
    except Exception as e:  # Never leave an iterator waiting.
        logger.exception("tfray: starting an epoch failed")
        channel.push_error(int(Code.INTERNAL), f"tfray: starting an epoch failed: {e}")
        channel.close()


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


def ensure_ray():
    """Starts a local Ray if none is running, and says so."""
    if not ray.is_initialized():
        ray.init()
        logger.warning(
            "tfray: Ray was not initialized; started a local Ray instance "
            "(call ray.init() first to choose its resources)."
        )
