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
Run on a quiet machine: ``/proc/stat`` counts any other program too.

Run: ``make bench-cluster`` (about 10 minutes) or ``python
benchmarks/cluster.py [--quick]``.
"""

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import end_to_end  # noqa: E402
import images  # noqa: E402
import nodes  # noqa: E402
import report  # noqa: E402

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


def pipeline(files, dtype, shard=0):
    """The image pipeline (see the module's docstring); every shard reads every file."""
    element = end_to_end.decode_and_crop(normalize=dtype == "float32")
    return end_to_end.file_pipeline(files, "autotune", element, batch=BATCH)[0]


def numpy_batches(files, dtype, shard):
    # A loop, not `yield from`: Ray's streaming generator resumes its
    # generator with send(), which a NumpyIterator does not have.
    for batch in pipeline(files, dtype, shard).as_numpy_iterator():
        yield batch


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
        return RayLoop(files, dtype)
    spec = pipeline(files, dtype).element_spec
    fn = functools.partial(numpy_batches, files, dtype)
    return tfray.Dataset.from_generators(fn, 1, element_spec=spec, ray_remote_args=one_core)


class RayLoop:
    """Ray's own loop: one streaming-generator task of the pipeline's batches, read with ``ray.get``."""

    def __init__(self, files, dtype):
        import ray

        produce = ray.remote(numpy_batches).options(
            num_cpus=1, num_returns="streaming", _generator_backpressure_num_objects=RAY_LOOP_AHEAD
        )
        self._refs = produce.remote(files, dtype, 0)

    def read(self, n):
        """Reads ``n`` batches, one element of each; their sum."""
        import ray

        total = 0.0
        for _ in range(n):
            batch = ray.get(next(self._refs))
            total += float(batch["image"][0, 0, 0, 0])
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


def sample(ds, *, warmup, seconds, trainer_node=None):
    """Images/s and CPU per image of one timed run of ``ds`` under the light consumer.

    ``trainer_node``: the trainer node's process group, whose processes' CPU is split by kind.
    """
    import tensorflow as tf

    @tf.function
    def consume(iterator, n):
        total = tf.constant(0.0, tf.float64)
        for _ in tf.range(n):
            batch = iterator.get_next()
            total += tf.cast(batch["image"][0, 0, 0, 0], tf.float64)
        return total

    if isinstance(ds, RayLoop):
        read = ds.read
    else:
        iterator = iter(ds)

        def read(n):
            return consume(iterator, tf.constant(n, tf.int64)).numpy()

    read(warmup)
    node = {} if trainer_node is None else group_cpu_s(trainer_node)
    n, busy, cpu, start = 0, core_busy_s(), time.process_time(), time.perf_counter()
    while n < 8 or time.perf_counter() - start < seconds:
        read(4)
        n += 4
    dt = time.perf_counter() - start
    cpu, after = time.process_time() - cpu, core_busy_s()
    node_after = {} if trainer_node is None else group_cpu_s(trainer_node)
    del read
    images_ = n * BATCH
    per_kind = {kind: 1e3 * (node_after[kind] - node.get(kind, 0.0)) / images_ for kind in node_after}
    return {
        **{f"trainer_node_{kind.replace(' ', '_')}_ms_per_image": ms for kind, ms in per_kind.items()},
        "images_per_s": images_ / dt,
        "trainer_ms_per_image": 1e3 * cpu / images_,
        "trainer_core_ms_per_image": 1e3 * (after[TRAINER_CORE] - busy[TRAINER_CORE]) / images_,
        "input_core_ms_per_image": 1e3 * (after[INPUT_CORE] - busy[INPUT_CORE]) / images_,
        "batches": n,
        "seconds": dt,
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
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="float32,uint8")
    parser.add_argument("--rounds", type=int, default=None, help="samples per figure (3)")
    parser.add_argument("--seconds", type=float, default=None, help="timed run length (8)")
    parser.add_argument("--warmup", type=int, default=12, help="batches read before timing")
    parser.add_argument("--data", default=os.path.join(HERE, "data"), help="where the JPEG set is kept")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "cluster.json"), help="JSON path")
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
    args.row_names = [r for r in args.rows.split(",") if r]
    args.dtype_names = [d for d in args.dtypes.split(",") if d]
    if not all("=" in e for e in args.ray_env):
        parser.error("--ray-env takes NAME=VALUE")
    if not set(args.row_names) <= set(ROWS) or not set(args.dtype_names) <= set(DTYPES):
        parser.error(f"--rows: some of {', '.join(ROWS)}; --dtypes: some of {', '.join(DTYPES)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.serve is not None:
        return serve(args.serve)
    if os.cpu_count() < 2:
        raise SystemExit("bench-cluster needs two cores: one for the trainer, one for the input")
    os.sched_setaffinity(0, {TRAINER_CORE})  # Before TensorFlow sizes its thread pools.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Here, in the service and in Ray's workers.
    log = functools.partial(print, flush=True)
    load_at_start = os.getloadavg()
    machine = report.machine_info()
    files = images.make_files(args.data, FILES)
    port = nodes.free_port()
    pinned = ["taskset", "-c", str(INPUT_CORE)]
    service = subprocess.Popen([*pinned, sys.executable, __file__, "--serve", str(port)])
    # Workers import end_to_end (the pipeline's functions) from here.
    env = {"PYTHONPATH": HERE, **dict(e.split("=", 1) for e in args.ray_env)}
    head = nodes.Node([TRAINER_CORE], num_cpus=0, store_bytes=STORE_BYTES, env=env)
    node = nodes.Node([INPUT_CORE], num_cpus=1, store_bytes=STORE_BYTES, env=env, head=head.address)
    import ray

    wall = time.perf_counter()
    try:
        nodes.connect(head.address, 2)
        log(
            f"cluster benchmark: {len(files)} JPEG files, batches of {BATCH}; the trainer and its "
            f"node (--num-cpus=0) on core {TRAINER_CORE}, the input node (1 CPU) and the tf.data "
            f"service on core {INPUT_CORE}; {args.rounds} round(s) of ~{args.seconds} s"
        )
        samples = {d: {r: [] for r in args.row_names} for d in args.dtype_names}
        for dtype in args.dtype_names:
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
    finally:
        ray.shutdown()
        node.stop()
        head.stop()
        service.kill()
        service.wait()
    rows = rows_of(samples)
    data = {
        "settings": vars(args) | {"load_avg_at_start": load_at_start},
        "machine": machine | {"load_avg_at_end": os.getloadavg()},
        "rows": rows,
        "targets": targets(rows),
        "samples": samples,
        "wall_s": time.perf_counter() - wall,
    }
    log("")
    log(report.text_table(*table(rows)))
    log("")
    for line in data["targets"]:
        log(line)
    log(
        "x local / x service: images/s over local tf.data / over the tf.data service row of "
        "higher images/s, paired within rounds. trainer ms/img: the trainer process's CPU; "
        f"trainer node ms/img: everything that ran on core {TRAINER_CORE} (the trainer and its node's "
        f"Ray processes); input ms/img: everything on core {INPUT_CORE} (/proc/stat)."
    )
    log("load average at start " + ", ".join(f"{x:.2f}" for x in load_at_start)
        + ", at end " + ", ".join(f"{x:.2f}" for x in data["machine"]["load_avg_at_end"]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, default=str)
    if args.chart:
        chart(rows, args.chart)
    log(f"wrote {os.path.relpath(args.out)}; wall time {data['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
