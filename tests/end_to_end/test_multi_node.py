"""Multi-node Ray: batches made on one node are consumed on another.

A two-node ``ray.cluster_utils.Cluster`` on this machine: the driver's node
(the head) and a producer node, each with its own object store. Producers
are placed on the producer node by a custom resource, so every batch the
driver's tfray dataset reads has to be pulled by Ray into the driver node's
store first; the zero-copy path must then hold there.
"""

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import two_node_cluster, wait_until
from support.dlpack_util import assert_zero_copy, data_pointer

import tfray

pytestmark = pytest.mark.timeout(180, method="thread")  # A hang may sit in native code.

STORE_BYTES = 100 * 1024 * 1024
PRODUCER = "tfray_test_producer"  # The custom resource only the producer node has.
SHAPE = (256, 256)  # 256 KB of float32: above Ray's inline limit, so in plasma.


@pytest.fixture(scope="module")
def cluster():
    """A head node (the driver's) and a producer node, 1 CPU each."""
    with two_node_cluster(STORE_BYTES, PRODUCER) as (cluster, _):
        yield cluster


def _copies(refs):
    """The nodes that hold a copy of each of ``refs``, as their owner knows them."""
    return [set(loc["node_ids"]) for loc in ray.experimental.get_object_locations(refs).values()]


def _node_ids(cluster):
    head = cluster.head_node.node_id
    (producer,) = [node.node_id for node in cluster.worker_nodes]
    return head, producer


def test_refs_made_on_another_node_are_pulled_and_zero_copy(cluster):
    """Task results from the producer node reach TF aliasing the driver node's copy."""
    head, producer = _node_ids(cluster)
    assert ray.get_runtime_context().get_node_id() == head

    @ray.remote(num_cpus=0, resources={PRODUCER: 1})
    def make(i):
        return {"x": np.full(SHAPE, i, np.float32), "id": np.array([i], np.int64)}

    refs = [make.remote(i) for i in range(6)]
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    # Raylets tell an owner where its objects' copies are after the fact.
    wait_until(lambda: all(_copies(refs)))
    assert all(nodes == {producer} for nodes in _copies(refs))

    ds = tfray.Dataset(refs)
    seen = []
    for i, batch in enumerate(ds):
        # ray.get maps the driver node's copy: the one tfray resolved.
        for key in ("x", "id"):
            assert data_pointer(batch[key]) == ray.get(refs[i])[key].ctypes.data, key
            assert_zero_copy(batch[key], f"{key} of batch {i}")
        assert float(batch["x"][0, 0]) == i
        seen.append(int(batch["id"][0]))
    assert seen == list(range(6))

    wait_until(lambda: all(nodes == {head, producer} for nodes in _copies(refs)))
    after = ray.experimental.get_object_locations(refs)
    (stats,) = ds.stats()
    assert stats.bytes_copied == 0 and stats.arrays_copied == 0
    assert stats.bytes_zero_copy == 6 * (np.prod(SHAPE) * 4 + 8)
    pulled = sum(loc["object_size"] for loc in after.values())
    assert pulled >= 6 * np.prod(SHAPE) * 4


def test_generators_on_another_node_feed_every_epoch_zero_copy(cluster):
    """Streaming producers on the producer node feed two epochs on the driver's node."""
    head, _ = _node_ids(cluster)

    def produce(shard):
        node = ray.get_runtime_context().get_node_id()
        for j in range(3):
            yield {
                "x": np.full(SHAPE, 10 * shard + j, np.float32),
                "remote": np.array([node != head]),
            }

    ds = tfray.Dataset.from_generators(
        produce,
        4,
        element_spec={
            "x": tf.TensorSpec((None,) + SHAPE[1:], tf.float32),
            "remote": tf.TensorSpec([None], tf.bool),
        },
        # Four producers at once: the producer node has 4 of the resource.
        ray_remote_args={"num_cpus": 0, "resources": {PRODUCER: 1}},
    )
    expected = sorted(10 * shard + j for shard in range(4) for j in range(3))
    for _ in range(2):
        got = []
        for batch in ds:
            assert bool(batch["remote"][0]), "a producer ran on the driver's node"
            for key in ("x", "remote"):  # In the driver node's store.
                assert_zero_copy(batch[key], key)
            got.append(float(batch["x"][0, 0]))
        assert sorted(got) == expected
    assert len(ds.stats()) == 2  # One per epoch.
    for stats in ds.stats():
        assert stats.batches == 12
        assert stats.bytes_copied == 0 and stats.arrays_copied == 0
        assert stats.bytes_zero_copy == 12 * (np.prod(SHAPE) * 4 + 1)
