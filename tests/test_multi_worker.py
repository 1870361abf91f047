"""Two real MultiWorkerMirroredStrategy workers on loopback, fed by tfray.

Each test starts two worker processes (mwms_worker.py) with TF_CONFIG on
127.0.0.1 ports; both join this module's Ray. Their producers record every
batch they make, and their models every batch they train on, in a ledger
actor. Per epoch: the workers' batches are disjoint and cover the data, and
each worker's producers made exactly the batches it trained on (none made
to be discarded). The shards are uneven (5 over 2 workers), so the workers'
shares differ and the epochs must still end together.
"""

import collections
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import ray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "mwms_worker.py")
NAMESPACE = "tfray-multi-worker-test"
NUM_WORKERS = 2
SHARDS = 5  # Uneven over 2 workers (shards 0, 2, 4 and 1, 3): epochs must still end together.
BATCHES_PER_SHARD = 2
ROWS = 4
EPOCHS = 2
WORKER_TIMEOUT = 200  # Seconds for both workers to finish; TF and Ray start slowly on 2 cores.


@ray.remote(num_cpus=0)
class Ledger:
    """Batch ids made by each worker's producers and trained on by its model."""

    def __init__(self):
        self._epoch = {}  # Ray job id of a trainer -> (worker, epoch) it is in.
        self._made = collections.defaultdict(list)  # (worker, epoch) -> ids.
        self._used = {}  # (worker, epoch) -> ids, one per row trained on.

    def epoch_begins(self, job, worker, epoch):
        self._epoch[job] = (worker, epoch)

    def produced(self, job, batch_id):
        self._made[self._epoch.get(job)].append(batch_id)

    def consumed(self, worker, epoch, ids):
        self._used[(worker, epoch)] = ids

    def report(self):
        return dict(self._made), dict(self._used)


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _run_workers(loop, tmp_path, source, shards, batches_per_shard):
    """Runs the workers to the end; returns the ledger's (made, used)."""
    ledger_name = f"ledger-{loop}"
    ledger = Ledger.options(name=ledger_name, namespace=NAMESPACE).remote()
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(NUM_WORKERS)]}
    config = dict(
        address=ray.get_runtime_context().gcs_address,
        namespace=NAMESPACE,
        ledger=ledger_name,
        loop=loop,
        source=source,
        shards=shards,
        batches_per_shard=batches_per_shard,
        rows=ROWS,
        epochs=EPOCHS,
    )
    procs, logs = [], []
    try:
        for index in range(NUM_WORKERS):
            env = dict(
                os.environ,
                TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
                CUDA_VISIBLE_DEVICES="",
                TF_USE_LEGACY_KERAS="1",  # Keras 3's fit fails under MWMS.
                TF_CPP_MIN_LOG_LEVEL="2",
            )
            log = open(tmp_path / f"worker{index}.log", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, json.dumps(config)], env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
        deadline = time.monotonic() + WORKER_TIMEOUT
        for index, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {index} did not finish in {WORKER_TIMEOUT} s:\n{_tail(logs[index])}")
            assert code == 0, f"worker {index} exited with {code}:\n{_tail(logs[index])}"
        return ray.get(ledger.report.remote())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
        ray.kill(ledger)


def _tail(log, chars=6000):
    log.flush()
    log.seek(0)
    return log.read()[-chars:]


def _check_epochs(made, used, num_batches, producers):
    """Asserts coverage (and, with producers, no waste).

    Returns:
        ``(epoch, worker, batches produced, batches consumed)`` tuples.
    """
    everything = collections.Counter({i: ROWS for i in range(num_batches)})
    assert None not in made, f"batches made outside any epoch: {made[None]}"
    figures = []
    for epoch in range(EPOCHS):
        rows = [collections.Counter(used[(w, epoch)]) for w in range(NUM_WORKERS)]
        ids = [set(r) for r in rows]
        assert not ids[0] & ids[1], f"epoch {epoch}: both workers trained on {ids[0] & ids[1]}"
        assert sum(rows, collections.Counter()) == everything, f"epoch {epoch}: rows trained on {rows}"
        for w in range(NUM_WORKERS):
            produced = sorted(made.get((w, epoch), []))
            if producers:
                # Exactly this worker's batches, each made once: none to discard.
                assert produced == sorted(ids[w]), f"epoch {epoch}, worker {w}: made {produced}, trained on {ids[w]}"
            figures.append((epoch, w, len(produced), len(ids[w])))
    return figures


# (loop, source): the first two run by default; together they cover fit and
# a custom loop, TF_CONFIG and input_context, generators and refs.
CASES = [
    ("fit", "generators"),
    ("loop", "refs"),
    pytest.param("fit", "refs", marks=pytest.mark.slow),
    pytest.param("loop", "generators", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("loop, source", CASES)
def test_workers_read_disjoint_complete_shares(loop, source, tmp_path):
    """Under MWMS, workers read disjoint shares that cover each epoch, and end it together.

    Generator producers make only their worker's batches. ``fit``: tf_keras ``model.fit(ds)``, sharded by TF_CONFIG (the dataset
    goes through ``experimental_distribute_dataset``). ``loop``:
    ``strategy.run`` over ``distribute_datasets_from_function``, sharded by
    its ``InputContext``.
    """
    per_shard = BATCHES_PER_SHARD if source == "generators" else 1  # A ref is a shard.
    made, used = _run_workers(loop, tmp_path, source, SHARDS, per_shard)
    figures = _check_epochs(made, used, SHARDS * per_shard, producers=source == "generators")
    # Worker i reads shards i::2 (3 and 2 of them): uneven shares, each whole.
    shares = [len(range(SHARDS)[w::NUM_WORKERS]) * per_shard for w in range(NUM_WORKERS)]
    assert [c for _, _, _, c in figures] == shares * EPOCHS
    for epoch, worker, produced, consumed in figures:
        print(f"{loop}/{source}: epoch {epoch} worker {worker}: produced {produced} batches, consumed {consumed}")
