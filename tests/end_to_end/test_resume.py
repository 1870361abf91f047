"""A restored epoch makes only what is left, in the order an uninterrupted epoch delivers it.

The checkpoint holds, per shard, what the iterator handed out (and where in
its bundle the last batch was); the resumed epoch's producers start each
shard there. Each generator here writes a line per batch it makes to a file
of its shard, so a resume that made the epoch again (or a shard from its
start) shows up in the count, whatever reaches TensorFlow. Shards outnumber
the producers that run at once, so the rotation a restore rebuilds includes
shards that ended and shards that took their places.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
from conftest import without_prefetch

import tfray

pytestmark = pytest.mark.timeout(240)

SHARDS = 5
PER_SHARD = 13  # Bundles of 1, 2, 4 and 6 batches: positions fall inside them.
SPEC = {"id": tf.TensorSpec([None], tf.int64)}


def _shard_function(made_dir, *, takes_start):
    """A shard generator function that notes each batch it makes (a closure: Ray pickles it by value)."""
    per_shard = PER_SHARD

    def made(shard, start):
        path = os.path.join(made_dir, f"made-{shard}")
        for j in range(start, per_shard - shard % 2):  # Shards of two lengths.
            with open(path, "a") as f:
                f.write(f"{j}\n")
            yield {"id": np.full((2,), 100 * shard + j, np.int64)}

    def shard_batches(shard, start=0):
        yield from made(shard, start)

    def plain(shard):
        yield from made(shard, 0)

    return shard_batches if takes_start else plain


def _starting(made_dir):
    return _shard_function(made_dir, takes_start=True)


def _plain(made_dir):
    return _shard_function(made_dir, takes_start=False)


def _made(made_dir):
    """Batches made so far, in all shards."""
    total = 0
    for name in os.listdir(made_dir):
        with open(os.path.join(made_dir, name)) as f:
            total += len(f.read().split())
    return total


def _ids(values):
    return [int(v["id"][0]) for v in values]


def _dataset(fn, deterministic=True):
    ds = tfray.Dataset.from_generators(fn, SHARDS, element_spec=SPEC, deterministic=deterministic)
    return without_prefetch(ds)


def _save_after(ds, k, path):
    it = iter(ds)
    read = [next(it) for _ in range(k)]
    tf.train.Checkpoint(iterator=it).write(path)
    return _ids(read)


def _restore(ds, path):
    it = iter(ds)
    tf.train.Checkpoint(iterator=it).read(path).assert_consumed()
    return _ids(it)


@pytest.fixture(scope="module")
def expected(ray_session, tmp_path_factory):
    made_dir = str(tmp_path_factory.mktemp("made"))
    ids = _ids(_dataset(_starting(made_dir)))
    assert sorted(ids) == sorted(100 * s + j for s in range(SHARDS) for j in range(PER_SHARD - s % 2))
    assert _made(made_dir) == len(ids)
    return ids


@pytest.fixture
def dirs(tmp_path):
    """Where the saving run and the restored run note what they make (apart: the saving run's
    producers may make a batch more while they stop), and the checkpoint's path."""
    saving, restored = tmp_path / "saving", tmp_path / "restored"
    saving.mkdir()
    restored.mkdir()
    return str(saving), str(restored), str(tmp_path / "ckpt")


@pytest.mark.parametrize("k", [1, 2, 5, 9, 16, 30, 44, 58, 62])
def test_resume_makes_only_what_is_left_in_order(expected, dirs, k):
    """A shard function that takes ``start`` makes exactly the batches not yet delivered."""
    saving, restored, path = dirs
    read = _save_after(_dataset(_starting(saving)), k, path)
    rest = _restore(_dataset(_starting(restored)), path)
    assert read + rest == expected
    assert _made(restored) == len(expected) - k


def test_plain_generator_resumes_in_order(expected, dirs):
    """A generator without ``start`` is run from the shard's start and passed over in its producer."""
    saving, restored, path = dirs
    read = _save_after(_dataset(_plain(saving)), 30, path)
    rest = _restore(_dataset(_plain(restored)), path)
    assert read + rest == expected
    # Shards that ended before the position are not run again.
    assert _made(restored) < len(expected)


def test_resume_twice_continues_the_same_epoch(expected, dirs, tmp_path):
    """A checkpoint of a resumed epoch holds the whole epoch's progress, not the resumed part's."""
    saving, restored, first = dirs
    second = str(tmp_path / "second")
    read = _save_after(_dataset(_starting(saving)), 7, first)
    it = iter(_dataset(_starting(saving)))
    tf.train.Checkpoint(iterator=it).read(first).assert_consumed()
    read += _ids(next(it) for _ in range(20))
    tf.train.Checkpoint(iterator=it).write(second)
    del it
    rest = _restore(_dataset(_starting(restored)), second)
    assert read + rest == expected
    assert _made(restored) == len(expected) - 27


def test_first_ready_interleave_resumes_every_batch_once(expected, dirs):
    """With ``deterministic=False`` the order may differ; each batch still comes once."""
    saving, restored, path = dirs
    read = _save_after(_dataset(_starting(saving), deterministic=False), 25, path)
    rest = _restore(_dataset(_starting(restored), deterministic=False), path)
    assert sorted(read + rest) == sorted(expected)
    assert _made(restored) == len(expected) - 25


def test_checkpoint_of_other_shards_is_refused(expected, dirs):
    """Progress naming shards this dataset does not have fails the restore's first read."""
    saving, restored, path = dirs
    _save_after(_dataset(_starting(saving)), 30, path)
    fewer = without_prefetch(tfray.Dataset.from_generators(_starting(restored), 2, element_spec=SPEC))
    it = iter(fewer)
    tf.train.Checkpoint(iterator=it).read(path).assert_consumed()
    with pytest.raises(tf.errors.FailedPreconditionError, match="shard"):
        next(it)


def _share(fn, index):
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=index)
    ds = tfray.Dataset.from_generators(fn, SHARDS, element_spec=SPEC, deterministic=True, input_context=context)
    return without_prefetch(ds)


def test_a_worker_restoring_the_chiefs_checkpoint_resumes_its_own_share(ray_session, dirs):
    """Under a synchronous multi-worker job each worker restores the chief's checkpoint.

    Worker 1's share stands at the chief's position of its own epoch; its own
    checkpoint would start each of its shards where they were.
    """
    saving, restored, path = dirs
    share = _ids(_share(_starting(saving), 1))
    _save_after(_share(_starting(saving), 0), 9, path)
    assert _restore(_share(_starting(restored), 1), path) == share[9:]
    _save_after(_share(_starting(saving), 1), 9, path)
    assert _restore(_share(_starting(restored), 1), path) == share[9:]
