"""Cluster benchmark: one tf.data image pipeline on an input node, feeding a trainer on another.

Two Ray nodes on this machine, each its own ``ray start`` and object store,
pinned with ``taskset``: the trainer's node on core 0, started with
``--num-cpus=0`` as a trainer's node is, and the input node on core 1,
offering 1 CPU; the trainer process (the Ray driver) runs on core 0. A
tf.data service dispatcher and worker run on core 1 too. The work is the
same everywhere: ``end_to_end``'s
JPEG files (1,024 here), listed in one long epoch, ``map(decode_and_crop,
num_parallel_calls=AUTOTUNE)`` (decode a random 224 x 224 crop, flip,
normalize to float32; for ``uint8`` batches, no normalizing) and
``batch(64)``: 38.5 MB float32 batches, or 9.6 MB uint8 ones.

Rows:

``tf_data_local``
    The pipeline in the trainer process itself: decode and consumer on
    core 0 (the input core idles).
``service_auto``, ``service_none``
    A tf.data service worker running the pipeline on core 1
    (``distribute(processing_mode="parallel_epochs")``), with its default
    compression (snappy) and with none.
``tfray_tf_data``
    ``tfray.Dataset.from_tf_data`` with default placement: its producer
    runs the pipeline on the input node (the trainer's offers no CPU), and
    Ray moves each batch across the node boundary into the trainer node's
    store, from which it reaches TensorFlow.
``tfray_generators``
    What a user could write before ``from_tf_data``:
    ``from_generators`` over ``yield from pipeline.as_numpy_iterator()``.
``tfray_this_node``
    ``from_tf_data`` with ``producers_on="this_node"``: the producer runs
    on the trainer's node, so core 0 does all the work (the input core
    idles): the cost of input work on the trainer's own node.
``ray_loop``
    Ray's own loop across the same boundary: a streaming-generator task
    on the input node iterates the pipeline and yields each batch; the
    trainer's Python loop ``ray.get``-s each ref and reads one element.
    The physical floor of the path: what Ray itself costs.

Ready-batch rows: the producer does no work but yield one float32 batch,
built once, over and over (``--ready-sizes``, in MB: 1, 12 and 38 by
default). Putting it in the store is its only cost, so these rows time the
path across the nodes alone: its MB/s, and the trainer's CPU per batch.

``ready_tfray``
    ``from_generators`` over that generator, ``producers_on="other_nodes"``.
``ready_ray_loop``
    Ray's own loop over it: a streaming-generator task pinned to the input
    node, 16 batches ahead, the trainer ``ray.get``-ting each ref in turn.

The consumer is light, as a GPU trainer's CPU is while the accelerator
reads the batch: a ``tf.function`` loop that reads one element of each
batch. So the input side sets the pace, and the figures compare what one
input core delivers.

Each row is built, warmed up (``--warmup`` batches: producers and the
service worker started, TensorFlow imported there) and timed for about
``--seconds``; the rows take turns within a round, each round starting one
further on (``--rounds``); figures are medians over rounds, ratios medians
of the ratios within a round. CPU per image: the trainer process's (all its
threads); the trainer's node (core 0's busy time from ``/proc/stat``:
the trainer process, and its node's raylet, object store and Ray's
daemons, which receive every batch from the other node); and the input
side (core 1: the producer or the service, and its node's Ray processes).
The ready rows give the same per batch, and MB/s. Run on a quiet machine:
``/proc/stat`` counts any other program too.

``--link RATE`` (``tc``'s units: ``4gbit``, ``500mbit``) puts a token bucket
(``tbf``) on loopback for the run, through which the two nodes' transfers
pass: a network link of that rate between them. It needs root and a
loopback with no root qdisc of its own (it refuses to replace one), and
removes the bucket at exit, on an exception or on SIGINT, SIGTERM or
SIGHUP (not on SIGKILL: then ``tc qdisc del dev lo root``). Every program
on the machine that uses loopback is limited meanwhile. Its target is
against the lower of the link and what the same producer delivered
without a limit (the ready rows of ``--unlimited``'s run, when there is one).

``--rows`` takes row names or the groups ``images`` and ``ready``; with
ready rows alone, no JPEG set is made and no tf.data service started.

Run: ``make bench-cluster`` (about 13 minutes) or ``python
benchmarks/cluster.py [--quick] [--rows ready] [--ready-sizes 1,12,38]
[--link 4gbit]``.
"""

import argparse
import atexit
import functools
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import end_to_end
import images
import nodes
import report

