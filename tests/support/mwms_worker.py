"""One worker of a MultiWorkerMirroredStrategy run fed by tfray (test_multi_worker.py).

Run by the test with TF_CONFIG set, as ``python mwms_worker.py CONFIG_JSON``.
It joins the test's Ray and trains for a few epochs, with ``model.fit`` or
a custom ``strategy.run`` loop over ``distribute_datasets_from_function``
("loop") or ``experimental_distribute_dataset`` ("loop-ds"), on batches
from examples/multi_worker.py's
producers or refs, sharded at the source by tfray's ``sharding="auto"``. It
reports the batch ids its model trained on, per epoch, to the example's
ledger actor (where its producers record what they made).
"""

import functools
import json
import os
import sys

import ray
from ray import cloudpickle

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
import multi_worker  # noqa: E402

# By value: Ray's workers cannot import the examples directory.
cloudpickle.register_pickle_by_value(multi_worker)


def main(config):
    ray.init(address=config["address"], namespace=multi_worker.NAMESPACE, log_to_driver=False)
    import tensorflow as tf

    # The strategy must exist before the first TF op of the program.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import tf_keras

    import tfray

    book = multi_worker.ledger()
    job = ray.get_runtime_context().get_job_id()
    worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rows = config["rows"]
    consumed = []  # The batch id of each row the model trained on this epoch.

    def record(ids):
        consumed.extend(ids.numpy().tolist())

    def epoch_begins(epoch):
        consumed.clear()
        ray.get(book.epoch_begins.remote(job, worker, epoch))

    def epoch_ends(epoch):
        ray.get(book.consumed.remote(worker, epoch, sorted(consumed)))

    made_refs = []  # (batch id, ref): checked unchanged after training.

    def make_dataset(input_context=None):
        if config["source"] == "refs":
            # The whole list on every worker; each resolves only its share.
            refs = [ray.put(multi_worker.batch(i, rows)) for i in range(config["shards"])]
            made_refs.extend(enumerate(refs))
            return tfray.Dataset.from_refs(refs, input_context=input_context)
        # Without a spec, the first epoch starts here to learn it, and serves
        # the first iterator: its producers must make no batch twice.
        spec = None
        if not config.get("learn_spec"):
            spec = {
                "x": tf.TensorSpec([None, 4], tf.float32),
                "y": tf.TensorSpec([None, 1], tf.float32),
                "id": tf.TensorSpec([None], tf.int64),
            }
        return tfray.Dataset.from_generators(
            functools.partial(multi_worker.produce, batches_per_shard=config["batches_per_shard"], rows=rows),
            config["shards"],
            element_spec=spec,
            ray_remote_args={"num_cpus": multi_worker.PRODUCER_CPUS},
            input_context=input_context,
        )

    with strategy.scope():
        dense = tf_keras.layers.Dense(1)
        dense.build((None, 4))  # Variables are made here, not in a replica.
        optimizer = tf_keras.optimizers.SGD(0.01)

    if config["loop"] == "fit":

        class IdRecordingModel(tf_keras.Model):
            def call(self, x):
                return dense(x)

            def train_step(self, data):
                tf.py_function(record, [data["id"]], [])
                return super().train_step((data["x"], data["y"]))

        class EpochLedger(tf_keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                epoch_begins(epoch)

            def on_epoch_end(self, epoch, logs=None):
                epoch_ends(epoch)

        with strategy.scope():
            model = IdRecordingModel()
            model.compile(optimizer=optimizer, loss="mse")
        epoch_begins(0)  # Batches a spec-learning first epoch makes now are epoch 0's.
        ds = make_dataset()
        model.fit(ds, epochs=config["epochs"], callbacks=[EpochLedger()], verbose=0)
        check_unchanged(made_refs, rows)
        return

    if config["loop"] == "loop":
        dist = strategy.distribute_datasets_from_function(make_dataset)
        global_rows = rows * strategy.num_replicas_in_sync  # Each batch is one replica's.
    else:
        dist = strategy.experimental_distribute_dataset(make_dataset())
        global_rows = rows  # TF splits each batch among all replicas.

    def step(batch):
        tf.py_function(record, [batch["id"]], [])
        with tf.GradientTape() as tape:
            # Averaged over the global batch, so that a worker whose data ran
            # out (an empty batch) adds zeros, not NaNs.
            per_row = tf.reduce_sum((dense(batch["x"]) - batch["y"]) ** 2, axis=1)
            loss = tf.nn.compute_average_loss(per_row, global_batch_size=global_rows)
        grads = tape.gradient(loss, dense.trainable_variables)
        optimizer.apply_gradients(zip(grads, dense.trainable_variables))  # All-reduce.

    @tf.function
    def train(batch):
        strategy.run(step, args=(batch,))

    for epoch in range(config["epochs"]):
        epoch_begins(epoch)
        for batch in dist:
            train(batch)
        epoch_ends(epoch)
    check_unchanged(made_refs, rows)


def check_unchanged(refs, rows):
    """Exits non-zero if training changed any of this worker's Ray objects (TF must never write there)."""
    import numpy as np

    for i, ref in refs:
        got, expected = ray.get(ref), multi_worker.batch(i, rows)
        for key in expected:
            if not np.array_equal(got[key], expected[key]):
                sys.exit(f"Ray object {i} field {key} changed by training")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
