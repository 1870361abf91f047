"""A checkpoint saved by a job of n workers continues its epoch on m, every batch once.

Each worker of a synchronous job is an iterator of its own share here
(``input_context``), all read in lockstep in this process, as
MultiWorkerMirroredStrategy's workers take a batch each per step. The chief
(worker 0) checkpoints between steps; every worker of the next job, of
another size, restores that one checkpoint, as MWMS and Ray Train do. What
the first job took and what the second delivers must be the whole epoch,
each batch once. Each generator notes what it makes, so a restore that made
a shard again from its start shows up too.
"""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf
from conftest import without_prefetch

import tfray

pytestmark = pytest.mark.timeout(300)

SHARDS = 7
SPEC = {"id": tf.TensorSpec([None], tf.int64)}


def _per_shard(shard):
    return 6 + shard % 3  # Shards of three lengths; several bundles each.


def _shard_function(made_dir):
    """A generator function that takes ``start`` and notes what it makes (a closure: pickled by value)."""

    def elastic_shard(shard, start=0):
        for j in range(start, 6 + shard % 3):  # _per_shard's, inline: this closure goes by value.
            with open(os.path.join(made_dir, f"made-{shard}"), "a") as f:
                f.write(f"{j}\n")
            yield {"id": np.full((2,), 100 * shard + j, np.int64)}

    return elastic_shard


def _made(made_dir):
    made = collections.Counter()
    for name in os.listdir(made_dir):
        shard = int(name.split("-")[1])
        with open(os.path.join(made_dir, name)) as f:
            made.update(100 * shard + int(j) for j in f.read().split())
    return made


def _workers(fn, n):
    """The iterators of a job of ``n`` workers, each over its own share."""
    iterators = []
    for i in range(n):
        context = tf.distribute.InputContext(num_input_pipelines=n, input_pipeline_id=i)
        ds = tfray.Dataset.from_generators(fn, SHARDS, element_spec=SPEC, deterministic=True, input_context=context)
        iterators.append(iter(without_prefetch(ds)))
    return iterators


def _steps(iterators, steps):
    """Each worker takes a batch a step, in lockstep; returns the ids taken."""
    return [int(next(it)["id"][0]) for _ in range(steps) for it in iterators]


@pytest.mark.parametrize(("before", "after", "steps"), [(3, 2, 4), (2, 3, 5), (3, 3, 3), (2, 1, 6)])
def test_every_batch_once_across_an_elastic_restore(ray_session, tmp_path, before, after, steps):
    saving, restored = tmp_path / "saving", tmp_path / "restored"
    saving.mkdir()
    restored.mkdir()
    path = str(tmp_path / "ckpt")
    job = _workers(_shard_function(str(saving)), before)
    taken = _steps(job, steps)
    tf.train.Checkpoint(iterator=job[0]).write(path)  # The chief's.
    del job
    rest = []
    for it in _workers(_shard_function(str(restored)), after):
        tf.train.Checkpoint(iterator=it).read(path).assert_consumed()
        rest += [int(b["id"][0]) for b in it]
    epoch = [100 * s + j for s in range(SHARDS) for j in range(_per_shard(s))]
    assert sorted(taken + rest) == epoch, collections.Counter(taken + rest) - collections.Counter(epoch)
    # The second job made what was left: no shard from its start again.
    assert _made(str(restored)) == collections.Counter(rest)


def test_same_worker_count_resumes_each_share_in_order(ray_session, tmp_path):
    """With as many workers as before, each share goes on as its uninterrupted epoch would."""
    made = str(tmp_path)
    fn = _shard_function(made)
    whole = [[int(b["id"][0]) for b in it] for it in _workers(fn, 2)]
    path = str(tmp_path / "ckpt")
    job = _workers(fn, 2)
    _steps(job, 4)
    tf.train.Checkpoint(iterator=job[0]).write(path)
    del job
    for i, it in enumerate(_workers(fn, 2)):
        tf.train.Checkpoint(iterator=it).read(path).assert_consumed()
        assert [int(b["id"][0]) for b in it] == whole[i][4:]
