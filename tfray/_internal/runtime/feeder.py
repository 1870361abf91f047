"""The feeder: one Python thread per iterator that moves batches into its channel.

It pulls resolved batches from its epoch's stream (a RefResolver, or Ray
Data's batch iterator), checks each against the element spec, pins it, and
pushes the whole lot to the native channel in one call. The channel is
bounded, so a slow consumer blocks the feeder, which then stops asking its
stream (and so Ray) for more.
"""

import logging
import queue
import threading

from tfray._internal.runtime import batch, ray_api
from tfray._internal.runtime.status import BatchError, Code, EpochError

logger = logging.getLogger("tfray")

# How long a wait may block before the feeder checks for cancellation.
_POLL_S = 0.1

class FeederPool:
    """The threads feeders run on (the runtime's): reused from epoch to epoch.

    Reusing threads keeps a new epoch from waiting on a thread's start-up
    handshake, which takes the GIL several times: slow when it is contended.
    A thread idle for ``idle_s`` ends while more than ``resting`` are idle,
    so a burst of iterators leaves no crowd of threads behind.
    """

    def __init__(self, *, idle_s=30.0, resting=2):
        self._idle_s = idle_s
        self._resting = resting
        self._lock = threading.Lock()
        self._live = set()  # Running feeders; guarded by _lock.
        # Threads waiting with no feeder promised to them; guarded by _lock.
        # start() promises one (a job in _jobs) by taking it off this count.
        self._idle = 0
        self._threads = 0  # Alive; guarded by _lock.
        self._stopped = False  # Guarded by _lock.
        self._jobs = queue.SimpleQueue()

    @property
    def threads(self):
        """How many threads the pool has now, running a feeder or idle."""
        return self._threads  # A snapshot either way: one read needs no lock.

    @property
    def idle(self):
        """How many of its threads wait for a feeder, none promised to them."""
        return self._idle  # Likewise.

    def start(self, feeder):
        """Runs ``feeder`` on an idle thread, or a new one."""
        with self._lock:
            if self._stopped:  # Exiting: its thread could not finish before finalization.
                feeder.channel.cancel()
                return
            self._live.add(feeder)
            spawn = self._idle == 0
            if spawn:
                self._threads += 1
            else:
                self._idle -= 1
        self._jobs.put(feeder)
        if spawn:
            threading.Thread(target=self._work, name="tfray-feeder", daemon=True).start()

    def wait_idle(self, timeout):
        """Waits up to ``timeout`` s for every running feeder to end; True if none runs."""
        with self._lock:
            feeders = list(self._live)
        for feeder in feeders:
            feeder.done.wait(timeout)
        with self._lock:
            return not self._live

    def stop(self, timeout):
        """Cancels every running feeder's channel, waits for them, and starts no more."""
        with self._lock:
            self._stopped = True
            feeders = list(self._live)
        for feeder in feeders:
            feeder.channel.cancel()
        for feeder in feeders:
            feeder.done.wait(timeout)
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._jobs.put(None)  # Ends the threads.

    def _work(self):
        while True:
            try:
                feeder = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    # Leaving keeps a waiting thread for every promised job:
                    # only an unpromised idle thread's place is given up.
                    if self._idle > self._resting and not self._stopped:
                        self._idle -= 1
                        self._threads -= 1
                        return
                continue
            if feeder is None:
                with self._lock:
                    self._threads -= 1
                return
            try:
                feeder.run()
            except (Exception, SystemExit):  # The thread must live on: it is counted as idle next.
                logger.exception("tfray: a feeder failed")
            with self._lock:
                self._live.discard(feeder)
                self._idle += 1


