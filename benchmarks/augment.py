"""Augmentation benchmark: Python-heavy per-batch work, three ways to run it beside training.

What it measures: batches per second reaching the same graph-mode consumer
as ``run.py``'s (``run.consume``: every byte of every batch summed, no
Python per batch), when every batch first needs Python work: ``images.py``'s
decode (JPEG through Pillow; raw bytes and numpy without Pillow), random
crop and flip, and float32 normalization of 32 pictures of 128x128 RGB into
``float32[32, 112, 112, 3]`` (4.8 MB). The same function makes the same
batches (batch ``i`` is seeded by ``i``) in each pipeline:

``tfray_generators@P``
    ``tfray.Dataset.from_generators(produce, P)``: ``P`` producers, Ray
    tasks (``num_cpus=1`` each, so that both of 2 run at once), producer
    ``s`` yielding batches ``s, s + P, ...``; tfray's defaults otherwise
    (``max_inflight_per_producer=2``, round-robin). One long epoch.
``tf_map@P``
    tf.data's own answer: ``Dataset.range(n).map(lambda i:
    tf.numpy_function(augment, [i], ...), num_parallel_calls=P)``, ``P`` 1, 2
    or ``AUTOTUNE``. The work runs in the trainer process, on tf.data's
    threads, under the trainer's GIL (Pillow and numpy release it for part of
    it).
``pool@P``
    ``tf.data.Dataset.from_generator`` over ``Pool(P).imap(augment,
    ...)``: ``P`` ``multiprocessing`` processes, each batch pickled back to
    the trainer through a pipe. The processes are spawned, not forked (a
    fork of a process running TensorFlow's and Ray's threads may deadlock).
    The pool is handed indices only as batches are taken, two per process
    ahead, as tfray's producers pause at two: an ``imap`` over an endless
    range would augment as fast as it can and pile finished batches up in
    the trainer's memory whenever the trainer is slower.

Method, as ``run.py``'s: each pipeline is built, warmed up (its processes
started, the first 16 batches read) and probed, then one timed call reads
about ``--seconds`` worth; the pipelines take turns within a round, each
round starting one further on; figures are medians over ``--rounds``, and
ratios (the ``1 -> 2`` scaling, ``x tf_map``) medians of the ratios within
a round. ``+ busy thread``: the same, with ``run.py``'s busy Python thread
in the trainer. Trainer CPU per batch excludes the busy thread's (shown
apart) and, as in ``run.py``, counts only the trainer process: the work
done in Ray's workers or the pool's processes is not in it, the work
``tf_map`` does in the trainer is. ``x 1 core``: the rate over that of
``augment`` alone, called in a loop in the trainer's main thread with no
pipeline and no busy thread (``alone``, measured at the start of every
round), i.e. how many cores' worth of augmentation reaches the consumer.

Run: ``make bench-augment`` or ``python benchmarks/augment.py [--quick]``.
Writes ``benchmarks/results/augment.json`` (not committed).

TensorFlow, Ray and tfray are imported inside functions: the pool's
processes import this module (``multiprocessing`` does so with a program's
main module) and need none of them.
"""

import argparse
import functools
import gc
import multiprocessing
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import images  # noqa: E402

DISTINCT = 8  # Distinct encoded batches, cycled.
EPOCH_BATCHES = 1_000_000  # One epoch covers every run.
AHEAD_PER_PROCESS = 2
OBJECT_STORE_BYTES = 2**30
PIPELINES = (
    "tfray_generators@1",
    "tfray_generators@2",
    "tf_map@1",
    "tf_map@2",
    "tf_map@autotune",
    "pool@1",
    "pool@2",
)
LABELS = {
    "alone": "augment alone, one thread",
    "tfray_generators": "tfray from_generators",
    "tf_map": "tf.data map(numpy_function)",
    "pool": "from_generator(Pool.imap)",
}


def element_spec(crop):
    import tensorflow as tf

    return {
        "image": tf.TensorSpec((None, crop, crop, 3), tf.float32),
        "label": tf.TensorSpec((None,), tf.int32),
    }


