"""Python references that keep batch memory alive while TensorFlow uses it.

A batch pushed to a channel is pinned here under a token id. When TensorFlow
drops the last tensor (and slice) of that batch, the native release queue
gets the id (on whatever thread that was, without the GIL) and the release
thread drops the reference, and with it Ray's pin on the object.
"""

import itertools
import threading

from tfray._internal.runtime.service import Service


class Pins(Service):
    """The pinned batches and the release thread that unpins them (the runtime's)."""

    name = "tfray-release"

    def __init__(self, lib):
        super().__init__()
        self._lib = lib
        self._lock = threading.Lock()
        self._pinned = {}  # token id -> object; guarded by _lock.
        self._ids = itertools.count(1)  # next() is atomic under the GIL.

    def pin(self, obj):
        """Keeps ``obj`` alive until its returned token id is released."""
        token = next(self._ids)
        with self._lock:
            self._pinned[token] = obj
        return token

    def count(self):
        """How many batches TensorFlow (or a channel) still holds."""
        with self._lock:
            return len(self._pinned)

    def _run(self):
        while not self._stop.is_set():
            released = self._lib.drain_released(0.2)  # Waits without the GIL.
            if released:
                with self._lock:
                    dropped = [self._pinned.pop(t, None) for t in released]
                del dropped  # Frees the batches outside the lock.
