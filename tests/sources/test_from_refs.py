"""tfray.Dataset.from_refs: structures, specs, epochs and tf.data composition."""

import collections

import numpy as np
import pytest
import ray
import tensorflow as tf

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]


def put_batches(n, rows=4, last_rows=None):
    """n dict batches; batch i holds the value i everywhere (a short last one)."""
    refs = []
    for i in range(n):
        r = last_rows if (last_rows and i == n - 1) else rows
        refs.append(
            ray.put(
                {
                    "x": np.full((r, 3), i, np.float32),
                    "y": np.full((r,), i, np.int64),
                }
            )
        )
    return refs


def ids(ds):
    return [int(b["y"][0]) for b in ds]


def test_dataset_is_a_tf_data_dataset_with_inferred_spec():
    """The source is a real tf.data.Dataset; the spec leaves the batch dim open."""
    ds = tfray.Dataset(put_batches(3))
    assert isinstance(ds, tf.data.Dataset)
    assert ds.element_spec == {
        "x": tf.TensorSpec([None, 3], tf.float32),
        "y": tf.TensorSpec([None], tf.int64),
    }


def test_short_last_batch_and_values():
    """A short last batch fits the inferred spec and every value arrives intact."""
    refs = put_batches(4, rows=5, last_rows=2)
    got = list(tfray.Dataset.from_refs(refs))
    assert [b["x"].shape[0] for b in got] == [5, 5, 5, 2]
    for i, b in enumerate(got):
        np.testing.assert_array_equal(b["x"].numpy(), np.full(b["x"].shape, i, np.float32))


def test_each_iterator_is_a_new_epoch_and_cardinality_is_known():
    """A list of refs replays: every iterator reads all batches in order."""
    ds = tfray.Dataset(put_batches(6))
    assert ds.cardinality().numpy() == 6
    assert ids(ds) == list(range(6))
    assert ids(ds) == list(range(6))
    assert len(ds.stats()) == 2


def test_one_shot_iterator_reads_once_then_fails_clearly():
    """An iterator of refs may be read once; a second epoch is a clear error."""
    ds = tfray.Dataset(iter(put_batches(3)))
    assert ds.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY
    assert ids(ds) == [0, 1, 2]
    with pytest.raises(tf.errors.FailedPreconditionError, match="one-shot iterator.*Pass a list of refs to from_refs to read it again"):
        ids(ds)


@pytest.mark.parametrize(
    "batch",
    [
        np.arange(12, dtype=np.int32).reshape(4, 3),
        (np.zeros((2, 2), np.float64), np.ones((2,), np.bool_)),
        [np.zeros((2,), np.uint8), np.ones((2, 1), np.float16)],
        {"a": {"b": np.zeros((2, 2), np.complex64)}, "c": np.int16(7)},
    ],
    ids=["array", "tuple", "list", "nested-dict-and-scalar"],
)
def test_batch_structures(batch):
    """Arrays and dict / tuple / list nests arrive as the same nest of tensors."""
    (got,) = list(tfray.Dataset([ray.put(batch)]))
    flat_in = tf.nest.flatten(tuple(batch) if isinstance(batch, list) else batch)
    flat_out = tf.nest.flatten(got)
    assert len(flat_in) == len(flat_out)
    for a, t in zip(flat_in, flat_out):
        assert t.dtype.as_numpy_dtype == np.asarray(a).dtype
        np.testing.assert_array_equal(t.numpy(), a)


def test_bfloat16():
    """bfloat16 (ml_dtypes) arrays are carried as tf.bfloat16."""
    import ml_dtypes

    a = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 4)
    (got,) = list(tfray.Dataset([ray.put(a)]))
    assert got.dtype == tf.bfloat16
    np.testing.assert_array_equal(tf.cast(got, tf.float32).numpy(), a.astype(np.float32))


def test_explicit_element_spec():
    """A given element_spec is used as is (no peek at the data)."""
    spec = {"x": tf.TensorSpec([None, 3], tf.float32), "y": tf.TensorSpec([None], tf.int64)}
    ds = tfray.Dataset(put_batches(2), element_spec=spec)
    assert ds.element_spec == spec
    assert ids(ds) == [0, 1]


def test_unsupported_dtype_is_refused_naming_the_field_and_dtypes():
    """Strings and objects are refused with the field and the supported dtypes."""
    ref = ray.put({"name": np.array(["a", "b"]), "x": np.zeros(2)})
    with pytest.raises(TypeError, match=r"name: dtype <U1 is not supported.*float32"):
        tfray.Dataset([ref])


def test_wrong_argument_types():
    """Arguments of the wrong type fail at construction with a clear message."""
    with pytest.raises(TypeError, match="ObjectRef"):
        tfray.Dataset([np.zeros(3)])
    with pytest.raises(TypeError, match="max_inflight"):
        tfray.Dataset(put_batches(1), max_inflight="4")
    with pytest.raises(ValueError, match="element_spec"):
        tfray.Dataset([])


