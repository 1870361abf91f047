"""Invariant 7: TensorFlow never writes into Ray's object store through tfray's tensors.

A kernel may forward an input's buffer to its output and write in place
when the input is the buffer's last user. A slice of a tfray batch (``b[1:]``,
``tf.split``, ``unbatch``, a strategy's per-replica split) must never count
as that, or ``b[1:] + 1`` writes into Ray's shared store: every later reader
(the next epoch, other workers, ``ray.get``) would see the change.

Each case runs a pipeline over batches in the store and checks, byte for
byte, that the objects are unchanged afterwards, and that TF's results are
right. Where the source's objects do not outlive the epoch (generators),
each result must lie outside the store's memory instead: a forwarded
buffer would lie inside it.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import ray
import ray.data
import tensorflow as tf
from support.dlpack_util import in_object_store, object_store_ranges

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]

ROWS, COLS = 8, 8192  # 256 KB of float32: in the shared-memory store, not inline.
BATCHES = 3


def batch(i):
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 1000.0 * i


# name -> (what TF computes from a batch, the same in numpy)
TRANSFORMS = {
    "slice_add": (lambda b: b[1:] + 1.0, lambda a: a[1:] + 1.0),
    "slice_mul": (lambda b: b[:2] * 2.0, lambda a: a[:2] * 2.0),
    "split_add": (lambda b: tf.split(b, 2)[1] + 1.0, lambda a: np.split(a, 2)[1] + 1.0),
    "unstack_sub": (lambda b: tf.unstack(b, num=ROWS)[3] - 5.0, lambda a: a[3] - 5.0),
    "add": (lambda b: b + 1.0, lambda a: a + 1.0),
    "mul": (lambda b: b * 3.0, lambda a: a * 3.0),
    "cast_same_dtype": (lambda b: tf.cast(b[2:], tf.float32) - 1.0, lambda a: a[2:] - 1.0),
    "where": (
        lambda b: tf.where(b[1:] > 3000.0, b[1:], -b[1:]),
        lambda a: np.where(a[1:] > 3000.0, a[1:], -a[1:]),
    ),
    "relu": (lambda b: tf.nn.relu(b[1:] - 2000.0), lambda a: np.maximum(a[1:] - 2000.0, 0.0)),
}


class Refs:
    """``from_refs`` over objects the test holds: checked byte for byte after."""

    def __init__(self):
        self.refs = [ray.put(batch(i)) for i in range(BATCHES)]

    def dataset(self):
        return tfray.Dataset(self.refs)

    def check_unchanged(self):
        for i, ref in enumerate(self.refs):
            np.testing.assert_array_equal(ray.get(ref), batch(i), err_msg=f"object {i} changed")


class Generators:
    """``from_generators``: the batches live only while tfray reads them."""

    def dataset(self):
        rows, cols = ROWS, COLS

        def produce(shard):  # Local: pickled by value for the producer tasks.
            yield np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) + 1000.0 * shard

        return tfray.Dataset.from_generators(produce, BATCHES)

    def check_unchanged(self):
        pass  # Nothing outlives the epoch; results are checked to lie outside the store.


class RayData:
    """``from_ray_data`` over a materialized dataset, one block per batch: re-read after."""

    def __init__(self):
        self.data = ray.data.from_numpy(np.concatenate([batch(i) for i in range(BATCHES)]))
        self.data = self.data.repartition(BATCHES).materialize()

    def dataset(self):
        return tfray.Dataset.from_ray_data(self.data, batch_size=ROWS, feature_columns="data")

    def check_unchanged(self):
        rows = np.stack([r["data"] for r in self.data.take_all()])
        np.testing.assert_array_equal(rows, np.concatenate([batch(i) for i in range(BATCHES)]))


SOURCES = {"refs": Refs, "generators": Generators, "ray_data": RayData}


def check_results(results, reference):
    """Each result is right and lies outside the store (was not forwarded)."""
    assert object_store_ranges(), "no mapping of the object store found in this process"
    assert len(results) == BATCHES
    for i, result in enumerate(results):
        assert not in_object_store(result), f"result {i} was written into the object store"
        np.testing.assert_array_equal(result.numpy(), reference(batch(i)))


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_graph_map_leaves_the_store_unchanged(source, transform):
    """``ds.map(f)``: f's in-place-capable ops never write into the batch's memory."""
    data = SOURCES[source]()
    fn, reference = TRANSFORMS[transform]
    for _ in range(2):  # A second epoch reads what the first left.
        check_results(list(data.dataset().map(fn)), reference)
        data.check_unchanged()


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("transform", ["slice_add", "split_add", "unstack_sub", "relu"])
def test_eager_ops_leave_the_store_unchanged(source, transform):
    """The same ops run eagerly on each batch once its iterator has moved on."""
    data = SOURCES[source]()
    fn, reference = TRANSFORMS[transform]
    results = []
    for b in data.dataset():
        piece = b[1:] if transform == "slice_add" else b
        del b  # The slice outlives its batch tensor, as in a training step.
        results.append(fn(piece) if transform != "slice_add" else piece + 1.0)
        del piece
    check_results(results, reference)
    data.check_unchanged()


@pytest.mark.parametrize("source", SOURCES)
def test_unbatch_batch_leaves_the_store_unchanged(source):
    """``unbatch().batch()`` slices every row out of its batch."""
    data = SOURCES[source]()
    ds = data.dataset().unbatch().batch(ROWS // 2).map(lambda b: b + 1.0)
    halves = list(ds)
    assert len(halves) == 2 * BATCHES
    got = np.concatenate([h.numpy() for h in halves])
    np.testing.assert_array_equal(got, np.concatenate([batch(i) for i in range(BATCHES)]) + 1.0)
    assert not any(in_object_store(h) for h in halves)
    data.check_unchanged()


@pytest.mark.parametrize("source", SOURCES)
def test_rebatch_leaves_the_store_unchanged(source):
    """``rebatch`` splits each batch into smaller ones, then an in-place-capable op."""
    data = SOURCES[source]()
    ds = data.dataset().rebatch(ROWS // 4).map(lambda b: b * 2.0)
    got = list(ds)
    assert len(got) == 4 * BATCHES
    np.testing.assert_array_equal(
        np.concatenate([g.numpy() for g in got]),
        np.concatenate([batch(i) for i in range(BATCHES)]) * 2.0,
    )
    data.check_unchanged()


@pytest.mark.parametrize("source", SOURCES)
def test_cache_then_map_leaves_the_store_unchanged(source):
    """``cache()`` keeps the tensors; later epochs' ops must not write into them."""
    data = SOURCES[source]()
    ds = data.dataset().cache().map(lambda b: b[1:] + 1.0)
    for _ in range(3):
        check_results(list(ds), lambda a: a[1:] + 1.0)
    data.check_unchanged()