TRAINER_CORE, INPUT_CORE = 0, 1
FILES = 1024
BATCH = 64
STORE_BYTES = 2 * 2**30
ROWS = (
    "tf_data_local",
    "service_auto",
    "service_none",
    "tfray_tf_data",
    "tfray_generators",
    "tfray_this_node",
    "ray_loop",
)
LABELS = {
    "tf_data_local": "local tf.data, one core",
    "service_auto": "tf.data service worker, compression AUTO",
    "service_none": "tf.data service worker, compression None",
    "tfray_tf_data": "tfray from_tf_data, across the nodes",
    "tfray_generators": "tfray from_generators (as_numpy_iterator), across",
    "tfray_this_node": "tfray from_tf_data, producer on the trainer's node",
    "ray_loop": "Ray's own loop (ray.get per batch), across",
}
# Ray's own loop pauses its producer this many batches ahead, as tfray's
# backpressure does, so a slow reader does not fill the store.
RAY_LOOP_AHEAD = 4
DTYPES = ("float32", "uint8")
READY_ROWS = ("ready_tfray", "ready_ray_loop")
LABELS |= {
    "ready_tfray": "tfray from_generators, ready batch, across",
    "ready_ray_loop": "Ray's own loop, ready batch, across",
}
GROUPS = {"images": ROWS, "ready": READY_ROWS}
READY_SIZES_MB = (1, 12, 38)
# Ray's loop over ready batches runs this far ahead: far enough that the
# producer never waits on a reader that keeps up.
READY_LOOP_AHEAD = 16


def pipeline(files, dtype, shard=0):
    """The image pipeline (see the module's docstring); every shard reads every file."""
    element = end_to_end.decode_and_crop(normalize=dtype == "float32")
    return end_to_end.file_pipeline(files, "autotune", element, batch=BATCH)[0]


def numpy_batches(files, dtype, shard):
    # A loop, not `yield from`: Ray's streaming generator resumes its
    # generator with send(), which a NumpyIterator does not have.
    for batch in pipeline(files, dtype, shard).as_numpy_iterator():  # noqa: UP028
        yield batch


def ready_batches(n):
    """``n`` float32s, built once and yielded for ever: putting them is the producer's only work."""
    import numpy as np

    batch = np.ones(n, np.float32)
    while True:
        yield batch


def first_pixel(batch):
    """What the light consumer reads of an image batch (numpy or TensorFlow)."""
    return batch["image"][0, 0, 0, 0]


def first_value(batch):
    """What the light consumer reads of a ready batch."""
    return batch[0]


def floats(size_mb):
    """The float32s in a ready batch of ``size_mb`` MB (10**6 bytes)."""
    return int(size_mb * 1e6) // 4


def build(row, files, dtype, service):
    import tensorflow as tf

    import tfray

    if row == "tf_data_local":
        return pipeline(files, dtype)
    if row.startswith("service_"):
        compression = None if row == "service_none" else "AUTO"
        return pipeline(files, dtype).apply(
            tf.data.experimental.service.distribute(
                processing_mode="parallel_epochs", service=service, compression=compression
            )
        )
    one_core = {"num_cpus": 1}
    if row in ("tfray_tf_data", "tfray_this_node"):
        fn = functools.partial(pipeline, files, dtype)
        where = "this_node" if row == "tfray_this_node" else "cluster"
        return tfray.Dataset.from_tf_data(fn, 1, ray_remote_args=one_core, producers_on=where)
    if row == "ray_loop":
        return RayLoop(numpy_batches, files, dtype, 0)
    spec = pipeline(files, dtype).element_spec
    fn = functools.partial(numpy_batches, files, dtype)
    return tfray.Dataset.from_generators(fn, 1, element_spec=spec, ray_remote_args=one_core)


def build_ready(row, n, input_node):
    """A ready-batch row over batches of ``n`` float32s; its producer on node ``input_node``."""
    import tensorflow as tf

    import tfray

    if row == "ready_ray_loop":
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        on_input = NodeAffinitySchedulingStrategy(input_node, soft=False)
        return RayLoop(ready_batches, n, ahead=READY_LOOP_AHEAD, pick=first_value, scheduling_strategy=on_input)
    return tfray.Dataset.from_generators(
        ready_batches,
        [n],
        element_spec=tf.TensorSpec([n], tf.float32),
        producers_on="other_nodes",
        ray_remote_args={"num_cpus": 1},
    )


