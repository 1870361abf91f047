"""tfray.Dataset.from_ray_data: a drop-in for Ray Data's to_tf()."""

import time

import numpy as np
import pytest
import ray
import ray.data
import tensorflow as tf
from support.dlpack_util import assert_zero_copy, data_pointer

import tfray
from tfray._internal.sources import ray_data

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]

ROWS, WIDTH = 96, 8


def table():
    x = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH)
    return ray.data.from_items(
        [{"x": x[i], "a": np.float64(i), "y": np.int64(i % 3)} for i in range(ROWS)]
    )


def as_numpy(element):
    return tf.nest.map_structure(lambda t: t.numpy(), element)


@pytest.mark.parametrize(
    "features,labels",
    [("x", "y"), (["x", "a"], "y"), ("x", ["y", "a"])],
    ids=["tensor-tensor", "dict-tensor", "tensor-dict"],
)
def test_same_batches_and_structure_as_to_tf(features, labels):
    """Same elements, same nest structure, dtypes and shapes as to_tf()."""
    data = table().materialize()
    ours = tfray.Dataset.from_ray_data(
        data, batch_size=16, feature_columns=features, label_columns=labels
    )
    theirs = data.to_tf(feature_columns=features, label_columns=labels, batch_size=16)
    strip = lambda spec: tf.TensorSpec(spec.shape, spec.dtype)  # noqa: E731
    assert tf.nest.map_structure(strip, ours.element_spec) == tf.nest.map_structure(
        strip, theirs.element_spec
    )
    got, expected = [as_numpy(e) for e in ours], [as_numpy(e) for e in theirs]
    assert len(got) == len(expected) == ROWS // 16
    for g, e in zip(got, expected):
        tf.nest.assert_same_structure(g, e)
        for a, b in zip(tf.nest.flatten(g), tf.nest.flatten(e)):
            np.testing.assert_array_equal(a, b)


def test_dispatch_drop_last_and_epochs():
    """tfray.Dataset(ray_ds, batch_size=...) dispatches here; every epoch reruns."""
    ds = tfray.Dataset(table(), batch_size=40, feature_columns="x", label_columns="y", drop_last=True)
    for _ in range(3):
        assert [x.shape[0] for x, _ in ds] == [40, 40]


def test_the_pipeline_runs_once_per_epoch_and_learns_its_schema_as_to_tf_does():
    """Construction runs what to_tf's runs (Ray's schema probe); each epoch runs once."""

    @ray.remote(num_cpus=0)
    class Counter:
        def __init__(self):
            self.rows = 0

        def add(self, n):
            self.rows += n

        def get(self):
            return self.rows

    counter = Counter.remote()

    def count(batch):
        ray.get(counter.add.remote(len(batch["x"])))
        return batch

    def settled():
        # to_tf's schema probe runs the pipeline until a first block is out; how
        # many tasks start before it stops varies (all of them, on a loaded
        # machine), and one still running may add its rows after it returns.
        last, deadline = ray.get(counter.get.remote()), time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(2)
            now = ray.get(counter.get.remote())
            if now == last:
                return now
            last = now
        raise AssertionError(f"the pipeline's row count still moved after 60 s (at {last})")

    table().map_batches(count).to_tf("x", "y", batch_size=32)
    theirs = settled()
    assert 0 < theirs <= ROWS  # Never more than one epoch.
    data = table().map_batches(count)  # A new dataset: Ray caches a schema it learned.
    ds = tfray.Dataset.from_ray_data(data, "x", "y", batch_size=32)
    built = settled()
    assert 0 < built - theirs <= ROWS
    assert sum(int(x.shape[0]) for x, _ in ds) == ROWS
    assert ray.get(counter.get.remote()) == built + ROWS
    assert sum(int(x.shape[0]) for x, _ in ds) == ROWS
    assert ray.get(counter.get.remote()) == built + 2 * ROWS


def test_a_batch_within_one_block_reaches_tf_without_a_copy():
    """A block-aligned batch's tensor points into the block in the object store."""
    # 256 KB: above Ray's inline limit, so the block is in the object store.
    x = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    data = ray.data.from_numpy(x).materialize()  # One block, one tensor column.
    ds = tfray.Dataset.from_ray_data(data, batch_size=64, feature_columns="data")
    (batch,) = list(ds)
    np.testing.assert_array_equal(batch.numpy(), x)
    (stats,) = ds.stats()
    assert stats.bytes_copied == 0 and stats.bytes_zero_copy == x.nbytes
    (bundle,) = list(data.iter_internal_ref_bundles())
    (block_ref,) = bundle.block_refs
    block = ray.get(block_ref)
    storage = block.column("data").chunk(0).storage
    values = storage.values if hasattr(storage, "values") else storage.flatten()
    assert data_pointer(batch) == values.buffers()[1].address
    assert_zero_copy(batch)


def test_unknown_column():
    """A column that does not exist is named, with the columns that do."""
    with pytest.raises(ValueError, match=r"feature_columns: there's no column named 'nope'"):
        tfray.Dataset.from_ray_data(table(), batch_size=4, feature_columns="nope")


@pytest.mark.parametrize("kind", ["local-shuffle", "data-iterator", "ray-without-block-refs"])
def test_iter_batches_path_delivers_every_row(kind, monkeypatch):
    """Local shuffling, DataIterators (Ray Train shards), and a Ray without
    Ray Data's block-ref developer APIs read via iter_batches."""
    data = table()
    if kind == "ray-without-block-refs":
        assert ray_data.reads_blocks(data)  # Every supported Ray has them.
        monkeypatch.setattr(ray_data, "reads_blocks", lambda data: False)
        monkeypatch.setattr(ray_data, "BlockBatches", None)  # Not taken.
        ds = tfray.Dataset.from_ray_data(data, batch_size=16, feature_columns="a")
    elif kind == "data-iterator":
        ds = tfray.Dataset.from_ray_data(data.iterator(), batch_size=16, feature_columns="a")
    else:
        ds = tfray.Dataset.from_ray_data(
            data, batch_size=16, feature_columns="a", local_shuffle_buffer_size=32
        )
    for _ in range(2):
        rows = np.concatenate([b.numpy() for b in ds])
        assert sorted(rows.tolist()) == list(range(ROWS))
