"""What a restart costs: batches made after a restore, against the batches left.

A trainer process reads ``p`` batches of an epoch, saves
``tf.train.Checkpoint(iterator=it)`` and exits; a fresh process builds the
same dataset, restores, and reads the rest. tf.data's injected prefetch is
off, so the checkpoint holds what the source itself saves. The epoch: 4
shards of 60 batches, each batch costing 20 ms of a producer's CPU; each
batch the producers make is noted in a file of its shard, so "made" counts
what the producers computed after the restore, whether or not it reached
TensorFlow.

Rows, for ``p`` at 10%, 50% and 90% of the epoch:

- ``from_generators, start``: a generator function that takes ``start=``;
- ``from_generators, plain``: one that does not (its producers pass over
  the batches before their shard's position; they are made, never put);
- ``from_tf_data, start``: a pipeline function that takes ``start=``
  (``range(start, n).map(work)``);
- ``from_tf_data, plain``: the same pipeline from its start, passed over
  with tf.data's ``skip`` in the producer (its ``map`` runs on them).

Each row says the batches made after the restore, the batches left, their
ratio, the time from the restore to the first batch, and whether the rest
matched an uninterrupted epoch (``deterministic=True``) batch for batch.
Targets, for the ``start`` rows: made at most 1.15x the batches left plus
the look-ahead, the first batch at 90% within 2x the time at 10%; for every
row, the rest exact. ``make bench-resume`` (about 4 minutes; ``--quick``: one
source kind, about 1).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

HERE = os.path.dirname(os.path.abspath(__file__))
SHARDS = 4
PER_SHARD = 60
WORK_S = 0.020  # A batch's producer CPU.
POSITIONS = (0.1, 0.5, 0.9)
KINDS = ("from_generators, start", "from_generators, plain", "from_tf_data, start", "from_tf_data, plain")
# The targets (see the module's docstring).
MADE_OVER_LEFT = 1.15
FIRST_BATCH_SPREAD = 2.0


def _spin(seconds):
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1
    return x


def dataset(kind, made_dir):
    """The benchmark's dataset of ``kind``; its producers note each batch they make in ``made_dir``."""
    import numpy as np
    import tensorflow as tf

    import tfray

    per_shard, work_s, spin = PER_SHARD, WORK_S, _spin

    def note(shard, j):
        with open(os.path.join(made_dir, f"made-{shard}"), "a") as f:
            f.write(f"{j}\n")

    def make(shard, j):
        spin(work_s)
        note(shard, j)
        return {"id": np.full((8,), 1000 * shard + j, np.int64), "x": np.zeros((8, 64), np.float32)}

    def generator_start(shard, start=0):
        for j in range(start, per_shard):
            yield make(shard, j)

    def generator_plain(shard):
        for j in range(per_shard):
            yield make(shard, j)

    def work(shard, j):
        return make(int(shard), int(j))["x"]

    def pipeline(shard, start):
        ids = tf.data.Dataset.range(start, per_shard)
        return ids.map(
            lambda j: {
                "id": tf.fill([8], 1000 * shard + j),
                "x": tf.ensure_shape(tf.numpy_function(work, [shard, j], tf.float32), [8, 64]),
            }
        )

    def pipeline_start(shard, start=0):
        return pipeline(shard, start)

    def pipeline_plain(shard):
        return pipeline(shard, 0)

    fns = {
        "from_generators, start": generator_start,
        "from_generators, plain": generator_plain,
        "from_tf_data, start": pipeline_start,
        "from_tf_data, plain": pipeline_plain,
    }
    spec = {"id": tf.TensorSpec([None], tf.int64), "x": tf.TensorSpec([None, 64], tf.float32)}
    if kind.startswith("from_generators"):
        ds = tfray.Dataset.from_generators(fns[kind], SHARDS, element_spec=spec, deterministic=True)
    else:
        ds = tfray.Dataset.from_tf_data(fns[kind], SHARDS, deterministic=True)
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    return ds.with_options(options)


def made(made_dir):
    total = 0
    for name in os.listdir(made_dir):
        with open(os.path.join(made_dir, name)) as f:
            total += len(f.read().split())
    return total


