"""End-to-end image benchmark: JPEG files to a trainer, in each way a TensorFlow user would try.

The data: a synthetic ImageNet-like set (``images.py``), 2,560 JPEG files of
varied sizes (each side 256 to 512 pixels, about 50 KB each), made once under
``benchmarks/data/`` (git-ignored). Every pipeline reads the files,
decodes them, crops a random 224 x 224 window, flips it left-right half the
time, normalizes it to float32 and delivers batches of 128 (77 MB each) in
one long epoch, as an ImageNet epoch of 1.28 M images is long: the files are
listed over and over (Ray Data: three times, more than a sample reads), so
no epoch starts are timed. ``@P`` is the pipeline's parallelism, 1 or 2 (this
machine's cores):

``tf_data@P``
    tf.data's best practice, all TensorFlow C++ ops: ``list_files`` +
    ``map(decode_and_crop, num_parallel_calls=P)`` (``read_file``,
    ``extract_jpeg_shape``, ``decode_and_crop_jpeg``, which decodes only the
    window, ``random_flip_left_right``, normalize) + ``batch`` +
    ``prefetch(AUTOTUNE)``; ``@autotune`` is ``num_parallel_calls=AUTOTUNE``.
``numpy_function@P``
    The same, with the Python augmentation (``images.augment_image``: Pillow
    decode, numpy crop, flip and normalize) in ``tf.numpy_function`` per
    image: it runs in the trainer process, on tf.data's threads, under the
    trainer's GIL (Pillow and numpy release it for part of the work).
``pool@P``
    ``tf.data.Dataset.from_generator`` over ``Pool(P).imap`` of
    ``images.load_batch`` (a whole batch per task): ``P`` ``multiprocessing``
    processes, spawned (a fork of a process running TensorFlow's and Ray's
    threads may deadlock), each batch pickled back through a pipe. Indices
    are handed out as batches are taken, two per process ahead.
``ray_data_to_tf@P``
    Ray Data: ``read_binary_files(include_paths=True)`` +
    ``map_batches(images.ray_data_batch, batch_size=128,
    compute=TaskPoolStrategy(size=P))``, read through Ray Data's ``to_tf``.
``ray_data_tfray@P``
    The same Ray Data dataset through ``tfray.Dataset.from_ray_data``.
``tfray_generators@P``
    ``tfray.Dataset.from_generators(produce, P)``: ``P`` Python producers,
    Ray streaming tasks of one CPU each, each reading its files and yielding
    augmented batches (``images.load_batch``); tfray's defaults otherwise.
``in_memory``
    One augmented batch as a tensor, ``from_tensors(batch).repeat()``: the
    small model's own speed, with no input pipeline (Keras consumer only).

The consumers, each a ``tf.function`` called once per batch: ``input``
(``run.consume``: every byte of every batch summed, no Python per batch) and
``keras`` (a train step of a small Keras model, three convolutions, on every
batch, an optimizer step included: a trainer whose cores are busy); on
request (``--consumers input,keras,busy``), ``busy``: ``input`` with
``run.py``'s busy Python thread in the trainer.

Method, as ``run.py``'s: each pipeline is built, warmed up (the graph traced,
processes started, the first batches read) and then timed for about
``--seconds``; the pipelines take turns within a round, each round starting
one further on; figures are medians over ``--rounds``, and ratios (``1 ->
2``, ``x tf.data``: over ``tf_data@autotune`` under the same consumer) are
medians of the ratios within a round. Trainer CPU per image is the trainer
process's CPU time over the timed run (every thread but the busy one) per
image: the work done in Ray's workers and the pool's processes is not in it,
the work tf.data does in the trainer is. Every sample is bounded in time: a
sample that takes over ``--timeout`` seconds ends the run with every
thread's traceback.

Run: ``make bench-images`` (12 to 15 minutes on 2 cores) or ``python
benchmarks/end_to_end.py [--quick]`` (``--quick``: one round of 1 s samples
of the ``@2`` pipelines, the baseline and the model alone, 2 to 3 minutes;
the first run adds about half a minute to make the files). A full run writes ``benchmarks/images.png`` (committed) and
``benchmarks/results/images.json``; a quick or partial run writes only under
``benchmarks/results/``.

TensorFlow, Ray and tfray are imported inside functions: the pool's
processes import this module (``multiprocessing`` does so with a program's
main module) and need none of them.
"""