class RayLoop:
    """Ray's own loop: one streaming-generator task of ``fn(*args)``'s batches, read with ``ray.get``.

    ``pick``: what the reader reads of each batch; ``options``: more of the task's Ray options.
    """

    def __init__(self, fn, *args, ahead=RAY_LOOP_AHEAD, pick=first_pixel, **options):
        import ray

        produce = ray.remote(fn).options(
            num_cpus=1, num_returns="streaming", _generator_backpressure_num_objects=ahead, **options
        )
        self._refs = produce.remote(*args)
        self._pick = pick

    def read(self, n):
        """Reads ``n`` batches, one element of each; their sum."""
        import ray

        total = 0.0
        for _ in range(n):
            batch = ray.get(next(self._refs))
            total += float(self._pick(batch))
            del batch
        return total

    def close(self):
        """Ends the task (it never ends by itself: the pipeline repeats), freeing its CPU."""
        import ray

        ray.cancel(self._refs)


def core_busy_s():
    """Each core's busy seconds so far (all but idle and iowait), from /proc/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    busy = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                values = [int(x) for x in fields]
                busy[int(name[3:])] = (sum(values) - values[3] - values[4]) / tick
    return busy


def group_cpu_s(pgid):
    """CPU seconds so far of each kind of process in process group ``pgid`` (a node's), by name."""
    out = {}
    for pid in os.listdir("/proc"):
        stat = report.proc_stat(f"/proc/{pid}/stat") if pid.isdigit() else None
        if stat is not None and stat[1] == pgid:  # None: not a process, or gone meanwhile.
            name, _, cpu_s = stat
            kind = "raylet" if name == "raylet" else "workers" if name.startswith("ray::") else "other Ray"
            out[kind] = out.get(kind, 0.0) + cpu_s
    return out


def reader(ds, pick=first_pixel):
    """``read(n)``: reads ``n`` batches of ``ds`` under the light consumer, ``pick`` of each."""
    import tensorflow as tf

    if isinstance(ds, RayLoop):
        return ds.read

    @tf.function
    def consume(iterator, n):
        total = tf.constant(0.0, tf.float64)
        for _ in tf.range(n):
            batch = iterator.get_next()
            total += tf.cast(pick(batch), tf.float64)
        return total

    iterator = iter(ds)

    def read(n):
        return consume(iterator, tf.constant(n, tf.int64)).numpy()

    return read


def timed(read, *, warmup, seconds, trainer_node=None):
    """Batches read in one timed run of ``read``, its seconds, and the CPU seconds spent meanwhile.

    ``trainer_node``: the trainer node's process group, whose processes' CPU is split by kind.
    """
    read(warmup)
    node = {} if trainer_node is None else group_cpu_s(trainer_node)
    n, busy, cpu, start = 0, core_busy_s(), time.process_time(), time.perf_counter()
    while n < 8 or time.perf_counter() - start < seconds:
        read(4)
        n += 4
    dt = time.perf_counter() - start
    cpu, after = time.process_time() - cpu, core_busy_s()
    node_after = {} if trainer_node is None else group_cpu_s(trainer_node)
    return {
        "batches": n,
        "seconds": dt,
        "trainer": cpu,
        "trainer_core": after[TRAINER_CORE] - busy[TRAINER_CORE],
        "input_core": after[INPUT_CORE] - busy[INPUT_CORE],
        **{
            f"trainer_node_{kind.replace(' ', '_')}": node_after[kind] - node.get(kind, 0.0)
            for kind in node_after
        },
    }


def sample(ds, *, warmup, seconds, trainer_node=None):
    """Images/s and CPU per image of one timed run of ``ds`` under the light consumer.

    ``trainer_node``: the trainer node's process group, whose processes' CPU is split by kind.
    """
    t = timed(reader(ds), warmup=warmup, seconds=seconds, trainer_node=trainer_node)
    images_ = t["batches"] * BATCH
    return {
        **{f"{k}_ms_per_image": 1e3 * v / images_ for k, v in t.items() if k.startswith("trainer_node_")},
        "images_per_s": images_ / t["seconds"],
        "trainer_ms_per_image": 1e3 * t["trainer"] / images_,
        "trainer_core_ms_per_image": 1e3 * t["trainer_core"] / images_,
        "input_core_ms_per_image": 1e3 * t["input_core"] / images_,
        "batches": t["batches"],
        "seconds": t["seconds"],
    }


def sample_ready(ds, batch_bytes, *, warmup, seconds, trainer_node=None):
    """MB/s and CPU per batch of one timed run of a ready-batch row under the light consumer."""
    t = timed(reader(ds, first_value), warmup=warmup, seconds=seconds, trainer_node=trainer_node)
    n = t["batches"]
    return {
        **{f"{k}_ms_per_batch": 1e3 * v / n for k, v in t.items() if k.startswith("trainer_node_")},
        "mb_per_s": n * batch_bytes / 1e6 / t["seconds"],
        "batches_per_s": n / t["seconds"],
        "trainer_ms_per_batch": 1e3 * t["trainer"] / n,
        "trainer_core_ms_per_batch": 1e3 * t["trainer_core"] / n,
        "input_core_ms_per_batch": 1e3 * t["input_core"] / n,
        "batches": n,
        "seconds": t["seconds"],
    }


def serve(port):
    """A tf.data service dispatcher and one worker, in this process, until killed."""
    import tensorflow as tf

    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=port))
    worker = service.WorkerServer(service.WorkerConfig(dispatcher_address=f"localhost:{port}"))
    dispatcher.join()  # Until the process is killed; the worker serves as long as it is referenced.
    worker.stop()


