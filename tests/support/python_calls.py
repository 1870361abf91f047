"""Counts the Python calls tfray's threads make in the trainer over an epoch.

Run as a script (by test_per_window.py): a profiler set before tfray starts
a feeder sees every call on tfray's feeder threads. For each case, prints
one JSON line: batches read, calls into tfray's own modules and into Ray's,
tfray's calls into Ray's by name, the windows the feeder pushed and, for
``from_generators``, the producers' bundles it read.

    python python_calls.py BATCHES,WINDOW,ROWS,SOURCE ...

``refs``: a list of BATCHES refs, ``max_inflight=WINDOW``; ``generators``:
two producers yielding BATCHES between them, ``max_inflight_per_producer=WINDOW``.
Each batch is ROWS x 256 float32. The cases run one after another in one
process and one Ray (a process and a Ray each would cost seconds more a
case); the counts start afresh for each.
"""

import functools
import json
import os
import sys
import threading

import numpy as np
import ray
import tensorflow as tf

import tfray
from tfray._internal.runtime import feeder, runtime
from tfray._internal.runtime import ray_api as tfray_ray_api

TFRAY = os.path.dirname(tfray.__file__)
RAY_API = tfray_ray_api.__file__
RAY = os.path.dirname(ray.__file__)
# tfray: calls into tfray's modules, but for a poll's own (polls: per
# wait, however long Ray takes); rounds: the feeder's turns (next_ready),
# windows: those that pushed batches (_deliver), bundles: producers'
# bundles handed on; ray: calls into Ray's modules, but for those a poll
# makes (ray_in_polls); waits: polls that found nothing in the whole
# of the feeder's poll interval (a feeder that spins waits in none).
counts = {"tfray": 0, "polls": 0, "rounds": 0, "windows": 0, "bundles": 0, "ray": 0, "ray_in_polls": 0, "waits": 0}
# Calls tfray's frames make straight into Ray's (but for a poll's), by name:
# ``get`` and ``wait`` give up the GIL and take it back.
ray_api = {}
# Calls into tfray's door to Ray (runtime/ray_api.py), by name: Ray's
# core-worker get that ``get_decoded`` makes is Cython, invisible above.
door = {}


def _in_poll(frame):
    """Whether tfray's nearest frame below ``frame`` (a call into Ray) is a poll."""
    while frame is not None and not frame.f_code.co_filename.startswith(TFRAY):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "poll"


def _called_by_tfray(frame):
    """Whether ``frame`` is tfray's, or Ray's decorators' (``wrapper``) called by tfray."""
    while frame is not None and frame.f_code.co_name == "wrapper" and frame.f_code.co_filename.startswith(RAY):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(TFRAY)


def profile(frame, event, arg):
    if event == "return":
        code = frame.f_code
        if code.co_name == "poll" and code.co_filename == RAY_API and arg == []:
            timeout = frame.f_locals.get("timeout")
            if timeout is not None and timeout >= feeder._POLL_S:
                counts["waits"] += 1
        return
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
        if filename == RAY_API:
            door[name] = door.get(name, 0) + 1
        if name == "_deliver":
            counts["windows"] += 1
        elif name == "next_ready" and filename.endswith("resolver.py"):
            counts["rounds"] += 1
        elif name == "labels" and filename.endswith("bundles.py"):
            counts["bundles"] += 1
    elif filename.startswith(RAY):
        in_poll = _in_poll(frame.f_back)
        counts["ray_in_polls" if in_poll else "ray"] += 1
        if not in_poll and frame.f_code.co_name != "wrapper" and _called_by_tfray(frame.f_back):
            name = frame.f_code.co_name
            ray_api[name] = ray_api.get(name, 0) + 1


def produce(shard, batches, rows):
    made = [np.full((rows, 256), shard + 2 * i, np.float32) for i in range(batches)]
    yield from made  # Made before the first yield: the epoch times delivery alone.


def dataset(batches, window, rows, source):
    if source == "refs":
        refs = [ray.put(np.full((rows, 256), i, np.float32)) for i in range(batches)]
        return tfray.Dataset(refs, max_inflight=window)
    return tfray.Dataset.from_generators(
        functools.partial(produce, batches=batches // 2, rows=rows),
        2,
        max_inflight_per_producer=window,
        element_spec=tf.TensorSpec((rows, 256), tf.float32),
    )


@tf.function
def total(ds):
    return ds.reduce(tf.constant(0.0), lambda n, b: n + b[0, 0])


def epoch(ds, batches):
    """One epoch of ``ds`` read in graph mode: the counts it took."""
    for table in (ray_api, door):
        table.clear()
    counts.update(dict.fromkeys(counts, 0))
    got = float(total(ds))
    assert got == sum(range(batches)), got
    stats = ds.stats()[-1]
    return dict(counts, ray_api=dict(ray_api), door=dict(door), batches=stats.batches, copied=stats.bytes_copied_by_tfray)


def main(*cases):
    ray.init(address="local", num_cpus=1, object_store_memory=200 << 20, include_dashboard=False)
    for i, case in enumerate(cases):
        batches, window, rows, source = case.split(",")
        batches = int(batches)
        ds = dataset(batches, int(window), int(rows), source)
        if i == 0:
            # Every thread tfray starts from here on: the first dataset
            # started the runtime's own threads, which are not counted.
            threading.setprofile(profile)
        print(json.dumps(epoch(ds, batches)), flush=True)
        del ds  # Its batches leave the store before the next case's.
        assert runtime.get().feeders.wait_idle(30), "a feeder still runs after its epoch"
    threading.setprofile(None)
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
