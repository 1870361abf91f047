"""Producers and Ray Data: tfray against the usual bridges, same consumer.

Two comparisons, each timed around a graph-mode ``tf.function`` that reads
every batch (no Python per batch), the median of ``--repeats`` runs:

``generators``
    N producers (default 2, one per core) that each spend ~5 ms of CPU per
    1 MB batch. ``tfray.Dataset.from_generators(fn, N)`` against
    ``tf.data.Dataset.from_generator`` over ``ray.get`` of the same
    streaming-generator tasks' refs, taken round-robin: the same producers,
    bridged by Python per batch.
``ray_data``
    A materialized Ray Data dataset of 10 MB batches (one block each):
    ``ray_ds.to_tf(...)`` against ``tfray.Dataset.from_ray_data(ray_ds, ...)``.

Run: ``python benchmarks/producers.py`` (about 2 minutes on 2 cores).
"""

import argparse
import itertools
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfray  # noqa: E402

MB = 1 << 20


def busy_batch(shard, i, cpu_ms):
    """A 1 MB batch that costs about ``cpu_ms`` of CPU to make."""
    rng = np.random.default_rng(shard * 100_003 + i)
    x = rng.standard_normal((256, 1024), dtype=np.float32)
    end = time.thread_time() + cpu_ms / 1e3
    while time.thread_time() < end:
        x = np.tanh(x)  # Augmentation-like work on the batch.
    return {"x": x, "y": np.full(256, shard, np.int64)}


def produce(shard, batches, cpu_ms):
    for i in range(batches):
        yield busy_batch(shard, i, cpu_ms)


@tf.function
def drain(ds):
    total = tf.constant(0.0)
    for batch in ds:
        total += tf.reduce_sum(tf.cast(tf.nest.flatten(batch)[-1], tf.float32))
    return total


def timed(make_ds, batches, repeats):
    """Median batches/s of draining a fresh ``make_ds()``, after a warm-up."""
    drain(make_ds())
    rates = []
    for _ in range(repeats):
        ds = make_ds()
        start = time.perf_counter()
        drain(ds)
        rates.append(batches / (time.perf_counter() - start))
    return statistics.median(rates)


def generators(producers, batches, cpu_ms, repeats, inflight):
    fn = lambda shard: produce(shard, batches, cpu_ms)  # noqa: E731
    spec = {"x": tf.TensorSpec([None, 1024], tf.float32), "y": tf.TensorSpec([None], tf.int64)}

    def shard_task(shard):
        yield from produce(shard, batches, cpu_ms)

    runner = ray.remote(num_returns="streaming")(shard_task)

    def from_generator():
        def gen():
            streams = [runner.remote(s) for s in range(producers)]
            for refs in itertools.zip_longest(*streams):
                for ref in refs:
                    if ref is not None:
                        yield ray.get(ref)

        return tf.data.Dataset.from_generator(gen, output_signature=spec)

    total = producers * batches
    return {
        "from_generator(ray.get)": timed(from_generator, total, repeats),
        "tfray.from_generators": timed(
            lambda: tfray.Dataset.from_generators(
                fn, producers, element_spec=spec, max_inflight_per_producer=inflight
            ),
            total,
            repeats,
        ),
    }


def ray_data(batches, repeats):
    rows, width = 40, 65536  # 40 x 64K float32: 10 MB a batch.
    data = ray.data.range(batches, override_num_blocks=batches).map_batches(
        lambda b: {
            "x": np.random.default_rng(int(b["id"][0])).random((rows, width), np.float32),
            "y": np.zeros(rows, np.int64),
        },
        batch_size=1,
    )
    data = data.materialize()
    args = dict(feature_columns="x", label_columns="y", batch_size=rows)
    return {
        "Ray Data to_tf": timed(lambda: data.to_tf(**args), batches, repeats),
        "tfray.from_ray_data": timed(
            lambda: tfray.Dataset.from_ray_data(data, **args), batches, repeats
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=100, help="per producer")
    parser.add_argument("--cpu-ms", type=float, default=5.0)
    parser.add_argument("--inflight", type=int, default=2, help="max_inflight_per_producer")
    parser.add_argument("--ray-data-batches", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/producers.json")
    args = parser.parse_args()
    # A Ray of its own: never one that another program (or `ray start`) runs here.
    ray.init(address="local", num_cpus=2, object_store_memory=1500 * MB, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False

    results = {
        f"{args.producers} producers x {args.cpu_ms:g} ms CPU per 1 MB batch": generators(
            args.producers, args.batches, args.cpu_ms, args.repeats, args.inflight
        ),
        "Ray Data, 10 MB batches": ray_data(args.ray_data_batches, args.repeats),
    }
    ideal = args.producers * 1e3 / args.cpu_ms
    print("\n| scenario | pipeline | batches/s | vs. baseline |\n|---|---|---:|---:|")
    for scenario, rates in results.items():
        baseline = next(iter(rates.values()))
        for name, rate in rates.items():
            print(f"| {scenario} | {name} | {rate:.1f} | {rate / baseline:.2f}x |")
    print(f"\n(producers' CPU cost alone allows at most {ideal:.0f} batches/s on {args.producers} cores)")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