def test_inplace_update_ops_copy_a_tfray_batch_first():
    """``tf.raw_ops.InplaceUpdate/Add/Sub`` on a tfray batch: right result, store unchanged.

    TF's own kernels write into their input whoever owns it; tfray's, which
    replace them, copy a tfray batch first. Other tensors are still updated
    in place, as TF does (its documented aliasing).
    """
    data = Refs()
    row = tf.fill([1, COLS], 7.0)
    ops = {
        "update": (tf.raw_ops.InplaceUpdate, lambda a: np.concatenate([a[:1], np.full((1, COLS), 7.0), a[2:]])),
        "add": (tf.raw_ops.InplaceAdd, lambda a: np.concatenate([a[:1], a[1:2] + 7.0, a[2:]])),
        "sub": (tf.raw_ops.InplaceSub, lambda a: np.concatenate([a[:1], a[1:2] - 7.0, a[2:]])),
    }
    for name, (op, reference) in ops.items():
        graph = list(data.dataset().map(lambda b: op(x=b, i=[1], v=row)))
        check_results(graph, reference)
        eager = [op(x=b, i=[1], v=row) for b in data.dataset()]
        check_results(eager, reference)
        data.check_unchanged()
    # Not a tfray batch: aliased and written in place, as TF's kernel does.
    x = tf.zeros([2, 3]) + 0.0
    y = tf.raw_ops.InplaceAdd(x=x, i=[0], v=tf.ones([1, 3]))
    np.testing.assert_array_equal(x.numpy(), [[1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(y.numpy(), [[1, 1, 1], [0, 0, 0]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="shape doesn't match"):
        tf.raw_ops.InplaceUpdate(x=x, i=[0], v=tf.ones([1, 4]))
    strings = tf.raw_ops.InplaceUpdate(x=tf.constant(["a", "b"]), i=[1], v=tf.constant(["c"]))
    assert strings.numpy().tolist() == [b"a", b"c"]


def test_batches_sliced_past_their_tensors_are_released():
    """Memory kept by slices alone is released once the slices go (no leak, no early free)."""
    data = Refs()
    slices = [b[1:] for b in data.dataset()]  # Each batch tensor is gone; its slice lives.
    from tfray._internal.runtime import runtime

    assert runtime.get().pins.count() == BATCHES
    np.testing.assert_array_equal(slices[0].numpy(), batch(0)[1:])
    del slices
    import conftest

    conftest.wait_until(lambda: runtime.get().pins.count() == 0, timeout=10)


STRATEGY_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "store_safety_strategy.py")


@pytest.mark.parametrize("keras", ["keras3", "tf_keras"])
def test_mirrored_strategy_fit_and_evaluate_leave_the_store_unchanged(keras, tmp_path):
    """Keras under MirroredStrategy (two logical CPUs) splits each batch per replica.

    Run in its own process (logical devices must be set before TF starts):
    evaluate gives the true loss, a long fit converges, every object unchanged.
    """
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1" if keras == "tf_keras" else "0")
    address = ray.get_runtime_context().gcs_address
    run = subprocess.run(
        [sys.executable, STRATEGY_SCRIPT, address],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "store unchanged" in run.stdout, run.stdout[-3000:]