def child(config):
    """One trainer process: ``save`` reads and checkpoints; ``restore`` restores and reads the rest."""
    import ray
    import tensorflow as tf

    ray.init(address=config["address"], log_to_driver=False, configure_logging=False)
    ds = dataset(config["kind"], config["made_dir"])
    it = iter(ds)
    checkpoint = tf.train.Checkpoint(iterator=it)
    out = {}
    if config["mode"] == "epoch":
        start = time.monotonic()
        out["ids"] = [int(b["id"][0]) for b in it]
        out["epoch_s"] = time.monotonic() - start
    elif config["mode"] == "save":
        for _ in range(config["position"]):
            next(it)
        checkpoint.write(config["ckpt"])
    else:
        start = time.monotonic()
        checkpoint.read(config["ckpt"]).assert_consumed()
        ids = [int(next(it)["id"][0])]
        out["first_s"] = time.monotonic() - start
        ids += [int(b["id"][0]) for b in it]
        out["ids"] = ids
    with open(config["out"], "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)  # As a preempted process would: no orderly shutdown.


def run_child(config, work_dir, timeout=300):
    config = dict(config, out=os.path.join(work_dir, "out.json"))
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{config['mode']} process failed:\n{done.stderr[-3000:]}")
    with open(config["out"]) as f:
        return json.load(f)


def fresh_dir(root, name):
    path = os.path.join(root, name)
    os.makedirs(path)
    return path


def measure(kind, address, root, log):
    """The rows of ``kind``: an uninterrupted epoch, then each position's save and restore."""
    base = dict(address=address, kind=kind)
    epoch = run_child(dict(base, mode="epoch", made_dir=fresh_dir(root, f"{kind}-epoch")), root)
    total = len(epoch["ids"])
    rows = []
    for fraction in POSITIONS:
        position = round(fraction * total)
        name = f"{kind}-{position}"
        ckpt = os.path.join(root, name, "ckpt")
        run_child(dict(base, mode="save", position=position, ckpt=ckpt, made_dir=fresh_dir(root, name + "-save")), root)
        restored_dir = fresh_dir(root, name + "-restore")
        out = run_child(dict(base, mode="restore", ckpt=ckpt, made_dir=restored_dir), root)
        row = dict(
            kind=kind,
            position=position,
            total=total,
            left=total - position,
            made=made(restored_dir),
            first_s=out["first_s"],
            exact=out["ids"] == epoch["ids"][position:],
        )
        log(row)
        rows.append(row)
    return rows


def targets(rows):
    """``(target, met)`` lines: for the ``start`` rows, made against left and the first batch's spread; for all, exactness.

    A plain generator or pipeline makes again, in its producers, what its
    running shards had delivered: its rows say what that costs, with no
    target.
    """
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        if kind.endswith("start"):
            worst = max(r["made"] / max(1, r["left"]) for r in mine)
            out.append(
                (
                    f"{kind}: made / left <= {MADE_OVER_LEFT} at every position (worst {worst:.2f})",
                    worst <= MADE_OVER_LEFT,
                )
            )
            first = {r["position"] / r["total"]: r["first_s"] for r in mine}
            spread = first[max(first)] / first[min(first)]
            out.append(
                (
                    f"{kind}: first batch at 90% / at 10% <= {FIRST_BATCH_SPREAD} ({spread:.2f})",
                    spread <= FIRST_BATCH_SPREAD,
                )
            )
        out.append((f"{kind}: the rest is an uninterrupted epoch's, batch for batch", all(r["exact"] for r in mine)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="from_generators with start only")
    parser.add_argument("--json", help="write the rows and the machine here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))

    import ray
    import report

    load_at_start = os.getloadavg()
    ray.init(num_cpus=2, object_store_memory=200 << 20, log_to_driver=False, include_dashboard=False)
    address = ray.get_runtime_context().gcs_address
    kinds = KINDS[:1] if args.quick else KINDS
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for kind in kinds:
            rows += measure(kind, address, root, lambda row: print(json.dumps(row), flush=True))
    ray.shutdown()
    machine = report.machine_info()
    header = ["source", "position", "made after restore", "left", "made / left", "first batch s", "rest exact"]
    lines = [
        [
            r["kind"],
            f"{r['position']} of {r['total']}",
            str(r["made"]),
            str(r["left"]),
            f"{r['made'] / max(1, r['left']):.2f}",
            f"{r['first_s']:.2f}",
            "yes" if r["exact"] else "NO",
        ]
        for r in rows
    ]
    print()
    print(report.text_table(header, lines))
    print()
    checks = targets(rows)
    for text, met in checks:
        print(("met     " if met else "NOT MET ") + text)
    print(
        f"\nload average at the start: {' '.join(f'{x:.2f}' for x in load_at_start)}, at the end: "
        f"{' '.join(f'{x:.2f}' for x in machine['load_avg_at_end'])}; "
        f"tfray {machine['git_commit']}{' (modified)' if machine['tfray_sources_modified'] else ''}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "targets": checks, "machine": machine, "load_at_start": load_at_start}, f, indent=1)
    return 0 if all(met for _, met in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