def rows_of(samples):
    """A row per dtype and pipeline: medians, and ratios paired within rounds."""
    out = []
    for dtype, by_row in samples.items():
        best = None
        for name in ("service_auto", "service_none"):
            s = by_row.get(name)
            if s and (best is None or report.median(s, "images_per_s") > report.median(best, "images_per_s")):
                best = s
        for name, s in by_row.items():
            out.append(
                {
                    "dtype": dtype,
                    "pipeline": name,
                    "images_per_s": report.median(s, "images_per_s"),
                    "range": [min(x["images_per_s"] for x in s), max(x["images_per_s"] for x in s)],
                    "x_local": report.paired(s, by_row.get("tf_data_local"), "images_per_s"),
                    "x_service": report.paired(s, best, "images_per_s"),
                    "x_ray_loop": report.paired(s, by_row.get("ray_loop"), "images_per_s"),
                    **{
                        key: report.median(s, key)
                        for key in (
                            "trainer_ms_per_image",
                            "trainer_core_ms_per_image",
                            "input_core_ms_per_image",
                            "trainer_node_raylet_ms_per_image",
                        )
                        if all(key in x for x in s)
                    },
                }
            )
    return out


def table(rows):
    header = ["batches", "pipeline", "images/s", "range", "x local", "x service", "x Ray loop", "trainer ms/img"]
    header += ["trainer node ms/img", "its raylet ms/img", "input ms/img"]
    lines = [
        [
            r["dtype"],
            LABELS[r["pipeline"]],
            f"{r['images_per_s']:.0f}",
            f"{r['range'][0]:.0f}-{r['range'][1]:.0f}",
            report._fmt_ratio(r["x_local"]),
            report._fmt_ratio(r["x_service"]),
            report._fmt_ratio(r["x_ray_loop"]),
            f"{r['trainer_ms_per_image']:.3f}",
            f"{r['trainer_core_ms_per_image']:.3f}",
            f"{r.get('trainer_node_raylet_ms_per_image', 0.0):.3f}",
            f"{r['input_core_ms_per_image']:.3f}",
        ]
        for r in rows
    ]
    return header, lines


def targets(rows):
    """The targets for ``from_tf_data`` across the nodes, each with the figure measured."""
    out = []
    by = {(r["dtype"], r["pipeline"]): r for r in rows}
    for r in rows:
        if r["pipeline"] != "tfray_tf_data":
            continue
        service = by.get((r["dtype"], "service_none"))
        checks = [
            ("x tf.data service (its best compression)", r["x_service"], 1.0, ">="),
            ("x local tf.data on one core", r["x_local"], 0.9, ">="),
            ("x Ray's own loop across the nodes", r["x_ray_loop"], 1.0, ">="),
            ("trainer CPU ms/image", r["trainer_ms_per_image"], 0.1, "<="),
            (
                "trainer node CPU over a tf.data service trainer's (compression None)",
                None if service is None else r["trainer_core_ms_per_image"] / service["trainer_core_ms_per_image"],
                0.5,
                "<=",
            ),
        ]
        for what, value, bound, op in checks:
            if value is None:
                continue  # Its baseline was not run.
            met = value >= bound if op == ">=" else value <= bound
            verdict = "met" if met else "NOT MET"
            out.append(f"{r['dtype']}: from_tf_data {what}: {value:.3f} (target {op} {bound}): {verdict}")
    return out


