"""Invariant 2: aligned C-contiguous arrays reach TF without a copy; others once."""

import numpy as np
import pytest
import ray
import tensorflow as tf
from support.dlpack_util import (
    assert_stats_match_addresses,
    assert_zero_copy,
    data_pointer,
)

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]


def test_tensor_aliases_the_object_store_buffer():
    """Every field's data pointer is the address ray.get returns for it, in the store."""
    image = np.random.rand(64, 32, 32, 3).astype(np.float32)  # ~786 KB: in plasma
    label = np.arange(64, dtype=np.int64)
    ref = ray.put({"image": image, "label": label})
    ds = tfray.Dataset([ref])
    batch = next(iter(ds))

    expected = ray.get(ref)  # Maps the same shared-memory object.
    for key in ("image", "label"):
        assert data_pointer(batch[key]) == expected[key].ctypes.data, key
        assert_zero_copy(batch[key], key)
    np.testing.assert_array_equal(batch["image"].numpy(), image)
    (stats,) = ds.stats()
    assert stats.bytes_copied == 0 and stats.arrays_copied == 0
    assert stats.bytes_zero_copy == image.nbytes + label.nbytes


def test_task_results_alias_without_copy():
    """Batches a Ray task returned alias the store across many batches."""

    @ray.remote
    def make(i):
        return np.full((256, 256), i, np.float32)

    refs = [make.remote(i) for i in range(8)]
    ds = tfray.Dataset(refs)
    seen = 0
    for i, t in enumerate(ds):
        assert data_pointer(t) == ray.get(refs[i]).ctypes.data
        assert_zero_copy(t, f"batch {i}")
        assert float(t[0, 0]) == i
        seen += 1
    assert seen == 8
    assert ds.stats()[-1].bytes_copied == 0


def test_generator_batches_alias_the_object_store():
    """Every field of every batch a streaming generator yields lies in the object store."""

    def produce(shard):
        import numpy as np

        for j in range(3):
            # 256 KB: above Ray's inline limit, so the whole batch is in plasma.
            yield {"x": np.full((256, 256), 10 * shard + j, np.float32), "id": np.array([10 * shard + j])}

    ds = tfray.Dataset.from_generators(
        produce,
        2,
        element_spec={"x": tf.TensorSpec([None, 256], tf.float32), "id": tf.TensorSpec([None], tf.int64)},
        ray_remote_args={"num_cpus": 0},
    )
    ids = []
    for batch in ds:
        for key in ("x", "id"):
            assert_zero_copy(batch[key], f"{key} of batch {int(batch['id'][0])}")
        assert float(batch["x"][0, 0]) == int(batch["id"][0])
        ids.append(int(batch["id"][0]))
    assert sorted(ids) == [0, 1, 2, 10, 11, 12]
    assert ds.stats()[-1].bytes_copied == 0


def test_non_contiguous_arrays_are_copied_once_and_counted():
    """A Fortran-order array arrives with the right values, copied once."""
    a = np.asfortranarray(np.arange(300 * 200, dtype=np.float32).reshape(300, 200))
    ref = ray.put(a)
    assert not ray.get(ref).flags.c_contiguous  # Ray keeps the order.
    ds = tfray.Dataset([ref])
    (t,) = list(ds)
    np.testing.assert_array_equal(t.numpy(), a)
    (stats,) = ds.stats()
    assert stats.arrays_copied == 1
    assert stats.bytes_copied == a.nbytes
    assert data_pointer(t) % 64 == 0


def test_unaligned_arrays_are_copied_to_aligned_memory():
    """An array not on a 64-byte boundary is copied to one, values intact."""
    # Ray packs small arrays of one object back to back, so not all land on
    # a 64-byte boundary.
    value = {"x": np.arange(10, dtype=np.int8), "y": np.arange(5, dtype=np.float64)}
    ref = ray.put(value)
    offsets = [a.ctypes.data % 64 for a in ray.get(ref).values()]
    assert any(offsets), "precondition: Ray returned an unaligned array"
    ds = tfray.Dataset([ref])
    (got,) = list(ds)
    for key in value:
        np.testing.assert_array_equal(got[key].numpy(), value[key])
        assert data_pointer(got[key]) % 64 == 0
    (stats,) = ds.stats()
    assert stats.arrays_copied == sum(1 for o in offsets if o)
    assert stats.bytes_copied + stats.bytes_zero_copy == sum(a.nbytes for a in value.values())


