"""Counts the Python calls tfray's threads make in the trainer over one epoch.

Run as a script (by test_per_window.py): a profiler set before tfray starts
any thread sees every call on tfray's threads (dispatcher, feeders, release
thread). Prints one JSON line: batches read, calls into tfray's own modules
and into Ray's, and the windows the feeder pushed.
"""

import json
import os
import sys
import threading

import numpy as np
import ray
import tensorflow as tf

import tfray

TFRAY = os.path.dirname(tfray.__file__)
RAY = os.path.dirname(ray.__file__)
# tfray: calls into tfray's modules, but for a poll's own (polls: per
# wait, however long Ray takes); rounds: the feeder's turns (next_ready),
# windows: those that pushed batches (_deliver).
counts = {"tfray": 0, "polls": 0, "rounds": 0, "windows": 0, "ray": 0}


def profile(frame, event, arg):
    if event != "call":
        return
    filename = frame.f_code.co_filename
    if filename.startswith(TFRAY):
        caller = frame.f_back
        if caller is not None and caller.f_code.co_name == "poll" and caller.f_code.co_filename.startswith(TFRAY):
            counts["polls"] += 1
            return
        counts["tfray"] += 1
        name = frame.f_code.co_name
        if name == "_deliver":
            counts["windows"] += 1
        elif name == "next_ready":
            counts["rounds"] += 1
    elif filename.startswith(RAY):
        counts["ray"] += 1


def main(batches, window, rows):
    ray.init(num_cpus=1, object_store_memory=200 << 20, include_dashboard=False)
    refs = [ray.put(np.full((rows, 256), i, np.float32)) for i in range(batches)]
    ds = tfray.Dataset(refs, max_inflight=window)

    @tf.function
    def total(ds):
        return ds.reduce(tf.constant(0.0), lambda n, b: n + b[0, 0])

    threading.setprofile(profile)  # Every thread tfray starts from here on.
    got = float(total(ds))
    threading.setprofile(None)
    assert got == sum(range(batches)), got
    stats = ds.stats()[-1]
    print(json.dumps(dict(counts, batches=stats.batches, copied=stats.bytes_copied)))
    ray.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