def ready_rows_of(samples):
    """A row per batch size and ready row: medians, and ratios to Ray's loop paired within rounds."""
    out = []
    for size_mb, by_row in samples.items():
        loop = by_row.get("ready_ray_loop")
        for name, s in by_row.items():
            out.append(
                {
                    "size_mb": size_mb,
                    "pipeline": name,
                    "mb_per_s": report.median(s, "mb_per_s"),
                    "range": [min(x["mb_per_s"] for x in s), max(x["mb_per_s"] for x in s)],
                    "x_ray_loop": report.paired(s, loop, "mb_per_s"),
                    "cpu_x_ray_loop": report.paired(s, loop, "trainer_ms_per_batch"),
                    **{
                        key: report.median(s, key)
                        for key in (
                            "batches_per_s",
                            "trainer_ms_per_batch",
                            "trainer_core_ms_per_batch",
                            "input_core_ms_per_batch",
                            "trainer_node_raylet_ms_per_batch",
                        )
                        if all(key in x for x in s)
                    },
                }
            )
    return out


def ready_table(rows):
    header = ["batch", "pipeline", "MB/s", "range", "x Ray loop", "trainer ms/batch", "CPU x loop"]
    header += ["trainer node ms/batch", "its raylet ms/batch", "input ms/batch"]
    lines = [
        [
            f"{r['size_mb']:g} MB",
            LABELS[r["pipeline"]],
            f"{r['mb_per_s']:.0f}",
            f"{r['range'][0]:.0f}-{r['range'][1]:.0f}",
            report._fmt_ratio(r["x_ray_loop"]),
            f"{r['trainer_ms_per_batch']:.3f}",
            report._fmt_ratio(r["cpu_x_ray_loop"]),
            f"{r['trainer_core_ms_per_batch']:.3f}",
            f"{r.get('trainer_node_raylet_ms_per_batch', 0.0):.3f}",
            f"{r['input_core_ms_per_batch']:.3f}",
        ]
        for r in rows
    ]
    return header, lines


def ready_targets(rows, link_mb_per_s=None, unlimited=None):
    """The targets for ``ready_tfray``, each with the figure measured.

    ``link_mb_per_s``: the link's rate, if limited; ``unlimited``: what the
    same producer delivered with no limit, MB/s by size (or None).
    """
    out = []
    for r in rows:
        if r["pipeline"] != "ready_tfray":
            continue
        checks = [
            ("x Ray's own loop", r["x_ray_loop"], 1.0, ">="),
            ("trainer CPU per batch over the loop's", r["cpu_x_ray_loop"], 1.0, "<="),
        ]
        if link_mb_per_s is not None:
            free = (unlimited or {}).get(r["size_mb"])
            ceiling = link_mb_per_s if free is None else min(link_mb_per_s, free)
            what = f"MB/s over min(link {link_mb_per_s:.0f} MB/s, " + (
                "no unlimited run)" if free is None else f"unlimited {free:.0f} MB/s)"
            )
            checks.append((what, r["mb_per_s"] / ceiling, 0.95, ">="))
        for what, value, bound, op in checks:
            if value is None:
                continue  # Its baseline was not run.
            met = value >= bound if op == ">=" else value <= bound
            verdict = "met" if met else "NOT MET"
            out.append(f"{r['size_mb']:g} MB: ready tfray {what}: {value:.3f} (target {op} {bound}): {verdict}")
    return out


def unlimited_mb_per_s(path):
    """What the ready producer delivered with no limit, MB/s by size, from the run at ``path``.

    The faster of its two ready rows at each size; None if it has none, or had a link limit.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if data.get("settings", {}).get("link") or not data.get("ready_rows"):
        return None
    out = {}
    for r in data["ready_rows"]:
        out[r["size_mb"]] = max(out.get(r["size_mb"], 0.0), r["mb_per_s"])
    return out


TC_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]i?)?(bit|bps)?", re.IGNORECASE)


def rate_bytes_per_s(rate):
    """Bytes/s of a rate in ``tc``'s units: a bare number or ``bit`` is bits/s, ``bps`` bytes/s."""
    m = TC_RATE.fullmatch(rate.strip())
    if m is None:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 4gbit, 500mbit)")
    number, prefix, unit = m.groups()
    prefix = (prefix or "").lower()
    scale = (1024 if prefix.endswith("i") else 1000) ** (" kmgt".index(prefix[:1]) if prefix else 0)
    return float(number) * scale / (1 if (unit or "").lower() == "bps" else 8)


