"""Where producers run: nodes that offer CPUs, in proportion to them; ``producers_on`` narrows them;
producers no node can run are said, in stats and a warning, and bounded by ``placement_timeout_s``.

Clusters of several nodes on this machine (``ray.cluster_utils.Cluster``),
the head the driver's. Each producer notes its node in its batches.
"""

import collections
import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import cluster_of
from ray import cloudpickle

import tfray

# By value: the producers' processes cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(300, method="thread")

HEAD = {"include_dashboard": False}
ALL_AT_ONCE = {"num_cpus": 0}  # An epoch's producers all run together (see generators.concurrency).


def noting_its_node(shard):
    node = ray.get_runtime_context().get_node_id()
    yield {"node": np.frombuffer(bytes.fromhex(node), np.uint8)[None], "shard": np.array([shard])}


def pipeline_noting_its_node(shard):
    """A tf.data pipeline built in its producer: the node is the producer's."""
    node = ray.get_runtime_context().get_node_id()
    element = {"node": np.frombuffer(bytes.fromhex(node), np.uint8)[None], "shard": np.array([shard])}
    return tf.data.Dataset.from_tensors(element)


def producers_per_node(ds):
    """{node id: producers that ran there} over one epoch of ``ds`` (a batch per producer)."""
    return collections.Counter(bytes(b["node"].numpy()[0]).hex() for b in ds)


def test_no_producer_on_a_node_that_offers_no_cpu_and_the_rest_by_cpus():
    """A 0-CPU head (a trainer's), nodes of 1 and 2 CPUs: 6 producers go 2 and 4, every epoch."""
    with cluster_of({**HEAD, "num_cpus": 0}, {"num_cpus": 1}, {"num_cpus": 2}) as (_, nodes):
        _, one, two = (n.node_id for n in nodes)
        for ds in (
            tfray.Dataset.from_generators(noting_its_node, 6, ray_remote_args=ALL_AT_ONCE),
            tfray.Dataset.from_tf_data(pipeline_noting_its_node, 6, ray_remote_args=ALL_AT_ONCE),
        ):
            for epoch in range(2):
                assert producers_per_node(ds) == {one: 2, two: 4}, f"epoch {epoch}"


def test_producers_on_says_which_nodes():
    with cluster_of({**HEAD, "num_cpus": 1}, {"num_cpus": 1}) as (_, nodes):
        head, other = (n.node_id for n in nodes)
        expected = {"cluster": {head: 1, other: 1}, "other_nodes": {other: 2}, "this_node": {head: 2}}
        for where, counts in expected.items():
            ds = tfray.Dataset.from_generators(
                noting_its_node, 2, ray_remote_args=ALL_AT_ONCE, producers_on=where
            )
            assert producers_per_node(ds) == counts, where


def test_rays_own_placement_replaces_tfray_s():
    """A custom resource asked in ray_remote_args: the producers go where Ray finds it."""
    resource = {"tfray_test_placement": 4}
    with cluster_of({**HEAD, "num_cpus": 2}, {"num_cpus": 0, "resources": resource}) as (_, nodes):
        _, marked = (n.node_id for n in nodes)
        remote_args = {"num_cpus": 0, "resources": {"tfray_test_placement": 1}}
        ds = tfray.Dataset.from_generators(noting_its_node, 2, ray_remote_args=remote_args)
        assert producers_per_node(ds) == {marked: 2}


def test_no_node_to_place_on_is_said_and_ray_places_the_producers(caplog):
    with cluster_of({**HEAD, "num_cpus": 1}) as (_, nodes):
        (head,) = (n.node_id for n in nodes)
        ds = tfray.Dataset.from_generators(
            noting_its_node, 2, ray_remote_args=ALL_AT_ONCE, producers_on="other_nodes"
        )
        with caplog.at_level(logging.WARNING, logger="tfray"):
            assert producers_per_node(ds) == {head: 2}
        assert "from_generators(noting_its_node): no alive node offers CPUs besides the trainer's" in caplog.text


@pytest.mark.slow
def test_twenty_fresh_clusters_place_no_producer_on_the_node_of_no_cpu():
    """As a user starts one: ``--num-cpus=0`` for the trainer's node, one CPU node beside it."""
    for cluster_number in range(20):
        with cluster_of({**HEAD, "num_cpus": 0}, {"num_cpus": 1}) as (_, nodes):
            head, worker = (n.node_id for n in nodes)
            ds = tfray.Dataset.from_generators(noting_its_node, 2)
            for epoch in range(2):
                assert producers_per_node(ds) == {worker: 2}, f"cluster {cluster_number}, epoch {epoch}"


MISSING = {"tfray_test_missing": 1}  # A resource no node offers until one joins.
SPEC = {"node": tf.TensorSpec([1, 28], tf.uint8), "shard": tf.TensorSpec([1], tf.int64)}


@pytest.fixture
def quick_watch(monkeypatch):
    """Placement checks every 0.3 s (not 5), and every warning said afresh."""
    from tfray._internal.sources import placement

    monkeypatch.setattr(placement, "CHECK_S", 0.3)
    monkeypatch.setattr(placement, "_warned", {})


