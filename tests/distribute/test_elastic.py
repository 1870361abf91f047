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
import gc
import os
import threading

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


def _workers(fn, n, dynamic=None):
    """The iterators of a job of ``n`` workers: each over its own share, or (``dynamic``: a name) units it is handed."""
    iterators = []
    for i in range(n):
        if dynamic is None:
            context = tf.distribute.InputContext(num_input_pipelines=n, input_pipeline_id=i)
            options = dict(input_context=context)
        else:
            options = dict(sharding=tfray.DynamicSharding(name=dynamic))
        ds = tfray.Dataset.from_generators(fn, SHARDS, element_spec=SPEC, deterministic=True, **options)
        iterators.append(iter(without_prefetch(ds)))
    return iterators


def _steps(iterators, steps):
    """Each worker takes a batch a step, in lockstep; returns the ids taken."""
    return [int(next(it)["id"][0]) for _ in range(steps) for it in iterators]


def _restored_job(fn, n, path, dynamic=None):
    """Every batch a job of ``n`` workers reads after each restored ``path``, the chief's checkpoint."""
    job = _workers(fn, n, dynamic)
    for it in job:
        tf.train.Checkpoint(iterator=it).read(path).assert_consumed()
    if dynamic is None:  # Each reads its share to its end.
        return [int(b["id"][0]) for it in job for b in it]
    # Dynamic: each in a thread of its own, as workers run apart: one that
    # has run dry waits for the epoch's end, which the others' reading brings.
    reads = [[] for _ in job]
    threads = [
        threading.Thread(target=lambda it=it, out=out: out.extend(int(b["id"][0]) for b in it))
        for it, out in zip(job, reads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a worker did not reach the epoch's end"
    return [i for out in reads for i in out]


@pytest.mark.parametrize(
    ("before", "after", "steps", "dynamic"),
    [
        (3, 2, 4, None),
        (2, 3, 5, None),
        (3, 3, 3, None),
        (2, 1, 6, None),
        (3, 2, 4, "elastic-a"),
        (2, 3, 5, "elastic-b"),
    ],
)
def test_every_batch_once_across_an_elastic_restore(ray_session, tmp_path, before, after, steps, dynamic):
    saving, restored = tmp_path / "saving", tmp_path / "restored"
    saving.mkdir()
    restored.mkdir()
    path = str(tmp_path / "ckpt")
    job = _workers(_shard_function(str(saving)), before, dynamic)
    taken = _steps(job, steps)
    tf.train.Checkpoint(iterator=job[0]).write(path)  # The chief's.
    del job
    gc.collect()  # Its iterators gone: their dynamic units return to the coordinator.
    rest = _restored_job(_shard_function(str(restored)), after, path, dynamic)
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


def _forget_the_job(name="tfray-position-"):
    """Kills every JobPosition actor, as a new Ray cluster would start without them."""
    import ray

    from tfray._internal.distribute import position

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == position.NAMESPACE and actor["name"].startswith(name):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))


def test_without_the_job_position_the_same_worker_count_still_resumes(ray_session, tmp_path):
    """Each worker then resumes its own share at the chief's position: every batch once, if slower."""
    fn = _shard_function(str(tmp_path))
    path = str(tmp_path / "ckpt")
    job = _workers(fn, 2)
    taken = _steps(job, 4)
    tf.train.Checkpoint(iterator=job[0]).write(path)
    del job
    _forget_the_job()
    rest = _restored_job(fn, 2, path)
    assert sorted(taken + rest) == [100 * s + j for s in range(SHARDS) for j in range(_per_shard(s))]


def test_without_the_job_position_another_worker_count_is_refused(ray_session, tmp_path):
    fn = _shard_function(str(tmp_path))
    path = str(tmp_path / "ckpt")
    job = _workers(fn, 3)
    _steps(job, 2)
    tf.train.Checkpoint(iterator=job[0]).write(path)
    del job
    _forget_the_job()
    it = _workers(fn, 2)[1]
    tf.train.Checkpoint(iterator=it).read(path).assert_consumed()
    with pytest.raises(tf.errors.FailedPreconditionError, match="job's position .* is gone"):
        next(it)