class Recorder:
    """Keeps an epoch's batches as the window push pushes them, to replay the epoch.

    Args:
        recording: the native Recording the window push adds each batch to.
        within: ``(batches, bytes)`` the recording may reach (bytes None: no
            byte bound); past either it is given up, as it is at a batch
            the window push did not take as it came.
    """

    def __init__(self, recording, within):
        self.recording = recording  # None once given up.
        self._batches, self._bytes = within

    def keep_if(self, every_batch_native):
        """Gives the recording up unless every batch so far was pushed natively, within its bounds."""
        r = self.recording
        if r is not None and (
            not every_batch_native
            or r.size > self._batches
            or (self._bytes is not None and r.bytes > self._bytes)
        ):
            self.recording = None


class Feeder:
    """Feeds one epoch from ``stream`` into ``channel``, on a FeederPool thread.

    Args:
        stream: the epoch's ItemStream (streams.py).
        channel: the native channel of the TF iterator this epoch serves.
        checks: a batch.Checks, how batches are checked against the spec.
        pins: the runtime's Pins, which keep each batch alive while TF uses it.
        recorder: a Recorder that keeps the epoch's batches to replay them
            (``recording`` below), or None. Only the native window push records.
        on_end: called with the feeder (on its thread) once every batch of
            the epoch is in the channel, unless the epoch was cancelled; it
            must return promptly (the registry posts a notice).
        name: the dataset this epoch is of, for messages.
        store: the dataset's StoreWatch (store_watch.py), told per window
            what TensorFlow holds of this epoch; None: not watched.
    """

    def __init__(
        self, stream, channel, checks, *, pins, recorder=None, on_end=None, name="tfray.Dataset", store=None
    ):
        self._pins = pins
        self._store = store
        self.done = threading.Event()
        self._name = name
        self._on_end = on_end
        self._stream = stream
        self._checks = checks
        self._recorder = recorder if checks.native is not None else None
        self._whole = False  # Every batch of the epoch is in the channel.
        self._channel = channel
        self.refs_in_flight = 0  # Read by stats(); an int store is atomic.
        self.lookahead = channel.capacity  # Likewise.

    @property
    def channel(self):
        return self._channel

    @property
    def store_capacity(self):
        """This node's object-store bytes, for stats(); 0 if unknown or not watched."""
        return (self._store and self._store.capacity) or 0

    @property
    def unplaced(self):
        """The epoch's producers that cannot be placed (streams.py), for stats(); None once it ended.

        Read from the stream when asked, not on every turn of the feeder.
        Ray Data's stream starts no producers of tfray's: it has none.
        """
        stream = self._stream
        return None if stream is None else getattr(stream, "unplaced", None)

    @property
    def recording(self):
        """The epoch's batches, if it was recorded and every batch was pushed natively.

        None otherwise: an epoch with an error, a copy, a batch the Python
        path handled, or one cut short is not replayed.
        """
        return self._recorder.recording if self._whole and self._recorder is not None else None

    def take_recording(self):
        """``recording``, handed over once: the feeder keeps it no longer (nor its pins)."""
        recording = self.recording
        self._recorder = None
        return recording

    def run(self):
        told = False
        try:
            if self._run() and self._on_end is not None:
                try:
                    self._on_end(self)
                    told = True
                except Exception:  # Only an optimisation: never fail the epoch for it.
                    logger.exception("tfray: the end-of-epoch hook failed")
        finally:
            if not told:  # Told, it keeps the recording for take_recording.
                self._recorder = None
            self.done.set()

    def _run(self):
        """Feeds the epoch and releases it; True if it reached the end."""
        try:
            self._whole = self._feed()
            return self._whole
        except EpochError as e:
            # Once Ray is gone, say which dataset lost it.
            self._push_error(e if ray_api.ray_running() else ray_api.shutdown_error(self._name))
        # A feeder must never die silently. Ray raises SystemExit from a call
        # that ray.shutdown() overtakes.
        except (Exception, SystemExit) as e:
            if not ray_api.ray_running():  # A Ray call met the shutdown.
                self._push_error(ray_api.shutdown_error(self._name))
            else:
                self._push_error(
                    BatchError(Code.INTERNAL, f"tfray: the feeder failed: {type(e).__name__}: {e}")
                )
        finally:
            try:
                self._stream.close()  # Stops the epoch's producers.
            except Exception:  # E.g. Ray went first; the epoch is over all the same.
                logger.warning("tfray: %s: stopping an epoch's producers failed", self._name, exc_info=True)
            with ray_api.held():  # Dropping refs and generators calls into Ray.
                self._stream = None  # Stats outlive the epoch; its data need not.
            self.refs_in_flight = 0
            self._channel.close()
        return False

    def _feed(self):
        """Feeds the epoch; True if it reached the end, False if cancelled."""
        lookahead = self._stream.lookahead  # Learns the batches' size even when fixed.
        adaptive = lookahead is not None and lookahead.adaptive
        if adaptive:  # Fixed: the channel's capacity already says it.
            self._channel.capacity = self.lookahead = lookahead.limit
        store = self._store
        if store is not None:
            store.start()
        while not self._channel.cancelled:
            items = self._stream.next_ready(_POLL_S)
            self.refs_in_flight = self._stream.in_flight
            if items is None:
                return True  # Every batch is in the channel.
            if items and not self._deliver(items, lookahead):
                return False
            if store is not None:
                store.check(self._channel.bytes_held, lookahead)
            if adaptive:
                limit = lookahead.update(self._channel.consumer_wait_s)
                if limit != self.lookahead:
                    self._channel.capacity = self.lookahead = limit
        return False

    def _deliver(self, items, lookahead):
        """Pushes ``items`` in order, errors in their places; False if cancelled.

        The window's batches go in one native call (window.h) up to the first
        item it does not take as it is: an error, a batch to copy or one that
        does not match the spec. From there on, this window's items are
        handled one by one here, with the messages that say what is wrong.
        ``lookahead``, if any, learns the size of the batches.
        """
        if self._checks.native is not None:
            values = [value for _, value, _ in items]
            origins = [getattr(label, "origin", None) for label, _, _ in items]
            recording = None if self._recorder is None else self._recorder.recording
            taken, pushed, nbytes = self._channel.push_window(values, self._checks.native, recording, origins)
            if pushed < taken:
                return False  # The consumer is gone.
            if taken and lookahead is not None:
                lookahead.observe(nbytes / taken)
            items = items[taken:]
        if self._recorder is not None:
            self._recorder.keep_if(every_batch_native=not items)
        pending = []
        for label, value, error in items:
            try:
                if error is not None:
                    raise error
                pending.append(self._entry(label, value))
                if lookahead is not None:
                    lookahead.observe(sum(a.nbytes for a in pending[-1].arrays))
            except BatchError as e:
                if not self._push(pending):
                    return False
                pending = []
                if isinstance(e, EpochError):
                    raise  # run() pushes it, once: it ends the epoch.
                self._push_error(e)
        return self._push(pending)

    def _entry(self, label, value):
        bytes_copied = arrays_copied = 0
        if isinstance(value, batch.Copied):
            value, bytes_copied, arrays_copied = value.value, value.bytes_copied, value.arrays_copied
        try:
            arrays = self._checks.flat_spec.check(value)
        except BatchError as e:
            raise BatchError(e.code, f"tfray: {label}: {e.message}") from None
        for i, array in enumerate(arrays):
            if not batch.fits(array, self._checks.alignment):
                arrays[i] = batch.aligned_copy(array, self._checks.alignment)
                bytes_copied += array.nbytes
                arrays_copied += 1
        # Pin the batch as it came, plus any copies made from it.
        token = self._pins.pin((value, arrays))
        return batch.Entry(arrays, token, bytes_copied, arrays_copied, getattr(label, "origin", None))

    def _push(self, entries):
        """Pushes entries in order; returns False once the consumer is gone."""
        if not entries:
            return not self._channel.cancelled
        # Blocks (without the GIL) while the channel is full; a cancel wakes it.
        return self._channel.push(entries, self._checks.flat_spec.dtype_enums) == len(entries)

    def _push_error(self, error):
        self._channel.push_error(int(error.code), error.message)
