"""The source registry and the dispatcher that starts a feeder per iterator.

Each tfray dataset registers its source under an integer key; the dataset
graph carries only that key. A TF iterator asks for an epoch by posting a
channel to the native registry (no GIL needed); the dispatcher thread here
takes the request and starts a feeder on it.
"""

import functools
import itertools
import logging
import threading

from tfray._internal.runtime import ray_errors
from tfray._internal.runtime.feeder import Feeder
from tfray._internal.runtime.service import Service
from tfray._internal.runtime.status import BatchError, Code

logger = logging.getLogger("tfray")


class Registry(Service):
    """The sources of this process's datasets, and the dispatcher thread (the runtime's).

    Args:
        lib: the native library's bindings.
        feeders: the FeederPool epochs' feeders run on.
        pins: the Pins that keep batches alive while TF uses them.
    """

    name = "tfray-dispatch"

    def __init__(self, lib, feeders, pins):
        super().__init__()
        self._lib = lib
        self._feeders = feeders
        self._pins = pins
        self._lock = threading.Lock()
        self._sources = {}  # key -> source; guarded by _lock.
        self._keys = itertools.count(1)  # next() is atomic under the GIL.

    def register(self, source):
        """Registers ``source``; returns the key its dataset graph carries."""
        key = next(self._keys)
        self._lib.register_source(key, source.cardinality, source.capacity)
        with self._lock:
            self._sources[key] = source
        return key

    def unregister(self, key):
        self._lib.unregister_source(key)
        with self._lock:
            source = self._sources.pop(key, None)
        if source is not None:
            source.close()

    def _source(self, key):
        with self._lock:
            return self._sources.get(key)

    def _run(self):
        while not self._stop.is_set():
            for request in self._lib.wait_requests(0.2):  # Waits without the GIL.
                self._start_epoch(request)

    def _start_epoch(self, request):
        # A method of its own so that no frame keeps the source alive while
        # the dispatcher waits: a collected dataset must free its refs.
        key, channel = request.key, request.channel
        source = self._source(key)
        if request.offered:  # An iterator took the epoch offered to it: its feeder runs.
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
            stream = source.open_epoch(
                deterministic=request.deterministic,
                skip=request.skip,
                taken=lambda: channel.items_taken,
            )
        except BatchError as e:
            channel.push_error(int(e.code), e.message)
            channel.close()
            return
        except Exception as e:  # Never leave an iterator waiting.
            logger.exception("tfray: starting an epoch failed")
            channel.push_error(int(Code.INTERNAL), f"tfray: starting an epoch failed: {e}")
            channel.close()
            return
        feeder = self._feeder(key, source, stream, channel)
        source.epochs += 1
        source.record(feeder)  # For stats().
        self._feeders.start(feeder)

    def _offer_next_epoch(self, key):
        """Starts the next epoch of a source that replays, as the last one ends.

        Its feeder resolves the first window into a channel the native registry
        offers to the source's next iterator, which then finds batches queued with
        no Python (so no GIL) between it and them: a new epoch no longer waits for
        the dispatcher and a feeder thread to get the GIL, which a busy Python
        thread in the trainer can make slow. Only for a source read more than
        once; the offer pins that window (within the look-ahead's bounds) until
        an iterator takes it or the dataset is collected.
        """
        source = self._source(key)
        if source is None or not source.replays or source.epochs < 2 or source.has_offer():
            return
        channel = self._lib.Channel(source.capacity)
        stream = source.open_epoch(deterministic=True, taken=lambda: channel.items_taken)
        feeder = self._feeder(key, source, stream, channel)
        if source.offer(feeder, lambda: self._lib.offer_epoch(key, channel)):
            self._feeders.start(feeder)
        else:  # Another epoch's end offered first, or the source is gone.
            stream.close()

    def _feeder(self, key, source, stream, channel):
        """A feeder of ``stream`` into ``channel`` that, at the epoch's end, offers the next."""
        return Feeder(
            stream,
            source.flat_spec,
            channel,
            pins=self._pins,
            alignment=self._lib.TENSOR_ALIGNMENT,
            native_spec=source.flat_spec.native(self._lib, self._lib.TENSOR_ALIGNMENT),
            on_end=functools.partial(self._offer_next_epoch, key),
            name=_describe(key, source),
        )


def _describe(key, source):
    return f"{source.kind} dataset (source {key})"


def _check_session(key, source):
    """Raises, for a new epoch, if the Ray that ``source`` was built in is gone."""
    where = _describe(key, source)
    if not ray_errors.ray_running():
        raise ray_errors.shutdown_error(where, reading=False)
    if ray_errors.session() != source.session:
        raise ray_errors.stale_session_error(where)