import argparse
import faulthandler
import functools
import gc
import json
import multiprocessing
import os
import threading
import time

# Run as a script, this folder is first on the path, for images, run and
# report; the pool's spawned processes inherit that path.
import images

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))

FILES = 2560
BATCH = 128
CROP = 224
# Ray Data lists the files this many times: an epoch longer than a sample.
# Ray Data plans a read by every path listed, before the first batch.
EPOCH_PASSES = 3
AHEAD_PER_PROCESS = 2
OBJECT_STORE_BYTES = 2 * 2**30
FAMILIES = (
    "tf_data",
    "numpy_function",
    "pool",
    "ray_data_to_tf",
    "ray_data_tfray",
    "tfray_generators",
)
BASELINE = "tf_data@autotune"
PIPELINES = (
    *(f"{family}@{p}" for family in FAMILIES for p in ("1", "2")),
    BASELINE,
    "in_memory",
)
# On two cores AUTOTUNE picks about what @2 does; run on request only.
EXTRA_PIPELINES = ("numpy_function@autotune",)
# A smoke run: every way at full parallelism, the baseline and the model alone.
QUICK_PIPELINES = (*(f"{family}@2" for family in FAMILIES), BASELINE, "in_memory")
CONSUMERS = ("input", "keras", "busy")
DEFAULT_CONSUMERS = ("input", "keras")
LABELS = {
    "tf_data": "tf.data C++ ops (decode_and_crop_jpeg)",
    "numpy_function": "tf.data map(numpy_function)",
    "pool": "from_generator(Pool.imap)",
    "ray_data_to_tf": "Ray Data to_tf",
    "ray_data_tfray": "Ray Data, tfray from_ray_data",
    "tfray_generators": "tfray from_generators",
    "in_memory": "one batch in memory (the model alone)",
}
CONSUMER_LABELS = {
    "input": "input only",
    "busy": "input only + busy Python thread",
    "keras": "small Keras model",
}


def element_spec():
    import tensorflow as tf

    return {
        "image": tf.TensorSpec((None, CROP, CROP, 3), tf.float32),
        "label": tf.TensorSpec((None,), tf.int32),
    }


def tf_label(path):
    """The label of a file in a graph: the name of its folder (see ``images.label_of``)."""
    import tensorflow as tf

    return tf.strings.to_number(tf.strings.split(path, os.sep)[-2], tf.int32)


def file_pipeline(files, parallel, element, batch=BATCH):
    """``list_files`` (one long epoch) + ``map(element)`` + ``batch`` + ``prefetch``."""
    import tensorflow as tf

    pattern = os.path.join(os.path.dirname(os.path.dirname(files[0])), "*", "*.jpg")
    calls = tf.data.AUTOTUNE if parallel == "autotune" else int(parallel)
    ds = tf.data.Dataset.list_files(pattern, shuffle=True, seed=0).repeat()
    ds = ds.map(element, num_parallel_calls=calls).batch(batch, drop_remainder=True)
    return ds.prefetch(tf.data.AUTOTUNE), None


def decode_and_crop(normalize=True):
    """tf.data's map of one file, in TensorFlow ops: decode a random crop, flip, normalize.

    ``normalize=False``: the crop stays uint8 (a quarter of the bytes).
    """
    import tensorflow as tf

    mean, std = images.MEAN, images.STD

    def element(path):
        data = tf.io.read_file(path)
        shape = tf.image.extract_jpeg_shape(data)
        top = tf.random.uniform((), 0, shape[0] - CROP + 1, tf.int32)
        left = tf.random.uniform((), 0, shape[1] - CROP + 1, tf.int32)
        image = tf.image.decode_and_crop_jpeg(data, tf.stack([top, left, CROP, CROP]), channels=3)
        image = tf.image.random_flip_left_right(image)
        if normalize:
            image = (tf.cast(image, tf.float32) * (1 / 255) - mean) / std
        return {"image": tf.ensure_shape(image, (CROP, CROP, 3)), "label": tf_label(path)}

    return element


def tf_data(files, parallel):
    return file_pipeline(files, parallel, decode_and_crop())


def numpy_function(files, parallel):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)  # Its own lock makes it safe on tf.data's threads.

    def augment(data):
        return images.augment_image(data, CROP, rng)

    def element(path):
        image = tf.numpy_function(augment, [tf.io.read_file(path)], tf.float32, stateful=True)
        return {"image": tf.ensure_shape(image, (CROP, CROP, 3)), "label": tf_label(path)}

    return file_pipeline(files, parallel, element)


