"""Per-iterator stats, the epoch verdict, and spans in TF's profiler trace."""

import glob
import os
import time

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import without_prefetch

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]


def test_stats_count_batches_bytes_and_waits():
    """Stats add up: batches, bytes, zero-copy bytes, the span TF was reading."""
    refs = [ray.put(np.ones((256, 256), np.float32)) for _ in range(6)]
    ds = tfray.Dataset(refs)
    for _ in ds:
        pass
    (s,) = ds.stats()
    assert s.batches == 6 and s.bytes == 6 * 256 * 256 * 4
    assert s.bytes_zero_copy == s.bytes and s.bytes_copied == 0
    assert s.get_next_calls == 7  # Six batches and the end.
    assert s.finished and s.refs_in_flight == 0 and s.queued == 0
    assert 0 <= s.consumer_wait_s <= s.active_s


def test_verdict_input_bound_when_producers_are_slow():
    """Slow producers: TF waits most of the epoch, and the verdict says so."""

    def slow(shard):
        for _ in range(6):
            time.sleep(0.2)
            yield np.zeros(4, np.float32)

    ds = tfray.Dataset.from_generators(slow, 1, element_spec=tf.TensorSpec([None], tf.float32))
    assert sum(1 for _ in ds) == 6
    verdict = ds.stats()[-1].verdict()
    assert verdict.startswith("input-bound: TensorFlow waited for input"), verdict


def test_verdict_not_input_bound_when_the_consumer_is_slow():
    """Batches ready ahead of a slow consumer: not input-bound; the feeder waited."""
    refs = [ray.put(np.zeros(4, np.float32)) for _ in range(8)]
    ds = tfray.Dataset(refs, max_inflight=2)
    read = 0
    for _ in without_prefetch(ds):
        time.sleep(0.15)
        read += 1
    assert read == 8
    s = ds.stats()[-1]
    assert s.verdict().startswith("not input-bound"), s.verdict()
    assert s.producer_wait_s > 0.5


def test_get_next_waits_show_in_the_profiler_trace(tmp_path):
    """GetNext's wait is a named span in the TensorFlow profiler's trace."""

    @ray.remote(num_cpus=0)
    def late():
        time.sleep(2)
        return np.zeros((64, 64), np.float32)

    # The first batch is made after the first GetNext starts to wait for it
    # (a batch already in the channel is no wait, and has no span).
    refs = [late.remote()] + [ray.put(np.zeros((64, 64), np.float32)) for _ in range(3)]
    ds = tfray.Dataset(refs, element_spec=tf.TensorSpec([64, 64], tf.float32))  # No batch read to infer it.
    tf.profiler.experimental.start(str(tmp_path))
    try:
        assert sum(1 for _ in ds) == 4
    finally:
        tf.profiler.experimental.stop()
    traces = glob.glob(os.path.join(str(tmp_path), "**", "*.xplane.pb"), recursive=True)
    assert traces, "the profiler wrote no trace"
    contents = b"".join(open(path, "rb").read() for path in traces)
    assert ds.stats()[-1].consumer_wait_s > 1  # Precondition: GetNext waited.
    assert b"TfrayWaitForBatch" in contents