def test_composes_with_tf_data_transformations():
    """map (parallel), batch/unbatch, shuffle, cache, take, repeat, zip, prefetch."""
    ds = tfray.Dataset(put_batches(8, rows=4))
    pipeline = (
        ds.map(lambda b: b["y"], num_parallel_calls=tf.data.AUTOTUNE)
        .unbatch()
        .batch(8)
        .cache()
        .shuffle(16, seed=1)
        .repeat(2)
        .take(6)
        .prefetch(tf.data.AUTOTUNE)
    )
    values = np.concatenate([b.numpy() for b in pipeline]).tolist()
    assert len(values) == 48
    # The first (cached) epoch is all 8 batches of 4 rows, shuffled.
    assert collections.Counter(values[:32]) == {i: 4 for i in range(8)}
    assert set(values[32:]) <= set(range(8))
    assert len(ds.stats()) == 1  # The second epoch came from the cache.
    zipped = tf.data.Dataset.zip((ds, tfray.Dataset(put_batches(8, rows=4))))
    assert [int(a["y"][0]) + int(b["y"][0]) for a, b in zipped] == [2 * i for i in range(8)]


def test_iteration_inside_tf_function():
    """A graph-mode loop over the dataset creates its iterator in the graph."""
    ds = tfray.Dataset(put_batches(5, rows=3))

    @tf.function
    def total(d):
        s = tf.constant(0.0)
        for b in d:
            s += tf.reduce_sum(b["x"])
        return s

    # Batch i holds 3 rows x 3 columns of value i.
    assert total(ds).numpy() == pytest.approx(9 * sum(range(5)))
    assert total(ds).numpy() == pytest.approx(9 * sum(range(5)))


def test_options_and_distribution_rewrites_reinstantiate_the_source():
    """tf.data rewrites that re-instantiate the graph find the source by key."""
    ds = tfray.Dataset(put_batches(4))
    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = True
    ds2 = ds.with_options(options).map(lambda b: b["y"])
    strategy = tf.distribute.get_strategy()
    dist = strategy.experimental_distribute_dataset(ds2)
    assert sorted(int(b[0]) for b in dist) == [0, 1, 2, 3]
    graph = ds._as_serialized_graph()
    assert b"TfrayDataset" in graph.numpy()


def test_epochs_after_the_second_are_started_ahead_and_released_with_the_dataset():
    """A list read again has its next epoch offered as the last one ends.

    The offer's first batches are resolved and pinned before any iterator
    asks; an iterator takes them (the order and values are those of any
    epoch), and a dataset collected with an offer untaken releases them.
    """
    import gc

    from conftest import store_bytes_used, wait_store_back_to, wait_until

    from tfray._internal.runtime import runtime

    refs = [ray.put(np.full((64, 1024), i, np.float32)) for i in range(6)]
    wait_until(lambda: runtime.get().pins.count() == 0)
    baseline = store_bytes_used()
    ds = tfray.Dataset(refs, max_inflight=3)
    for _ in range(2):
        assert [int(b[0, 0]) for b in ds] == list(range(6))
    # The next epoch's first window is pinned with no iterator open.
    wait_until(lambda: runtime.get().pins.count() >= 3)
    for _ in range(3):  # Each taken offer is replaced as its epoch ends.
        assert [int(b[0, 0]) for b in ds] == list(range(6))
        wait_until(lambda: runtime.get().pins.count() >= 3)
    assert len(ds.stats()) == 5 and all(s.batches == 6 for s in ds.stats())
    del ds
    gc.collect()
    wait_until(lambda: runtime.get().pins.count() == 0)
    wait_store_back_to(baseline)


def test_strategy_run_over_a_distributed_tfray_dataset():
    """strategy.run steps over experimental_distribute_dataset of a tfray dataset: every batch once.

    The in-process sibling of test_multi_worker's slow ``loop-ds`` case
    (a MirroredStrategy on this process's CPU instead of two workers).
    """
    refs = [ray.put({"x": np.full((4, 3), i, np.float32)}) for i in range(6)]
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    dist = strategy.experimental_distribute_dataset(tfray.Dataset(refs))

    @tf.function
    def step(batch):
        per_replica = strategy.run(lambda b: tf.reduce_sum(b["x"][:, 0]), args=(batch,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    assert sorted(float(step(batch)) for batch in dist) == [4.0 * i for i in range(6)]


def test_the_dataset_graph_is_written_and_rebuilt_within_the_process():
    """What tf.distribute's rewrites do to a dataset across workers: the graph, then a new dataset.

    The second in-process sibling of test_multi_worker's slow cases: a
    one-device strategy never writes the graph, so this writes it and
    reads the rebuilt dataset (its source key names the same source).
    """
    refs = [ray.put({"x": np.full((4, 3), i, np.float32)}) for i in range(6)]
    ds = tfray.Dataset(refs)
    graph = tf.raw_ops.DatasetToGraphV2(input_dataset=ds._variant_tensor)
    assert b"TfrayDataset" in graph.numpy()
    rebuilt = tf.data.experimental.from_variant(tf.raw_ops.DatasetFromGraph(graph_def=graph), ds.element_spec)
    assert [float(b["x"][0, 0]) for b in rebuilt] == [float(i) for i in range(6)]