class Link:
    """A token bucket on loopback, through which the two nodes' transfers pass: a link of ``rate``.

    ``apply()`` refuses a loopback that has a root qdisc of its own (other
    than the default ``noqueue``) rather than replace it; ``remove()``
    deletes the bucket, once, and runs at exit, on SIGTERM and SIGHUP
    (whose handlers also end the run) and from the caller's ``finally``.
    """

    DEVICE = "lo"

    def __init__(self, rate):
        self.rate = rate
        self.bytes_per_s = rate_bytes_per_s(rate)
        self._applied = False

    def _tc(self, verb, *args, check=True):
        command = ["tc", "qdisc", verb, "dev", self.DEVICE, *args]
        return subprocess.run(command, capture_output=True, text=True, check=check)

    def apply(self):
        try:
            shown = self._tc("show").stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"--link needs tc: {e}")
        roots = [line for line in shown.splitlines() if " root " in line and not line.startswith("qdisc noqueue")]
        if roots:
            raise SystemExit(
                f"--link: {self.DEVICE} already has a root qdisc ({roots[0].strip()}); not replacing it. "
                f"Remove it (tc qdisc del dev {self.DEVICE} root) or run without --link."
            )
        atexit.register(self.remove)
        self.handle_signals()
        # No signal between adding the bucket and recording it, which would leave it behind.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            bucket = ["tbf", "rate", self.rate, "burst", "1mb", "latency", "50ms"]
            added = self._tc("add", "root", *bucket, check=False)
            self._applied = added.returncode == 0
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if added.returncode:
            raise SystemExit(f"--link: tc could not add the token bucket: {added.stderr.strip()}")

    def handle_signals(self):
        """SIGTERM and SIGHUP remove the bucket and end the run as SystemExit (unwinding ``finally``).

        SIGINT already raises KeyboardInterrupt. Call again after ``ray.init``, which sets its own.
        """
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.remove()
        raise SystemExit(128 + signum)

    def remove(self):
        if self._applied:
            self._applied = False
            removed = self._tc("del", "root", check=False)
            if removed.returncode:
                print(f"--link: could not remove the token bucket: {removed.stderr.strip()}", file=sys.stderr)

    def describe(self):
        return f"loopback limited to {self.rate} ({self.bytes_per_s / 1e6:.0f} MB/s) by a token bucket"


