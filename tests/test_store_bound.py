"""The store bound of a ``from_generators`` epoch, measured against what the README states.

With a consumer that stops reading, an epoch holds in the object store at
most ``max_inflight_per_producer`` batches per running producer not yet
taken from Ray, plus tfray's look-ahead twice over (resolved ahead, and
queued for TF): it starts at 2 batches, grows only while TF waits (as it
does for the first batch), and stays within ``max_inflight_per_producer``
per running producer and a quarter of the store. Plus what the tf.data
pipeline holds: here the batch in hand.
"""

import time

import numpy as np
import pytest
import ray
import tensorflow as tf

import conftest
import tfray

pytestmark = pytest.mark.timeout(240)

MB = 1024 * 1024
STORE_BYTES = 400 * MB
CPUS = 2
PER_PRODUCER = 2  # The default max_inflight_per_producer.


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


def bound_in_batches(batch_bytes, running):
    most = PER_PRODUCER * running
    lookahead = max(1, min(most, int(STORE_BYTES // 4 // (2 * batch_bytes))))
    return most + 2 * lookahead + 1


@pytest.mark.parametrize("batch_mb", [16, 32])
def test_a_reader_that_stops_holds_at_most_the_stated_bound(batch_mb):
    """Peak store use with a stalled consumer stays within the bound, and nothing spills."""
    size = batch_mb * MB

    def gen(shard):
        for i in range(10):
            yield np.full(size // 4, i, np.float32)

    ds = tfray.Dataset.from_generators(gen, 4, element_spec=tf.TensorSpec([None], tf.float32))
    it = iter(conftest.without_prefetch(ds))
    first = next(it)
    peak = 0
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        peak = max(peak, conftest.store_bytes_used())
        time.sleep(0.05)
    bound = bound_in_batches(size, running=CPUS)
    print(f"{batch_mb} MB batches: peak {peak / size:.1f} batches, bound {bound}")
    # The producers did run ahead to their backpressure: the bound was tested.
    assert peak >= PER_PRODUCER * CPUS * size
    assert peak <= bound * size + 4 * MB  # Plus the store's own small objects.
    assert conftest.store_stats().spilled_bytes_total == 0
    del first
    assert sum(1 for _ in it) == 39
    del it
    conftest.wait_until(lambda: conftest.store_bytes_used() < size)  # For the next case.
