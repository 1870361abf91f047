"""Invariants 3 and 4: errors are TF errors from next(); pins are released."""

import gc

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import store_bytes_used, wait_store_back_to, wait_until, without_prefetch

import tfray
from tfray._internal.runtime import runtime

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]


def image_batch(dtype=np.float32, rows=64, side=32):
    return {
        "image": np.zeros((rows, side, side, 3), dtype),
        "label": np.zeros((rows,), np.int64),
    }


def take_all(it, n):
    """Calls next() n times; returns each value or the error it raised."""
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except tf.errors.OpError as e:
            out.append(e)
    return out


def test_dtype_mismatch_names_the_field_and_the_stream_goes_on():
    """A bad batch is an InvalidArgumentError in its place; later batches follow."""
    refs = [ray.put(image_batch()), ray.put(image_batch(np.uint8)), ray.put(image_batch())]
    it = iter(tfray.Dataset(refs))
    first, bad, third = take_all(it, 3)
    assert isinstance(bad, tf.errors.InvalidArgumentError)
    assert "batch 1: image: expected float32 [?,32,32,3], got uint8 [64,32,32,3]" in bad.message
    assert first["image"].dtype == third["image"].dtype == tf.float32
    with pytest.raises(StopIteration):
        next(it)


def test_shape_mismatch():
    """A batch of the wrong shape names the field, expected vs. got."""
    refs = [ray.put(image_batch()), ray.put(image_batch(side=16))]
    _, bad = take_all(iter(tfray.Dataset(refs)), 2)
    assert isinstance(bad, tf.errors.InvalidArgumentError)
    assert "image: expected float32 [?,32,32,3], got float32 [64,16,16,3]" in bad.message


def test_structure_mismatch():
    """A batch with a missing field says which fields were expected."""
    refs = [ray.put(image_batch()), ray.put({"image": np.zeros((64, 32, 32, 3), np.float32)})]
    _, bad = take_all(iter(tfray.Dataset(refs)), 2)
    assert isinstance(bad, tf.errors.InvalidArgumentError)
    assert "structure: expected fields ['image', 'label'], got ['image']" in bad.message


def test_an_object_that_is_not_a_batch():
    """A Ray object that is not an array nest is refused, naming what it is."""
    spec = tf.TensorSpec([None], tf.float32)
    refs = [ray.put("hello"), ray.put([1.0, 2.0]), ray.put(np.ones(2, np.float32))]
    bad_str, bad_list, good = take_all(iter(tfray.Dataset(refs, element_spec=spec)), 3)
    assert "element: expected a numpy array, got str" in bad_str.message
    assert "structure: expected fields ['element'], got ['0', '1']" in bad_list.message
    np.testing.assert_array_equal(good.numpy(), [1.0, 1.0])


def test_ignore_errors_skips_bad_batches():
    """tf.data's ignore_errors() drops bad batches and keeps the rest."""
    refs = [ray.put(np.full(3, i, np.int32)) for i in range(4)]
    refs.insert(2, ray.put(np.zeros(3, np.float64)))
    ds = tfray.Dataset(refs).ignore_errors()
    assert [int(t[0]) for t in ds] == [0, 1, 2, 3]


def test_producer_exception_carries_type_message_and_traceback():
    """A task that raised: next() says which exception, its message and where."""

    @ray.remote
    def make_batch(i):
        if i == 1:
            raise ValueError(f"shard {i} is corrupt")
        return np.zeros(4, np.float32)

    refs = [make_batch.remote(i) for i in range(3)]
    _, bad, good = take_all(iter(tfray.Dataset(refs)), 3)
    assert isinstance(bad, tf.errors.UnknownError)
    assert "batch 1: the Ray task that produced it raised ValueError: shard 1 is corrupt" in (
        bad.message
    )
    # The producer's traceback, down to the line that raised (Ray's header
    # alone names the function, not the line).
    assert 'raise ValueError(f"shard {i} is corrupt")' in bad.message
    assert good.shape == (4,)


def test_application_errors_are_not_retried(tmp_path):
    """A task that raised is not run again (Ray's default): its error is delivered at once."""
    attempts = tmp_path / "attempts"

    @ray.remote
    def failing():
        with open(attempts, "a") as f:
            f.write("x")
        raise ValueError("bad input")

    (error,) = take_all(iter(tfray.Dataset([failing.remote()], element_spec=tf.TensorSpec([None], tf.float32))), 1)
    assert isinstance(error, tf.errors.UnknownError) and "ValueError: bad input" in error.message
    assert attempts.read_text() == "x", "the task ran again after raising"


