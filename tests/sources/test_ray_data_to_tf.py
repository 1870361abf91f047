"""from_ray_data against Ray Data's own to_tf(): every argument, column type and edge.

Each test builds the same pipeline through both and checks that they agree:
element_spec (TensorSpec names included), cardinality, and every batch of
an epoch, in order.
"""

import inspect
import threading

import numpy as np
import pytest
import ray
import ray.data
import tensorflow as tf
from conftest import ray_data_in_order

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]

ROWS = 24


@pytest.fixture(scope="module", autouse=True)
def ordered():
    """Ray Data yields blocks in order, so both readers see the same order."""
    with ray_data_in_order():
        yield


def table(rows=ROWS, blocks=3):
    """Numeric, tensor, string, bytes, list and variable-shaped tensor columns."""
    items = [
        {
            "x": np.float64(i) / 2,
            "t": np.full((2, 3), i, np.float32),
            "y": np.int64(i % 3),
            "w": np.float32(1 + i % 2),
            "s": "row " * (i % 4) + str(i),
            "b": bytes([i, 0, 255 - i]),
            "l": list(range(i % 5)),
            "v": np.full((i % 3 + 1, 2), i, np.int32),
        }
        for i in range(rows)
    ]
    return ray.data.from_items(items, override_num_blocks=blocks).materialize()


class Rows:
    """A ragged tensor's rows as nested lists, and its dtype (a leaf for tf.nest)."""

    def __init__(self, ragged):
        self.rows, self.dtype = ragged.to_list(), ragged.dtype

    def __eq__(self, other):
        return isinstance(other, Rows) and (self.rows, self.dtype) == (other.rows, other.dtype)


def values(element):
    """An element as numpy values; ragged tensors as Rows, strings as bytes."""

    def one(t):
        return Rows(t) if isinstance(t, tf.RaggedTensor) else t.numpy()

    return tf.nest.map_structure(one, element)


def assert_same(ours, theirs, epochs=1):
    """Same element_spec and cardinality; the same batches, in order, each epoch."""
    assert ours.element_spec == theirs.element_spec
    assert int(ours.cardinality()) == int(theirs.cardinality())
    expected = [values(e) for e in theirs]
    for _ in range(epochs):
        got = [values(e) for e in ours]
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            tf.nest.assert_same_structure(g, e)
            for a, b in zip(tf.nest.flatten(g), tf.nest.flatten(e)):
                if isinstance(b, Rows):
                    assert a == b
                else:
                    assert a.dtype == b.dtype
                    np.testing.assert_array_equal(a, b)
    return expected


def test_signature_is_to_tf_s():
    """Every to_tf parameter, in its place (positional or keyword-only), with its default."""
    theirs = inspect.signature(ray.data.Dataset.to_tf).parameters
    ours = inspect.signature(tfray.Dataset.from_ray_data).parameters
    for name, param in theirs.items():
        if name == "self":
            continue
        assert name in ours, name
        assert ours[name].kind == param.kind, name
        if param.default is not param.empty:
            assert ours[name].default == param.default, name
    assert list(ours)[1:3] == ["feature_columns", "label_columns"]


@pytest.mark.parametrize(
    "features,labels,additional",
    [("x", "y", None), (["x", "t"], "y", None), ("t", ["y", "x"], None), ("x", "y", "w"), ("x", "y", ["w", "x"])],
    ids=["tensor-tensor", "dict-tensor", "tensor-dict", "additional", "additional-dict"],
)
@pytest.mark.parametrize("kind", ["dataset", "iterator"])
def test_structures_and_names(features, labels, additional, kind):
    """Tensor or dict groups, additional columns, named specs; on a Dataset and a DataIterator."""
    data = table()
    source = data if kind == "dataset" else data.iterator()
    ours = tfray.Dataset.from_ray_data(
        source, features, labels, additional_columns=additional, batch_size=5
    )
    theirs = source.to_tf(features, labels, additional_columns=additional, batch_size=5)
    assert_same(ours, theirs, epochs=2)


@pytest.mark.parametrize(
    "args",
    [{}, {"batch_size": None}, {"batch_size": 7}, {"batch_size": 7, "drop_last": True}, {"batch_size": 40}],
    ids=["default-1", "None-per-block", "7", "7-drop-last", "more-than-rows"],
)
def test_batch_size_and_drop_last(args):
    """batch_size defaults to 1; None gives a batch per block; drop_last drops the short one."""
    data = table()
    assert_same(tfray.Dataset.from_ray_data(data, "x", "y", **args), data.to_tf("x", "y", **args))


def test_local_shuffle_with_a_seed_gives_to_tf_s_order():
    """A seeded local shuffle yields to_tf's batches in to_tf's order."""
    data = table()
    args = dict(batch_size=4, local_shuffle_buffer_size=8, local_shuffle_seed=7, prefetch_batches=0)
    expected = assert_same(
        tfray.Dataset.from_ray_data(data, "x", "y", **args), data.to_tf("x", "y", **args)
    )
    assert np.concatenate([x for x, _ in expected]).tolist() != sorted(
        np.concatenate([x for x, _ in expected]).tolist()
    )


