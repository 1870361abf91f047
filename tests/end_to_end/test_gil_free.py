"""Invariant 1: no TensorFlow thread takes the GIL.

The test holds the GIL in the main thread for several seconds (a C call made
through ctypes.PyDLL keeps it) while a graph-mode consumer, started just
before, drains batches already resolved into the channel: GetNext, tensor
release, and a new iterator's creation, first GetNext (of an epoch offered
ahead) and destruction all happen inside the hold, as do whole epochs of a
list replayed natively (each a new iterator, as `repeat` makes), and so does the
cancellation of a GetNext blocked on an empty channel (a prefetch's
background read of a source whose only batch never resolves, cancelled by
deleting the prefetch iterator). If any of them needed the GIL, the
consumer would finish after the hold.
"""

import ctypes
import threading
import time

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import wait_until, without_prefetch

import tfray
from tfray._internal.runtime import runtime

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]

N = 24
SIDE = 512  # One 512x512 float32 batch (1 MB) per step.
HOLD_S = 8.0
WORK = 4  # Matmuls per batch.
REPLAYED, REPLAYED_EPOCHS = 3, 4


def hold_gil(seconds):
    """Sleeps in C without releasing the GIL."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def test_consumer_runs_while_another_thread_holds_the_gil():
    """Graph-mode GetNext, tensor release, iterator creation and destruction."""
    refs = [ray.put(np.full((SIDE, SIDE), i, np.float32)) for i in range(N)]
    ds = tfray.Dataset(refs, max_inflight=N)  # The channel can hold the epoch.
    iterator = iter(without_prefetch(ds))
    first = next(iterator)  # Asks for the epoch, outside the hold.
    wait_until(lambda: ds.stats()[-1].queued == N - 1)  # The rest is resolved.
    # A source read twice has its next epoch started ahead and offered to
    # its next iterator (the registry's view says when it is ready); with
    # max_inflight=1 its epoch of 2 is more than it may keep to replay.
    registry = runtime.get().registry
    other = tfray.Dataset(refs[:2], max_inflight=1)
    for _ in range(2):
        assert len(list(other)) == 2
    wait_until(lambda: registry.view(other.source_key).offered_queued == 1)
    other_epoch = without_prefetch(other)  # Reads no batch ahead of the one GetNext.
    # A list read twice whose epoch fits its look-ahead is replayed.
    replayed = tfray.Dataset(refs[:REPLAYED])
    for _ in range(2):
        assert len(list(replayed)) == REPLAYED
    wait_until(lambda: registry.view(replayed.source_key).replayed)
    replayed_epochs = without_prefetch(replayed).repeat(REPLAYED_EPOCHS)
    # A source whose only batch never resolves: its GetNext blocks on an
    # empty channel until it is cancelled.
    never = _never_ready.remote()
    blocked = tfray.Dataset([never], element_spec=tf.TensorSpec([None], tf.float32))
    warm = tf.data.Options()
    warm.experimental_warm_start = True  # The prefetch reads from its creation on.
    blocked_prefetch = without_prefetch(blocked).prefetch(1).with_options(warm)

    @tf.function
    def consume(it):
        # The prefetch's thread starts reading the blocked source now.
        blocked_handle, blocked_deleter = tf.raw_ops.AnonymousIteratorV2(
            output_types=[tf.float32], output_shapes=[[None]]
        )
        blocked_made = tf.raw_ops.MakeIterator(dataset=blocked_prefetch._variant_tensor, iterator=blocked_handle)
        with tf.control_dependencies([blocked_made]):
            total = tf.reduce_sum(first) * 0.0  # Batch 0 was read above.
        for _ in tf.range(N - 1):  # No prefetch after the source.
            m = next(it)
            # Some GIL-free work per batch, so the drain outlasts the start
            # of the hold and tensors are released during it.
            for _ in tf.range(WORK):
                total += tf.reduce_sum(tf.matmul(m, m)) / SIDE**3
        with tf.control_dependencies([total]):
            # Creates an iterator, reads the epoch offered to it, and destroys it.
            handle, deleter = tf.raw_ops.AnonymousIteratorV2(
                output_types=[tf.float32], output_shapes=[[None, SIDE]]
            )
            made = tf.raw_ops.MakeIterator(dataset=other_epoch._variant_tensor, iterator=handle)
        with tf.control_dependencies([made]):
            (batch,) = tf.raw_ops.IteratorGetNext(
                iterator=handle, output_types=[tf.float32], output_shapes=[[None, SIDE]]
            )
        # The batch's last use: the executor frees it (its release) before
        # anything that depends on this sum runs.
        total += tf.reduce_sum(batch)
        with tf.control_dependencies([total]):
            # Whole epochs of the replayed list, a new tfray iterator each.
            replay_handle, replay_deleter = tf.raw_ops.AnonymousIteratorV2(
                output_types=[tf.float32], output_shapes=[[None, SIDE]]
            )
            replay_made = tf.raw_ops.MakeIterator(dataset=replayed_epochs._variant_tensor, iterator=replay_handle)
        with tf.control_dependencies([replay_made]):
            for _ in tf.range(REPLAYED * REPLAYED_EPOCHS):
                (b,) = tf.raw_ops.IteratorGetNext(
                    iterator=replay_handle, output_types=[tf.float32], output_shapes=[[None, SIDE]]
                )
                total += tf.reduce_sum(b) / SIDE**2
        with tf.control_dependencies([total]):
            replay_deleted = tf.raw_ops.DeleteIterator(handle=replay_handle, deleter=replay_deleter)
            deleted = tf.raw_ops.DeleteIterator(handle=handle, deleter=deleter)
            # Cancels the blocked GetNext: the prefetch iterator's destruction
            # cancels its reader and joins its thread.
            unblocked = tf.raw_ops.DeleteIterator(handle=blocked_handle, deleter=blocked_deleter)
        with tf.control_dependencies([deleted, replay_deleted, unblocked]):
            return tf.identity(total), tf.timestamp()

    concrete = consume.get_concrete_function(iterator)  # Trace outside the hold.
    result = {}
    consumer = threading.Thread(target=lambda: result.update(out=concrete(iterator)))
    consumer.start()
    # A tight poll (wait_until collects garbage between polls, which takes
    # longer than the drain): the hold must start while the consumer works.
    deadline = time.monotonic() + 60
    while ds.stats()[-1].get_next_calls < 2 or not blocked.stats():
        assert time.monotonic() < deadline, "the consumer never started"
    consumed_before = ds.stats()[-1].batches
    blocked_before = (blocked.stats()[-1].get_next_calls, blocked.stats()[-1].batches)
    start = time.time()
    hold_gil(HOLD_S)
    end = time.time()
    # The hold began after `start` and lasted HOLD_S, so the GIL was held
    # until start + HOLD_S at least. `end` may be read after the main thread
    # has let the GIL go at the hold's end, by which time a consumer that
    # waited for it may already be done.
    held_until = start + HOLD_S
    consumer.join(timeout=60)

    assert not consumer.is_alive()
    total, finished_at = (t.numpy() for t in result["out"])
    # Batch i is all i, so each matmul's sum over SIDE**3 is i * i; the
    # other dataset's batch is all 0; the replayed epochs add i each.
    replayed_sum = REPLAYED_EPOCHS * sum(range(REPLAYED))
    assert total == pytest.approx(WORK * sum(i * i for i in range(N)) + replayed_sum, rel=1e-5)
    assert consumed_before < N, "inconclusive: the drain ended before the hold"
    assert blocked_before == (1, 0), "inconclusive: the blocked GetNext was not waiting when the hold began"
    assert start < finished_at < held_until, (
        f"the consumer finished {finished_at - start:.3f} s after the hold "
        f"began, which held the GIL for {HOLD_S} s (and ended {end - start:.3f} s after)"
    )
    # The iterator made inside the hold read the offered epoch, and was dropped.
    assert len(other.stats()) == 3 and other.stats()[-1].batches == 1
    assert other.stats()[-1].cancelled
    # The replayed epochs were served natively (the dispatcher counts them after).
    wait_until(lambda: len(replayed.stats()) == 2 + REPLAYED_EPOCHS)
    assert [s.batches for s in replayed.stats()] == [REPLAYED] * (2 + REPLAYED_EPOCHS)
    # The blocked read was cancelled without a batch.
    assert blocked.stats()[-1].cancelled and blocked.stats()[-1].batches == 0
    del iterator
    wait_until(lambda: ds.stats()[-1].cancelled)
    # The blocked epoch's feeder has stopped polling `never` before it is
    # cancelled: a feeder that sees it fail resolves it, and Ray's calls,
    # if the module's ray.shutdown() overtakes them, end the process.
    wait_until(lambda: blocked.stats()[-1].finished)
    ray.cancel(never, force=True)


@ray.remote(num_cpus=0)
def _never_ready():
    time.sleep(3600)
