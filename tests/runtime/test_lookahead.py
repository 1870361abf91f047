"""The look-ahead adapts to an input-bound consumer, within its memory budget."""

import time

import numpy as np
import pytest
import ray
from conftest import OBJECT_STORE_BYTES

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]

MB = 1 << 20


@ray.remote
def slow_batch(i, nbytes):
    time.sleep(0.05)  # A producer slower than the consumer.
    return np.full(nbytes // 8, i, np.float64)


def read_all(ds):
    return [float(t[0]) for t in ds]


def test_grows_when_tensorflow_waits_for_input():
    """An input-bound epoch doubles the look-ahead from its start of 2."""
    refs = [slow_batch.remote(i, 4096) for i in range(40)]
    ds = tfray.Dataset(refs)
    assert read_all(ds) == list(range(40))
    assert ds.stats()[-1].lookahead > 2


def test_stays_within_the_memory_budget():
    """Batches pinned ahead (window and channel) stay within max_inflight_bytes.

    The same epoch with a budget 16 times larger grows past it: the limit,
    not a look-ahead that never grew, is what holds it.
    """
    roomy = tfray.Dataset([slow_batch.remote(i, MB) for i in range(16)], max_inflight_bytes=64 * MB)
    assert read_all(roomy) == list(range(16))
    assert roomy.stats()[-1].lookahead > 2, "precondition: this epoch makes the look-ahead grow"
    refs = [slow_batch.remote(i, MB) for i in range(16)]
    ds = tfray.Dataset(refs, max_inflight_bytes=4 * MB)
    assert read_all(ds) == list(range(16))
    assert ds.stats()[-1].lookahead <= 2  # 4 MB / (2 x 1 MB batches).


def test_a_fixed_look_ahead_does_not_move():
    """max_inflight fixes the look-ahead."""
    refs = [slow_batch.remote(i, 4096) for i in range(12)]
    ds = tfray.Dataset(refs, max_inflight=3)
    assert read_all(ds) == list(range(12))
    assert ds.stats()[-1].lookahead == 3


def test_the_next_epoch_starts_where_the_last_one_got_to():
    """Short epochs do not each start small again."""
    refs = [slow_batch.remote(i, 4096) for i in range(40)]
    ds = tfray.Dataset(refs)
    read_all(ds)
    learned = ds.stats()[-1].lookahead
    assert learned > 2
    it = iter(ds)
    next(it)
    assert ds.stats()[-1].lookahead >= learned


def test_the_default_budget_is_a_quarter_of_the_object_store():
    """Without max_inflight_bytes, batches pinned ahead stay within a quarter of the store.

    With 10 MB batches a quarter of the 150 MB store allows a look-ahead of
    1 (37.5 MB / (2 x 10 MB)); twice that budget lets the same epoch grow.
    """
    roomy = tfray.Dataset([slow_batch.remote(i, 10 * MB) for i in range(8)], max_inflight_bytes=OBJECT_STORE_BYTES // 2)
    assert read_all(roomy) == list(range(8))
    assert roomy.stats()[-1].lookahead > 1, "precondition: this epoch makes the look-ahead grow"
    del roomy
    ds = tfray.Dataset([slow_batch.remote(i, 10 * MB) for i in range(8)])
    assert read_all(ds) == list(range(8))
    assert ds.stats()[-1].lookahead == 1
