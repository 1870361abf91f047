"""Input-pipeline benchmark: tfray against the usual ways to feed TF from Ray.

What it measures: how many batches per second each input pipeline (see
``pipelines.py``) delivers to one and the same graph-mode consumer, for three
batch sizes, with the trainer idle and with one busy Python thread in it.

Why it is fair:

- **Same batches.** Each scenario makes ``N`` distinct batches once and puts
  them in Ray's object store before anything is timed; every pipeline cycles
  those same ``N`` batches (the ceiling holds them as tensors; Ray Data holds
  them as its own blocks, also made before timing).
- **Same consumer.** ``consume`` below is one ``tf.function``: a graph
  ``while`` loop that takes the next batch from the pipeline's iterator and
  adds ``reduce_sum`` of every component to a total, so every byte of every
  batch is read, with no Python per batch. The timer is around the
  ``tf.function`` calls alone. Ray's own loop (``ray_loop``), which has no
  TensorFlow, reads its batches with the same sums in numpy, and times them:
  numpy and TensorFlow sum the same bytes at somewhat different costs (the
  batches are float32, where the two are close; TensorFlow's uint8 sum costs
  1.5x numpy's), so RESULTS.md also shows each path's trainer CPU less its
  consumer's sum.
- **Light consumer** (``+light`` scenarios): ``consume_one`` reads one
  element of each component instead, what a GPU trainer's CPU does while
  the accelerator reads the batch; Ray's loop reads one element in numpy.
  The sum's cost then no longer hides the delivery path's own: these rows
  compare ``from_generators`` with Ray's own loop over the same producers,
  at four sizes (1 MB with this consumer only).
- **Same conditions.** Each pipeline's iterator is created and warmed up
  (traced, buffers filled, every distinct batch read twice) before the timed
  calls, each of a number of batches chosen from a short probe to take about
  ``--seconds``, repeated while they cover less than half of it (a stall
  during the probe would otherwise leave a run of a fraction of a second).
  The pipelines are measured in turn within each round, and the rounds
  repeat (``--rounds``, default 5), each starting at the next pipeline,
  after a scenario's warm-up rounds (``--warmup-rounds``, default 2), which
  are not counted: whichever pipelines ran first would otherwise
  pay alone for the object store's fresh pages and Ray's worker start. Each
  figure is the median of its rounds, and each ratio the median over rounds
  of the ratio within a round, so the drifts of this
  shared machine hit the pipelines compared alike. Ratios to the ceiling use
  the ceiling measured under the same load: a busy thread takes a core from
  TensorFlow too.
- **Python's collector.** After warm-up, the trainer collects its garbage
  and freezes what survives (``gc.freeze``) until the timed calls end, so
  that a collection during them walks only what the pipeline itself makes.
  Ray asks every worker, the trainer too, for a ``gc.collect()`` at most
  every 30 s while its object store is over 70% full, as the streaming
  pipelines keep it at 38 MB; with TensorFlow's objects in the process that
  took 0.18 to 0.32 s with the GIL held (0.2 to 4 ms frozen), a fifth or
  more of a timed call, and it fell on whichever pipeline first filled the
  store after the 30 s: with the round order fixed, mostly the same one.
- **Busy thread** (``+busy`` scenarios): a thread in the trainer process runs
  ``while not stop: x = sum(range(1000))`` during warm-up and timing: pure
  Python that holds the GIL except when the interpreter forces a switch.
- **Trainer CPU per batch**: the trainer process's CPU time (user + system,
  all its threads: TensorFlow's, tfray's, Ray's core worker's) over the timed
  call, divided by its batches. The busy thread's own CPU time, read from
  its thread CPU clock, is taken out (and reported apart): it spins whatever
  the pipeline does, so per batch it would only restate the throughput.
  Work done in other processes is not trainer CPU and is not counted: Ray's
  object store and raylet, Ray Data's tasks, and ``tfray_generators``'
  producers, which run in Ray's worker processes (on the same cores).

It also measures the trainer's resident memory around one long tfray run
(12 MB batches, ``--rss-batches``, default 2000) and reports the growth in
batches: a leak of one pinned batch per step would show as hundreds.

Run it as ``make bench`` or ``python benchmarks/run.py [--quick]
[--scenarios 12MB,16KB+busy,1MB+light]``. A full run writes ``benchmarks/RESULTS.md``
and ``benchmarks/throughput.png`` (committed) and
``benchmarks/results/latest.json``; a quick or partial run writes only under
``benchmarks/results/``.
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import sys
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ray  # noqa: E402
import ray.data  # noqa: E402
import tensorflow as tf  # noqa: E402

import pipelines  # noqa: E402
import report  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    rows: int
    x_shape: tuple
    x_dtype: str
    distinct: int  # Distinct batches in the object store, cycled.
    extra: tuple = ()  # Pipeline variants run in this scenario only.
    loads: tuple = ("idle", "busy", "light")

    def describe(self):
        shape = ",".join(str(d) for d in (self.rows, *self.x_shape))
        return f"x {self.x_dtype}[{shape}] + y int32[{self.rows}]"


SCENARIOS = {
    # (a) 12.6 MB: 256 rows of 12288 float32 features. Producers that may
    # have 2 batches waiting, as those started before a batch was read do,
    # are tried too (by default, 16 here).
    "12MB": Scenario("12MB", 256, (12288,), "float32", 8, extra=("tfray_generators@2",)),
    # (b) 38.5 MB: 64 normalized 224x224 RGB images, float32, as producers
    # that augment yield them (images.py). Every batch is float32, so the
    # consumer's sum costs about the same in TensorFlow as in numpy (Ray's
    # loop): TensorFlow's integer sums are not vectorized, and took 2.8 to
    # 3.7 ms of CPU for 38.5 MB of uint8 where numpy took 2.06 to 2.18.
    "38MB": Scenario("38MB", 64, (224, 224, 3), "float32", 8),
    # (c) 16 KB: 16 rows of 256 float32; per-batch overhead dominates.
    # The window (max_inflight) matters here, so a window of all 16 distinct
    # refs is tried too (a bigger one would hold the same refs twice, and Ray
    # gets a repeated ref more cheaply than a distinct one), and producers
    # that may have 2 bundles waiting (by default, 16 here).
    "16KB": Scenario(
        "16KB", 16, (256,), "float32", 16, extra=("tfray_1epoch@16", "tfray_generators@2")
    ),
    # (d) 1 MB: 256 rows of 1024 float32, between the two; with the light
    # consumer only.
    "1MB": Scenario("1MB", 256, (1024,), "float32", 8, loads=("light",)),
}
# idle: the consumer sums every byte; busy: so, with a busy Python thread in
# the trainer; light: the consumer reads one element of each batch (what a
# GPU trainer's CPU does), which leaves the delivery path's own cost bare.
LOADS = ("idle", "busy", "light")
# The light consumer compares the producers' path with Ray's own loop.
LIGHT_PIPELINES = ("ceiling", "tfray_1epoch", "tfray_generators", "ray_loop", "from_generator_tasks")


ALL_RUNS = [report.run_label(s, load) for load in LOADS for s, sc in SCENARIOS.items() if load in sc.loads]

OBJECT_STORE_BYTES = 2 * 2**30


@tf.function
def consume(iterator, n):
    """Takes ``n`` batches from ``iterator``; sums every component of each.

    A graph while-loop: no Python runs per batch. The sum goes into the
    returned total so that nothing can be pruned; integer sums may wrap,
    only the reading matters.
    """
    total = tf.constant(0.0, tf.float64)
    for _ in tf.range(n):
        batch = iterator.get_next()
        for t in tf.nest.flatten(batch):
            total += tf.cast(tf.reduce_sum(t), tf.float64)
    return total


@tf.function
def consume_one(iterator, n):
    """Takes ``n`` batches from ``iterator``; reads one element of each component.

    The light consumer: what a GPU trainer's CPU does while the accelerator
    reads the batch. The path's own cost shows, instead of hiding behind a
    sum of every byte.
    """
    total = tf.constant(0.0, tf.float64)
    for _ in tf.range(n):
        batch = iterator.get_next()
        for t in tf.nest.flatten(batch):
            total += tf.cast(tf.reshape(t, [-1])[0], tf.float64)
    return total


def run_consume(iterator, n, light=False):
    """Times one ``consume`` (or, ``light``, ``consume_one``) call; returns seconds.

    Ray's loop reads its batches alike, in numpy.
    """
    if isinstance(iterator, pipelines.RayLoop.Iterator):
        start = time.perf_counter()
        iterator.consume(n, light=light)
        return time.perf_counter() - start
    n = tf.constant(n, tf.int64)
    fn = consume_one if light else consume
    start = time.perf_counter()
    fn(iterator, n).numpy()
    return time.perf_counter() - start


class BusyThread:
    """One Python thread spinning on pure-Python work while active."""

    def __init__(self, active):
        self.active = active
        self.iterations = 0
        self._stop = False
        self._thread = None
        self._clock = None

    def _spin(self):
        iterations = 0
        while not self._stop:
            x = sum(range(1000))  # noqa: F841
            iterations += 1
        self.iterations = iterations

    def __enter__(self):
        if self.active:
            self._thread = threading.Thread(target=self._spin, name="busy", daemon=True)
            self._thread.start()
            self._clock = time.pthread_getcpuclockid(self._thread.ident)
        return self

    def cpu_s(self):
        """The busy thread's CPU time so far (0 when inactive), read from another thread."""
        if self._thread is None:
            return 0.0
        return time.clock_gettime(self._clock)

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop = True
            self._thread.join()


