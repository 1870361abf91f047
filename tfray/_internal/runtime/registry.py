"""The source registry, and the dispatcher that owns every epoch's life.

Each tfray dataset registers its source under an integer key; the dataset
graph carries only that key. Where an epoch starts, who owns it and who
ends it, all here, on the dispatcher thread:

1. **Start.** A TF iterator asks for an epoch by posting a channel to the
   native registry (no GIL needed). The dispatcher takes the request, opens
   the source's epoch (``Source.open_epoch``: what to read) and starts a
   feeder on it (``FeederPool``).
2. **Served ahead.** A source read again may be served without the
   dispatcher, natively: from the epoch offered as the last one ended (its
   first window already in the channel), or, when a whole epoch fits in the
   source's replay bounds, every epoch from the third on is replayed from the
   pinned batches of the second. The native registry tells the dispatcher of
   each such epoch, which it counts.
3. **End.** A feeder that pushed every batch of its epoch posts a notice
   (``post_ended``) and is done; the dispatcher then keeps the epoch to
   replay or opens the next one and offers it. A cancelled epoch ends with
   its iterator; the source's epochs end when its dataset is collected
   (``unregister``).

``SourceEpochs`` holds one source's part of that state; ``view`` reads it.
"""

import collections
import functools
import itertools
import json
import logging
import threading
from typing import NamedTuple, Tuple

import ray._raylet

from tfray._internal.runtime import ray_api
from tfray._internal.runtime.batch import Checks
from tfray._internal.runtime.feeder import Feeder, Recorder
from tfray._internal.runtime.progress import Progress
from tfray._internal.runtime.service import Service
from tfray._internal.runtime.status import BatchError, Code
from tfray._internal.runtime.store_watch import StoreWatch

logger = logging.getLogger("tfray")


class SourceEpochs:
    """One registered source's epochs: how many began, the one offered ahead, the recent ones.

    Changed on the dispatcher thread only; read by stats() from others, so
    every access holds ``_lock``.
    """

    def __init__(self, source, name="tfray.Dataset"):
        self.source = source
        self.store = StoreWatch(name)  # Warns once if TensorFlow holds more than the store.
        self._lock = threading.Lock()
        self._began = 0  # Epochs begun: started, taken from an offer, replayed.
        self._offered = None  # The feeder of the epoch offered ahead; until claimed.
        self._recent = collections.deque(maxlen=256)  # Feeders of begun epochs, for stats().

    @property
    def epochs(self):
        """Epochs begun so far."""
        with self._lock:
            return self._began

    def began(self, epoch):
        """Counts an epoch an iterator reads (a feeder, or a Replayed) and keeps it for stats()."""
        with self._lock:
            self._began += 1
            self._recent.append(epoch)

    def offer(self, feeder, publish):
        """Offers the epoch ``feeder`` fills to the next iterator, via ``publish()``.

        False if there is an offer already or ``publish()`` fails. Under the
        lock, so that the offer is kept before anyone can see it taken.
        """
        with self._lock:
            self._settle()
            if self._offered is not None or not publish():
                return False
            self._offered = feeder
            return True

    def offer_taken(self, channel):
        """An iterator took the epoch offered in ``channel``: it counts as begun.

        Returns its feeder (None if it was not the offer kept here).
        """
        with self._lock:
            self._began += 1
            self._settle()
            return next((f for f in reversed(self._recent) if f.channel is channel), None)

    def find(self, channel):
        """The feeder of a begun or offered epoch whose channel is ``channel``, or None."""
        with self._lock:
            if self._offered is not None and self._offered.channel is channel:
                return self._offered
            return next((f for f in reversed(self._recent) if f.channel is channel), None)

    def forget_offer(self):
        """Forgets an epoch no iterator took (the dataset is gone)."""
        with self._lock:
            self._offered = None  # Unregistering cancelled its channel.

    def view(self, replayed):
        """A SourceView of now; ``replayed``: whether the native registry replays the source."""
        with self._lock:
            self._settle()
            offered = self._offered
            return SourceView(
                epochs=self._began,
                offered=offered is not None,
                offered_queued=0 if offered is None else offered.channel.stats()["queued"],
                replayed=replayed,
                recent=tuple(self._recent),
            )

    def _settle(self):
        # An iterator takes an offer natively (its channel is claimed then),
        # before the dispatcher hears of it: from then on it is an epoch like
        # any other, and the next may be offered.
        if self._offered is not None and self._offered.channel.claimed:
            self._recent.append(self._offered)
            self._offered = None