class PoolFeed:
    """``Pool(processes).imap`` over batch indices handed out as batches are taken."""

    def __init__(self, batches, processes):
        context = multiprocessing.get_context("spawn")
        self._pool = context.Pool(processes, images.pool_init, (batches, CROP))
        self._permits = threading.Semaphore(AHEAD_PER_PROCESS * processes)
        self._stop = threading.Event()

    def _indices(self):
        # Runs on the pool's task-feeding thread; ends when the feed closes.
        # An imap over an endless range would augment as fast as it can and
        # pile finished batches up in the trainer whenever it is slower.
        i = 0
        while not self._stop.is_set():
            if self._permits.acquire(timeout=0.1):
                yield i
                i += 1

    def generate(self):
        for batch in self._pool.imap(images.pool_batch, self._indices()):
            self._permits.release()
            yield batch

    def close(self):
        self._stop.set()
        self._pool.terminate()
        self._pool.join()


def pool(batches, processes):
    import tensorflow as tf

    feed = PoolFeed(batches, processes)
    ds = tf.data.Dataset.from_generator(feed.generate, output_signature=element_spec())
    return ds, feed.close


def ray_dataset(files, concurrency):
    import ray.data

    ds = ray.data.read_binary_files(files * EPOCH_PASSES, include_paths=True)
    return ds.map_batches(
        images.ray_data_batch,
        batch_size=BATCH,
        compute=ray.data.TaskPoolStrategy(size=concurrency),
        fn_kwargs={"crop": CROP},
    )


def ray_data_to_tf(files, concurrency):
    spec = element_spec()
    ds = ray_dataset(files, concurrency).to_tf(
        "image",
        "label",
        batch_size=BATCH,
        feature_type_spec=spec["image"],
        label_type_spec=spec["label"],
    )
    return ds.repeat(), None


def ray_data_tfray(files, concurrency):
    import tfray

    ds = tfray.Dataset.from_ray_data(
        ray_dataset(files, concurrency), "image", "label", batch_size=BATCH
    )
    return ds.repeat(), None


def tfray_generators(batches, producers):
    import tfray

    produce = functools.partial(images.produce, batches, CROP, producers)
    source = tfray.Dataset.from_generators(
        produce, producers, element_spec=element_spec(), ray_remote_args={"num_cpus": 1}
    )
    return source, None


def in_memory(batches):
    import tensorflow as tf

    batch = images.load_batch(batches[0], CROP, 0)
    return tf.data.Dataset.from_tensors(batch).repeat(), None


def build(name, files, batches):
    """(dataset, a function that frees what it holds, or None) for ``family@parallelism``."""
    family, _, parallel = name.partition("@")
    if family == "tf_data":
        return tf_data(files, parallel)
    if family == "numpy_function":
        return numpy_function(files, parallel)
    if family == "pool":
        return pool(batches, int(parallel))
    if family == "ray_data_to_tf":
        return ray_data_to_tf(files, int(parallel))
    if family == "ray_data_tfray":
        return ray_data_tfray(files, int(parallel))
    if family == "tfray_generators":
        return tfray_generators(batches, int(parallel))
    if family == "in_memory":
        return in_memory(batches)
    raise ValueError(name)


def image_and_label(batch):
    """(image, label) of a batch: a dict, or ``to_tf``'s and ``from_ray_data``'s pair."""
    return (batch["image"], batch["label"]) if isinstance(batch, dict) else batch