def machine_cpu_s():
    """(busy, idle) CPU seconds of the whole machine so far, every core, from /proc/stat.

    (None, None) where there is no /proc/stat. What else runs on the machine
    counts too: the figures mean something on a quiet machine only.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None, None
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields) - idle) / hz, idle / hz


@contextlib.contextmanager
def frozen_heap():
    """Collects garbage, then freezes what survives until the block ends ("Python's collector")."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def rss_kb():
    """The trainer's resident memory, from /proc/self/status, in kB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0])
    return fields


def measure(dataset, *, busy, seconds, distinct, min_probe_s, light=False):
    """One timed sample of ``dataset``: warm-up, probe, then a timed run.

    Returns a dict with the batches, seconds and CPU seconds of the timed run:
    ``cpu_s_per_batch`` the trainer process's (all threads),
    ``busy_cpu_s_per_batch`` the busy thread's share of it. ``light``: the
    consumer reads one element of each batch instead of every byte.
    """
    iterator = iter(dataset)
    timed = functools.partial(run_consume, light=light)
    busy_start = time.perf_counter()
    with BusyThread(busy) as load:
        timed(iterator, 2 * distinct)  # Trace, fill buffers, read every batch twice.
        with frozen_heap():
            probe = distinct
            while True:
                dt = timed(iterator, probe)
                if dt >= min_probe_s or probe >= 1_000_000:
                    break
                probe *= 4 if dt < min_probe_s / 4 else 2
            step = max(distinct, int(round(probe / dt * seconds)))
            sums = getattr(iterator, "sum_cpu_s", None)
            cpu, busy_cpu, machine = time.process_time(), load.cpu_s(), machine_cpu_s()
            n, dt = 0, 0.0
            # A probe that a stall slowed (a producer's Ray worker starting, say)
            # picks too few batches: the run then goes on, a step at a time,
            # until it covers at least half of ``seconds``, instead of timing a
            # fraction of a second right after the stall.
            while dt < seconds / 2:
                dt += timed(iterator, step)
                n += step
            cpu, busy_cpu = time.process_time() - cpu, load.cpu_s() - busy_cpu
            machine = [None if a is None else b - a for a, b in zip(machine, machine_cpu_s())]
            sums = None if sums is None else iterator.sum_cpu_s - sums
    busy_s = time.perf_counter() - busy_start
    del iterator
    return {
        "batches": n,
        "seconds": dt,
        "batches_per_s": n / dt,
        "cpu_s_per_batch": cpu / n,
        "busy_cpu_s_per_batch": busy_cpu / n,
        # Every process's (the producers', Ray's, the trainer's), and the
        # cores' idle time: where the producers saturate the machine, the
        # rate is its cores over the CPU a batch takes in all of them.
        "machine_cpu_s_per_batch": None if machine[0] is None else machine[0] / n,
        "machine_idle_s_per_batch": None if machine[1] is None else machine[1] / n,
        # Ray's loop only: its numpy sums' share of cpu_s_per_batch.
        "sum_cpu_s_per_batch": None if sums is None else sums / n,
        # How much the busy thread got to run (its loops per second over
        # warm-up, probe and timed run): the GIL and a core it did not get.
        "busy_loops_per_s": load.iterations / busy_s if busy else None,
    }


def tfray_totals(source):
    """tfray's own counters, summed over the (recent) epochs of a sample."""
    try:
        stats = source.stats()
    except Exception as e:  # noqa: BLE001 - informational only
        return {"error": repr(e)}
    fields = ("batches", "bytes_copied", "consumer_wait_s", "producer_wait_s")
    out = {"epochs": len(stats)}
    for field in fields:
        out[field] = sum(getattr(s, field, 0) or 0 for s in stats)
    if stats and hasattr(stats[-1], "lookahead"):
        out["lookahead_last_epoch"] = stats[-1].lookahead
    return out


