"""Iterator checkpoints: a restored iterator continues with the next batch.

Each source is rebuilt before restoring (as a program that restarts does),
so these tests also show that the checkpoint holds a position, not a
pointer into this process.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import ray_data_in_order, without_prefetch
from support import resolutions, resume_worker
from tensorflow.python.data.kernel_tests import checkpoint_test_base

import tfray

N = 12


def _ids(values):
    return [int(np.asarray(v["id"]).reshape(-1)[0]) for v in values]


def _save_after(ds, k, path):
    """Reads ``k`` elements, checkpoints the iterator; returns what it read."""
    it = iter(ds)
    read = [next(it) for _ in range(k)]
    tf.train.Checkpoint(iterator=it).write(path)
    return read


def _restore(ds, path):
    it = iter(ds)
    tf.train.Checkpoint(iterator=it).read(path).assert_consumed()
    return list(it)


@pytest.fixture(scope="module")
def refs(ray_session):
    return [ray.put({"id": np.full((4,), i, np.int64)}) for i in range(N)]


@pytest.mark.parametrize("k", [0, 1, 5, N - 1, N])
def test_refs_resume_after_k(refs, tmp_path, k):
    path = str(tmp_path / "ckpt")
    read = _save_after(tfray.Dataset.from_refs(refs), k, path)
    rest = _restore(tfray.Dataset.from_refs(refs), path)
    assert _ids(read) + _ids(rest) == list(range(N))


def test_refs_resume_through_map_and_prefetch(refs, tmp_path):
    # tf.data saves what prefetch had buffered; tfray resumes after it.
    def pipeline():
        ds = tfray.Dataset.from_refs(refs).map(lambda b: {"id": b["id"] * 10})
        return ds.prefetch(4)

    path = str(tmp_path / "ckpt")
    read = _save_after(pipeline(), 3, path)
    rest = _restore(pipeline(), path)
    assert _ids(read) + _ids(rest) == [10 * i for i in range(N)]


def test_exhausted_iterator_restores_exhausted(refs, tmp_path):
    path = str(tmp_path / "ckpt")
    it = iter(tfray.Dataset.from_refs(refs))
    assert len(list(it)) == N
    tf.train.Checkpoint(iterator=it).write(path)
    assert _restore(tfray.Dataset.from_refs(refs), path) == []


def test_restore_replays_from_its_position_not_an_epoch_offered_ahead(refs, tmp_path):
    # A dataset read twice has its next epoch started ahead; a restored
    # iterator must not take it, as it starts at the beginning.
    path = str(tmp_path / "ckpt")
    ds = tfray.Dataset.from_refs(refs)
    assert _ids(_save_after(ds, 4, path)) == list(range(4))
    for _ in range(2):  # The second full epoch's end offers the next.
        assert _ids(list(ds)) == list(range(N))
    assert _ids(_restore(ds, path)) == list(range(4, N))
    assert _ids(list(ds)) == list(range(N))  # The offer, still there.


def test_restore_into_a_different_dataset_is_refused(refs, tmp_path):
    path = str(tmp_path / "ckpt")
    _save_after(tfray.Dataset.from_refs(refs), 2, path)
    with pytest.raises(tf.errors.FailedPreconditionError, match="12 batches, but this one has 5"):
        _restore(tfray.Dataset.from_refs(refs[:5]), path)


def test_one_shot_iterator_resumes(refs, tmp_path):
    path = str(tmp_path / "ckpt")
    read = _save_after(tfray.Dataset.from_refs(iter(refs)), 4, path)
    rest = _restore(tfray.Dataset.from_refs(iter(refs)), path)
    assert _ids(read) + _ids(rest) == list(range(N))


def test_restored_iterator_resolves_no_skipped_batch(ray_session, tmp_path):
    """A restored iterator fetches only the refs from its saved position on, once each.

    (Without tf.data's injected prefetch, whose buffer the checkpoint would
    hold.) The restored dataset's refs count their resolutions: one fetched
    and dropped would show up even though it is never delivered.
    """

    def counted_refs(name):
        return [ray.put({"id": resolutions.counted((name, i), np.full((4,), i, np.int64))}) for i in range(N)]

    spec = {"id": tf.TensorSpec([None], tf.int64)}
    path = str(tmp_path / "ckpt")
    _save_after(without_prefetch(tfray.Dataset.from_refs(counted_refs("saved"), element_spec=spec)), 7, path)
    ds = tfray.Dataset.from_refs(counted_refs("restored"), element_spec=spec)
    assert _ids(_restore(without_prefetch(ds), path)) == list(range(7, N))
    restored = {key[1]: n for key, n in resolutions.resolved().items() if key[0] == "restored"}
    assert restored == {i: 1 for i in range(7, N)}, f"resolutions by ref index: {restored}"
    assert [s.batches for s in ds.stats()] == [N - 7]


def _counting():
    """A generator function (a closure, so Ray pickles it by value)."""

    def shard_batches(shard):
        for j in range(4):
            yield {"id": np.full((2,), 100 * shard + j, np.int64)}

    return shard_batches


def test_generators_resume_in_deterministic_mode(ray_session, tmp_path):
    def make():
        return tfray.Dataset.from_generators(_counting(), 3, deterministic=True)

    expected = _ids(list(make()))
    assert sorted(expected) == sorted(100 * s + j for s in range(3) for j in range(4))
    path = str(tmp_path / "ckpt")
    read = _save_after(make(), 5, path)
    rest = _restore(make(), path)
    assert _ids(read) + _ids(rest) == expected


def test_tf_data_resumes_in_deterministic_mode(ray_session, tmp_path):
    def pipeline(shard):
        ids = tf.data.Dataset.range(100 * shard, 100 * shard + 4)
        return ids.map(lambda i: {"id": tf.fill([2], i)})

    def make():
        return tfray.Dataset.from_tf_data(pipeline, 3, deterministic=True, ray_remote_args={"num_cpus": 0})

    expected = _ids(list(make()))
    assert sorted(expected) == sorted(100 * s + j for s in range(3) for j in range(4))
    path = str(tmp_path / "ckpt")
    read = _save_after(make(), 5, path)
    rest = _restore(make(), path)
    assert _ids(read) + _ids(rest) == expected


@pytest.fixture
def ordered_ray_data():
    with ray_data_in_order():
        yield


def test_ray_data_resumes_when_order_is_preserved(ray_session, ordered_ray_data, tmp_path):
    import ray.data

    def make():
        data = ray.data.range(40, override_num_blocks=4)
        return tfray.Dataset.from_ray_data(data, batch_size=4)

    path = str(tmp_path / "ckpt")
    read = _save_after(make(), 3, path)
    rest = _restore(make(), path)
    rows = [int(x) for batch in read + rest for x in batch["id"]]
    assert rows == list(range(40))


@pytest.mark.usefixtures("ray_session")
class TfrayCheckpointTest(checkpoint_test_base.CheckpointTestBase):
    """TensorFlow's own iterator checkpoint harness, on tfray sources (eager)."""

    def _refs_ds(self):
        refs = [ray.put(np.arange(3, dtype=np.float32) + i) for i in range(10)]
        return lambda: tfray.Dataset.from_refs(refs)

    def _generators_ds(self):
        return lambda: tfray.Dataset.from_generators(_counting(), 2, deterministic=True)

    def _check(self, ds_fn, num_outputs):
        self.verify_unused_iterator(ds_fn, num_outputs)
        self.verify_fully_used_iterator(ds_fn, num_outputs)
        self.verify_exhausted_iterator(ds_fn, num_outputs)
        self.verify_multiple_breaks(ds_fn, num_outputs, num_breaks=4)

    def test_from_refs(self):
        self._check(self._refs_ds(), 10)

    def test_from_generators(self):
        self._check(self._generators_ds(), 8)


WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "resume_worker.py")
PROCESS_TIMEOUT = 150  # Seconds per training process; TF and Ray start slowly on 2 shared cores.


def _train(mode, kill_at, tmp_path):
    """Runs resume_worker.py once; returns its exit status and its log so far."""
    log = tmp_path / "log.jsonl"
    config = dict(
        address=ray.get_runtime_context().gcs_address,
        mode=mode,
        kill_at=kill_at,
        ckpt_dir=str(tmp_path / "ckpt"),
        log=str(log),
    )
    before = len(log.read_text().splitlines()) if log.exists() else 0
    process = subprocess.run(
        [sys.executable, WORKER, json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
    )
    records = [json.loads(line) for line in log.read_text().splitlines()[before:]]
    return process.returncode, records, process.stderr[-4000:]


def _expected_epoch():
    """One uninterrupted epoch of resume_worker's data, in its deterministic order."""
    ds = tfray.Dataset.from_generators(
        resume_worker.batches(), resume_worker.SHARDS, element_spec=resume_worker.SPEC, deterministic=True
    )
    ids = [int(b["id"][0]) for b in ds]
    assert sorted(ids) == sorted(100 * s + j for s in range(resume_worker.SHARDS) for j in range(resume_worker.PER_SHARD))
    return ids


def test_killed_training_loop_resumes_mid_epoch(ray_session, tmp_path):
    """A process killed mid-epoch resumes from its checkpoint, none lost, none repeated.

    Steps after the last checkpoint are trained again after the restart (as
    with any checkpoint); what the checkpoint covered is not.
    """
    kill_at = 17  # In the second epoch, two steps after the checkpoint at 15.
    code, first, err = _train("loop", kill_at, tmp_path)
    assert code == resume_worker.KILLED, err
    code, second, err = _train("loop", -1, tmp_path)
    assert code == 0, err

    saved = max(r["step"] for r in first if r["event"] == "saved")
    assert saved == 15
    assert second[0] == {"event": "restored", "step": saved}
    covered = [r["id"] for r in first if r["event"] == "trained" and r["step"] <= saved]
    resumed = [r["id"] for r in second if r["event"] == "trained"]
    assert covered + resumed == _expected_epoch() * resume_worker.EPOCHS
    assert [r["step"] for r in second if r["event"] == "trained"][0] == saved + 1


def test_killed_keras_fit_resumes_at_its_epoch(ray_session, tmp_path):
    """Keras BackupAndRestore resumes at the interrupted epoch; tfray serves it whole.

    (Keras restores model and epoch, not the input position: the interrupted
    epoch is trained again from its first batch.)
    """
    per_epoch = resume_worker.SHARDS * resume_worker.PER_SHARD
    code, first, err = _train("fit", per_epoch + 5, tmp_path)
    assert code == resume_worker.KILLED, err
    assert [r["epoch"] for r in first if r["event"] == "epoch_end"] == [0]
    code, second, err = _train("fit", -1, tmp_path)
    assert code == 0, err
    ends = [r for r in second if r["event"] == "epoch_end"]
    assert [r["epoch"] for r in ends] == [1, 2]
    assert [r["batches"] for r in ends] == [per_epoch, per_epoch]
    # The restored weights carried on: the resumed run starts where the first left off.
    first_loss = [r["loss"] for r in first if r["event"] == "epoch_end"][0]
    assert ends[-1]["loss"] < first_loss


def test_save_while_get_next_waits_for_a_batch(ray_session, tmp_path):
    """A checkpoint taken while GetNext waits on an empty channel does not wait for it.

    It saves the position before the awaited batch, which a restored iterator
    then delivers first.
    """
    import threading
    import time

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self):
            self.open = False

        def release(self):
            self.open = True

        def is_open(self):
            return self.open

    gate = Gate.remote()

    def gen(shard):
        yield {"id": np.full((4,), 0, np.int64)}
        while not ray.get(gate.is_open.remote()):
            time.sleep(0.05)
        yield {"id": np.full((4,), 1, np.int64)}

    spec = {"id": tf.TensorSpec([4], tf.int64)}
    ds = without_prefetch(tfray.Dataset.from_generators(gen, 1, element_spec=spec))
    it = iter(ds)
    assert _ids([next(it)]) == [0]
    waiting = threading.Thread(target=lambda: next(it), daemon=True)
    waiting.start()
    time.sleep(0.5)  # GetNext is now blocked on the empty channel.
    assert waiting.is_alive()
    path = str(tmp_path / "ckpt")
    saved = threading.Thread(target=lambda: tf.train.Checkpoint(iterator=it).write(path), daemon=True)
    saved.start()
    saved.join(timeout=20)
    blocked = saved.is_alive()
    ray.get(gate.release.remote())
    waiting.join(timeout=30)
    assert not blocked, "Save waited for the blocked GetNext"
    restored = iter(without_prefetch(tfray.Dataset.from_generators(gen, 1, element_spec=spec)))
    tf.train.Checkpoint(iterator=restored).read(path).assert_consumed()
    assert _ids(list(restored)) == [1]
