"""The source registry and the dispatcher that starts a feeder per iterator.

Each tfray dataset registers its source under an integer key; the dataset
graph carries only that key. A TF iterator asks for an epoch by posting a
channel to the native registry (no GIL needed); the dispatcher thread here
takes the request and starts a feeder on it.

A source read again may be served ahead of the dispatcher, natively: its
next epoch offered as the last one ends (the first window already in the
channel), or, when its whole epoch fits in its look-ahead's bounds, every
epoch from the third on replayed from the pinned batches of the second.
"""

import functools
import itertools
import logging
import threading

import ray._raylet

from tfray._internal.runtime import ray_api
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
        # Replays need to see the Ray session end (see _replay).
        self._session_probe = lib.watch_ray_session(ray._raylet.__file__)

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
            if not ray_api.ray_running():  # Ray shut down: replays and offers go.
                self._lib.end_session()

    def _start_epoch(self, request):
        # A method of its own so that no frame keeps the source alive while
        # the dispatcher waits: a collected dataset must free its refs.
        key, channel = request.key, request.channel
        source = self._source(key)
        if request.replayed:  # Served natively; kept for stats().
            if source is not None:
                source.epochs += 1
                source.record(Replayed(channel))
            return
        if request.offered:  # An iterator took the epoch offered to it: its feeder runs.
            if source is not None:
                source.epochs += 1
                if source.take_offered(channel):  # Already filled: no end will offer the next.
                    self._offer_next_epoch(key)
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
        # A second reading of a whole epoch is recorded, to replay.
        record = source.epochs >= 1 and request.skip == 0
        feeder = self._feeder(key, source, stream, channel, record=record)
        source.epochs += 1
        source.record(feeder)  # For stats().
        self._feeders.start(feeder)

    def _epoch_ended(self, key, feeder):
        """On the feeder's thread: every batch of an epoch of ``key`` is in its channel.

        A recorded epoch that fits its source's bounds is kept to replay;
        otherwise the next epoch is offered.
        """
        source = self._source(key)
        if source is None:
            return
        recording = feeder.recording  # Within the source's replay bounds.
        if recording is not None and recording.size == source.cardinality and self._replay(key, recording):
            return
        self._offer_next_epoch(key)

    def _replay(self, key, recording):
        """Keeps ``recording`` for the native registry to serve ``key``'s epochs from.

        Only while the Ray session lasts: before it serves an epoch, the
        native registry asks Ray's core worker whether it is up, so that once
        ``ray.shutdown()`` began a new iterator goes to the dispatcher, which
        reports the shutdown; the dispatcher then drops every replay (_run).
        A Ray whose core worker cannot be asked gets no replays.
        """
        return self._session_probe and self._lib.set_replay(key, recording)

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
        if (
            source is None
            or not source.replays
            or source.epochs < 2
            or source.has_offer()
            or self._lib.has_replay(key)
        ):
            return
        channel = self._lib.Channel(source.capacity)
        stream = source.open_epoch(deterministic=True, taken=lambda: channel.items_taken)
        feeder = self._feeder(key, source, stream, channel, record=True)
        if source.offer(feeder, lambda: self._lib.offer_epoch(key, channel)):
            self._feeders.start(feeder)
        else:  # Another epoch's end offered first, or the source is gone.
            stream.close()

    def _feeder(self, key, source, stream, channel, *, record=False):
        """A feeder of ``stream`` into ``channel`` that, at the epoch's end, calls _epoch_ended.

        ``record``: it records the epoch, to replay, if the source allows.
        """
        bounds = source.replay_bounds() if record else None
        return Feeder(
            stream,
            source.flat_spec,
            channel,
            pins=self._pins,
            alignment=self._lib.TENSOR_ALIGNMENT,
            native_spec=source.flat_spec.native(self._lib, self._lib.TENSOR_ALIGNMENT),
            recording=None if bounds is None else self._lib.Recording(),
            record_within=bounds or (0, None),
            on_end=functools.partial(self._epoch_ended, key),
            name=_describe(key, source),
        )


class Replayed:
    """An epoch the native registry served from a replay: what stats() reads of it."""

    refs_in_flight = 0

    def __init__(self, channel):
        self.channel = channel
        self.lookahead = channel.capacity
        self.done = threading.Event()
        self.done.set()  # Whole from the start.


def _describe(key, source):
    return f"{source.kind} dataset (source {key})"


def _check_session(key, source):
    """Raises, for a new epoch, if the Ray that ``source`` was built in is gone."""
    where = _describe(key, source)
    if not ray_api.ray_running():
        raise ray_api.shutdown_error(where, reading=False)
    if ray_api.session() != source.session:
        raise ray_api.stale_session_error(where)
