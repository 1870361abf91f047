"""The trainer's CPU per batch, thread by thread, with the light consumer.

``run.py``'s light rows give the trainer process's CPU per batch as one
figure; this splits it by thread, to say whose it is: tfray's own threads
(``tfray-feeder``, ``tfray-release``), TensorFlow's (``tf_Compute``: the
consumer's graph and the ``IteratorGetNext`` it runs), Ray's core worker
(``worker.io``, ``client.poll``, ``server.poll``, ``nexting_thread``) and
the main thread (Ray's loop runs there). Python threads are named as
Python names them, native ones by their kernel name without a trailing
number.

``ceiling_paced`` is the in-memory ceiling made to wait before each
batch (TensorFlow's own ``sleep`` transformation, ``--pace-us``; the
default gives about the rate of the 38 MB producers): what TensorFlow's
consumer costs when it waits for its input, with no Ray and no tfray.

Each round runs each pipeline (of ``run.py``'s, or ``ceiling_paced``;
``ceiling``, ``ceiling_paced``, ``tfray_generators``, ``ray_loop`` by
default) as ``run.py``'s light consumer does: batches read twice to fill
buffers, then about ``--seconds`` of ``consume_one`` calls, the heap
frozen; a warm-up round comes first. The table gives each thread's CPU
per batch over the timed calls (``/proc/self/task``), median over the
rounds.

Run: ``python benchmarks/trainer_threads.py [--scenario 38MB] [--rounds 3]``
(about two minutes on 2 cores; say the load average with any figure).
"""

import argparse
import collections
import gc
import os
import statistics
import sys
import threading
import time

import ray
from tensorflow.python.data.experimental.ops import testing as tf_data_testing

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pipelines  # noqa: E402
import report  # noqa: E402
import run  # noqa: E402


def thread_cpu_s():
    """{thread group: CPU seconds so far} of this process's threads, alive now."""
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    groups = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        stat = report.proc_stat(f"/proc/self/task/{tid}/stat")
        if stat is None:  # The thread ended since the listing.
            continue
        name, _, cpu_s = stat
        groups[python_names.get(int(tid), name.rstrip("0123456789"))] += cpu_s
    return groups


def sample(dataset, distinct, seconds):
    """(batches/s, {thread group: CPU ms per batch}) of one light-consumer run."""
    iterator = iter(dataset)
    run.run_consume(iterator, 2 * distinct, light=True)
    with run.frozen_heap():
        before, start, n = thread_cpu_s(), time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            run.run_consume(iterator, distinct, light=True)
            n += distinct
        elapsed, after = time.perf_counter() - start, thread_cpu_s()
    del iterator
    # A thread that ended during the run counts for what it had before; one
    # that started during it, for all it spent.
    per_batch = {g: (after[g] - before.get(g, 0.0)) * 1e3 / n for g in after}
    return n / elapsed, per_batch


def build(name, batches, refs, spec, pace_us):
    """(dataset, tfray source or None): ``run.build``'s, or the paced ceiling."""
    if name == "ceiling_paced":
        return pipelines.ceiling(batches).apply(tf_data_testing.sleep(pace_us)), None
    return run.build(name, batches, refs, spec, None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="38MB", choices=sorted(run.SCENARIOS))
    parser.add_argument("--pipelines", default="ceiling,ceiling_paced,tfray_generators,ray_loop")
    parser.add_argument("--pace-us", type=int, default=5000, help="ceiling_paced's wait before each batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args(argv)
    names = args.pipelines.split(",")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    run.start_ray()
    scenario = run.SCENARIOS[args.scenario]
    batches = pipelines.make_batches(scenario.rows, scenario.x_shape, scenario.x_dtype, scenario.distinct)
    refs = [ray.put(b) for b in batches]
    spec = pipelines.element_spec(batches[0])
    rates = collections.defaultdict(list)
    splits = collections.defaultdict(list)  # name: [{thread group: ms/batch} a round]
    # A warm-up round first, not counted: the first pipelines to run would
    # pay alone for starting Ray's workers and the store's fresh pages.
    for rnd in range(-1, args.rounds):
        shift = rnd % len(names)  # No pipeline always runs first.
        for name in names[shift:] + names[:shift]:
            gc.collect()
            dataset, source = build(name, batches, refs, spec, args.pace_us)
            rate, per_batch = sample(dataset, scenario.distinct, args.seconds)
            del dataset, source
            if rnd >= 0:
                rates[name].append(rate)
                splits[name].append(per_batch)
            top = sorted(per_batch.items(), key=lambda kv: -kv[1])
            print(
                f"{f'round {rnd + 1}' if rnd >= 0 else 'warm-up'} {name:17s} {rate:9.1f} batches/s, CPU ms/batch "
                f"{sum(per_batch.values()):.3f}: "
                + ", ".join(f"{g} {v:.3f}" for g, v in top if v >= 0.005),
                flush=True,
            )
    ray.shutdown()

    print(f"\n{args.scenario}, light consumer: trainer CPU ms per batch by thread, median of {args.rounds} rounds")

    def median(name, group):
        return statistics.median(rounds.get(group, 0.0) for rounds in splits[name])

    groups = {g for name in names for rounds in splits[name] for g in rounds}
    rows = sorted(((g, [median(n, g) for n in names]) for g in groups), key=lambda row: -max(row[1]))
    print(f"| thread | {' | '.join(names)} |")
    print(f"|---|{'---:|' * len(names)}")
    print(f"| batches/s | {' | '.join(f'{statistics.median(rates[n]):.1f}' for n in names)} |")
    totals = [statistics.median(sum(rounds.values()) for rounds in splits[n]) for n in names]
    print(f"| all threads | {' | '.join(f'{t:.3f}' for t in totals)} |")
    for group, cells in rows:
        if max(cells) >= 0.005:
            print(f"| {group} | {' | '.join(f'{c:.3f}' for c in cells)} |")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
