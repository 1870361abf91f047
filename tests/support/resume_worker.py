"""A training process that checkpoints, may kill itself, and resumes.

Run by tests/end_to_end/test_checkpoint.py as ``python resume_worker.py CONFIG_JSON``.
It joins the test's Ray, trains on a deterministic ``from_generators``
dataset whose batches carry ids, and appends what it does to a log, one JSON
line per event, flushed at once so a killed run leaves its record:

- ``loop``: a custom loop over ``ds.repeat(EPOCHS)`` that saves model,
  optimizer and *iterator* every SAVE_EVERY steps (``tf.train.Checkpoint``)
  and resumes mid-epoch from the latest checkpoint.
- ``fit``: Keras ``model.fit`` with ``BackupAndRestore``, which resumes at the
  start of the interrupted epoch; tfray serves each epoch afresh.

``kill_at`` (a step, or -1) ends the process with ``os._exit`` right after
that step, as a crash would: no cleanup, no atexit.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np  # noqa: E402
import ray  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfray  # noqa: E402

SHARDS = 3
PER_SHARD = 4
ROWS = 8
EPOCHS = 2
SAVE_EVERY = 3
KILLED = 3  # Exit status of a run that killed itself.


def batches():
    def shard_batches(shard):
        rng = np.random.default_rng(shard)
        for j in range(PER_SHARD):
            x = rng.normal(size=(ROWS, 4)).astype(np.float32)
            yield {
                "id": np.full((ROWS,), 100 * shard + j, np.int64),
                "x": x,
                "y": x.sum(axis=1, keepdims=True),
            }

    return shard_batches


SPEC = {
    "id": tf.TensorSpec([None], tf.int64),
    "x": tf.TensorSpec([None, 4], tf.float32),
    "y": tf.TensorSpec([None, 1], tf.float32),
}


def model():
    m = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    m.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
    return m


def run_loop(config, dataset, log):
    m = model()
    optimizer = m.optimizer
    iterator = iter(dataset.repeat(EPOCHS))
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(model=m, optimizer=optimizer, iterator=iterator, step=step)
    manager = tf.train.CheckpointManager(checkpoint, config["ckpt_dir"], max_to_keep=1)
    optimizer.build(m.trainable_variables)  # Its variables exist to restore into.
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).assert_consumed()
        log({"event": "restored", "step": int(step.numpy())})

    @tf.function
    def train(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(m(batch["x"]) - batch["y"]))
        optimizer.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))
        return loss

    for batch in iterator:
        loss = train(batch)
        step.assign_add(1)
        log({"event": "trained", "step": int(step.numpy()), "id": int(batch["id"][0]), "loss": float(loss)})
        if int(step.numpy()) % SAVE_EVERY == 0:
            manager.save()
            log({"event": "saved", "step": int(step.numpy())})
        if int(step.numpy()) == config["kill_at"]:
            os._exit(KILLED)
    log({"event": "done", "step": int(step.numpy())})


def run_fit(config, dataset, log):
    m = model()
    m.build((None, 4))

    class Record(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0

        def on_epoch_begin(self, epoch, logs=None):
            log({"event": "epoch_begin", "epoch": epoch})

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step == config["kill_at"]:
                os._exit(KILLED)

        def on_epoch_end(self, epoch, logs=None):
            # This epoch's iterator is the one that delivered batches last.
            delivered = [s.batches for s in dataset.stats() if s.batches][-1]
            log({"event": "epoch_end", "epoch": epoch, "loss": logs["loss"], "batches": delivered})

    backup = tf.keras.callbacks.BackupAndRestore(config["ckpt_dir"], delete_checkpoint=False)
    m.fit(
        dataset.map(lambda b: (b["x"], b["y"])),
        epochs=EPOCHS + 1,
        verbose=0,
        callbacks=[backup, Record()],
    )
    log({"event": "done"})


def main():
    config = json.loads(sys.argv[1])
    ray.init(address=config["address"], log_to_driver=False, configure_logging=False)
    dataset = tfray.Dataset.from_generators(batches(), SHARDS, element_spec=SPEC, deterministic=True)
    with open(config["log"], "a") as out:

        def log(record):
            out.write(json.dumps(record) + "\n")
            out.flush()

        (run_loop if config["mode"] == "loop" else run_fit)(config, dataset, log)


if __name__ == "__main__":
    main()
