"""Train on two MultiWorkerMirroredStrategy workers, each fed only its share by tfray.

Each worker builds the same ``tfray.Dataset.from_generators(produce, SHARDS)``
and calls ``model.fit``. tfray's ``sharding="auto"`` reads TF_CONFIG and runs
only the worker's own producers (shards ``index::num_workers``), so no batch
is produced on one worker to be discarded there. The shares are uneven on
purpose (5 shards over 2 workers); TF's partial-batch handling ends the
epoch on both workers together.

Every producer records the batch ids it makes, and every worker the ids its
model trained on, in a ledger actor. When training ends the chief (worker 0)
prints, per epoch and worker, batches produced vs. consumed, and exits
non-zero unless each epoch's shares were disjoint and complete and every
worker trained on exactly what its producers made.

On one machine: ``python examples/multi_worker.py`` starts a local Ray and
two worker processes with TF_CONFIG on 127.0.0.1 ports. On a Ray cluster,
run on each of N machines that are Ray nodes, with TF_CONFIG naming the N
hosts: ``python examples/multi_worker.py --worker --address auto``.

It uses tf_keras (``TF_USE_LEGACY_KERAS=1``): Keras 3's fit fails under
MultiWorkerMirroredStrategy, even on plain tf.data.
"""

import argparse
import collections
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import ray

NAMESPACE = "tfray-multi-worker"
LEDGER = "tfray-multi-worker-ledger"
SHARDS = 5
BATCHES_PER_SHARD = 2
ROWS = 8  # Rows per batch: TF splits each among all replicas (a global batch).
EPOCHS = 2
# The workers step in lockstep: a worker whose producers wait for a CPU
# stalls the other in its collectives. Producers that hold no CPU never wait
# for one (here 2 CPUs, 5 producers); on a cluster, give the producers CPUs
# enough for every worker's to run at once.
PRODUCER_CPUS = 0


@ray.remote(num_cpus=0)
class Ledger:
    """Batch ids made by each worker's producers and trained on by its model."""

    def __init__(self):
        self._epoch = {}  # Ray job id of a trainer -> (worker, epoch) it is in.
        self._made = collections.defaultdict(list)  # (worker, epoch) -> ids.
        self._used = {}  # (worker, epoch) -> batch id of each row trained on.

    def epoch_begins(self, job, worker, epoch):
        self._epoch[job] = (worker, epoch)

    def produced(self, job, batch_id):
        self._made[self._epoch.get(job)].append(batch_id)

    def consumed(self, worker, epoch, ids):
        self._used[(worker, epoch)] = ids

    def report(self):
        return dict(self._made), dict(self._used)


def ledger():
    """The run's ledger: made by whoever asks first, shared by all."""
    return Ledger.options(name=LEDGER, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()


def batch(batch_id, rows):
    """A batch whose every row carries ``batch_id``."""
    return {
        "x": np.full((rows, 4), batch_id, np.float32),
        "y": np.full((rows, 1), batch_id % 2, np.float32),
        "id": np.full(rows, batch_id, np.int64),
    }


def produce(shard, *, batches_per_shard, rows):
    """Shard ``shard``'s batches, each recorded in the ledger as it is made."""
    book = ray.get_actor(LEDGER, namespace=NAMESPACE)
    job = ray.get_runtime_context().get_job_id()  # The trainer that started it.
    for j in range(batches_per_shard):
        batch_id = shard * batches_per_shard + j
        ray.get(book.produced.remote(job, batch_id))
        yield batch(batch_id, rows)


def check_epochs(made, used, *, num_workers, num_batches, epochs, rows, producers=True):
    """Whether each epoch was disjoint, complete and (with producers) not wasteful.

    Returns:
        ``(problems, figures)``: a list of what went wrong, and
        ``(epoch, worker, batches produced, batches consumed)`` tuples.
    """
    problems, figures = [], []
    if None in made:
        problems.append(f"batches made outside any epoch: {made[None]}")
    everything = collections.Counter({i: rows for i in range(num_batches)})
    for epoch in range(epochs):
        counts = [collections.Counter(used.get((w, epoch), [])) for w in range(num_workers)]
        seen = collections.Counter()
        for w, c in enumerate(counts):
            twice = set(c) & set(seen)
            if twice:
                problems.append(f"epoch {epoch}: worker {w} trained on batches another did: {sorted(twice)}")
            seen += c
        if seen != everything:
            problems.append(
                f"epoch {epoch}: rows trained on per batch id {dict(seen)}, expected {rows} of each"
            )
        for w, c in enumerate(counts):
            produced = sorted(made.get((w, epoch), []))
            if producers and produced != sorted(c):
                problems.append(f"epoch {epoch}, worker {w}: produced {produced}, trained on {sorted(c)}")
            figures.append((epoch, w, len(produced), len(c)))
    return problems, figures


def loopback_tf_configs(num_workers):
    """TF_CONFIG for each of ``num_workers`` workers on free 127.0.0.1 ports."""
    sockets = [socket.socket() for _ in range(num_workers)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]}
    for s in sockets:
        s.close()
    return [
        json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}) for i in range(num_workers)
    ]