@pytest.mark.parametrize(
    "column,spec",
    [
        ("s", tf.TensorSpec([None], tf.string, name="s")),
        ("b", tf.TensorSpec([None], tf.string, name="b")),
        ("l", tf.RaggedTensorSpec([None, None], tf.int64, 1, tf.int64)),
        ("v", tf.RaggedTensorSpec([None, None, None], tf.int32, 2, tf.int64)),
        ("t", tf.TensorSpec([None, 2, 3], tf.float32, name="t")),
    ],
    ids=["string", "bytes", "list", "variable-shaped-tensor", "fixed-shape-tensor"],
)
def test_column_types(column, spec):
    """Strings are tf.string, lists and variable-shaped tensors tf.RaggedTensor, as in to_tf."""
    data = table()
    ours = tfray.Dataset.from_ray_data(data, column, "y", batch_size=5)
    assert ours.element_spec[0] == spec
    assert_same(ours, data.to_tf(column, "y", batch_size=5))


def test_strings_and_ragged_are_copied_and_counted_numeric_is_not():
    """Strings and ragged columns cost counted copies; numeric columns of one block none."""
    data = ray.data.from_items(
        [{"x": np.full(1024, i, np.float32), "s": "abc" * i, "l": list(range(i))} for i in range(8)],
        override_num_blocks=1,
    ).materialize()
    numeric = tfray.Dataset.from_ray_data(data, "x", None, batch_size=8)
    assert len(list(numeric)) == 1
    (stats,) = numeric.stats()
    assert stats.bytes_copied == 0 and stats.bytes_zero_copy == 8 * 1024 * 4
    mixed = tfray.Dataset.from_ray_data(data, "x", ["s", "l"], batch_size=8)
    assert_same(mixed, data.to_tf("x", ["s", "l"], batch_size=8))
    stats = mixed.stats()[-1]
    # Bytes + splits for the strings, values + splits for the list column.
    string_bytes = sum(len("abc" * i) for i in range(8)) + 9 * 8
    list_bytes = sum(range(8)) * 8 + 9 * 8
    assert (stats.arrays_copied, stats.bytes_copied) == (4, string_bytes + list_bytes)
    assert stats.bytes_zero_copy == 8 * 1024 * 4


def test_type_specs_cast_and_name():
    """feature/label/additional_type_spec cast the data and name the specs, as in to_tf."""
    data = table()
    args = dict(
        batch_size=6,
        additional_columns=["w"],
        feature_type_spec=tf.TensorSpec([None], tf.float32, name="features"),
        label_type_spec=tf.TensorSpec([None], tf.float64, name="label"),
        additional_type_spec={"w": tf.TensorSpec([None], tf.float64, name="weight")},
    )
    ours = tfray.Dataset.from_ray_data(data, "x", "y", **args)
    assert_same(ours, data.to_tf("x", "y", **args))
    assert ours.stats()[-1].arrays_copied == 3 * ROWS // 6  # A cast array per column and batch.


def test_a_type_spec_given_alone_is_kept():
    """The one documented difference: to_tf drops a feature_type_spec given without label_type_spec."""
    data = table()
    spec = tf.TensorSpec([None], tf.float32, name="features")
    ours = tfray.Dataset.from_ray_data(data, "x", "y", batch_size=6, feature_type_spec=spec)
    theirs = data.to_tf("x", "y", batch_size=6, feature_type_spec=spec)
    assert ours.element_spec[0] == spec
    assert theirs.element_spec[0] == tf.TensorSpec([None], tf.float64, name="x")
    assert ours.element_spec[1] == theirs.element_spec[1]
    ours, theirs = list(ours), list(theirs)
    assert len(ours) == len(theirs) == ROWS // 6
    for (a, _), (b, _) in zip(ours, theirs):
        np.testing.assert_array_equal(a.numpy(), b.numpy().astype(np.float32))


def test_a_ragged_spec_over_a_fixed_shape_column():
    """A RaggedTensorSpec given for a tensor column makes it ragged, as in to_tf."""
    data = table()
    spec = tf.RaggedTensorSpec([None, None, None], tf.float32, 2, tf.int64)
    args = dict(batch_size=5, feature_type_spec=spec, label_type_spec=tf.TensorSpec([None], tf.int64, name="y"))
    assert_same(tfray.Dataset.from_ray_data(data, "t", "y", **args), data.to_tf("t", "y", **args))


@pytest.mark.parametrize("group", ["feature_columns", "label_columns", "additional_columns"])
def test_unknown_columns_raise_value_error_as_to_tf_does(group):
    """A column that is not in the dataset is a ValueError at construction, naming it."""
    data = table()
    args = {"feature_columns": "x", "label_columns": "y", group: "nope"}
    with pytest.raises(ValueError, match="no column named 'nope'"):
        data.to_tf(**args)
    with pytest.raises(ValueError, match=f"{group}: there's no column named 'nope'"):
        tfray.Dataset.from_ray_data(data, **args)


