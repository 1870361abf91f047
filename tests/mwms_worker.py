"""One worker of a MultiWorkerMirroredStrategy run fed by tfray (test_multi_worker.py).

Run by the test with TF_CONFIG set, as ``python mwms_worker.py CONFIG_JSON``.
It joins the test's Ray, trains for a few epochs on batches from
``from_generators`` (sharded at the source by tfray's ``sharding="auto"``)
and reports to the test's ledger actor which batch ids its producers made
and which its model consumed, per epoch. Each batch's rows all carry the
batch's id, so a batch TF splits among replicas still counts whole.
"""

import json
import os
import sys

import numpy as np
import ray

# One test's configuration; see test_multi_worker.py.
CONFIG = json.loads(sys.argv[1]) if __name__ == "__main__" else {}


def produce(shard):
    """Shard ``shard``'s batches; each recorded in the ledger as it is made."""
    ledger = ray.get_actor(CONFIG["ledger"], namespace=CONFIG["namespace"])
    job = ray.get_runtime_context().get_job_id()  # The trainer that started it.
    rows = CONFIG["rows"]
    for j in range(CONFIG["batches_per_shard"]):
        batch_id = shard * CONFIG["batches_per_shard"] + j
        ray.get(ledger.produced.remote(job, batch_id))
        yield {
            "x": np.full((rows, 4), batch_id, np.float32),
            "y": np.full((rows, 1), batch_id % 2, np.float32),
            "id": np.full(rows, batch_id, np.int64),
        }


def main():
    ray.init(address=CONFIG["address"], namespace=CONFIG["namespace"], log_to_driver=False)
    import tensorflow as tf

    # The strategy must exist before the first TF op of the program.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import tf_keras

    import tfray

    ledger = ray.get_actor(CONFIG["ledger"], namespace=CONFIG["namespace"])
    job = ray.get_runtime_context().get_job_id()
    worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    consumed = []  # Batch ids of the rows the model trained on this epoch.

    def record(ids):
        consumed.extend(int(i) for i in ids.numpy())

    def epoch_begins(epoch):
        consumed.clear()
        ray.get(ledger.epoch_begins.remote(job, worker, epoch))

    def epoch_ends(epoch):
        ray.get(ledger.consumed.remote(worker, epoch, sorted(consumed)))

    def make_dataset(input_context=None):
        if CONFIG["source"] == "refs":
            # The whole list on every worker; each resolves only its share.
            rows = CONFIG["rows"]
            refs = [
                ray.put({
                    "x": np.full((rows, 4), i, np.float32),
                    "y": np.full((rows, 1), i % 2, np.float32),
                    "id": np.full(rows, i, np.int64),
                })
                for i in range(CONFIG["shards"] * CONFIG["batches_per_shard"])
            ]
            return tfray.Dataset.from_refs(refs, input_context=input_context)
        return tfray.Dataset.from_generators(
            produce,
            CONFIG["shards"],
            element_spec={
                "x": tf.TensorSpec([None, 4], tf.float32),
                "y": tf.TensorSpec([None, 1], tf.float32),
                "id": tf.TensorSpec([None], tf.int64),
            },
            # Producers hold no CPU: two trainers share a 2-CPU Ray, and a
            # trainer whose producers cannot run stalls the other's collectives.
            ray_remote_args={"num_cpus": 0},
            input_context=input_context,
        )

    with strategy.scope():
        dense = tf_keras.layers.Dense(1)
        dense.build((None, 4))  # Variables are made here, not in a replica.
        optimizer = tf_keras.optimizers.SGD(0.01)

    if CONFIG["loop"] == "fit":

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
        model.fit(make_dataset(), epochs=CONFIG["epochs"], callbacks=[EpochLedger()], verbose=0)
    else:
        dist = strategy.distribute_datasets_from_function(make_dataset)

        def step(batch):
            tf.py_function(record, [batch["id"]], [])
            with tf.GradientTape() as tape:
                # Averaged over the global batch, so that a worker whose data
                # ran out (an empty batch) adds zeros, not NaNs.
                per_row = tf.reduce_sum((dense(batch["x"]) - batch["y"]) ** 2, axis=1)
                loss = tf.nn.compute_average_loss(
                    per_row, global_batch_size=CONFIG["rows"] * strategy.num_replicas_in_sync
                )
            grads = tape.gradient(loss, dense.trainable_variables)
            optimizer.apply_gradients(zip(grads, dense.trainable_variables))  # All-reduce.

        @tf.function
        def train(batch):
            strategy.run(step, args=(batch,))

        for epoch in range(CONFIG["epochs"]):
            epoch_begins(epoch)
            for batch in dist:
                train(batch)
            epoch_ends(epoch)


if __name__ == "__main__":
    main()
