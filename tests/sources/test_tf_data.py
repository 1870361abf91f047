"""tfray.Dataset.from_tf_data: tf.data pipelines run by Ray producers, their batches read zero-copy.

Each case compares against the reference: the same pipelines iterated by
plain tf.data in this process.
"""

import os
import time

import numpy as np
import pytest
import tensorflow as tf
from support.dlpack_util import assert_stats_match_addresses, assert_zero_copy

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]

# Producers reserve no CPU by default; the tests say so, as users of a
# shared test Ray would.
NO_CPU = {"num_cpus": 0}


def counting(rows=4, batches=3, width=8):
    """``fn(shard)``: batches of ``{"id", "x"}``, ids ``100 * shard + i``, ``rows`` a batch."""

    def pipeline(shard):
        ids = tf.data.Dataset.range(100 * shard, 100 * shard + rows * batches)
        fill = lambda i: {"id": i, "x": tf.fill([width], tf.cast(i, tf.float32))}  # noqa: E731
        return ids.map(fill, num_parallel_calls=tf.data.AUTOTUNE).batch(rows)

    return pipeline


def by_shard(batches):
    """Each shard's batch ids, in the order they came: {shard: [first id of each batch]}."""
    out = {}
    for batch in batches:
        first = int(np.asarray(batch["id"])[0])
        out.setdefault(first // 100, []).append(first)
    return out


def reference(fn, shards):
    return [batch for shard in shards for batch in fn(shard).as_numpy_iterator()]


def test_each_shard_s_batches_are_its_pipeline_s_in_its_order():
    fn = counting()
    ds = tfray.Dataset.from_tf_data(fn, 3, ray_remote_args=NO_CPU)
    expected = reference(fn, range(3))
    for epoch in range(2):  # Each iterator is a new epoch.
        got = [{k: v.numpy() for k, v in batch.items()} for batch in ds]
        assert by_shard(got) == by_shard(expected), f"epoch {epoch}"
        keyed = {int(b["id"][0]): b for b in got}
        for want in expected:
            have = keyed[int(want["id"][0])]
            np.testing.assert_array_equal(have["id"], want["id"])
            np.testing.assert_array_equal(have["x"], want["x"])


def test_the_element_spec_is_the_pipeline_s_own_and_nothing_runs_to_learn_it(tmp_path):
    """Built in the trainer to read its spec, never iterated: no element is made before ``iter``."""
    marks = str(tmp_path)

    def pipeline(shard):
        def mark(i):
            open(os.path.join(marks, f"{shard}-{int(i)}"), "w").close()
            return i

        ids = tf.data.Dataset.range(3).map(lambda i: tf.py_function(mark, [i], tf.int64))
        return ids.map(lambda i: {"id": tf.reshape(i, [1]), "x": tf.zeros([2, 5], tf.float16)})

    ds = tfray.Dataset.from_tf_data(pipeline, 2, ray_remote_args=NO_CPU)
    assert ds.element_spec == pipeline(0).element_spec
    time.sleep(2.0)  # Producers started at construction would have marked by now.
    assert os.listdir(marks) == []
    assert sorted(int(b["id"][0]) for b in ds) == [0, 0, 1, 1, 2, 2]
    assert sorted(os.listdir(marks)) == ["0-0", "0-1", "0-2", "1-0", "1-1", "1-2"]


def test_string_and_ragged_components_arrive_as_tf_data_makes_them():
    def strings_and_ragged(shard):
        ids = tf.data.Dataset.range(10 * shard, 10 * shard + 7)
        element = lambda i: {  # noqa: E731
            "name": tf.strings.join(["item-", tf.strings.as_string(i), "-é"]),
            "tokens": tf.range(i % 4),
            "id": i,
        }
        return ids.map(element).ragged_batch(3)

    ds = tfray.Dataset.from_tf_data(strings_and_ragged, [0, 1], ray_remote_args=NO_CPU)
    assert ds.element_spec == strings_and_ragged(0).element_spec
    assert isinstance(ds.element_spec["tokens"], tf.RaggedTensorSpec)
    expected = {int(b["id"][0]): b for s in (0, 1) for b in strings_and_ragged(s)}
    got = list(ds)
    assert sorted(int(b["id"][0]) for b in got) == sorted(expected)
    for batch in got:
        want = expected[int(batch["id"][0])]
        assert isinstance(batch["tokens"], tf.RaggedTensor)
        assert batch["tokens"].to_list() == want["tokens"].to_list()
        assert batch["name"].dtype == tf.string
        assert batch["name"].numpy().tolist() == want["name"].numpy().tolist()
        np.testing.assert_array_equal(batch["id"], want["id"])


def test_batches_lie_in_the_object_store_by_address():
    """Dense components of every batch are Ray's bytes, with and without a string beside them."""

    def images(shard):
        ids = tf.data.Dataset.range(4 * shard, 4 * shard + 4)
        # 256 KB a batch: above Ray's inline limit, so in shared memory.
        element = lambda i: {"image": tf.fill([64, 256], tf.cast(i, tf.float32)), "id": i}  # noqa: E731
        return ids.map(element).batch(4, drop_remainder=True).repeat(3)

    def named(shard):
        return images(shard).map(lambda b: dict(b, name=tf.strings.as_string(b["id"])))

    for fn in (images, named):
        ds = tfray.Dataset.from_tf_data(fn, 2, ray_remote_args=NO_CPU)
        elements = list(ds)
        assert len(elements) == 6
        for batch in elements:
            for key in ("image", "id"):
                assert_zero_copy(batch[key], f"{fn.__name__}: {key} of batch {int(batch['id'][0])}")
            assert float(batch["image"][0, 0, 0]) == int(batch["id"][0])
        if fn is images:
            assert_stats_match_addresses(ds.stats()[-1], elements, "dense batches")
            assert ds.stats()[-1].bytes_copied == 0


def test_tensorflow_is_imported_once_per_producer_process_and_tfray_never():
    """Producers' processes are reused across tasks: one import of TensorFlow serves many shards.

    Each ``fn(shard)`` call notes its process and whether tfray is in it;
    ten producer tasks (five epochs of two shards) run in at most five
    processes.
    """

    def pipeline(shard):
        import sys

        noted = tf.constant([os.getpid(), int("tfray" in sys.modules)], tf.int64)
        return tf.data.Dataset.from_tensors({"noted": noted})

    ds = tfray.Dataset.from_tf_data(pipeline, 2, ray_remote_args=NO_CPU)
    noted = [batch["noted"].numpy().tolist() for _ in range(5) for batch in ds]
    assert len(noted) == 10
    assert {tfray_loaded for _, tfray_loaded in noted} == {0}, "a producer process imported tfray"
    processes = {pid for pid, _ in noted}
    assert len(processes) <= 5, f"10 producer tasks ran in {len(processes)} processes"


def test_a_pipeline_s_error_reaches_next_naming_its_shard():
    def failing(shard):
        def check(i):
            if shard == 1 and int(i) == 2:
                raise ValueError("cannot decode train-1-00002.jpg")
            return i

        ids = tf.data.Dataset.range(4).map(lambda i: tf.py_function(check, [i], tf.int64))
        return ids.map(lambda i: tf.reshape(i, [1]))

    ds = tfray.Dataset.from_tf_data(failing, 2, ray_remote_args=NO_CPU)
    with pytest.raises(tf.errors.OpError, match=r"(?s)shard 1 batch 2.*cannot decode train-1-00002\.jpg"):
        for _ in ds:
            pass


def test_a_shard_whose_pipeline_is_not_the_dataset_s_is_refused_naming_it():
    def differing(shard):
        dtype = tf.int64 if shard == 0 else tf.int32
        return tf.data.Dataset.range(2).map(lambda i: tf.cast(tf.reshape(i, [1]), dtype))

    ds = tfray.Dataset.from_tf_data(differing, 2, ray_remote_args=NO_CPU)
    with pytest.raises(tf.errors.OpError, match=r"(?s)fn\(1\) built a pipeline whose element_spec"):
        for _ in ds:
            pass


def test_a_fn_that_returns_no_dataset_is_refused_at_construction():
    with pytest.raises(TypeError, match=r"from_tf_data: fn must return a tf.data.Dataset; fn\(0\) returned a list"):
        tfray.Dataset.from_tf_data(lambda shard: [1, 2], 2)
    with pytest.raises(TypeError, match="from_tf_data: element_spec x: expected a tf.TensorSpec or tf.RaggedTensorSpec, got SparseTensorSpec"):
        tfray.Dataset.from_tf_data(
            lambda shard: tf.data.Dataset.from_tensors({"x": tf.sparse.eye(2)}), 2
        )


def test_a_worker_reads_only_its_shards_at_the_source():
    fn = counting(batches=1)
    part = tfray.Dataset.from_tf_data(fn, 4, ray_remote_args=NO_CPU).shard(2, 1)
    assert sorted(by_shard(list(part))) == [1, 3]
    context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0)
    auto = tfray.Dataset.from_tf_data(fn, 4, input_context=context, ray_remote_args=NO_CPU)
    assert sorted(by_shard(list(auto))) == [0, 2]

