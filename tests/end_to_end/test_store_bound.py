"""The store bound of a ``from_generators`` epoch, measured against what the README states.

With a consumer that stops reading, an epoch holds in the object store at
most ``max_inflight_per_producer`` batches per running producer not yet
taken from Ray, plus tfray's look-ahead twice over (resolved ahead, and
queued for TF): it starts at 2 batches, grows only while TF waits (as it
does for the first batch), and stays within ``max_inflight_per_producer``
per running producer and a quarter of the store. Plus what the tf.data
pipeline holds: here the batch in hand. By default that count is 2 for
producers started before the dataset read a batch, and follows the
batches' bytes after (sources/inflight.py).
"""

import time

import conftest
import numpy as np
import pytest
import ray
import tensorflow as tf

import tfray
from tfray._internal.sources import generators

pytestmark = pytest.mark.timeout(240)

MB = 1024 * 1024
STORE_BYTES = 400 * MB
CPUS = 2
PER_PRODUCER = 2  # The default max_inflight_per_producer, before a batch was read.


@pytest.fixture(scope="module", autouse=True)
def big_store():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=CPUS,
        object_store_memory=STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


def bound_in_batches(batch_bytes, running, per_producer=PER_PRODUCER):
    most = per_producer * running
    lookahead = max(1, min(most, int(STORE_BYTES // 4 // (2 * batch_bytes))))
    return most + 2 * lookahead + 1


def shards_of(batch_bytes):
    """A generator function: 10 float32 batches of ``batch_bytes`` a shard."""

    def gen(shard):
        for i in range(10):
            yield np.full(batch_bytes // 4, i, np.float32)

    return gen


def stalled(created_before, run_ahead, seconds=6, limit=60):
    """``(peak, made)`` while the consumer reads nothing.

    It reads nothing for ``seconds``, and longer, up to ``limit`` seconds,
    until the store's use has reached ``run_ahead`` bytes: on a loaded
    machine the producers take longer to run ahead to their backpressure.
    ``peak``: the store's use, sampled. ``made``: the bytes created in the
    store since ``created_before`` (``conftest.store_bytes_created()`` taken
    before the epoch's iterator): with every batch of the epoch still held
    or unread, it bounds the peak however briefly the peak lasted, where
    sampling could miss it.
    """
    peak = 0
    start = time.monotonic()
    while True:
        peak = max(peak, conftest.store_bytes_used())
        waited = time.monotonic() - start
        if waited >= limit or (waited >= seconds and peak >= run_ahead):
            break
        time.sleep(0.05)
    return peak, conftest.store_bytes_created() - created_before


@pytest.mark.parametrize("batch_mb", [16, 32])
def test_a_reader_that_stops_holds_at_most_the_stated_bound(batch_mb):
    """Peak store use with a stalled consumer stays within the bound, and nothing spills."""
    size = batch_mb * MB

    ds = tfray.Dataset.from_generators(shards_of(size), 4, element_spec=tf.TensorSpec([None], tf.float32))
    created = conftest.store_bytes_created()
    it = iter(conftest.without_prefetch(ds))
    first = next(it)
    peak, made = stalled(created, run_ahead=PER_PRODUCER * CPUS * size)
    bound = bound_in_batches(size, running=CPUS)
    print(f"{batch_mb} MB batches: peak {peak / size:.1f} batches, made {made / size:.1f}, bound {bound}")
    # The producers did run ahead to their backpressure: the bound was tested.
    assert peak >= PER_PRODUCER * CPUS * size
    assert made <= bound * size + 4 * MB  # Plus the store's own small objects.
    assert conftest.store_stats().spilled_bytes_total == 0
    del first
    assert sum(1 for _ in it) == 39
    del it
    conftest.wait_until(lambda: conftest.store_bytes_used() < size)  # For the next case.


def test_a_later_epoch_runs_ahead_by_the_batches_bytes_within_the_bound(monkeypatch):
    """By default, producers started after a batch was read pause at a count from its size, within the bound."""
    size = 16 * MB
    per_producer = STORE_BYTES // 4 // CPUS // size  # 3: a quarter of the store over 2 producers.
    counts = []  # The backpressure each epoch's producers were given.
    given = generators.with_backpressure

    def recorded(remote_fn, options, count):
        counts.append(count)
        return given(remote_fn, options, count)

    monkeypatch.setattr(generators, "with_backpressure", recorded)

    ds = tfray.Dataset.from_generators(shards_of(size), 4, element_spec=tf.TensorSpec([None], tf.float32))
    # A first epoch: its producers start before any batch is read.
    assert sum(1 for _ in ds.take(1)) == 1
    assert counts[0] == PER_PRODUCER
    conftest.assert_feeders_idle()  # Its producers stopped: they make nothing more.
    conftest.wait_until(lambda: conftest.store_bytes_used() < size)
    before = len(counts)
    created = conftest.store_bytes_created()
    it = iter(conftest.without_prefetch(ds))
    first = next(it)
    peak, made = stalled(created, run_ahead=per_producer * CPUS * size)
    assert counts[before:] == [per_producer], counts
    bound = bound_in_batches(size, running=CPUS, per_producer=per_producer)
    print(f"a later epoch, {per_producer} per producer: peak {peak / size:.1f} batches, made {made / size:.1f}, bound {bound}")
    assert peak >= per_producer * CPUS * size
    assert made <= bound * size + 4 * MB
    assert conftest.store_stats().spilled_bytes_total == 0
    del first
    assert sum(1 for _ in it) == 39
    del it
    conftest.wait_until(lambda: conftest.store_bytes_used() < size)