def tfray_generators(encoded, crop, producers):
    from ray import cloudpickle

    import tfray

    # By value: Ray's workers need not find this directory on their path.
    cloudpickle.register_pickle_by_value(images)
    produce = functools.partial(
        images.produce, encoded, crop, -(-EPOCH_BATCHES // producers), producers
    )
    source = tfray.Dataset.from_generators(
        produce, producers, element_spec=element_spec(crop), ray_remote_args={"num_cpus": 1}
    )
    return source.repeat(), None


def tf_map(encoded, crop, parallel):
    import tensorflow as tf

    def augment(i):
        batch = images.augment(encoded, int(i), crop)
        return batch["image"], batch["label"]

    def element(i):
        image, label = tf.numpy_function(augment, [i], (tf.float32, tf.int32))
        return {
            "image": tf.ensure_shape(image, (None, crop, crop, 3)),
            "label": tf.ensure_shape(label, (None,)),
        }

    calls = tf.data.AUTOTUNE if parallel == "autotune" else int(parallel)
    ds = tf.data.Dataset.range(EPOCH_BATCHES).map(element, num_parallel_calls=calls)
    return ds.repeat(), None


class PoolFeed:
    """``Pool(processes).imap`` over batch indices handed out as batches are taken."""

    def __init__(self, encoded, crop, processes):
        context = multiprocessing.get_context("spawn")
        self._pool = context.Pool(processes, images.pool_init, (encoded, crop))
        self._permits = threading.Semaphore(AHEAD_PER_PROCESS * processes)
        self._stop = threading.Event()

    def _indices(self):
        # Runs on the pool's task-feeding thread; ends when the feed closes.
        i = 0
        while not self._stop.is_set():
            if self._permits.acquire(timeout=0.1):
                yield i
                i += 1

    def generate(self):
        for batch in self._pool.imap(images.pool_augment, self._indices()):
            self._permits.release()
            yield batch

    def close(self):
        self._stop.set()
        self._pool.terminate()
        self._pool.join()


def pool(encoded, crop, processes):
    import tensorflow as tf

    feed = PoolFeed(encoded, crop, processes)
    ds = tf.data.Dataset.from_generator(feed.generate, output_signature=element_spec(crop))
    return ds.repeat(), feed.close


def build(name, encoded, crop):
    """(dataset, a function that frees what it holds, or None) for ``family@producers``."""
    family, _, producers = name.partition("@")
    if family == "tfray_generators":
        return tfray_generators(encoded, crop, int(producers))
    if family == "tf_map":
        return tf_map(encoded, crop, producers)
    if family == "pool":
        return pool(encoded, crop, int(producers))
    raise ValueError(name)


def alone(encoded, crop, seconds):
    """A sample of ``augment`` alone, in this thread, for about ``seconds``."""
    images.augment(encoded, 0, crop)
    wall, cpu, n = time.perf_counter(), time.thread_time(), 0
    while time.perf_counter() - wall < seconds:
        images.augment(encoded, n, crop)
        n += 1
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return {
        "batches": n,
        "seconds": wall,
        "batches_per_s": n / wall,
        "cpu_s_per_batch": cpu / n,
        "busy_cpu_s_per_batch": 0.0,
    }


def rows(samples):
    """A row per load and pipeline: medians and paired ratios (see ``report.py``)."""
    import report

    out = []
    for load, by_name in samples.items():
        by_name = {name: report.trainer_cpu(s) for name, s in by_name.items() if s}
        for name, s in by_name.items():
            family, _, producers = name.partition("@")
            one = by_name.get(f"{family}@1")
            rate = report.median(s, "batches_per_s")
            out.append(
                {
                    "load": load,
                    "pipeline": name,
                    "family": family,
                    "producers": producers,
                    "batches_per_s": rate,
                    "min_batches_per_s": min(x["batches_per_s"] for x in s),
                    "max_batches_per_s": max(x["batches_per_s"] for x in s),
                    "samples_batches_per_s": [x["batches_per_s"] for x in s],
                    "x_one_core": report.paired(s, by_name.get("alone@1")),
                    "x_one_producer": report.paired(s, one) if producers != "1" else None,
                    "x_tf_map": report.paired(s, by_name.get(f"tf_map@{producers}"))
                    if family not in ("tf_map", "alone")
                    else None,
                    "cpu_ms_per_batch": 1e3 * report.median(s, "trainer_cpu_s_per_batch"),
                    "busy_cpu_ms_per_batch": (
                        1e3 * report.median(s, "busy_cpu_s_per_batch")
                        if load == "busy" and family != "alone"
                        else None
                    ),
                }
            )
    return out


def table(rows_):
    """(header, lines) for ``report.text_table`` and ``report.markdown_table``."""
    header = [
        "load",
        "pipeline",
        "producers",
        "batches/s",
        "range",
        "x 1 core",
        "1 -> 2",
        "x tf_map",
        "CPU ms/batch",
        "busy thread ms/batch",
    ]

    def ratio(x):
        return "" if x is None else f"{x:.2f}x"

    lines = []
    for r in rows_:
        lines.append(
            [
                "idle" if r["load"] == "idle" else "+ busy thread",
                LABELS[r["family"]],
                r["producers"],
                f"{r['batches_per_s']:.1f}",
                f"{r['min_batches_per_s']:.0f}-{r['max_batches_per_s']:.0f}",
                ratio(r["x_one_core"]),
                ratio(r["x_one_producer"]),
                ratio(r["x_tf_map"]),
                f"{r['cpu_ms_per_batch']:.2f}",
                "" if r["busy_cpu_ms_per_batch"] is None else f"{r['busy_cpu_ms_per_batch']:.2f}",
            ]
        )
    return header, lines


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (under a minute): 1 round, batches of 8 pictures",
    )
    parser.add_argument(
        "--pipelines",
        default=",".join(PIPELINES),
        help="comma-separated, of %s (default: all)" % ", ".join(PIPELINES),
    )
    parser.add_argument("--loads", default="idle,busy", help="comma-separated, of idle, busy")
    parser.add_argument("--rounds", type=int, default=None, help="samples per figure (5)")
    parser.add_argument("--seconds", type=float, default=None, help="timed run length (1.5)")
    parser.add_argument("--images", type=int, default=None, help="pictures per batch (32)")
    parser.add_argument("--size", type=int, default=128, help="picture height and width")
    parser.add_argument("--crop", type=int, default=112, help="crop height and width")
    parser.add_argument(
        "--format",
        choices=images.FORMATS,
        default=images.default_format(),
        help="how the pictures are stored (default: jpeg with Pillow, else raw)",
    )
    parser.add_argument(
        "--out", default=os.path.join(HERE, "results", "augment.json"), help="JSON path"
    )
    args = parser.parse_args(argv)
    args.images = args.images or (8 if args.quick else 32)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.seconds = args.seconds or (0.3 if args.quick else 1.5)
    args.min_probe_s = 0.1 if args.quick else 0.25
    args.pipeline_names = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    unknown = [p for p in args.pipeline_names if p not in PIPELINES]
    if unknown:
        parser.error(f"unknown pipelines {unknown}; choose from {', '.join(PIPELINES)}")
    args.load_names = [x.strip() for x in args.loads.split(",") if x.strip()]
    if not set(args.load_names) <= {"idle", "busy"}:
        parser.error(f"--loads: expected idle and/or busy, got {args.loads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    import json

    import ray

    import report
    import run

    wall = time.perf_counter()
    load_avg_at_start = os.getloadavg()
    machine = report.machine_info()
    encoded = images.make_encoded(DISTINCT, args.images, args.size, args.format)
    print(
        f"augmentation benchmark: {args.images} x {args.size}x{args.size} RGB {args.format} "
        f"-> float32[{args.images},{args.crop},{args.crop},3] a batch; "
        f"{args.rounds} round(s) of ~{args.seconds} s",
        flush=True,
    )
    run.start_ray(OBJECT_STORE_BYTES)
    names = args.pipeline_names
    samples = {}
    for load in args.load_names:
        samples[load] = {name: [] for name in ["alone@1", *names]}
        for rnd in range(args.rounds):
            samples[load]["alone@1"].append(alone(encoded, args.crop, args.seconds / 3))
            shift = rnd % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()
                ds, close = build(name, encoded, args.crop)
                try:
                    sample = run.measure(
                        ds,
                        busy=load == "busy",
                        seconds=args.seconds,
                        distinct=DISTINCT,
                        min_probe_s=args.min_probe_s,
                    )
                finally:
                    if close is not None:
                        close()
                del ds
                samples[load][name].append(sample)
                print(
                    f"  {load:4s} round {rnd + 1}: {name:20s} {sample['batches_per_s']:8.1f} "
                    f"batches/s ({sample['batches']} in {sample['seconds']:.2f} s)",
                    flush=True,
                )
    data = {
        "settings": vars(args) | {"load_avg_at_start": load_avg_at_start},
        "machine": machine | {"load_avg_at_end": os.getloadavg()},
        "rows": rows(samples),
        "samples": samples,
        "wall_s": time.perf_counter() - wall,
    }
    print()
    print(report.text_table(*table(data["rows"])))
    print(
        "\nx 1 core: over augment alone in one thread (no pipeline, no busy thread) in the "
        "same round. 1 -> 2: over the same pipeline with 1 (tf_map AUTOTUNE included). "
        "CPU ms/batch: the trainer process's, busy thread excluded; producers and pool "
        "processes not counted."
    )
    print(
        "load average at start "
        + ", ".join(f"{x:.2f}" for x in load_avg_at_start)
        + ", at end "
        + ", ".join(f"{x:.2f}" for x in data["machine"]["load_avg_at_end"])
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(f"wrote {os.path.relpath(args.out)}; wall time {data['wall_s']:.0f} s")
    ray.shutdown()


if __name__ == "__main__":
    main()