@pytest.mark.parametrize(
    "make",
    [
        lambda: table().filter(lambda row: False),
        lambda: table(rows=3, blocks=1),
    ],
    ids=["filtered-out", "drop-last-short"],
)
def test_empty_gives_zero_batches(make):
    """A dataset with a known schema and no (whole) batch yields nothing, not an error."""
    data = make()
    args = dict(batch_size=4, drop_last=True)
    ours = tfray.Dataset.from_ray_data(data, "x", "s", **args)
    assert_same(ours, data.to_tf("x", "s", **args), epochs=2)
    assert list(ours) == []


def read_together(datasets):
    """Reads every dataset in its own thread (split shards start their epoch together)."""
    out = [None] * len(datasets)

    def read(i):
        out[i] = [values(e) for e in datasets[i]]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(datasets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return out


def rows_of(shards):
    return sorted(x for shard in shards for features, _ in shard for x in features.tolist())


def test_streaming_split_shards_built_in_one_thread_in_any_order():
    """Building shard 1 then shard 0 starts nothing; read together they give every row once."""
    for maker in ("tfray", "to_tf"):
        shards = table().streaming_split(2)
        args = dict(batch_size=4)
        if maker == "tfray":
            built = [tfray.Dataset.from_ray_data(shards[i], "x", "y", **args) for i in (1, 0)]
        else:
            built = [shards[i].to_tf("x", "y", **args) for i in (1, 0)]
        assert built[0].element_spec == built[1].element_spec
        for _ in range(2):
            assert rows_of(read_together(built)) == [i / 2 for i in range(ROWS)]


def test_an_empty_streaming_split_shard_gives_zero_batches():
    """A Ray Train worker's empty shard yields no batch, with the spec from the schema."""
    data = ray.data.from_items([{"x": 1.0, "y": 1}], override_num_blocks=1).materialize()
    got = {}
    for maker in ("tfray", "to_tf"):
        shards = data.streaming_split(2)
        if maker == "tfray":
            built = [tfray.Dataset.from_ray_data(s, "x", "y", batch_size=4) for s in shards]
        else:
            built = [s.to_tf("x", "y", batch_size=4) for s in shards]
        got[maker] = (built[0].element_spec, sorted(len(b) for b in read_together(built)))
    assert got["tfray"] == got["to_tf"]
    assert got["tfray"][1] == [0, 1]


def test_spec_of_a_pipeline_with_an_unknown_schema():
    """After map_batches (schema unknown until run) the spec comes from Ray's schema probe."""

    def make(batch):
        return {"x": batch["id"].astype(np.float32), "s": np.array([str(i) for i in batch["id"]])}

    data = ray.data.range(ROWS, override_num_blocks=3).map_batches(make)
    assert data.schema(fetch_if_missing=False) is None
    assert_same(tfray.Dataset.from_ray_data(data, "x", "s", batch_size=5), data.to_tf("x", "s", batch_size=5))


def test_dispatch_and_tfray_extras():
    """tfray.Dataset(ray_ds, ...) takes to_tf's options; element_spec= and label_columns=None work."""
    data = table()
    assert_same(tfray.Dataset(data, feature_columns="x", label_columns="y", batch_size=5), data.to_tf("x", "y", batch_size=5))
    spec = {"x": tf.TensorSpec([None], tf.float64), "s": tf.TensorSpec([None], tf.string)}
    ours = tfray.Dataset.from_ray_data(data, ["x", "s"], batch_size=6, element_spec=spec)
    assert ours.element_spec == spec
    features = [values(f) for f in ours]
    theirs = [values(f) for f, _ in data.to_tf(["x", "s"], "y", batch_size=6)]
    assert len(features) == len(theirs) == ROWS // 6
    for g, e in zip(features, theirs):
        np.testing.assert_array_equal(g["x"], e["x"])
        np.testing.assert_array_equal(g["s"], e["s"])


def test_keras_fit_gives_to_tf_s_losses_and_weights():
    """Fitting through from_ray_data gives the losses and weights that to_tf gives."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.1).astype(np.float32)
    data = ray.data.from_items(
        [{"x": x[i], "y": y[i], "w": np.float32(1 + i % 2)} for i in range(64)], override_num_blocks=4
    ).materialize()

    def fit(ds):
        tf.keras.utils.set_random_seed(1)
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(ds, epochs=3, verbose=0)
        return history.history["loss"], model.get_weights()

    args = dict(additional_columns="w", batch_size=16)
    ours = fit(tfray.Dataset.from_ray_data(data, "x", "y", **args))
    theirs = fit(data.to_tf("x", "y", **args))
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6)
    assert ours[0][-1] < ours[0][0]
    for a, b in zip(ours[1], theirs[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6)
