"""sharding="auto": which share a process reads, and tf.data auto-shard policies on top.

One process plays a worker of a cluster through TF_CONFIG (no strategy is
started); test_multi_worker.py runs real workers.
"""

import json
import logging

import numpy as np
import pytest
import ray
import ray.data
import tensorflow as tf
from support import resolutions
from tensorflow.python.data.experimental.ops import distribute as tf_distribute

import tfray
from tfray._internal.distribute import auto as distribute

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]

POLICY = tf.data.experimental.AutoShardPolicy


def _as_worker(monkeypatch, cluster, task_type, index):
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    )


def _firsts(ds):
    return [int(t[0]) for t in ds]


@pytest.fixture
def refs():
    return [ray.put(np.full(2, i, np.int64)) for i in range(10)]


@pytest.mark.parametrize(
    "cluster, task_type, index, share",
    [
        ({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "chief", 0, (3, 0)),
        ({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "worker", 1, (3, 2)),
        ({"worker": ["w:1", "w:2"]}, "worker", 1, (2, 1)),
        ({"worker": ["w:1"]}, "worker", 0, None),
        ({"worker": ["w:1", "w:2"], "evaluator": ["e:1"]}, "evaluator", 0, None),
        ({"worker": ["w:1", "w:2"], "ps": ["p:1"]}, "ps", 0, None),
    ],
)
def test_cluster_share_numbers_workers_as_mwms_does(monkeypatch, cluster, task_type, index, share):
    """Chief first, then workers; evaluators and parameter servers read everything."""
    _as_worker(monkeypatch, cluster, task_type, index)
    assert distribute.worker_share() == share


def test_no_cluster_reads_everything(monkeypatch, refs):
    """Outside a multi-worker cluster, auto changes nothing (known cardinality too)."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    ds = tfray.Dataset(refs)
    assert ds.cardinality().numpy() == 10
    assert _firsts(ds) == list(range(10))


def test_worker_reads_its_share_at_the_source(monkeypatch):
    """Worker 2 of 3 resolves only refs 2::3 (counted as fetched), with an unknown cardinality."""
    refs = [resolutions.put(("auto", i), np.full(2, i, np.int64)) for i in range(10)]
    _as_worker(monkeypatch, {"chief": ["c:1"], "worker": ["w:1", "w:2"]}, "worker", 1)
    ds = tfray.Dataset(refs, element_spec=tf.TensorSpec([None], tf.int64))
    assert ds.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY
    assert _firsts(ds) == [2, 5, 8]
    assert sum(s.batches for s in ds.stats()) == 3
    # Counted at deserialization: a ref fetched and dropped would show here.
    fetched = {key[1]: n for key, n in resolutions.resolved().items() if key[0] == "auto"}
    assert fetched == {2: 1, 5: 1, 8: 1}, f"resolutions by ref index: {fetched}"


def test_generator_worker_runs_only_its_producers(monkeypatch):
    """A worker reads the batches of its shards index::n (element_spec inferred)."""
    _as_worker(monkeypatch, {"worker": ["w:1", "w:2"]}, "worker", 1)

    def gen(shard):
        yield np.full(1, shard, np.int64)

    assert sorted(_firsts(tfray.Dataset.from_generators(gen, 5))) == [1, 3]


def test_input_context_decides_over_tf_config(monkeypatch, refs):
    """The InputContext's pipeline share wins; sharding='off' reads everything."""
    _as_worker(monkeypatch, {"worker": ["w:1", "w:2"]}, "worker", 1)
    context = tf.distribute.InputContext(num_input_pipelines=4, input_pipeline_id=3)
    assert _firsts(tfray.Dataset(refs, input_context=context)) == [3, 7]
    assert _firsts(tfray.Dataset.from_refs(refs, sharding="off")) == list(range(10))


def test_explicit_shard_replaces_the_automatic_share(monkeypatch, refs):
    """ds.shard(n, i) splits the whole source, not the worker's share again."""
    _as_worker(monkeypatch, {"worker": ["w:1", "w:2"]}, "worker", 1)
    assert _firsts(tfray.Dataset(refs).shard(5, 0)) == [0, 5]


def test_unshardable_sources_are_read_as_given(monkeypatch, caplog):
    """Ray Data and one-shot iterators are taken as this worker's part, and it says so."""
    _as_worker(monkeypatch, {"worker": ["w:1", "w:2"]}, "worker", 0)
    caplog.set_level(logging.INFO, logger="tfray")
    ray_ds = ray.data.from_numpy(np.arange(8, dtype=np.int64).reshape(8, 1))
    ds = tfray.Dataset.from_ray_data(ray_ds, batch_size=4)
    assert sum(len(t["data"]) for t in ds) == 8
    assert "reads its RayDataSource as given, unsharded" in caplog.text
    one_shot = tfray.Dataset(iter([ray.put(np.zeros(2)) for _ in range(3)]))
    assert len(list(one_shot)) == 3
    assert "reads its RefsSource as given" in caplog.text


def test_bad_options_say_what_to_do(refs):
    """Unknown modes, a wrong input_context, and input_context with 'off'."""
    with pytest.raises(ValueError, match="sharding: expected one of 'auto', 'off', 'dynamic'"):
        tfray.Dataset(refs, sharding="files")
    with pytest.raises(TypeError, match="InputContext"):
        tfray.Dataset(refs, input_context=(2, 0))
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0)
    with pytest.raises(ValueError, match="pass sharding='auto' with it"):
        tfray.Dataset(refs, sharding="off", input_context=context)


def _policy(policy):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return options


def test_file_policy_on_a_share_becomes_off(monkeypatch, refs, caplog):
    """FILE cannot shard tfray (no files); on a share it is replaced by OFF, with a warning."""
    _as_worker(monkeypatch, {"worker": ["w:1", "w:2"]}, "worker", 1)
    options = _policy(POLICY.FILE)
    ds = tfray.Dataset(refs).with_options(options)
    assert ds.options().experimental_distribute.auto_shard_policy == POLICY.OFF
    assert options.experimental_distribute.auto_shard_policy == POLICY.FILE  # The caller's is untouched.
    assert "tfray already reads only worker 1's share of 2" in caplog.text
    assert _firsts(tf_distribute._AutoShardDataset(ds, 2, 1)) == [1, 3, 5, 7, 9]


def test_file_policy_without_a_share_becomes_off_and_says_how_to_split(monkeypatch, refs, caplog):
    """Where tfray does not split the source, FILE becomes OFF too, with how to split it."""
    _as_worker(monkeypatch, {"worker": ["w:1", "w:2"]}, "worker", 0)
    ds = tfray.Dataset(refs, sharding="off").with_options(_policy(POLICY.FILE))
    assert ds.options().experimental_distribute.auto_shard_policy == POLICY.OFF
    assert "to split it among workers use sharding='auto'" in caplog.text
    assert _firsts(tf_distribute._AutoShardDataset(ds, 2, 0)) == list(range(10))


def test_file_policy_set_downstream_fails_in_tf(monkeypatch, refs):
    """What TF does with FILE set after a map (out of tfray's sight): its rewrite
    finds no file reader and fails when the dataset is distributed."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    ds = tfray.Dataset(refs).map(lambda x: x).with_options(_policy(POLICY.FILE))
    with pytest.raises(tf.errors.NotFoundError, match="Did not find a shardable source"):
        tf_distribute._AutoShardDataset(ds, 2, 0)


def test_data_policy_on_a_share_warns(monkeypatch, refs, caplog):
    """DATA on top of a share drops (n-1)/n of it: applied as asked, with a warning."""
    _as_worker(monkeypatch, {"worker": ["w:1", "w:2"]}, "worker", 0)
    ds = tfray.Dataset(refs).with_options(_policy(POLICY.DATA))
    assert "drop all but 1/2 of it" in caplog.text
    assert _firsts(tf_distribute._AutoShardDataset(ds, 2, 0)) == [0, 4, 8]  # A quarter.
    caplog.clear()
    tfray.Dataset(refs, sharding="off").with_options(_policy(POLICY.DATA))
    assert "auto_shard_policy" not in caplog.text  # TF's own sharding, as chosen.


def test_auto_policy_downstream_keeps_tfrays_off(refs):
    """Setting AUTO (the default) downstream does not undo the source's OFF."""
    ds = tfray.Dataset(refs, sharding="off").map(lambda x: x).with_options(_policy(POLICY.AUTO))
    assert ds.options().experimental_distribute.auto_shard_policy == POLICY.OFF
    assert _firsts(tf_distribute._AutoShardDataset(ds, 2, 0)) == list(range(10))
