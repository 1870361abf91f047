"""The feeder: one Python thread per iterator that moves batches into its channel.

It keeps up to ``max_inflight`` refs resolving ahead of the consumer, resolves
whatever is ready in bulk (one ``ray.wait`` and one ``ray.get`` for many
batches, so the GIL is taken per window, not per batch), checks each batch
against the element spec and pushes the window to the native channel in one
call. The channel is bounded, so a slow consumer blocks the feeder, which then
stops asking Ray for more.
"""

import collections
import threading

import numpy as np
import ray

from tfray._internal import pins, ray_errors
from tfray._internal.status import BatchError, Code, EpochError

# How long a wait may block before the feeder checks for cancellation.
_POLL_S = 0.1

_live_lock = threading.Lock()
_live = set()  # Running feeders; guarded by _live_lock.


def stop_all(timeout):
    """Cancels every running feeder's channel and waits for the feeders."""
    with _live_lock:
        feeders = list(_live)
    for feeder in feeders:
        feeder.channel.cancel()
    for feeder in feeders:
        feeder.join(timeout)


def aligned_copy(array, alignment):
    """An aligned, C-contiguous copy of ``array`` (for TF, which needs both)."""
    raw = np.empty(array.nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    out = raw[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
    np.copyto(out, array)
    return out


class Feeder(threading.Thread):
    """Feeds one epoch of ``refs`` into ``channel``.

    Args:
        refs: an iterator of ObjectRefs, read lazily in order.
        flat_spec: the source's FlatSpec.
        channel: the native channel of the TF iterator this epoch serves.
        max_inflight: refs resolved ahead of the consumer.
        alignment: the byte alignment TF tensors need.
    """

    def __init__(self, refs, flat_spec, channel, *, max_inflight, alignment):
        super().__init__(name="tfray-feeder", daemon=True)
        self._refs = refs
        self._spec = flat_spec
        self._channel = channel
        self._max_inflight = max_inflight
        self._alignment = alignment
        self._index = 0  # Position in the epoch of the next ref taken.
        self._window = collections.deque()  # (index, ref); feeder thread only.
        self.refs_in_flight = 0  # Read by stats(); an int store is atomic.

    @property
    def channel(self):
        return self._channel

    def run(self):
        with _live_lock:
            _live.add(self)
        try:
            self._feed()
        except EpochError as e:
            self._push_error(e)
        except Exception as e:  # A feeder must never die silently.
            self._push_error(
                BatchError(
                    Code.INTERNAL,
                    f"tfray: the feeder failed: {type(e).__name__}: {e}",
                )
            )
        finally:
            self._refs = None  # Stats outlive the epoch; the refs need not.
            self._window.clear()
            self.refs_in_flight = 0
            self._channel.close()
            with _live_lock:
                _live.discard(self)

    def _feed(self):
        exhausted = False
        while not self._channel.cancelled:
            while not exhausted and len(self._window) < self._max_inflight:
                ref = next(self._refs, None)
                if ref is None:
                    exhausted = True
                    break
                self._window.append((self._index, ref))
                self._index += 1
            self.refs_in_flight = len(self._window)
            if not self._window:
                return
            ready = self._ready_prefix()
            if ready:
                self._deliver(ready)

    def _ready_prefix(self):
        """Pops and returns the longest run of resolved refs at the window's head."""
        if not ray_errors.ray_running():
            raise ray_errors.shutdown_error()
        head = self._window[0][1]
        done, _ = ray.wait([head], num_returns=1, timeout=_POLL_S, fetch_local=True)
        if not done:
            return []
        unique = list(dict.fromkeys(ref for _, ref in self._window))
        done, _ = ray.wait(unique, num_returns=len(unique), timeout=0, fetch_local=True)
        done = set(done)
        ready = []
        while self._window and self._window[0][1] in done:
            ready.append(self._window.popleft())
        return ready

    def _deliver(self, ready):
        """Resolves ``ready`` and pushes it in order, errors in their places."""
        refs = [ref for _, ref in ready]
        try:
            values = [(value, None) for value in ray.get(refs)]
        except Exception:  # Find out which ones failed, and why.
            values = []
            for ref in refs:
                try:
                    values.append((ray.get(ref), None))
                except Exception as e:  # noqa: PERF203
                    values.append((None, e))
        pending = []
        for (index, ref), (value, error) in zip(ready, values):
            try:
                if error is not None:
                    raise ray_errors.translate(error, f"batch {index}")
                pending.append(self._entry(index, value))
            except BatchError as e:
                if not self._push(pending):
                    return
                pending = []
                self._push_error(e)
                if isinstance(e, EpochError):
                    raise
        self._push(pending)

    def _entry(self, index, value):
        try:
            arrays = self._spec.check(value)
        except BatchError as e:
            raise BatchError(e.code, f"tfray: batch {index}: {e.message}") from None
        bytes_copied = arrays_copied = 0
        for i, array in enumerate(arrays):
            if not array.flags.c_contiguous or array.ctypes.data % self._alignment:
                arrays[i] = aligned_copy(array, self._alignment)
                bytes_copied += array.nbytes
                arrays_copied += 1
        # Pin the batch as Ray returned it, plus any copies made from it.
        token = pins.pin((value, arrays))
        return (arrays, token, bytes_copied, arrays_copied)

    def _push(self, entries):
        """Pushes entries in order; returns False once the consumer is gone."""
        if not entries:
            return not self._channel.cancelled
        # Blocks (without the GIL) while the channel is full; a cancel wakes it.
        return self._channel.push(entries, self._spec.dtype_enums) == len(entries)

    def _push_error(self, error):
        self._channel.push_error(int(error.code), error.message)