def run_workers(argv, num_workers, *, timeout, log_dir):
    """Runs ``num_workers`` processes of ``argv`` on loopback TF_CONFIGs.

    Each gets ``CUDA_VISIBLE_DEVICES=""`` and ``TF_USE_LEGACY_KERAS=1``; its
    output goes to ``log_dir/worker<i>.log``. Processes still running when
    this returns or raises are killed.

    Returns:
        A list of ``(exit code or None if timed out, output)`` per worker.
    """
    procs, logs, results = [], [], []
    try:
        for index, tf_config in enumerate(loopback_tf_configs(num_workers)):
            env = dict(os.environ, TF_CONFIG=tf_config, CUDA_VISIBLE_DEVICES="", TF_USE_LEGACY_KERAS="1")
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            logs.append(open(os.path.join(log_dir, f"worker{index}.log"), "w+"))
            procs.append(subprocess.Popen(argv, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for proc, log in zip(procs, logs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None  # One hung worker: the rest are killed below.
            log.seek(0)
            results.append((code, log.read()))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def train(address):
    """One worker: fit for EPOCHS on its share; the chief then checks the run."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    # Set here, not at import: the tests import this module.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import tensorflow as tf

    # The strategy must exist before the first TF op of the program.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import tf_keras

    import tfray

    book = ledger()
    job = ray.get_runtime_context().get_job_id()
    worker, num_workers = _worker_and_count(strategy.cluster_resolver)
    consumed = []

    class IdRecordingModel(tf_keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = tf_keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            tf.py_function(lambda ids: consumed.extend(ids.numpy().tolist()), [data["id"]], [])
            return super().train_step((data["x"], data["y"]))

    class EpochLedger(tf_keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            consumed.clear()
            ray.get(book.epoch_begins.remote(job, worker, epoch))

        def on_epoch_end(self, epoch, logs=None):
            ray.get(book.consumed.remote(worker, epoch, sorted(consumed)))

    ds = tfray.Dataset.from_generators(
        functools.partial(produce, batches_per_shard=BATCHES_PER_SHARD, rows=ROWS),
        SHARDS,
        element_spec={
            "x": tf.TensorSpec([None, 4], tf.float32),
            "y": tf.TensorSpec([None, 1], tf.float32),
            "id": tf.TensorSpec([None], tf.int64),
        },
        ray_remote_args={"num_cpus": PRODUCER_CPUS},
    )
    with strategy.scope():
        model = IdRecordingModel()
        model.compile(optimizer=tf_keras.optimizers.SGD(0.01), loss="mse")
    model.fit(ds, epochs=EPOCHS, callbacks=[EpochLedger()], verbose=0)
    if worker == 0:
        sys.exit(report(book, num_workers))


def _worker_and_count(resolver):
    # As MultiWorkerMirroredStrategy numbers workers: the chief first.
    cluster = resolver.cluster_spec().as_dict()
    chiefs = len(cluster.get("chief", []))
    worker = 0 if resolver.task_type == "chief" else chiefs + resolver.task_id
    return worker, chiefs + len(cluster.get("worker", []))


def report(book, num_workers, timeout=60):
    """Prints the run's figures once every worker reported; 0 if it was right."""
    deadline = time.monotonic() + timeout
    while True:
        made, used = ray.get(book.report.remote())
        if len(used) == num_workers * EPOCHS or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    problems, figures = check_epochs(
        made, used, num_workers=num_workers, num_batches=SHARDS * BATCHES_PER_SHARD, epochs=EPOCHS, rows=ROWS
    )
    ray.kill(book)
    for epoch, worker, produced, trained in figures:
        print(f"epoch {epoch} worker {worker}: produced {produced} batches, consumed {trained}")
    for problem in problems:
        print("FAILED:", problem)
    return 1 if problems else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="run one worker (TF_CONFIG must be set)")
    parser.add_argument("--address", default=None, help="the Ray cluster to join (workers; default: local)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds the local run may take")
    args = parser.parse_args()
    if args.worker:
        train(args.address)
        return
    # A Ray of its own: never one that another program (or `ray start`) runs here.
    ray.init(address="local", num_cpus=2, object_store_memory=150 * 1024 * 1024, include_dashboard=False)
    try:
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--address",
            ray.get_runtime_context().gcs_address,
        ]
        with tempfile.TemporaryDirectory() as log_dir:
            results = run_workers(argv, 2, timeout=args.timeout, log_dir=log_dir)
    finally:
        ray.shutdown()
    for index, (code, output) in enumerate(results):
        if index == 0 or code != 0:
            print(f"--- worker {index} (exit code {code}) ---")
            print(
                "\n".join(
                    line for line in output.splitlines() if not line.startswith(("I0000", "W0000", "E0000"))
                )
            )
    if any(code != 0 for code, _ in results):
        sys.exit("multi_worker: FAILED")
    print("multi_worker: OK")


if __name__ == "__main__":
    main()
