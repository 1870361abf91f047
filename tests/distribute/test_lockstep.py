"""Epochs read in lockstep never hang, on a cluster of 1 CPU or 2.

Two ``from_generators`` epochs read together (zip, ``sample_from_datasets``,
Keras training with a validation set, two iterators advanced by hand) once
hung for good: the first epoch's producers, paused by backpressure, held
every CPU while its consumer waited on the second epoch, whose producers
could never start. Producers now reserve no CPU from Ray. A watchdog fails
each test, with every thread's stack, if no batch arrives for 20 s.
"""

import sys
import threading
import time
import traceback

import conftest
import numpy as np
import pytest
import ray
import tensorflow as tf

import tfray

pytestmark = pytest.mark.timeout(240)

SPEC = tf.TensorSpec([None, 8], tf.float32)
STALL_S = 20


@pytest.fixture(scope="module", params=[1, 2], ids=["1cpu", "2cpus"])
def cpus(request):
    if request.param == 2:  # start_ray()'s, which other modules share.
        with conftest.shared_ray():
            yield request.param
        return
    conftest.shutdown_ray()
    ray.init(
        address="local",
        num_cpus=request.param,
        object_store_memory=conftest.OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield request.param
    conftest.shutdown_ray()


# More batches a shard than tfray's look-ahead and Ray's backpressure hold
# between them: the producers do pause, holding what they reserve. A batch
# over half a bundle's bound (2 MB, producer.py) travels alone or in a pair,
# so what they hold is counted in batches; small batches, bundled by the
# hundred, would let a whole shard be taken and its producer end.
BATCHES = 40
ROWS = (2 << 20) // (8 * 4) + 1


def generators(shards, batches=BATCHES, offset=0):
    def gen(shard):
        for i in range(batches):
            yield np.full((ROWS, 8), offset + 100 * shard + i, np.float32)

    return tfray.Dataset.from_generators(gen, shards, element_spec=SPEC)


def run_watched(work):
    """Runs ``work(tick)``; fails with all stacks if ``tick`` is not called for STALL_S."""
    ticks = [0]
    outcome = []
    done = threading.Event()

    def run():
        try:
            outcome.append(work(lambda: ticks.__setitem__(0, ticks[0] + 1)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            outcome.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="lockstep-consumer", daemon=True).start()
    seen, since = 0, time.monotonic()
    while not done.wait(0.25):
        if ticks[0] != seen:
            seen, since = ticks[0], time.monotonic()
        elif time.monotonic() - since > STALL_S:
            stacks = "\n".join(
                f"--- thread {ident}:\n" + "".join(traceback.format_stack(frame))
                for ident, frame in sys._current_frames().items()
            )
            pytest.fail(f"no batch for {STALL_S} s after {seen} batches; stacks:\n{stacks}")
    (result,) = outcome
    if isinstance(result, BaseException):
        raise result
    return result


def count(ds):
    def work(tick):
        n = 0
        for _ in ds:
            n += 1
            tick()
        return n

    return work


def test_zip_of_a_dataset_with_itself(cpus):
    """``zip((g, g))``: two epochs of one 3-shard dataset, read in lockstep."""
    g = generators(3)
    assert run_watched(count(tf.data.Dataset.zip((g, g)))) == 3 * BATCHES


def test_zip_of_two_datasets(cpus):
    """``zip((g1, g2))``: each with more shards than the cluster has CPUs."""
    pairs = run_watched(count(tf.data.Dataset.zip((generators(3), generators(4, offset=1000)))))
    assert pairs == 3 * BATCHES


def test_sample_from_datasets(cpus):
    """``sample_from_datasets``: reads whichever dataset the dice pick, to the end of both."""
    mixed = tf.data.Dataset.sample_from_datasets(
        [generators(3), generators(3, offset=1000)], seed=1, stop_on_empty_dataset=False
    )
    assert run_watched(count(mixed)) == 6 * BATCHES


def test_two_iterators_advanced_by_hand(cpus):
    """Two models' input loops in one process, one step each in turn."""

    def work(tick):
        first, second = iter(generators(3)), iter(generators(2, batches=9, offset=1000))
        for _ in range(18):
            next(first)
            next(second)
            tick()
        return True

    assert run_watched(work)


def test_keras_fit_with_steps_per_epoch_and_a_generator_validation_set(cpus):
    """Keras keeps its training iterator across epochs while validation reads a new one."""
    import keras

    train = generators(3).map(lambda b: (b, tf.reduce_sum(b, axis=1, keepdims=True)))
    val = generators(2, batches=3, offset=1000).map(lambda b: (b, tf.reduce_sum(b, axis=1, keepdims=True)))

    class Tick(keras.callbacks.Callback):
        def __init__(self, tick):
            super().__init__()
            self.tick = tick

        def on_train_batch_end(self, batch, logs=None):
            self.tick()

        def on_test_batch_end(self, batch, logs=None):
            self.tick()

    def work(tick):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(
            train, steps_per_epoch=10, epochs=3, validation_data=val, callbacks=[Tick(tick)], verbose=0
        )
        return history.history

    history = run_watched(work)
    assert len(history["loss"]) == 3 and len(history["val_loss"]) == 3
