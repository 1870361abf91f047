"""A ``ray.shutdown()`` that overtakes a Ray call a tfray thread has begun.

Run as a script (tests/runtime/test_shutdown.py): ``python shutdown_race.py SOURCE ...``,
one Ray session per source, one after another.
Ray's ``shutdown`` marks the worker disconnected, shuts the core worker
down (``shutdown_driver``), then drops it: a call that passed Ray's
is-connected check before and reaches the core worker in between ends the
process ("The core worker has already been shutdown"). That window is
widened here on purpose (``Widened``): once the main thread starts the
shutdown, a core worker call from a tfray thread waits until the core
worker is shut down (up to ``HOLD_S``), and the shutdown lingers there
(``LINGER_S``). tfray must keep the shutdown from starting while its call
is under way, and its reader must then get the documented
``UnavailableError``: the script prints ``SOURCE: UnavailableError`` for
each and exits 0 then, 1 on any other outcome, and the process dies in Ray
if the shutdown overtakes the call.
"""

import sys
import threading
import time

import numpy as np
import ray
import tensorflow as tf

import tfray

HOLD_S = 5.0
LINGER_S = 1.0


class Widened:
    """Ray's core worker, with the window between its shutdown and its drop widened."""

    def __init__(self, real):
        self._real = real
        self.begun = threading.Event()  # The main thread is about to shut Ray down.
        self.shut = threading.Event()  # The core worker is shut down, not yet dropped.

    def shutdown_driver(self):
        self._real.shutdown_driver()
        self.shut.set()
        time.sleep(LINGER_S)

    def __getattr__(self, name):
        method = getattr(self._real, name)
        if not callable(method):
            return method

        def call(*args, **kwargs):
            if self.begun.is_set() and threading.current_thread().name.startswith("tfray-"):
                self.shut.wait(HOLD_S)
            return method(*args, **kwargs)

        return call


def dataset(source):
    spec = tf.TensorSpec([None], tf.float64)
    if source == "refs":

        @ray.remote(num_cpus=0)
        def slow():
            time.sleep(120)
            return np.zeros(4)

        return tfray.Dataset([slow.remote()], element_spec=spec)

    def produce(shard):
        import time

        import numpy as np

        time.sleep(120)
        yield np.zeros(4)

    return tfray.Dataset.from_generators(produce, 2, element_spec=spec, ray_remote_args={"num_cpus": 0})


def race(source):
    ray.init(address="local", num_cpus=2, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False)
    ds = dataset(source)
    it = iter(ds)
    got = {}

    def read():
        try:
            next(it)
            got["result"] = "a batch"
        except tf.errors.UnavailableError as e:
            got["result"] = "UnavailableError" if "Ray was shut down" in str(e) else f"UnavailableError: {e}"
        except Exception as e:  # noqa: BLE001  Reported, and the exit status says it.
            got["result"] = f"{type(e).__name__}: {e}"

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 60
    while not (ds.stats() and ds.stats()[-1].get_next_calls) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)  # The reader waits, and its feeder polls in calls into Ray.
    worker = ray._private.worker.global_worker
    widened = worker.core_worker = Widened(worker.core_worker)
    widened.begun.set()
    ray.shutdown()
    reader.join(60)
    print(f"{source}: {got.get('result', 'no result: the reader hangs')}", flush=True)
    return got.get("result") == "UnavailableError"


if __name__ == "__main__":
    sys.exit(0 if all([race(source) for source in sys.argv[1:]]) else 1)
