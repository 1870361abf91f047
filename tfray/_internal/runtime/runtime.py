"""The runtime: every thread tfray starts in a process, with one start and one stop.

- the dispatcher (Registry): takes TF iterators' requests for epochs and
  starts a feeder for each;
- the feeders (FeederPool): one thread per running epoch, reused;
- the release thread (Pins): drops a batch's pin once TF has freed it;
- the lease heartbeat (Heartbeat): keeps dynamic sharding's leases.

It also keeps the Ray actors a process needs once per Ray session (the
producers' stop board): an actor lives while a handle to it does.

It starts with the first dataset and stops at exit, before Python finalizes:
a daemon thread that retakes the GIL during finalization unwinds through
C++ and aborts the process, so every thread leaves its native waits first.
"""

import atexit
import functools
import threading

from tfray._internal.runtime import native, ray_api
from tfray._internal.runtime.feeder import FeederPool
from tfray._internal.runtime.heartbeat import Heartbeat
from tfray._internal.runtime.pins import Pins
from tfray._internal.runtime.registry import Registry

_STOP_TIMEOUT_S = 5.0


class Runtime:
    """Owns tfray's threads and the state they share; see the module docstring."""

    def __init__(self):
        lib = native.load().lib
        self.pins = Pins(lib)
        self.feeders = FeederPool()
        self.registry = Registry(lib, self.feeders, self.pins)
        self.heartbeat = Heartbeat()
        self._actors_lock = threading.Lock()
        self._actors = {}  # name -> (Ray session, handle); guarded by _actors_lock.

    def session_actor(self, name, make):
        """The actor ``make()`` made in this Ray session, made on first use."""
        session = ray_api.session()
        with self._actors_lock:
            made = self._actors.get(name)
            if made is None or made[0] != session:
                made = self._actors[name] = (session, ray_api.call(make))
            return made[1]

    def start(self):
        self.pins.start()
        self.registry.start()
        self.heartbeat.start()
        atexit.register(self.stop)

    def stop(self, timeout=_STOP_TIMEOUT_S):
        """Stops every thread: first the dispatcher, so that no new feeder starts."""
        self.registry.stop(timeout)
        self.feeders.stop(timeout)
        self.heartbeat.stop(timeout)
        self.pins.stop(timeout)


_lock = threading.Lock()  # One Runtime even when two threads ask first.


def get():
    """This process's Runtime, started on first use."""
    with _lock:
        return _started()


@functools.lru_cache(maxsize=None)
def _started():
    runtime = Runtime()
    runtime.start()
    return runtime
