"""Python references that keep batch memory alive while TensorFlow uses it.

A batch pushed to a channel is pinned here under a token id. When TensorFlow
drops the last tensor of that batch, the native release queue gets the id
(on whatever TF thread that was, without the GIL) and this module's thread
drops the reference, and with it Ray's pin on the object.
"""

import itertools
import threading

from tfray._internal import native

_lock = threading.Lock()
_pinned = {}  # token id -> object; guarded by _lock.
_ids = itertools.count(1)
_thread = None  # guarded by _lock.
_stop = threading.Event()


def pin(obj):
    """Keeps ``obj`` alive until its returned token id is released."""
    _ensure_thread()
    token = next(_ids)
    with _lock:
        _pinned[token] = obj
    return token


def count():
    """How many batches TensorFlow (or a channel) still holds."""
    with _lock:
        return len(_pinned)


def _ensure_thread():
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="tfray-release", daemon=True)
            _thread.start()


def stop():
    """Stops the release thread (at exit: no thread may wait in C++ then)."""
    _stop.set()
    with _lock:
        thread = _thread
    if thread is not None:
        thread.join(timeout=5)


def _run():
    lib = native.load().lib
    while not _stop.is_set():
        released = lib.drain_released(0.2)  # Waits without the GIL.
        if released:
            with _lock:
                dropped = [_pinned.pop(t, None) for t in released]
            del dropped  # Frees the batches outside the lock.
