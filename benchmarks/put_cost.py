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

The second table is the same question asked of ``from_tf_data``'s
producer itself: the image pipeline of ``cluster.py`` (decode a random
224 x 224 crop of a JPEG, flip, normalize; ``batch(64)``: float32 batches
of 38.5 MB, or uint8 ones of 9.6 MB) in one Ray actor pinned to one core,
run three ways in turn, each round: ``loop``, the pipeline in a plain loop
that reads one element of each batch; ``loop + copy``, and each batch
copied into buffers made once (one memory copy); ``producer``, the code a
``from_tf_data`` producer runs past the pipeline (its ``bundles``, Ray's
streaming generator, the driver taking each ref), over the same iterator.
Its process's CPU
per batch, and the producer's and the copy's excess over the loop of the
same round: whether the producer costs its core more than one copy of
each batch. The actor first runs the producer through twice the store, so
that its process has mapped the store's pages (the first table measures
that first pass).

Run: ``python benchmarks/put_cost.py [--tables put,pipeline]`` (about five
minutes on 2 cores; say the load average with any figure).
"""

import argparse
import ctypes
import functools
import os
import resource
import sys
import time

import numpy as np
import ray

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = (64, 224, 224, 3)
KEEP = 4
MADV_POPULATE_WRITE = 23  # Linux 5.14+.
STORE_BYTES = 2 * 2**30
PIPELINE_CORE = 1
PIPELINE_WAYS = ("loop", "loop + copy", "producer")


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


def pin_process(core):
    """Pins every thread of this process to ``core`` (threads made later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # A thread that ended meanwhile.
            pass


class _NoStop:
    """A producer's stop check (producer.py) for an epoch nothing stops."""

    @staticmethod
    def requested():
        return False


@ray.remote(num_cpus=1)
class PipelineCore:
    """The image pipeline on one core: in a plain loop, or as ``from_tf_data``'s producer runs it."""

    def __init__(self, files, dtype):
        import cluster  # The image pipeline, from this folder (the workers' PYTHONPATH).

        pin_process(PIPELINE_CORE)
        self._fn = functools.partial(cluster.pipeline, files, dtype)
        self._batches = self._fn(0).as_numpy_iterator()
        first = next(self._batches)  # The pipeline's start, outside any count.
        # The copy's buffers, their pages mapped now, outside any count too.
        self._spare = {k: v.copy() for k, v in first.items()}
        self._bundles = None

    def loop(self, n, copy):
        """CPU seconds and faults of ``n`` batches of a plain loop (each copied once if ``copy``)."""
        pin_process(PIPELINE_CORE)
        before = usage()
        for _ in range(n):
            batch = next(self._batches)
            if copy:
                for k, v in batch.items():
                    np.copyto(self._spare[k], v)
            float(batch["image"].flat[0])  # The consumer reads one element.
            del batch
        return (usage() - before).tolist()

    @ray.method(num_returns="streaming")
    def produce(self, n):
        """``n`` batches handed on as a ``from_tf_data`` producer does; last, its CPU seconds, faults and batches.

        A producer's code past the pipeline: its bundles (producer.py) and
        Ray's streaming generator, which puts each in the store, over the
        same iterator as the loop's (``PipelineBatches`` adds nothing per
        batch for dense components). One iterator for every way: a second
        pipeline would work on in TensorFlow's threads, filling its
        buffers, while the other way is counted.
        """
        if self._bundles is None:
            from tfray._internal.sources import producer

            # The trainer's pair limit with one producer and this store: the most it sets.
            self._bundles = producer.bundles(self._batches, _NoStop, producer.PAIR_BYTES)
        pin_process(PIPELINE_CORE)
        made, before = 0, usage()
        while made < n:
            bundle = next(self._bundles)
            made += len(bundle)
            yield bundle
        yield (usage() - before).tolist() + [made]


def pipeline_rounds(files, dtype, batches, rounds, log):
    """Per round, each way's (CPU s, faults) per batch on the pipeline core."""
    core = PipelineCore.options(
        runtime_env={"env_vars": {"PYTHONPATH": HERE, "TF_CPP_MIN_LOG_LEVEL": "2"}}
    ).remote(files, dtype)

    def produced(n):
        last = None
        for ref in core.produce.remote(n):
            last = ray.get(ref)
            del ref
        cpu, _sys, faults, made = last
        return [cpu / made, faults / made]

    batch_bytes = np.prod(SHAPE) * (4 if dtype == "float32" else 1)
    produced(int(2 * STORE_BYTES // batch_bytes))  # Every page of the store mapped in its process.
    out = []
    for rnd in range(rounds):
        got = {}
        for way in PIPELINE_WAYS[rnd % 3 :] + PIPELINE_WAYS[: rnd % 3]:
            if way == "producer":
                got[way] = produced(batches)
            else:
                cpu, _sys, faults = ray.get(core.loop.remote(batches, way == "loop + copy"))
                got[way] = [cpu / batches, faults / batches]
        out.append(got)
        log(f"  {dtype} round {rnd + 1}: " + ", ".join(f"{w} {1e3 * got[w][0]:.1f} ms" for w in PIPELINE_WAYS))
    ray.kill(core)
    return out


def pipeline_table(dtype, rounds, load):
    print(f"\n{dtype} batches of the image pipeline, one core; load average {load:.2f} at start")
    print(
        "| round | loop: CPU ms/batch | loop + copy | producer | copy's excess | producer's excess "
        "| producer faults/batch |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i, got in enumerate(rounds):
        loop, copied, prod = (1e3 * got[w][0] for w in PIPELINE_WAYS)
        print(
            f"| {i + 1} | {loop:.1f} | {copied:.1f} | {prod:.1f} | {copied - loop:+.1f} | "
            f"{prod - loop:+.1f} | {got['producer'][1]:.0f} |"
        )
    excess = [got["producer"][0] - got["loop"][0] for got in rounds]
    copy = [got["loop + copy"][0] - got["loop"][0] for got in rounds]
    print(
        f"excess per batch over the loop, median (quartiles) over {len(rounds)} rounds: producer "
        f"{spread(excess)}, one copy {spread(copy)} ms"
    )


def spread(values):
    """``median (first quartile to third)`` of seconds, in ms."""
    low, mid, high = 1e3 * np.percentile(values, [25, 50, 75])
    return f"{mid:+.1f} ({low:+.1f} to {high:+.1f})"


def put_table(args, load):
    """The first table: synthetic batches (see the docstring)."""
    run("put", STORE_BYTES // (np.prod(SHAPE) * 4) + 8)  # Every page of the store made resident.
    print(f"{np.prod(SHAPE) * 4 / 1e6:.1f} MB batches, {args.batches} per task, load average {load:.2f}")
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="per task")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pipeline-batches", type=int, default=24, help="per way and round")
    parser.add_argument("--pipeline-rounds", type=int, default=15)
    parser.add_argument("--data", default=os.path.join(HERE, "data"), help="where the JPEG set is kept")
    parser.add_argument("--tables", default="put,pipeline", help="put, pipeline or both: put,pipeline")
    args = parser.parse_args()
    tables = args.tables.split(",")
    load = os.getloadavg()
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        if "put" in tables:
            put_table(args, load[0])
        if "pipeline" in tables:
            sys.path.insert(0, HERE)
            import images

            files = images.make_files(args.data, 1024)
            log = functools.partial(print, flush=True)
            for dtype in ("float32", "uint8"):
                start = os.getloadavg()[0]
                rounds = pipeline_rounds(files, dtype, args.pipeline_batches, args.pipeline_rounds, log)
                pipeline_table(dtype, rounds, start)
    finally:
        ray.shutdown()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