def wait_for(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def test_producers_no_node_can_run_are_said_and_start_when_one_joins(quick_watch, caplog):
    """Asking a resource no node offers: a warning naming the dataset, stats, then every batch once a node joins."""
    with cluster_of({**HEAD, "num_cpus": 1}) as (cluster, _):
        ds = tfray.Dataset.from_generators(
            noting_its_node, 2, element_spec=SPEC, ray_remote_args={"num_cpus": 0, "resources": MISSING}
        )
        shards = []
        with caplog.at_level(logging.WARNING, logger="tfray"):
            reader = threading.Thread(target=lambda: shards.extend(int(b["shard"][0]) for b in ds), daemon=True)
            reader.start()
            wait_for(lambda: ds.stats() and ds.stats()[-1].producers_unplaced == 2, 30, "stats say 2 unplaced")
            wait_for(lambda: "waited" in caplog.text, 10, "the warning")
        assert (
            "from_generators(noting_its_node): 2 producer(s) have waited" in caplog.text
            and "each asks {'tfray_test_missing': 1.0}, which no alive node offers" in caplog.text
        ), caplog.text
        assert ds.stats()[-1].unplaced_s > 0
        assert "waiting for a node: 2 producer(s) cannot be placed" in ds.stats()[-1].verdict()
        assert reader.is_alive()  # Still waiting: no error without a timeout.
        cluster.add_node(num_cpus=0, resources={"tfray_test_missing": 2}, object_store_memory=80 << 20)
        reader.join(60)
        assert not reader.is_alive(), "the epoch did not end once a node offered the resource"
        assert sorted(shards) == [0, 1]
        assert ds.stats()[-1].producers_unplaced == 0


def raised_within(seconds, call):
    """The exception ``call()`` raised, within ``seconds`` (run on a thread: a wait with no end fails the test)."""
    raised = []

    def run():
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the test checks which.
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    assert raised, "it returned instead of raising"
    return raised[0]


def test_placement_timeout_fails_the_epoch_with_what_to_do(quick_watch):
    with cluster_of({**HEAD, "num_cpus": 1}):
        remote_args = {"num_cpus": 0, "resources": MISSING}
        ds = tfray.Dataset.from_generators(
            noting_its_node, 2, element_spec=SPEC, ray_remote_args=remote_args, placement_timeout_s=1
        )
        error = raised_within(20, lambda: next(iter(ds)))
        assert isinstance(error, tf.errors.UnavailableError), repr(error)
        name = "from_generators(noting_its_node)"
        assert f"{name}: 2 producer(s) could not be placed within placement_timeout_s=1" in error.message
        assert "'tfray_test_missing': 1.0" in error.message and "ask for less in ray_remote_args" in error.message
        # Without element_spec, learning it runs a producer: its wait is bounded alike.
        error = raised_within(
            20,
            lambda: tfray.Dataset.from_generators(
                noting_its_node, 2, ray_remote_args=remote_args, placement_timeout_s=1
            ),
        )
        assert isinstance(error, TimeoutError) and "while learning element_spec" in str(error), repr(error)


def test_dynamic_sharding_units_that_cannot_be_placed_are_said_and_bounded(quick_watch):
    """A unit's producer, handed out by the coordinator, is watched as any epoch's."""
    with cluster_of({**HEAD, "num_cpus": 1}):
        ds = tfray.Dataset.from_generators(
            noting_its_node,
            2,
            element_spec=SPEC,
            sharding="dynamic",
            ray_remote_args={"num_cpus": 0, "resources": MISSING},
            placement_timeout_s=3,
        )
        errors = []

        def read():
            try:
                next(iter(ds))
            except tf.errors.UnavailableError as e:
                errors.append(str(e))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_for(lambda: ds.stats() and ds.stats()[-1].producers_unplaced >= 1, 30, "stats say unplaced")
        reader.join(30)
        assert not reader.is_alive() and errors, "the timeout did not end the epoch"
        assert "could not be placed within placement_timeout_s=3" in errors[0]


AUTOSCALING = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "autoscaling_cluster.py")


def test_an_autoscaler_sees_the_demand_of_producers_no_node_can_run():
    """Producers that ask a resource only a node type the autoscaler may launch offers: it launches one, they run there.

    Producers ask no CPU (lockstep epochs would deadlock on their reservations),
    so it is a resource they ask that an autoscaler sees; tfray says they wait meanwhile.
    Ray's fake autoscaling cluster, in a process of its own (support/autoscaling_cluster.py).
    """
    if ray.is_initialized():
        ray.shutdown()  # Its cluster is this machine's only one meanwhile.
    process = subprocess.run([sys.executable, AUTOSCALING], capture_output=True, text=True, timeout=240)
    assert process.returncode == 0, process.stderr[-4000:]
    out = json.loads(process.stdout.strip().splitlines()[-1])
    assert len(out["launched"]) == 1, "the autoscaler launched no node"
    assert out["counts"] == {out["launched"][0]: 2}
    assert any("2 producer(s) have waited" in w for w in out["warnings"]), out["warnings"]
