"""ds.shard(n, i) on a tfray source reads only its share, at the source."""

import numpy as np
import pytest
import ray
import ray.data
import tensorflow as tf
from support import resolutions

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]


def test_refs_shard_resolves_only_its_refs():
    """Shard i of n gets batches i, i+n, ...; the others are never fetched."""
    refs = [resolutions.put(("shard", i), np.full(2, i, np.int64)) for i in range(10)]
    ds = tfray.Dataset(refs, element_spec=tf.TensorSpec([None], tf.int64))
    part = ds.shard(3, 1)
    assert isinstance(part, tfray.Dataset)
    assert part.cardinality().numpy() == 3
    assert [int(t[0]) for t in part] == [1, 4, 7]
    assert sum(s.batches for s in part.stats()) == 3
    # Counted at deserialization: a ref fetched and dropped would show here.
    fetched = {key[1]: n for key, n in resolutions.resolved().items() if key[0] == "shard"}
    assert fetched == {1: 1, 4: 1, 7: 1}, f"resolutions by ref index: {fetched}"
    union = sorted(int(t[0]) for i in range(3) for t in ds.shard(3, i))
    assert union == list(range(10))


def test_generator_shard_runs_only_its_producers():
    """Only the generator shards index::num_shards run."""

    def gen(shard):
        yield np.full(1, shard, np.int64)

    ds = tfray.Dataset.from_generators(gen, 4, element_spec=tf.TensorSpec([None], tf.int64))
    assert [int(t[0]) for t in ds.shard(2, 1)] == [1, 3]


def test_shard_refuses_what_it_cannot_shard_at_the_source():
    """Bad indices, one-shot iterators and Ray Data get clear errors."""
    refs = [ray.put(np.zeros(2)) for _ in range(4)]
    with pytest.raises(ValueError, match="index"):
        tfray.Dataset(refs).shard(2, 2)
    with pytest.raises(TypeError, match="one-shot"):
        tfray.Dataset(iter(refs)).shard(2, 0)
    ray_ds = ray.data.from_numpy(np.zeros((8, 2)))
    with pytest.raises(TypeError, match="get_dataset_shard"):
        tfray.Dataset.from_ray_data(ray_ds, batch_size=4).shard(2, 0)