def build(name, batches, refs, spec, ray_data):
    """(dataset, tfray source or None) for pipeline ``name`` (``base@max_inflight``)."""
    name, _, max_inflight = name.partition("@")
    max_inflight = int(max_inflight) if max_inflight else None
    if name == "ceiling":
        return pipelines.ceiling(batches), None
    if name == "ceiling_1":
        return pipelines.ceiling_1(batches), None
    if name == "from_generator":
        return pipelines.from_generator(refs, spec), None
    if name == "to_tf":
        return pipelines.to_tf(ray_data), None
    if name in ("tfray", "tfray_1epoch"):
        source, ds = pipelines.tfray_dataset(
            refs, spec, max_inflight=max_inflight, one_epoch=name == "tfray_1epoch"
        )
        return ds, source
    if name == "ray_loop":
        return pipelines.RayLoop(refs, batches[0]), None
    if name == "from_generator_tasks":
        return pipelines.from_generator_tasks(refs, spec, batches[0]), None
    if name == "tfray_generators":
        source, ds = pipelines.tfray_generators(refs, spec, max_inflight_per_producer=max_inflight)
        return ds, source
    raise ValueError(name)


def run_scenario(scenario, loads, names, args, log):
    """All samples of one scenario (both loads); returns {load: {name: [sample]}}."""
    t0 = time.perf_counter()
    batches = pipelines.make_batches(
        scenario.rows, scenario.x_shape, scenario.x_dtype, scenario.distinct
    )
    refs = [ray.put(b) for b in batches]
    spec = pipelines.element_spec(batches[0])
    ray_data = pipelines.RayDataSource(batches) if "to_tf" in names else None
    bytes_per_batch = pipelines.batch_bytes(batches[0])
    log(
        f"\n== {scenario.name}: {scenario.describe()}, {bytes_per_batch / 1e6:.3f} MB a batch, "
        f"{scenario.distinct} distinct batches (set up in {time.perf_counter() - t0:.1f} s)"
    )
    names = list(names) + [n for n in scenario.extra if n not in names and n.split("@")[0] in names]
    results = {}
    for i, load in enumerate(loads):
        busy = load == "busy"
        names_now = names
        if load == "light":
            names_now = [n for n in names if n.split("@")[0] in LIGHT_PIPELINES]
        samples = {name: [] for name in names_now}
        # Warm-up rounds first (round 0), once per scenario, not counted: the
        # first pipelines to run would pay alone for the store's fresh pages
        # and for starting Ray's workers.
        warmup = args.warmup_rounds if i == 0 else 0
        for rnd in range(-warmup, args.rounds):
            # Each round starts one pipeline further on, so no pipeline always
            # runs first (after set-up) or right after the same neighbour.
            shift = rnd % len(names_now)
            for name in names_now[shift:] + names_now[:shift]:
                gc.collect()
                ds, source = build(name, batches, refs, spec, ray_data)
                sample = measure(
                    ds,
                    busy=busy,
                    seconds=args.seconds,
                    distinct=scenario.distinct,
                    min_probe_s=args.min_probe_s,
                    light=load == "light",
                )
                sample["gb_per_s"] = sample["batches_per_s"] * bytes_per_batch / 1e9
                if source is not None:
                    sample["tfray"] = tfray_totals(source)
                if name == "to_tf" and ray_data.fallback:
                    sample["to_tf_fallback"] = True
                if rnd >= 0:
                    samples[name].append(sample)
                del ds, source
                log(
                    f"  {scenario.name:5s} {load:4s} "
                    f"{f'round {rnd + 1}' if rnd >= 0 else 'warm-up'}: {name:15s} "
                    f"{sample['batches_per_s']:10.1f} batches/s {sample['gb_per_s']:7.2f} GB/s "
                    f"({sample['batches']} in {sample['seconds']:.2f} s)"
                )
        results[load] = samples

    rss = None
    if scenario.name == "12MB" and args.rss_batches and any(n.startswith("tfray") for n in names):
        rss = rss_check(refs, spec, scenario, bytes_per_batch, args.rss_batches, log)

    del batches, refs, ray_data
    gc.collect()
    return results, bytes_per_batch, rss