def chart(rows, path):
    """Images/s and the trainer node's CPU per image, a bar per pipeline, a panel per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6 * len(dtypes), 7), squeeze=False)
    for col, dtype in enumerate(dtypes):
        mine = [r for r in rows if r["dtype"] == dtype]
        names = [LABELS[r["pipeline"]] for r in mine]
        y = range(len(mine))
        for row, (key, title) in enumerate(
            [("images_per_s", "images/s"), ("trainer_core_ms_per_image", "trainer node CPU ms per image")]
        ):
            ax = axes[row][col]
            colors = ["C1" if r["pipeline"].startswith("tfray") else "C0" for r in mine]
            ax.barh(y, [r[key] for r in mine], color=colors)
            ax.set_yticks(list(y), names if col == 0 else [""] * len(mine), fontsize=8)
            ax.invert_yaxis()
            ax.set_title(f"{dtype} batches: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 3 s samples")
    parser.add_argument(
        "--rows",
        default="images,ready",
        help=f"comma-separated, of {', '.join(ROWS + READY_ROWS)}, or the groups images and ready",
    )
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="float32,uint8 (the image rows')")
    parser.add_argument(
        "--ready-sizes", default=",".join(map(str, READY_SIZES_MB)), help="the ready rows' batch sizes, MB"
    )
    parser.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="limit loopback to RATE (tc's units: 4gbit, 500mbit) by a token bucket, for the run (root)",
    )
    parser.add_argument(
        "--unlimited",
        default=os.path.join(HERE, "results", "cluster.json"),
        help="with --link: a run without one, whose ready rows say what the producer delivers unlimited",
    )
    parser.add_argument("--rounds", type=int, default=None, help="samples per figure (3)")
    parser.add_argument("--seconds", type=float, default=None, help="timed run length (8)")
    parser.add_argument("--warmup", type=int, default=12, help="batches read before timing")
    parser.add_argument("--data", default=os.path.join(HERE, "data"), help="where the JPEG set is kept")
    parser.add_argument(
        "--out", default=None, help="JSON path (results/cluster.json; with --link, cluster-link-RATE.json)"
    )
    parser.add_argument("--chart", default=None, help="write the chart here (PNG)")
    parser.add_argument(
        "--ray-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a Ray setting for both nodes, e.g. RAY_object_manager_default_chunk_size=33554432 (repeatable)",
    )
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.seconds = args.seconds or (3.0 if args.quick else 8.0)
    names = [r for r in args.rows.split(",") if r]
    names = list(dict.fromkeys(x for r in names for x in GROUPS.get(r, [r])))
    args.row_names = [r for r in names if r in ROWS]
    args.ready_names = [r for r in names if r in READY_ROWS]
    args.dtype_names = [d for d in args.dtypes.split(",") if d]
    if not all("=" in e for e in args.ray_env):
        parser.error("--ray-env takes NAME=VALUE")
    if not set(names) <= set(ROWS + READY_ROWS) or not names or not set(args.dtype_names) <= set(DTYPES):
        parser.error(
            f"--rows: some of {', '.join(ROWS + READY_ROWS)}, images, ready; --dtypes: some of {', '.join(DTYPES)}"
        )
    try:
        args.ready_sizes_mb = [float(x) for x in args.ready_sizes.split(",") if x]
        if args.link:
            rate_bytes_per_s(args.link)
    except ValueError as e:
        parser.error(f"--ready-sizes: MB, e.g. 1,12,38; --link: a tc rate, e.g. 4gbit ({e})")
    if not args.ready_sizes_mb or min(args.ready_sizes_mb) <= 0:
        parser.error("--ready-sizes: MB, e.g. 1,12,38")
    if args.out is None:
        name = "cluster.json" if not args.link else f"cluster-link-{args.link}.json"
        args.out = os.path.join(HERE, "results", name)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.serve is not None:
        return serve(args.serve)
    if os.cpu_count() < 2:
        raise SystemExit("bench-cluster needs two cores: one for the trainer, one for the input")
    link = Link(args.link) if args.link else None
    # Read before this run's JSON may replace it.
    unlimited = unlimited_mb_per_s(args.unlimited) if link else None
    if link:
        link.apply()
    try:
        run(args, link, unlimited)
    finally:
        if link:
            link.remove()


def input_node_id():
    """The input node's Ray ID: the node offering CPUs (the trainer's offers none)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    (node,) = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    assert node["NodeID"] != here, "the driver is on the input node"
    return node["NodeID"]


