"""Ray Train: two workers fit one Keras model under MultiWorkerMirroredStrategy, fed by tfray.

``ray.train.tensorflow.TensorflowTrainer`` starts the workers and sets their
``TF_CONFIG``; each builds a ``MultiWorkerMirroredStrategy`` and feeds
``model.fit`` from its own Ray Data shard through
``tfray.Dataset.from_ray_data(ray.train.get_dataset_shard("train"), ...)``.
Ray Train splits the rows among the workers (``streaming_split``, equal
row counts), so each worker's tfray dataset is already its part: tfray
reads it as given, and keeps tf.data's auto-shard from dropping any of it
(tfray's source sets ``auto_shard_policy=OFF``).

Keras 3 cannot ``fit`` under MultiWorkerMirroredStrategy; the workers run
tf_keras (``TF_USE_LEGACY_KERAS=1`` in their environment, so ``tf.keras`` is
tf_keras). Every row carries its id; each worker tells a ledger actor which
rows its model trained on, so the driver can show that per epoch the workers
saw disjoint parts whose union is the whole dataset.

Run it with ``python examples/ray_train_mwms.py`` (``--rows``,
``--batch-size``, ``--epochs``). Sized for a small machine (2 CPUs: each
worker holds half a CPU, Ray Data runs on the rest); it exits non-zero if
coverage is wrong or the loss did not fall.
"""

import argparse
import logging
import sys
import tempfile

import numpy as np
import ray
import ray.data

FEATURES = 16
NUM_CLASSES = 4
WORKERS = 2
# A row's label is the largest of NUM_CLASSES fixed random projections of its
# features (seeded, so every Ray Data task uses the same).
PROJECTION = np.random.default_rng(0).standard_normal((FEATURES, NUM_CLASSES)).astype(np.float32)


def make_rows(batch):
    """A ``map_batches`` step: row ids in; the ids, features and a label out."""
    ids = batch["id"]
    rng = np.random.default_rng(int(ids[0]))
    features = rng.standard_normal((len(ids), FEATURES), dtype=np.float32)
    label = (features @ PROJECTION).argmax(axis=1).astype(np.int64)
    return {"id": ids, "features": features, "label": label}


@ray.remote(num_cpus=0)
class Ledger:
    """What each worker trained on, per epoch: row ids, tfray batches, loss."""

    def __init__(self):
        self._epochs = {}  # (worker, epoch) -> what that worker reported.

    def record(self, worker, epoch, report):
        self._epochs[(worker, epoch)] = report

    def epochs(self):
        return dict(self._epochs)


