"""What a producer's core pays per batch for Ray's put path, against one copy.

A Ray task makes image-sized batches (64 x 224 x 224 x 3 float32, 38.5 MB:
one pass that writes a fresh array, standing in for a pipeline's last op)
and hands each on in one of these ways; its process's CPU time (all its
threads: Ray's core worker too) and minor page faults per batch, from
``getrusage``, for the first and the second half of its batches:

``make``
    the batch is made and dropped: the work itself.
``make + copy``
    and copied into a buffer made once: one memory copy of the batch, what
    tfray's overhead on the input side is measured against.
``make + put``
    and ``ray.put``, keeping the last 4 refs (as backpressure keeps a few
    objects waiting).
``make + yield``
    yielded by a streaming generator (``num_returns="streaming"``), as a
    tfray producer does; the driver reads each ref and drops it.
``make + put, store prefaulted``
    as ``make + put``, after mapping every page of the store into the
    task's process at once (``madvise(MADV_POPULATE_WRITE)``; its own time
    is reported apart).

Each task runs in a fresh worker process (``max_calls=1``), as a producer
does the first time it runs on a node. The store's pages are first made
resident by a task that puts objects through all of it, so that a fresh
process's faults only map pages, as on a node that has run for a while.

Run: ``python benchmarks/put_cost.py [--batches 200]`` (about a minute on
2 cores; say the load average with any figure).
"""

import argparse
import ctypes
import os
import resource
import time

import numpy as np
import ray

SHAPE = (64, 224, 224, 3)
KEEP = 4
MADV_POPULATE_WRITE = 23  # Linux 5.14+.


def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt])


def prefault_store():
    """Maps every page of this process's store mappings now; the seconds it took."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = time.perf_counter()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            # The store's segments are files named plasmaXXXXXX (csrc/store_map.h).
            if len(fields) >= 6 and os.path.basename(fields[5]).startswith("plasma"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if libc.madvise(low, high - low, MADV_POPULATE_WRITE) != 0:
                    raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
    return time.perf_counter() - start


def halves(per_batch):
    """Mean (cpu s, sys s, faults) per batch over the first and the second half."""
    a = np.array(per_batch)
    return a[: len(a) // 2].mean(0).tolist(), a[len(a) // 2 :].mean(0).tolist()


@ray.remote(num_cpus=1, max_calls=1)
def hand_on(mode, n):
    src = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    ray.put(np.zeros(1))  # Connects to the store, as any producer has.
    prefault_s = prefault_store() if mode == "put_prefaulted" else None
    spare, refs, per_batch = np.empty_like(src), [], []
    for _ in range(n):
        before = usage()
        batch = np.multiply(src, 1.0001)
        if mode == "copy":
            np.copyto(spare, batch)
        elif mode in ("put", "put_prefaulted"):
            refs = [*refs[-(KEEP - 1):], ray.put(batch)]
        del batch
        per_batch.append(usage() - before)
    return halves(per_batch), prefault_s


@ray.remote(num_cpus=1, max_calls=1, num_returns="streaming", _generator_backpressure_num_objects=KEEP)
def yielded(n):
    src = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    ray.put(np.zeros(1))
    per_batch = []
    before = usage()
    for _ in range(n):
        yield np.multiply(src, 1.0001)
        # From one batch's making to the next's: Ray's put of the yielded
        # batch happens before the generator resumes.
        after = usage()
        per_batch.append(after - before)
        before = after
    yield halves(per_batch)


def run(mode, n):
    if mode == "yield":
        last = None
        for ref in yielded.remote(n):
            last = ray.get(ref)
            del ref
        return last, None
    return ray.get(hand_on.remote(mode, n))


MODES = {
    "make": "make",
    "copy": "make + copy",
    "put": "make + put",
    "yield": "make + yield",
    "put_prefaulted": "make + put, store prefaulted",
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="per task")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    load = os.getloadavg()
    ray.init(address="local", num_cpus=2, object_store_memory=2 * 2**30, include_dashboard=False, log_to_driver=False)
    try:
        run("put", 2 * 2**30 // (np.prod(SHAPE) * 4) + 8)  # Every page of the store made resident.
        print(f"{np.prod(SHAPE) * 4 / 1e6:.1f} MB batches, {args.batches} per task, load average {load[0]:.2f}")
        print("| way | round | first half: CPU ms/batch (sys) | faults | second half: CPU ms/batch (sys) | faults |")
        print("|---|---:|---:|---:|---:|---:|")
        for rnd in range(args.rounds):
            for mode, label in MODES.items():
                (first, second), prefault_s = run(mode, args.batches)
                note = "" if prefault_s is None else f" (prefault {prefault_s:.2f} s)"
                print(
                    f"| {label}{note} | {rnd + 1} | {1e3 * first[0]:.2f} ({1e3 * first[1]:.2f}) | "
                    f"{first[2]:.0f} | {1e3 * second[0]:.2f} ({1e3 * second[1]:.2f}) | {second[2]:.0f} |"
                )
    finally:
        ray.shutdown()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