def run(args, link, unlimited):
    """Starts the nodes (and the service), times every row, prints and writes the results."""
    os.sched_setaffinity(0, {TRAINER_CORE})  # Before TensorFlow sizes its thread pools.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Here, in the service and in Ray's workers.
    log = functools.partial(print, flush=True)
    load_at_start = os.getloadavg()
    machine = report.machine_info()
    files = images.make_files(args.data, FILES) if args.row_names else []
    port = nodes.free_port()
    pinned = ["taskset", "-c", str(INPUT_CORE)]
    # Workers import end_to_end (the pipeline's functions) from here.
    env = {"PYTHONPATH": HERE, **dict(e.split("=", 1) for e in args.ray_env)}
    import ray

    service = head = node = None
    wall = time.perf_counter()
    try:
        if args.row_names:
            service = subprocess.Popen([*pinned, sys.executable, __file__, "--serve", str(port)])
        head = nodes.Node([TRAINER_CORE], num_cpus=0, store_bytes=STORE_BYTES, env=env)
        node = nodes.Node([INPUT_CORE], num_cpus=1, store_bytes=STORE_BYTES, env=env, head=head.address)
        nodes.connect(head.address, 2)
        if link:
            link.handle_signals()  # Again: ray.init sets its own SIGTERM handler.
        work = []
        if args.row_names:
            work.append(f"{len(files)} JPEG files, batches of {BATCH}")
        if args.ready_names:
            work.append("ready float32 batches of " + ", ".join(f"{mb:g}" for mb in args.ready_sizes_mb) + " MB")
        log(
            f"cluster benchmark: {'; '.join(work)}; the trainer and its node (--num-cpus=0) on core "
            f"{TRAINER_CORE}, the input node (1 CPU)"
            + (" and the tf.data service" if args.row_names else "")
            + f" on core {INPUT_CORE}; {link.describe() if link else 'loopback unlimited'}; "
            f"{args.rounds} round(s) of ~{args.seconds} s"
        )
        samples = {d: {r: [] for r in args.row_names} for d in args.dtype_names} if args.row_names else {}
        for dtype in samples:
            names = args.row_names
            for rnd in range(args.rounds):
                shift = rnd % len(names)
                for name in names[shift:] + names[:shift]:
                    gc.collect()
                    ds = build(name, files, dtype, f"grpc://localhost:{port}")
                    s = sample(ds, warmup=args.warmup, seconds=args.seconds, trainer_node=head.pgid)
                    if isinstance(ds, RayLoop):
                        ds.close()
                    del ds
                    samples[dtype][name].append(s)
                    log(
                        f"  {dtype} round {rnd + 1}: {name:17s} {s['images_per_s']:6.0f} images/s, "
                        f"trainer {s['trainer_ms_per_image']:.3f} ms/img, its node "
                        f"{s['trainer_core_ms_per_image']:.3f} (raylet "
                        f"{s.get('trainer_node_raylet_ms_per_image', 0.0):.3f}), "
                        f"input {s['input_core_ms_per_image']:.3f}"
                    )
        ready = {mb: {r: [] for r in args.ready_names} for mb in args.ready_sizes_mb} if args.ready_names else {}
        input_node = input_node_id() if ready else None
        for size_mb in ready:
            names = args.ready_names
            for rnd in range(args.rounds):
                shift = rnd % len(names)
                for name in names[shift:] + names[:shift]:
                    gc.collect()
                    ds = build_ready(name, floats(size_mb), input_node)
                    s = sample_ready(
                        ds, 4 * floats(size_mb), warmup=args.warmup, seconds=args.seconds, trainer_node=head.pgid
                    )
                    if isinstance(ds, RayLoop):
                        ds.close()
                    del ds
                    ready[size_mb][name].append(s)
                    log(
                        f"  {size_mb:g} MB round {rnd + 1}: {name:15s} {s['mb_per_s']:7.0f} MB/s, "
                        f"trainer {s['trainer_ms_per_batch']:.3f} ms/batch, its node "
                        f"{s['trainer_core_ms_per_batch']:.3f} (raylet "
                        f"{s.get('trainer_node_raylet_ms_per_batch', 0.0):.3f}), "
                        f"input {s['input_core_ms_per_batch']:.3f}"
                    )
    finally:
        ray.shutdown()
        for n in (node, head):
            if n is not None:
                n.stop()
        if service is not None:
            service.kill()
            service.wait()
    rows = rows_of(samples)
    ready_rows = ready_rows_of(ready)
    link_mb_per_s = link.bytes_per_s / 1e6 if link else None
    data = {
        "settings": vars(args) | {"load_avg_at_start": load_at_start, "link_mb_per_s": link_mb_per_s},
        "machine": machine | {"load_avg_at_end": os.getloadavg()},
        "rows": rows,
        "ready_rows": ready_rows,
        "unlimited_mb_per_s": unlimited,
        "targets": targets(rows) + ready_targets(ready_rows, link_mb_per_s, unlimited),
        "samples": samples,
        "ready_samples": ready,
        "wall_s": time.perf_counter() - wall,
    }
    if rows:
        log("")
        log(report.text_table(*table(rows)))
    if ready_rows:
        log("")
        log(report.text_table(*ready_table(ready_rows)))
    log("")
    for line in data["targets"]:
        log(line)
    if rows:
        log(
            "x local / x service: images/s over local tf.data / over the tf.data service row of "
            "higher images/s, paired within rounds. trainer ms/img: the trainer process's CPU; "
            f"trainer node ms/img: everything that ran on core {TRAINER_CORE} (the trainer and its node's "
            f"Ray processes); input ms/img: everything on core {INPUT_CORE} (/proc/stat)."
        )
    if ready_rows:
        log(
            "ready rows: x Ray loop / CPU x loop: MB/s / trainer CPU per batch over Ray's loop's, "
            "paired within rounds; trainer ms/batch: the trainer process's CPU; trainer node and input "
            f"ms/batch: everything on core {TRAINER_CORE} / core {INPUT_CORE} (/proc/stat)."
        )
    if link:
        baseline = "" if unlimited else f"; no unlimited run's ready rows in {os.path.relpath(args.unlimited)}"
        log(link.describe() + baseline)
    log("load average at start " + ", ".join(f"{x:.2f}" for x in load_at_start)
        + ", at end " + ", ".join(f"{x:.2f}" for x in data["machine"]["load_avg_at_end"]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, default=str)
    if args.chart and rows:
        chart(rows, args.chart)
    log(f"wrote {os.path.relpath(args.out)}; wall time {data['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