def rss_check(refs, spec, scenario, bytes_per_batch, n, log):
    """RSS before and after ``n`` batches through one tfray pipeline."""
    source, ds = pipelines.tfray_dataset(refs, spec)
    iterator = iter(ds)
    start = rss_kb()
    run_consume(iterator, 4 * scenario.distinct)  # Maps every batch's pages, traces.
    gc.collect()
    before = rss_kb()
    seconds = run_consume(iterator, n)
    gc.collect()
    after = rss_kb()
    del iterator
    growth = (after["VmRSS"] - before["VmRSS"]) * 1024
    out = {
        "batches": n,
        "seconds": seconds,
        "at_iterator_start_kb": start,
        "before_kb": before,
        "after_kb": after,
        "growth_bytes": growth,
        "growth_batches": growth / bytes_per_batch,
        "batch_bytes": bytes_per_batch,
    }
    log(
        f"  RSS around {n} tfray batches of {bytes_per_batch / 1e6:.1f} MB: "
        f"{before['VmRSS'] / 1024:.0f} -> {after['VmRSS'] / 1024:.0f} MB "
        f"(growth {growth / 1e6:+.1f} MB = {out['growth_batches']:+.2f} batches)"
    )
    return out


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run")
    parser.add_argument(
        "--scenarios",
        default=",".join(ALL_RUNS),
        help=f"comma-separated, of {', '.join(ALL_RUNS)} (default: all)",
    )
    parser.add_argument(
        "--pipelines",
        default=",".join(pipelines.PIPELINES),
        help="comma-separated, of %s; tfray@K sets max_inflight=K (for tfray_generators@K, "
        "max_inflight_per_producer=K)" % ", ".join(pipelines.PIPELINES),
    )
    parser.add_argument("--rounds", type=int, default=None, help="samples per figure (5)")
    parser.add_argument(
        "--warmup-rounds",
        type=int,
        default=None,
        help="uncounted rounds before a scenario's first (2; quick: 0)",
    )
    parser.add_argument("--seconds", type=float, default=None, help="timed run length (1.0)")
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (Python's default: 0.005 s); a diagnostic "
        "of GIL hand-off latency with the busy thread",
    )
    parser.add_argument("--rss-batches", type=int, default=None, help="batches of the RSS run (2000)")
    parser.add_argument("--out", default=None, help="JSON path (benchmarks/results/latest.json)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 5)
    if args.warmup_rounds is None:
        args.warmup_rounds = 0 if args.quick else 2
    args.seconds = args.seconds or (0.3 if args.quick else 1.0)
    args.min_probe_s = 0.1 if args.quick else 0.25
    if args.rss_batches is None:
        args.rss_batches = 300 if args.quick else 2000
    runs = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [r for r in runs if r not in ALL_RUNS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {ALL_RUNS}")
    args.runs = runs
    args.pipeline_names = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    for p in args.pipeline_names:
        if p.split("@")[0] not in pipelines.PIPELINES:
            parser.error(f"unknown pipeline {p}")
    args.full = (
        not args.quick
        and args.switch_interval is None
        and set(runs) == set(ALL_RUNS)
        and set(args.pipeline_names) >= set(pipelines.PIPELINES)
    )
    return args


def start_ray(object_store_bytes=OBJECT_STORE_BYTES):
    """A local Ray of 2 CPUs, quiet: no dashboard, worker logs or progress bars."""
    import logging

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ray.init(
        address="local",  # Its own Ray, never another process's.
        num_cpus=2,
        object_store_memory=object_store_bytes,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False


def main(argv=None):
    args = parse_args(argv)
    wall = time.perf_counter()
    args.load_avg_at_start = os.getloadavg()
    machine = report.machine_info()  # The commit that runs, and when it started.
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    def log(message):
        print(message, flush=True)

    start_ray()

    log(
        f"tfray input-pipeline benchmark: {len(args.runs)} scenario(s), "
        f"pipelines {', '.join(args.pipeline_names)}; {args.rounds} round(s) of "
        f"~{args.seconds} s each{' (quick)' if args.quick else ''}"
    )
    results = []
    rss = None
    for scenario in SCENARIOS.values():
        loads = [load for load in scenario.loads if report.run_label(scenario.name, load) in args.runs]
        if not loads:
            continue
        by_load, bytes_per_batch, scenario_rss = run_scenario(
            scenario, loads, args.pipeline_names, args, log
        )
        rss = rss or scenario_rss
        for load, samples in by_load.items():
            results.append(
                {
                    "scenario": scenario.name,
                    "load": load,
                    "describe": scenario.describe(),
                    "distinct_batches": scenario.distinct,
                    "bytes_per_batch": bytes_per_batch,
                    "samples": samples,
                }
            )

    wall = time.perf_counter() - wall
    data = report.assemble(results, rss, args, wall, machine)
    log("")
    log(report.table_text(data))
    log("")
    log(report.targets_text(data))
    paths = report.write(data, HERE, full=args.full, out=args.out)
    log("")
    for path in paths:
        log(f"wrote {os.path.relpath(path)}")
    log(f"wall time {wall:.0f} s")
    ray.shutdown()


if __name__ == "__main__":
    main()
