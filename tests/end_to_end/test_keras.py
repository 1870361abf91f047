"""Keras 3 fit / evaluate / predict on a tfray dataset."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfray  # noqa: E402

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

FEATURES, CLASSES, ROWS, BATCHES = 16, 4, 64, 24


@ray.remote
def make_batch(i):
    # The label is a fixed linear rule of the features: learnable.
    rng = np.random.default_rng(i)
    w = np.random.default_rng(1234).normal(size=(FEATURES, CLASSES))
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return {"x": x, "y": np.argmax(x @ w, axis=1).astype(np.int32)}


def test_fit_loss_falls_over_three_epochs_then_evaluate_and_predict():
    """Each epoch re-reads every batch; the loss falls; evaluate/predict work."""
    refs = [make_batch.remote(i) for i in range(BATCHES)]
    source = tfray.Dataset(refs)
    ds = source.map(lambda b: (b["x"], b["y"]), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(CLASSES)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(ds, epochs=3, verbose=0)
    losses = history.history["loss"]
    assert losses[0] > losses[1] > losses[2], losses
    assert losses[2] < 0.6 * losses[0], losses
    delivered = sum(s.batches for s in source.stats())
    assert delivered == 3 * BATCHES  # Every epoch read every batch once.

    loss, accuracy = model.evaluate(ds, verbose=0)
    assert accuracy > 0.7
    predictions = model.predict(ds.map(lambda x, y: x), verbose=0)
    assert predictions.shape == (BATCHES * ROWS, CLASSES)