def train_loop_per_worker(config):
    """One Ray Train worker: MWMS, a tfray dataset over its shard, ``fit``."""
    import tensorflow as tf  # In the worker, after TF_USE_LEGACY_KERAS is set.

    import tfray
    from ray import train

    # The strategy must exist before the worker's first TF op.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = train.get_context().get_world_rank()
    ledger = config["ledger"]

    ds = tfray.Dataset.from_ray_data(
        train.get_dataset_shard("train"),
        batch_size=config["batch_size"],
        feature_columns=["features", "id"],
        label_columns="label",
    )
    seen = []  # Row ids this worker's model trained on in the current epoch.

    def record(ids):
        seen.extend(int(i) for i in ids.numpy())

    class IdRecordingModel(tf.keras.Model):
        """A small classifier that notes the ids of the rows each step trains on."""

        def __init__(self):
            super().__init__()
            self.hidden = tf.keras.layers.Dense(32, activation="relu")
            self.logits = tf.keras.layers.Dense(NUM_CLASSES)

        def call(self, features):
            return self.logits(self.hidden(features))

        def train_step(self, data):
            features, label = data
            # Recorded in the step, after tf.distribute's input handling:
            # rows TF dropped (an extra DATA shard, say) would be missing.
            tf.py_function(record, [features["id"]], [])
            return super().train_step((features["features"], label))

    class Report(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.clear()

        def on_epoch_end(self, epoch, logs=None):
            # Keras opens one iterator per epoch; the newest that delivered
            # is this epoch's.
            delivered = [s for s in ds.stats() if s.batches]
            report = dict(
                ids=sorted(seen),
                loss=float(logs["loss"]),
                tfray_batches=delivered[-1].batches,
                bytes_zero_copy=delivered[-1].bytes_zero_copy,
                bytes_copied=delivered[-1].bytes_copied,
                bytes_copied_by_tfray=delivered[-1].bytes_copied_by_tfray,
            )
            ray.get(ledger.record.remote(worker, epoch, report))

    with strategy.scope():
        model = IdRecordingModel()
        model.compile(
            optimizer=tf.keras.optimizers.Adam(1e-2),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(ds, epochs=config["epochs"], callbacks=[Report()], verbose=0)


def run(*, rows, batch_size, epochs, storage_path):
    """Trains with TensorflowTrainer; returns the ledger's ``{(worker, epoch): report}``."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    data = ray.data.range(rows, override_num_blocks=4).map_batches(make_rows, batch_format="numpy")
    ledger = Ledger.remote()
    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config=dict(ledger=ledger, batch_size=batch_size, epochs=epochs),
        # Half a CPU each, so that two workers and Ray Data fit in 2 CPUs.
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(
            storage_path=storage_path,
            # Keras 3 cannot fit under MultiWorkerMirroredStrategy: tf.keras
            # must be tf_keras in the workers.
            worker_runtime_env={"env_vars": {"TF_USE_LEGACY_KERAS": "1"}},
        ),
        datasets={"train": data},
    )
    trainer.fit()
    return ray.get(ledger.epochs.remote())


def check(reports, *, rows, epochs, batch_size):
    """Problems with the coverage, the batches or the loss ([] when there are none)."""
    problems = []
    missing = sorted({(w, e) for w in range(WORKERS) for e in range(epochs)} - set(reports))
    if missing:
        return [f"no report from (worker, epoch) {missing}"]
    half = rows // WORKERS
    for (worker, epoch), r in sorted(reports.items()):
        # Ray Data's equal split: a part each. What tfray delivered is what
        # the model trained on: nothing read only to be dropped.
        if len(r["ids"]) != half or r["tfray_batches"] != -(-half // batch_size):
            problems.append(
                f"worker {worker} epoch {epoch}: trained on {len(r['ids'])} rows in {r['tfray_batches']} "
                f"batches, not its {half} rows in {-(-half // batch_size)}"
            )
        # A part is read through Ray Data's iter_batches: any copy is Ray
        # Data's, none tfray's.
        if r["bytes_copied_by_tfray"]:
            problems.append(f"worker {worker} epoch {epoch}: tfray copied {r['bytes_copied_by_tfray']} bytes")
    for epoch in range(epochs):
        parts = [set(reports[(w, epoch)]["ids"]) for w in range(WORKERS)]
        if sum(len(p) for p in parts) != len(set().union(*parts)):
            problems.append(f"epoch {epoch}: the workers' rows overlap")
        if set().union(*parts) != set(range(rows)):
            problems.append(f"epoch {epoch}: the workers saw {len(set().union(*parts))} of {rows} rows")
    for w in range(WORKERS):
        first, last = reports[(w, 0)]["loss"], reports[(w, epochs - 1)]["loss"]
        if not last < 0.9 * first:
            problems.append(f"worker {w}: the loss did not fall ({first:.3f} -> {last:.3f})")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    if not ray.is_initialized():
        # A Ray of its own: never one that another program (or `ray start`) runs here.
        ray.init(address="local", num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)

    with tempfile.TemporaryDirectory() as storage_path:
        reports = run(
            rows=args.rows, batch_size=args.batch_size, epochs=args.epochs, storage_path=storage_path
        )
    for (worker, epoch), r in sorted(reports.items(), key=lambda item: item[0][::-1]):
        ids = r["ids"]
        print(
            f"epoch {epoch + 1} worker {worker}: loss {r['loss']:.3f}; trained on {len(ids)} rows "
            f"(ids {ids[0]}..{ids[-1]}); tfray "
            f"delivered {r['tfray_batches']} batches, {r['bytes_zero_copy'] / 1e3:.0f} KB "
            f"zero-copy, {r['bytes_copied'] / 1e3:.0f} KB copied"
        )
    problems = check(reports, rows=args.rows, epochs=args.epochs, batch_size=args.batch_size)
    if problems:
        sys.exit("ray_train_mwms: FAILED: " + "; ".join(problems))
    print(
        f"ray_train_mwms: {WORKERS} workers, {args.epochs} epochs: each epoch the workers "
        f"trained on disjoint rows covering all {args.rows}; the loss fell on every worker"
    )


if __name__ == "__main__":
    main()
