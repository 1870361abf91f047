"""Two real MultiWorkerMirroredStrategy workers on loopback, fed by tfray.

Each test starts two worker processes (mwms_worker.py) with TF_CONFIG on
127.0.0.1 ports; both join this module's Ray. Their producers record every
batch they make, and their models every batch they train on, in the ledger
actor of examples/multi_worker.py. Per epoch: the workers' batches are
disjoint and cover the data, and each worker's producers made exactly the
batches it trained on (none made to be discarded). The shares are uneven
(5 shards over 2 workers), so the epochs must end together all the same.
"""

import json
import os
import sys

import pytest
import ray

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
import multi_worker  # noqa: E402

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "mwms_worker.py")
NUM_WORKERS = 2
SHARDS = 5  # Worker 0 reads shards 0, 2, 4; worker 1 shards 1, 3.
ROWS = 4
EPOCHS = 2
WORKER_TIMEOUT = 200  # Seconds for both workers; TF and Ray start slowly on 2 shared cores.

# (loop, source): the first two run by default (10 to 25 s each on 2 shared
# cores) and between them cover fit and a custom loop, TF_CONFIG and an
# InputContext, generators and refs; `make test-all` adds the others.
CASES = [
    ("fit", "generators"),
    ("loop", "refs"),
    pytest.param("fit", "refs", marks=pytest.mark.slow),
    pytest.param("loop", "generators", marks=pytest.mark.slow),
    pytest.param("loop-ds", "generators", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("loop, source", CASES)
def test_workers_read_disjoint_complete_shares(loop, source, tmp_path):
    """Under MWMS, workers read disjoint shares that cover each epoch, and end it together.

    Generator producers make only their worker's batches. ``fit``: tf_keras
    ``model.fit(ds)``, sharded by TF_CONFIG (the dataset goes through
    ``experimental_distribute_dataset``). ``loop``: ``strategy.run`` over
    ``distribute_datasets_from_function``, sharded by its ``InputContext``.
    ``loop-ds``: ``strategy.run`` over ``experimental_distribute_dataset``.
    """
    per_shard = 2 if source == "generators" else 1  # A ref is a shard of one batch.
    config = dict(
        address=ray.get_runtime_context().gcs_address,
        loop=loop,
        source=source,
        shards=SHARDS,
        batches_per_shard=per_shard,
        rows=ROWS,
        epochs=EPOCHS,
        # fit learns the generators' spec: the epoch that learns it is the
        # first one, and the ledger shows nothing made twice.
        learn_spec=loop == "fit",
    )
    book = multi_worker.ledger()
    try:
        results = multi_worker.run_workers(
            [sys.executable, WORKER, json.dumps(config)],
            NUM_WORKERS,
            timeout=WORKER_TIMEOUT,
            log_dir=tmp_path,
        )
        for index, (code, output) in enumerate(results):
            assert code == 0, f"worker {index} exited with {code} (None: timed out):\n{output[-6000:]}"
        made, used = ray.get(book.report.remote())
    finally:
        ray.kill(book)

    problems, figures = multi_worker.check_epochs(
        made,
        used,
        num_workers=NUM_WORKERS,
        num_batches=SHARDS * per_shard,
        epochs=EPOCHS,
        rows=ROWS,
        producers=source == "generators",
    )
    assert problems == []
    # Uneven shares, each read whole: 3 and 2 shards.
    shares = [len(range(SHARDS)[w::NUM_WORKERS]) * per_shard for w in range(NUM_WORKERS)]
    assert [consumed for _, _, _, consumed in figures] == shares * EPOCHS
    for epoch, worker, produced, consumed in figures:
        print(
            f"{loop}/{source}: epoch {epoch} worker {worker}: produced {produced} batches, consumed {consumed}"
        )
