"""Ray Train: a worker dies mid-epoch, the job restarts from its checkpoint, and every batch is trained on once.

``ray.train.tensorflow.TensorflowTrainer`` runs two workers under
``MultiWorkerMirroredStrategy``; each reads its share of a
``tfray.Dataset.from_generators`` dataset (tfray shards it by the workers'
``TF_CONFIG``) in a custom loop whose every step is a collective, so the
workers go in lockstep, as synchronous training does. Every few steps the
chief saves ``tf.train.Checkpoint(iterator=...)`` and all workers report it
to Ray Train. In the first attempt worker 1 dies (``os._exit``) two steps
after a checkpoint; ``FailureConfig(max_failures=1)`` restarts the group,
and every worker restores the chief's checkpoint (``train.get_checkpoint()``),
as Ray Train and MWMS jobs do. tfray resumes the job's position: each
worker's share goes on where the whole job was.

Each batch carries its id; each worker tells a ledger actor what every step
trained on. The steps after the checkpoint that the failure undid are
trained again, as with any checkpoint; what the checkpoint covered is not.
The check: the steps the checkpoint kept and the steps after the restart
hold every batch of the epoch, each once.

Run it with ``python examples/ray_train_resume.py``; it exits non-zero if
a batch is lost or trained on twice.
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import ray

WORKERS = 2
SHARDS = 4
PER_SHARD = 6
SAVE_EVERY = 3
DIE_AT = 5  # Worker 1's step in the first attempt: two after the checkpoint at 3.


def shard_batches(shard, start=0):
    """A shard's batches from ``start`` on, each a batch of its id (100 * shard + index)."""
    for j in range(start, PER_SHARD):
        yield {"id": np.full((4,), 100 * shard + j, np.int64)}


@ray.remote(num_cpus=0)
class Ledger:
    """Attempts and what each step trained on."""

    def __init__(self):
        self._starts = {}  # rank -> attempts started.
        self._steps = []  # (attempt, rank, step, batch id).

    def start(self, rank):
        self._starts[rank] = self._starts.get(rank, 0) + 1
        return self._starts[rank] - 1

    def step(self, attempt, rank, step, batch):
        self._steps.append((attempt, rank, step, batch))

    def steps(self):
        return list(self._steps)


def train_loop_per_worker(config):
    """One worker: MWMS, its share of the dataset, a step a batch, a checkpoint every SAVE_EVERY steps."""
    import tensorflow as tf
    from ray import train

    import tfray

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # Before the worker's first TF op.
    rank = train.get_context().get_world_rank()
    ledger = config["ledger"]
    attempt = ray.get(ledger.start.remote(rank))

    ds = tfray.Dataset.from_generators(
        shard_batches, SHARDS, element_spec={"id": tf.TensorSpec([None], tf.int64)}, deterministic=True
    )
    # No buffer after the source: a checkpoint's position is then what each
    # worker trained on (docs/checkpoints.md).
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    iterator = iter(ds.with_options(options))
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(iterator=iterator, step=step)
    restored = train.get_checkpoint()
    if restored is not None:  # Every worker restores the chief's.
        with restored.as_directory() as directory:
            checkpoint.read(os.path.join(directory, "ckpt")).assert_consumed()

    @tf.function
    def train_step(ids):
        # A collective: no worker runs ahead of the others.
        total = strategy.run(lambda x: tf.reduce_sum(x), args=(ids,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, total, axis=None)

    for batch in iterator:
        train_step(batch["id"])
        step.assign_add(1)
        ledger.step.remote(attempt, rank, int(step.numpy()), int(batch["id"][0]))
        if attempt == 0 and rank == 1 and int(step.numpy()) == DIE_AT:
            # Once Ray Train has taken in the last checkpoint (it collects
            # reports as it polls the workers): a checkpoint it never took in
            # is not one to restart from.
            train.get_all_reported_checkpoints()
            os._exit(1)  # Preempted: no cleanup.
        if int(step.numpy()) % SAVE_EVERY == 0:
            with tempfile.TemporaryDirectory() as directory:
                saved = None
                if rank == 0:
                    checkpoint.write(os.path.join(directory, "ckpt"))
                    saved = train.Checkpoint.from_directory(directory)
                train.report({"step": int(step.numpy())}, checkpoint=saved)


def run(storage_path):
    """Trains with TensorflowTrainer; returns the ledger's steps."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    ledger = Ledger.remote()
    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config=dict(ledger=ledger),
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=storage_path, failure_config=FailureConfig(max_failures=1)),
    )
    trainer.fit()
    return ray.get(ledger.steps.remote())


def check(steps):
    """Problems with what was trained on ([] when every batch was trained on once)."""
    attempts = {a for a, _, _, _ in steps}
    if attempts != {0, 1}:
        return [f"expected a failure and one restart, got attempts {sorted(attempts)}"]
    # The first attempt's steps up to its last checkpoint before the failure stand.
    kept = (DIE_AT // SAVE_EVERY) * SAVE_EVERY
    trained = [b for a, _, s, b in steps if (a == 0 and s <= kept) or a == 1]
    epoch = [100 * s + j for s in range(SHARDS) for j in range(PER_SHARD)]
    problems = []
    twice = sorted(b for b in set(trained) if trained.count(b) > 1)
    if twice:
        problems.append(f"trained on twice: {twice}")
    lost = sorted(set(epoch) - set(trained))
    if lost:
        problems.append(f"never trained on: {lost}")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False)
    with tempfile.TemporaryDirectory() as storage_path:
        steps = run(storage_path)
    problems = check(steps)
    if problems:
        sys.exit("ray_train_resume: FAILED: " + "; ".join(problems))
    restarted = sorted({s for a, _, s, _ in steps if a == 1})
    print(
        f"ray_train_resume: worker 1 died at step {DIE_AT}; the job restarted from the checkpoint "
        f"at step {restarted[0] - 1} and trained on every one of the epoch's "
        f"{SHARDS * PER_SHARD} batches once"
    )


if __name__ == "__main__":
    main()