class SourceView(NamedTuple):
    """What a registered source's epochs look like now (``Registry.view``)."""

    epochs: int  # Begun, however served.
    offered: bool  # An epoch waits on offer for the next iterator.
    offered_queued: int  # Batches already in the offered epoch's channel.
    replayed: bool  # Later epochs are replayed natively.
    recent: Tuple  # The recent epochs' feeders (or Replayed), oldest first.


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
        self._sources = {}  # key -> SourceEpochs; guarded by _lock.
        self._keys = itertools.count(1)  # next() is atomic under the GIL.
        # Epoch ends posted and not yet handled (see settled); guarded by _settled.
        self._ends_pending = 0
        self._settled = threading.Condition()
        # Replays need to see the Ray session end (see _replay).
        self._session_probe = lib.watch_ray_session(ray._raylet.__file__)
        # Keys of collected datasets, for the dispatcher to forget (unregister).
        self._collected = collections.deque()

    def register(self, source):
        """Registers ``source``; returns the key its dataset graph carries."""
        key = next(self._keys)
        self._lib.register_source(key, source.cardinality, source.capacity)
        with self._lock:
            self._sources[key] = SourceEpochs(source, _describe(key, source))
        return key

    def unregister(self, key):
        """Source ``key``'s dataset was collected: no iterator is served it; the dispatcher forgets it.

        It runs as the dataset's finalizer, in whichever thread the garbage
        collector ran, perhaps one inside a lock of tfray's that forgetting
        takes (a SourceEpochs' is one): so it takes no Python lock and calls
        no Ray here. The native registry cancels the source's offer and
        replay at once, and never holds its lock while Python runs.
        """
        self._lib.unregister_source(key)
        self._collected.append(key)  # Atomic under the GIL.

    def stop(self, timeout):
        super().stop(timeout)
        self._forget_collected()  # At exit, the finalizers ran just before.

    def _forget_collected(self):
        """Drops the collected datasets' sources and stops what they keep running."""
        while self._collected:
            key = self._collected.popleft()
            with self._lock:
                entry = self._sources.pop(key, None)
            if entry is None:
                continue
            entry.forget_offer()
            try:
                entry.source.close()  # Its Ray calls are its own to guard.
            except Exception:  # One source's failure must not keep the others open.
                logger.exception("tfray: closing a collected dataset's source failed")
            with ray_api.held():  # Dropping the source drops its refs and actor handles.
                del entry

    def view(self, key):
        """A SourceView of source ``key``, or None if it is not registered."""
        entry = self._entry(key)
        return None if entry is None else entry.view(replayed=self._lib.has_replay(key))

    def recent(self, key):
        """The recent epochs of source ``key`` (for stats()), oldest first."""
        view = self.view(key)
        return [] if view is None else list(view.recent)

    def settled(self, timeout):
        """Waits up to ``timeout`` s until every epoch end posted so far was handled; True if so.

        Then each ended epoch has been kept to replay or has had its next one
        offered.
        """
        with self._settled:
            return self._settled.wait_for(lambda: self._ends_pending == 0, timeout)

    def _entry(self, key):
        with self._lock:
            return self._sources.get(key)

    def _run(self):
        while not self._stop.is_set():
            requests = self._lib.wait_requests(0.2)  # Waits without the GIL.
            self._forget_collected()  # First: a collected dataset's requests find it gone.
            for request in requests:
                try:
                    self._handle(request)
                except Exception:  # The dispatcher must live on: every iterator waits on it.
                    logger.exception("tfray: the dispatcher failed on a request")
            if not ray_api.ray_running():  # Ray shut down: replays and offers go.
                self._lib.end_session()

    def _handle(self, request):
        # A method of its own so that no frame keeps the source alive while
        # the dispatcher waits: a collected dataset must free its refs.
        key, channel = request.key, request.channel
        entry = self._entry(key)
        if request.ended:
            try:
                if entry is not None:
                    self._epoch_ended(key, entry, entry.find(channel))
            finally:
                with self._settled:
                    self._ends_pending -= 1
                    self._settled.notify_all()
        elif request.replayed:  # Served natively; kept for stats().
            if entry is not None:
                entry.began(Replayed(channel))
        elif request.offered:  # An iterator took the epoch offered to it: its feeder runs.
            if entry is not None:
                taken = entry.offer_taken(channel)
                if taken is not None and taken.done.is_set():
                    # It ended while on offer, when no next one could be offered.
                    self._epoch_ended(key, entry, taken)
        elif entry is None:
            channel.push_error(
                int(Code.NOT_FOUND),
                f"tfray source {key} was unregistered: its tfray.Dataset was garbage collected.",
            )
            channel.close()
        else:
            self._start_epoch(key, entry, request)

    def _start_epoch(self, key, entry, request):
        channel = request.channel
        source = entry.source
        try:
            _check_session(key, source)
            stream = source.open_epoch(
                deterministic=request.deterministic,
                skip=request.skip,
                progress=Progress.decode(request.progress),
                resume_info=json.loads(request.resume_info) if request.resume_info else None,
                taken=lambda: channel.items_taken,
            )
            info = getattr(stream, "resume_info", None)  # What its checkpoints save.
            channel.resume_info = "" if info is None else json.dumps(info)
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
        record = entry.epochs >= 1 and request.skip == 0
        feeder = self._feeder(key, entry, stream, channel, record=record)
        entry.began(feeder)
        self._feeders.start(feeder)

    def _epoch_ended(self, key, entry, feeder):
        """Every batch of ``feeder``'s epoch is in its channel.

        A recorded epoch that fits its source's bounds is kept to replay;
        otherwise the next epoch is offered.
        """
        recording = None if feeder is None else feeder.take_recording()
        if recording is not None and recording.size == entry.source.cardinality and self._replay(key, recording):
            return
        del recording  # Not kept: its batches' pins go.
        self._offer_next_epoch(key, entry)

    def _replay(self, key, recording):
        """Keeps ``recording`` for the native registry to serve ``key``'s epochs from.

        Only while the Ray session lasts: before it serves an epoch, the
        native registry asks Ray's core worker whether it is up, so that once
        ``ray.shutdown()`` began a new iterator goes to the dispatcher, which
        reports the shutdown; the dispatcher then drops every replay (_run).
        A Ray whose core worker cannot be asked gets no replays.
        """
        return self._session_probe and self._lib.set_replay(key, recording)

    def _offer_next_epoch(self, key, entry):
        """Starts the next epoch of a source that replays, as the last one ends.

        Its feeder resolves the first window into a channel the native registry
        offers to the source's next iterator, which then finds batches queued with
        no Python (so no GIL) between it and them: a new epoch no longer waits for
        the dispatcher and a feeder thread to get the GIL, which a busy Python
        thread in the trainer can make slow. Only for a source read more than
        once; the offer pins that window (within the look-ahead's bounds) until
        an iterator takes it or the dataset is collected.
        """
        source = entry.source
        view = entry.view(replayed=self._lib.has_replay(key))
        if not source.replays or view.epochs < 2 or view.offered or view.replayed:
            return
        channel = self._lib.Channel(source.capacity)
        try:
            _check_session(key, source)
            stream = source.open_epoch(deterministic=True, taken=lambda: channel.items_taken)
        except BatchError:  # Ray went: the next iterator hears it from _start_epoch.
            return
        feeder = self._feeder(key, entry, stream, channel, record=True)
        if entry.offer(feeder, lambda: self._lib.offer_epoch(key, channel)):
            self._feeders.start(feeder)
        else:  # The source is gone meanwhile.
            stream.close()

    def _feeder(self, key, entry, stream, channel, *, record=False):
        """A feeder of ``stream`` into ``channel`` (an epoch of ``entry``'s source) that posts its end to the dispatcher.

        ``record``: it records the epoch, to replay, if the source allows.
        """
        source = entry.source
        bounds = source.replay_bounds() if record else None
        alignment = self._lib.TENSOR_ALIGNMENT
        checks = Checks(source.flat_spec, source.flat_spec.native(self._lib, alignment), alignment)
        return Feeder(
            stream,
            channel,
            checks,
            pins=self._pins,
            recorder=None if bounds is None else Recorder(self._lib.Recording(), bounds),
            on_end=functools.partial(self._post_ended, key),
            name=_describe(key, source),
            store=entry.store,
        )

    def _post_ended(self, key, feeder):
        with self._settled:
            self._ends_pending += 1
        self._lib.post_ended(key, feeder.channel)


class Replayed:
    """An epoch the native registry served from a replay: what stats() reads of it."""

    refs_in_flight = 0
    unplaced = None
    store_capacity = 0  # Its batches are held by the epoch it replays.

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