def test_lost_object_is_a_data_loss_error():
    """A batch whose owner died (the object is lost) gives DataLossError, no hang."""

    @ray.remote(num_cpus=0)
    class Owner:
        def make(self):
            return [ray.put(np.zeros(100_000, np.float32))]  # Owned by the actor.

    owner = Owner.remote()
    (orphan,) = ray.get(owner.make.remote())
    ray.kill(owner)
    wait_until(lambda: _lost(orphan))  # The kill is asynchronous.
    refs = [ray.put(np.zeros(100_000, np.float32)), orphan, ray.put(np.ones(100_000, np.float32))]
    _, lost, last = take_all(iter(tfray.Dataset(refs)), 3)
    assert isinstance(lost, tf.errors.DataLossError), lost
    assert "batch 1: its Ray object is lost or was freed (OwnerDiedError)" in lost.message
    assert float(last[0]) == 1.0


def _lost(ref):
    try:
        ray.get(ref, timeout=5)
    except ray.exceptions.ObjectLostError:
        return True
    return False


def test_dropping_an_iterator_mid_epoch_releases_every_pin():
    """The object store returns to its baseline once iterator and refs are gone."""
    gc.collect()
    wait_until(lambda: runtime.get().pins.count() == 0)
    baseline = store_bytes_used()

    @ray.remote
    def make(i):
        return np.full((512, 512), i, np.float32)  # 1 MB each, in the store.

    refs = [make.remote(i) for i in range(20)]
    # Every task ends first: Ray leaves the result of a task that ends after
    # its refs were dropped in the store (unpinned, until the space is needed).
    assert len(ray.wait(refs, num_returns=len(refs), fetch_local=False, timeout=120)[0]) == len(refs)
    ds = tfray.Dataset(refs, max_inflight=4)
    it = iter(without_prefetch(ds))
    held = [next(it) for _ in range(3)]  # TF still holds these three.
    wait_until(lambda: ds.stats()[-1].queued == 4)
    assert ds.stats()[-1].batches == 3
    assert runtime.get().pins.count() >= 3
    del it
    wait_until(lambda: ds.stats()[-1].finished and ds.stats()[-1].cancelled)
    assert ds.stats()[-1].refs_in_flight == 0
    wait_until(lambda: runtime.get().pins.count() == 3)  # Only what TF still holds.
    del held
    wait_until(lambda: runtime.get().pins.count() == 0)
    del ds, refs
    wait_store_back_to(baseline)


def test_batches_pushed_one_at_a_time_are_unpinned_too():
    """Batches the feeder copies (pinned in Python, one at a time) are released like the others.

    Fortran-order arrays cannot reach TF as they are, so each batch leaves
    the window path for the one that copies it and pins it in Python.
    """
    gc.collect()
    wait_until(lambda: runtime.get().pins.count() == 0)
    refs = [ray.put(np.asfortranarray(np.full((64, 32), i, np.float32))) for i in range(8)]
    ds = tfray.Dataset(refs)
    assert [float(t[0, 0]) for t in ds] == list(range(8))
    assert ds.stats()[-1].arrays_copied == 8, "precondition: every batch was copied"
    wait_until(lambda: runtime.get().pins.count() == 0)


def test_a_blocked_get_next_honours_tf_cancellation():
    """GetNext waiting on a batch not yet produced returns when TF cancels."""
    import threading

    from tensorflow.python.eager import cancellation

    @ray.remote
    def slow_batch():
        import time

        time.sleep(60)
        return np.zeros(4, np.float32)

    slow = slow_batch.remote()
    ds = tfray.Dataset([slow], element_spec=tf.TensorSpec([None], tf.float32))

    @tf.function
    def first(d):
        return next(iter(d))  # The iterator is made inside the function.

    manager = cancellation.CancellationManager()
    cancelable = manager.get_cancelable_function(first.get_concrete_function(ds))
    outcome = {}

    def consume():
        try:
            cancelable(ds)
        except tf.errors.CancelledError as e:
            outcome["error"] = e

    consumer = threading.Thread(target=consume)
    consumer.start()
    wait_until(lambda: ds.stats() and ds.stats()[-1].get_next_calls >= 1)
    manager.start_cancel()
    consumer.join(timeout=20)
    assert not consumer.is_alive(), "GetNext ignored the cancellation"
    assert "error" in outcome
    wait_until(lambda: ds.stats()[-1].finished)  # The feeder stopped too.
    ray.cancel(slow, force=True)  # Its CPU, for the next test.