def test_tf_never_writes_into_the_object_store():
    """Ops that could reuse an input buffer in place leave Ray's object intact."""
    a = np.arange(128 * 128, dtype=np.float32).reshape(128, 128)
    ref = ray.put(a)
    ds = tfray.Dataset([ref]).map(lambda x: tf.nn.relu(-x) + 1.0)
    (out,) = list(ds)
    np.testing.assert_array_equal(out.numpy(), np.maximum(-a, 0) + 1.0)
    np.testing.assert_array_equal(ray.get(ref), a)


def test_from_refs_stats_match_addresses_over_epochs():
    """Plasma objects, inline task results, unaligned and Fortran arrays: stats by address, each epoch."""

    @ray.remote
    def inline(i):
        return np.full((4, 64), i, np.float32)  # 1 KB: Ray returns it inline, a copy in the heap.

    @ray.remote
    def plasma(i):
        return np.full((1024, 64), i, np.float32)  # 256 KB: in the store.

    refs = [plasma.remote(0), inline.remote(1), plasma.remote(2), inline.remote(3)]
    ds = tfray.Dataset(refs, element_spec=tf.TensorSpec([None, 64], tf.float32))
    for epoch in range(2):  # The second epoch is a replay of the first.
        elements = list(ds)
        assert len(elements) == 4
        stats = ds.stats()[-1]
        total, in_store = assert_stats_match_addresses(stats, elements, f"epoch {epoch}")
        assert in_store == 2 * 1024 * 64 * 4
        assert stats.bytes_copied_upstream == 2 * 4 * 64 * 4 and stats.bytes_copied_by_tfray == 0

    fortran = ray.put(np.asfortranarray(np.ones((300, 200), np.float32)))
    ds = tfray.Dataset([fortran])
    elements = list(ds)
    stats = ds.stats()[-1]
    assert_stats_match_addresses(stats, elements, "a Fortran array")
    assert stats.bytes_copied == stats.bytes_copied_by_tfray == 300 * 200 * 4
    assert stats.arrays_copied == stats.arrays_copied_by_tfray == 1


def test_from_generators_stats_match_addresses():
    """Small batches bundled into one object, and batches over the store's size (fallback files)."""

    def produce(arg):
        import numpy as np

        shard, rows = arg
        for j in range(3):
            yield np.full((rows, 1024), 10 * shard + j, np.float32)

    small = tfray.Dataset.from_generators(
        produce, [(0, 4), (1, 4)], element_spec=tf.TensorSpec([None, 1024], tf.float32),
        ray_remote_args={"num_cpus": 0},
    )
    elements = list(small)
    assert len(elements) == 6
    assert_stats_match_addresses(small.stats()[-1], elements, "bundled 16 KB batches")

    # 160 MB, over the test's 150 MB store: Ray writes it to a fallback file.
    rows = 160 * 1024 * 1024 // 4096
    big = tfray.Dataset.from_generators(
        produce, [(0, rows)], element_spec=tf.TensorSpec([None, 1024], tf.float32),
        ray_remote_args={"num_cpus": 0},
    )
    seen = 0  # Batches are checked one at a time: three would not fit on the disk at once.
    for batch in big:
        path = assert_zero_copy(batch, f"batch {seen} over the store's size")
        assert "/dev/shm/" not in path, f"precondition: a fallback file, not {path}"
        seen += 1
        stats = big.stats()[-1]
        assert stats.bytes_zero_copy == stats.bytes == seen * rows * 4096
        assert stats.bytes_copied == 0
        del batch
    assert seen == 3
