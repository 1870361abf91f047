"""Ray Train: TensorflowTrainer workers fit under MWMS from tfray over their Ray Data shards.

Runs examples/ray_train_mwms.py's training with 2 workers. Every row
carries its id and each worker reports the ids its model trained on, so the
test sees, per epoch, that the workers' parts are disjoint and cover the
dataset: Ray Train split the rows, tfray read each worker's part whole, and
tf.data's auto-shard did not shard it again by DATA (that would drop half of
each part).
"""

import os
import sys

import pytest
from ray import cloudpickle

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
import ray_train_mwms  # noqa: E402

# By value: Ray Train's workers cannot import the examples directory.
cloudpickle.register_pickle_by_value(ray_train_mwms)

# Ray Train starts a controller, its workers and TensorFlow in each: 75-115 s
# with other work on the machine, and over 240 s (its worker group alone took
# 3 minutes to start) when that work was several times its 2 cores. Slow: the
# default CI run has `make examples-quick` run the same training and check.
pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600, method="thread"), pytest.mark.slow]

ROWS, BATCH, EPOCHS = 512, 64, 2


def test_two_workers_fit_on_disjoint_halves_covering_every_row(tmp_path):
    """Per epoch: disjoint, complete coverage; tfray delivered every batch whole; the loss fell."""
    reports = ray_train_mwms.run(rows=ROWS, batch_size=BATCH, epochs=EPOCHS, storage_path=str(tmp_path))

    assert ray_train_mwms.check(reports, rows=ROWS, epochs=EPOCHS, batch_size=BATCH) == []
    # Blocks of a few KB come back inline, in the heap: every byte is Ray
    # Data's copy (test_ray_data_zero_copy.py has a shard of big blocks
    # reach TF zero-copy).
    assert all(report["bytes_copied"] > 0 for report in reports.values())


def test_a_worker_that_dies_mid_epoch_resumes_with_every_batch_once(tmp_path):
    """examples/ray_train_resume.py: a restart from the chief's checkpoint trains on each batch once."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))
    import ray_train_resume

    cloudpickle.register_pickle_by_value(ray_train_resume)
    assert ray_train_resume.check(ray_train_resume.run(str(tmp_path))) == []
