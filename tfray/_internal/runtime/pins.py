"""Python references that keep batch memory alive while TensorFlow uses it.

A batch the feeder pushes one at a time is pinned here under a token id;
batches pushed a window at a time are pinned natively (window.h). When
TensorFlow drops the last tensor (and slice) of a batch, the native release
queue gets its id (on whatever thread that was, without the GIL) and the
release thread drops the reference, and with it Ray's pin on the object:
for all the ids released meanwhile at once, with the GIL taken once, and
under Ray's connect/shutdown lock, since dropping Ray's pin calls into Ray
(ray_api).
"""

import itertools
import threading

from tfray._internal.runtime import ray_api
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
            return len(self._pinned) + self._lib.native_pins()

    def _run(self):
        while not self._stop.is_set():
            released = self._lib.wait_released(0.2)  # Waits without the GIL.
            if released:
                with ray_api.held():
                    released = self._lib.unpin_native(released)  # Returns the others.
                    with self._lock:
                        dropped = [self._pinned.pop(t, None) for t in released]
                    del dropped  # Frees the batches outside self._lock.
