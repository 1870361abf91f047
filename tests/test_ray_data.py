"""tfray.Dataset.from_ray_data: a drop-in for Ray Data's to_tf()."""

import numpy as np
import pytest
import ray
import ray.data
import tensorflow as tf

import tfray
from dlpack_util import assert_zero_copy, data_pointer

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


def test_the_pipeline_runs_once_per_epoch_not_again_for_the_schema():
    """Learning the spec starts epoch 1, which the first iterator then reads."""

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

    data = table().map_batches(count)
    ds = tfray.Dataset.from_ray_data(data, batch_size=32, feature_columns="x", label_columns="y")
    assert sum(int(x.shape[0]) for x, _ in ds) == ROWS
    assert ray.get(counter.get.remote()) == ROWS
    assert sum(int(x.shape[0]) for x, _ in ds) == ROWS
    assert ray.get(counter.get.remote()) == 2 * ROWS


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
    (block_ref,) = [entry.ref for entry in bundle.blocks]
    block = ray.get(block_ref)
    storage = block.column("data").chunk(0).storage
    values = storage.values if hasattr(storage, "values") else storage.flatten()
    assert data_pointer(batch) == values.buffers()[1].address
    assert_zero_copy(batch)


def test_variable_length_column_is_a_clear_error():
    """Ragged columns are refused, naming the column."""
    data = ray.data.from_items([{"v": np.arange(i + 1), "y": i} for i in range(8)])
    with pytest.raises(ValueError, match=r"column 'v' is variable-length"):
        tfray.Dataset.from_ray_data(data, batch_size=4, feature_columns="v", label_columns="y")


def test_unknown_column():
    """A column that does not exist is named, with the columns that do."""
    with pytest.raises(ValueError, match=r"column 'nope' is not in the Ray dataset"):
        tfray.Dataset.from_ray_data(table(), batch_size=4, feature_columns="nope")


@pytest.mark.parametrize("kind", ["local-shuffle", "data-iterator"])
def test_iter_batches_path_delivers_every_row(kind):
    """Local shuffling and DataIterators (Ray Train shards) read via iter_batches."""
    data = table()
    if kind == "data-iterator":
        ds = tfray.Dataset.from_ray_data(data.iterator(), batch_size=16, feature_columns="a")
    else:
        ds = tfray.Dataset.from_ray_data(
            data, batch_size=16, feature_columns="a", local_shuffle_buffer_size=32
        )
    for _ in range(2):
        rows = np.concatenate([b.numpy() for b in ds])
        assert sorted(rows.tolist()) == list(range(ROWS))