def keras_trainer():
    """A function that runs ``n`` train steps of a small Keras model on batches of an iterator.

    Three strided convolutions and a classifier: about 8 GFLOP a batch,
    forward and backward, so that the model takes a good share of the two
    cores without hiding the input pipelines' differences. One graph ``while`` loop per call, no Python per
    batch.
    """
    import tensorflow as tf

    keras = tf.keras
    model = keras.Sequential(
        [
            keras.Input((CROP, CROP, 3)),
            keras.layers.Conv2D(16, 5, strides=4, activation="relu"),
            keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
            keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(images.CLASSES),
        ]
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)

    @tf.function(reduce_retracing=True)
    def train(iterator, n):
        loss = tf.constant(0.0)
        for _ in tf.range(n):
            image, label = image_and_label(iterator.get_next())
            with tf.GradientTape() as tape:
                loss = loss_fn(label, model(image, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def run_train(iterator, n):
        train(iterator, tf.constant(n, tf.int64)).numpy()

    return run_train


def sample(ds, step, *, busy, warmup, seconds):
    """One timed sample: ``warmup`` batches, then batches one call each for ``seconds``.

    Returns the images, seconds and CPU seconds of the timed part:
    ``cpu_s_per_batch`` the trainer process's (all threads),
    ``busy_cpu_s_per_batch`` the busy thread's share of it (as ``run.measure``).
    """
    import run

    iterator = iter(ds)
    with run.BusyThread(busy) as load:
        step(iterator, warmup)
        n, start = 0, time.perf_counter()
        cpu, busy_cpu = time.process_time(), load.cpu_s()
        while n < 3 or time.perf_counter() - start < seconds:
            step(iterator, 1)
            n += 1
        dt = time.perf_counter() - start
        cpu, busy_cpu = time.process_time() - cpu, load.cpu_s() - busy_cpu
    del iterator
    return {
        "batches": n,
        "seconds": dt,
        "batches_per_s": n / dt,
        "images_per_s": n * BATCH / dt,
        "cpu_s_per_batch": cpu / n,
        "busy_cpu_s_per_batch": busy_cpu / n,
    }


def rows(samples):
    """A row per consumer and pipeline: medians and paired ratios (see ``report.py``)."""
    import report

    out = []
    for consumer, by_name in samples.items():
        by_name = {name: report.trainer_cpu(s) for name, s in by_name.items() if s}
        for name, s in by_name.items():
            family, _, parallel = name.partition("@")
            one = by_name.get(f"{family}@1")
            out.append(
                {
                    "consumer": consumer,
                    "pipeline": name,
                    "family": family,
                    "parallel": parallel,
                    "images_per_s": report.median(s, "images_per_s"),
                    "min_images_per_s": min(x["images_per_s"] for x in s),
                    "max_images_per_s": max(x["images_per_s"] for x in s),
                    "samples_images_per_s": [x["images_per_s"] for x in s],
                    "x_tf_data": report.paired(s, by_name.get(BASELINE), "images_per_s"),
                    "x_in_memory": report.paired(s, by_name.get("in_memory"), "images_per_s"),
                    "x_one": report.paired(s, one, "images_per_s") if parallel == "2" else None,
                    "cpu_ms_per_image": 1e3 * report.median(s, "trainer_cpu_s_per_batch") / BATCH,
                }
            )
    return out


def table(rows_):
    """(header, lines) for ``report.text_table``: a line per consumer and pipeline."""
    import report

    header = ["consumer", "pipeline", "P", "images/s", "range"]
    header += ["x tf.data", "1 -> 2", "CPU ms/image"]
    lines = [
        [
            CONSUMER_LABELS[r["consumer"]],
            LABELS[r["family"]],
            r["parallel"],
            f"{r['images_per_s']:.0f}",
            f"{r['min_images_per_s']:.0f}-{r['max_images_per_s']:.0f}",
            report._fmt_ratio(r["x_tf_data"]),
            report._fmt_ratio(r["x_one"]),
            f"{r['cpu_ms_per_image']:.2f}",
        ]
        for r in rows_
    ]
    return header, lines


def summary(rows_):
    """(header, lines) for ``report.markdown_table``: a line per pipeline, consumers across.

    Each figure is images/s and, in brackets, its ratio to ``tf_data@autotune``
    under the same consumer.
    """
    import report

    consumers = [c for c in CONSUMERS if any(r["consumer"] == c for r in rows_)]
    by = {(r["consumer"], r["pipeline"]): r for r in rows_}
    names = list(dict.fromkeys(r["pipeline"] for r in rows_))
    header = ["pipeline", "P"]
    header += [f"{CONSUMER_LABELS[c]}, images/s" for c in consumers]
    header += ["1 -> 2, input only"] if "input" in consumers else []
    header += [
        f"trainer CPU ms/image, {CONSUMER_LABELS[c]}" for c in ("input", "keras") if c in consumers
    ]
    lines = []
    for name in names:
        family, _, parallel = name.partition("@")
        cells = [LABELS[family], parallel or "-"]
        for c in consumers:
            r = by.get((c, name))
            ratio = "" if r is None or r["x_tf_data"] is None else f" ({r['x_tf_data']:.2f}x)"
            cells.append("" if r is None else f"{r['images_per_s']:.0f}{ratio}")
        if "input" in consumers:
            r = by.get(("input", name))
            cells.append("" if r is None else report._fmt_ratio(r["x_one"]))
        for c in ("input", "keras"):
            if c in consumers:
                r = by.get((c, name))
                cells.append("" if r is None else f"{r['cpu_ms_per_image']:.2f}")
        lines.append(cells)
    return header, lines


def chart(data, path):
    """Two panels: images/s per pipeline under each consumer, and trainer CPU ms per image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_ = data["rows"]
    consumers = [c for c in CONSUMERS if any(r["consumer"] == c for r in rows_)]
    names = list(dict.fromkeys(r["pipeline"] for r in rows_))
    by = {(r["consumer"], r["pipeline"]): r for r in rows_}
    colors = {"input": "#56b4e9", "busy": "#e69f00", "keras": "#009e73"}
    height = 0.8 / len(consumers)
    fig, (left, right) = plt.subplots(
        1, 2, sharey=True, figsize=(13, 0.55 * len(names) + 2), width_ratios=(3, 2)
    )
    xlabels = {"images_per_s": "images / s", "cpu_ms_per_image": "trainer CPU ms / image"}
    for ax, key in zip((left, right), xlabels):
        for i, c in enumerate(consumers):
            ys, xs = [], []
            for j, name in enumerate(names):
                if (c, name) in by:
                    ys.append(j + (i - (len(consumers) - 1) / 2) * height)
                    xs.append(by[(c, name)][key])
            ax.barh(
                ys,
                xs,
                height,
                label=CONSUMER_LABELS[c],
                color=colors[c],
                edgecolor="black",
                linewidth=0.4,
            )
        ax.set_xlabel(xlabels[key])
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    left.set_yticks(range(len(names)))
    left.set_yticklabels(
        [
            LABELS[n.partition("@")[0]] + (f" @{n.partition('@')[2]}" if "@" in n else "")
            for n in names
        ]
    )
    left.invert_yaxis()
    m, settings = data["machine"], data["settings"]
    left.set_title(
        f"JPEG files to a trainer, batches of {BATCH} x {CROP}x{CROP} float32, "
        f"median of {settings['rounds']} rounds\n{m['cores']} cores, {m['cpu']}; "
        f"TF {m['tensorflow']}, Ray {m['ray']}; load average "
        f"{settings['load_avg_at_start'][0]:.0f} at start (a shared machine)",
        fontsize=10,
    )
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = (*PIPELINES, *EXTRA_PIPELINES)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run of 2 to 3 minutes: 1 round of {', '.join(QUICK_PIPELINES)}",
    )
    parser.add_argument(
        "--pipelines",
        default=None,
        help=f"comma-separated, of {', '.join(choices)} (default: all but "
        f"{', '.join(EXTRA_PIPELINES)})",
    )
    parser.add_argument(
        "--consumers",
        default=",".join(DEFAULT_CONSUMERS),
        help=f"comma-separated, of {', '.join(CONSUMERS)} (default: {','.join(DEFAULT_CONSUMERS)})",
    )
    parser.add_argument("--rounds", type=int, default=None, help="samples per figure (3)")
    parser.add_argument("--seconds", type=float, default=None, help="timed run length (2.5)")
    parser.add_argument("--warmup", type=int, default=None, help="batches read before timing (3)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a sample may take")
    parser.add_argument(
        "--data", default=os.path.join(HERE, "data"), help="where the JPEG set is kept"
    )
    parser.add_argument(
        "--out", default=os.path.join(HERE, "results", "images.json"), help="JSON path"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.seconds = args.seconds or (1.0 if args.quick else 2.5)
    # Two producers have each made a batch by the third.
    args.warmup = args.warmup or 3
    default = QUICK_PIPELINES if args.quick else PIPELINES
    args.pipelines = args.pipelines or ",".join(default)
    args.pipeline_names = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    unknown = [p for p in args.pipeline_names if p not in choices]
    if unknown:
        parser.error(f"unknown pipelines {unknown}; choose from {', '.join(choices)}")
    args.consumer_names = [c.strip() for c in args.consumers.split(",") if c.strip()]
    if not set(args.consumer_names) <= set(CONSUMERS):
        parser.error(f"--consumers: expected some of {', '.join(CONSUMERS)}, got {args.consumers}")
    args.full = (
        not args.quick
        and set(args.pipeline_names) >= set(PIPELINES)
        and set(args.consumer_names) >= set(DEFAULT_CONSUMERS)
    )
    return args


def measure_all(args, files, batches, log):
    """{consumer: {pipeline: [sample per round]}}, the pipelines alternating within rounds."""
    import run

    steps = {"input": run.run_consume, "busy": run.run_consume, "keras": keras_trainer()}
    samples = {}
    for consumer in args.consumer_names:
        # The model alone is a reference for the model, not for reading.
        names = [n for n in args.pipeline_names if n != "in_memory" or consumer == "keras"]
        samples[consumer] = {name: [] for name in names}
        for rnd in range(args.rounds):
            shift = rnd % len(names)
            for name in names[shift:] + names[:shift]:
                gc.collect()
                faulthandler.dump_traceback_later(args.timeout, exit=True)
                start = time.perf_counter()
                ds, close = build(name, files, batches)
                try:
                    s = sample(
                        ds,
                        steps[consumer],
                        busy=consumer == "busy",
                        warmup=args.warmup,
                        seconds=args.seconds,
                    )
                finally:
                    if close is not None:
                        close()
                    faulthandler.cancel_dump_traceback_later()
                del ds
                s["sample_wall_s"] = time.perf_counter() - start
                samples[consumer][name].append(s)
                log(
                    f"  {consumer:5s} round {rnd + 1}: {name:26s} {s['images_per_s']:7.0f} images/s "
                    f"({s['batches']} batches in {s['seconds']:.2f} s, "
                    f"{1e3 * s['cpu_s_per_batch'] / BATCH:.2f} trainer CPU ms/image; "
                    f"{s['sample_wall_s']:.0f} s in all)"
                )
    return samples


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import ray
    import report
    import run
    from ray import cloudpickle

    def log(message):
        print(message, flush=True)

    wall = time.perf_counter()
    load_avg_at_start = os.getloadavg()
    machine = report.machine_info()
    t0 = time.perf_counter()
    files = images.make_files(args.data, FILES)
    order = np.random.default_rng(0).permutation(len(files))
    shuffled = [files[i] for i in order]
    batches = [shuffled[i : i + BATCH] for i in range(0, len(files) - BATCH + 1, BATCH)]
    mean_kb = sum(os.path.getsize(p) for p in files) / len(files) / 1e3
    log(
        f"image benchmark: {len(files)} JPEG files ({mean_kb:.0f} KB on average; ready in "
        f"{time.perf_counter() - t0:.0f} s) -> batches of float32[{BATCH},{CROP},{CROP},3]; "
        f"{args.rounds} round(s) of ~{args.seconds} s; consumers {', '.join(args.consumer_names)}"
    )
    # By value: Ray's workers need not find this directory on their path.
    cloudpickle.register_pickle_by_value(images)
    run.start_ray(OBJECT_STORE_BYTES)
    try:
        samples = measure_all(args, files, batches, log)
    finally:
        ray.shutdown()
    data = {
        "settings": vars(args) | {"load_avg_at_start": load_avg_at_start, "files": len(files)},
        "machine": machine | {"load_avg_at_end": os.getloadavg()},
        "rows": rows(samples),
        "samples": samples,
        "wall_s": time.perf_counter() - wall,
    }
    log("")
    log(report.text_table(*table(data["rows"])))
    log("")
    log(report.markdown_table(*summary(data["rows"])))
    log(
        "\nx tf.data: over tf_data@autotune under the same consumer, paired within rounds. "
        "1 -> 2: over the same pipeline at 1. CPU ms/image: the trainer process's, busy "
        "thread excluded; Ray's workers and the pool's processes not counted."
    )
    log(
        "load average at start "
        + ", ".join(f"{x:.2f}" for x in load_avg_at_start)
        + ", at end "
        + ", ".join(f"{x:.2f}" for x in data["machine"]["load_avg_at_end"])
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, default=str)
    # A partial run's chart goes beside its JSON, not over the committed one.
    chart_path = (
        os.path.join(HERE, "images.png") if args.full else os.path.splitext(args.out)[0] + ".png"
    )
    chart(data, chart_path)
    log(
        f"wrote {os.path.relpath(args.out)}, {os.path.relpath(chart_path)}; wall time {data['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    main()
