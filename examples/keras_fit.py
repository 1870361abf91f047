"""Train a Keras model on batches that Ray tasks put in the object store.

Shows tfray end to end: ``@ray.remote`` tasks make batches of a synthetic,
learnable image task in parallel; ``tfray.Dataset`` feeds them to
``model.fit`` straight from Ray's object store, zero-copy and without the
GIL; then the dataset's own ``stats()`` tell how fast the input pipeline
delivered and how many bytes it did (not) copy. A pass over the input alone,
with no model, shows what the pipeline can deliver when nothing else runs.

Run it with ``make demo``, or ``python examples/keras_fit.py --epochs 5``.
It is sized for a small machine (2 CPUs, a 300 MB object store) and exits
non-zero if the loss did not fall or a byte was copied.
"""

import argparse
import os
import sys
import time

# Keras must train with TensorFlow for tf.data tensors to reach the model
# as they are; another backend would convert (copy) every batch.
os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfray  # noqa: E402
import training  # noqa: E402

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


@ray.remote
def make_batch(index, batch_size):
    """One batch of random images, labelled by a fixed linear rule.

    The projection comes from a fixed seed, so every task labels by the same
    rule and a model can learn it; each batch's pixels use their own seed.
    """
    pixels = int(np.prod(IMAGE_SHAPE))
    projection = np.random.default_rng(0).standard_normal((pixels, NUM_CLASSES))
    rng = np.random.default_rng(index + 1)
    # uint8, as real images are stored: 0.8 MB a batch, so the default 200
    # batches fit the 300 MB object store (float32 would spill to disk).
    image = rng.integers(0, 256, (batch_size, *IMAGE_SHAPE), dtype=np.uint8)
    # Centred, so that every class wins about equally often.
    logits = (image.reshape(batch_size, pixels) - 127.5) @ projection
    return {"image": image, "label": logits.argmax(axis=1).astype(np.int32)}


def build_model():
    # Small, so that an epoch takes seconds on two CPU cores. The images stay
    # uint8 through tfray (a quarter of float32's bytes) and become floats here.
    model = keras.Sequential(
        [
            keras.Input(IMAGE_SHAPE, dtype="uint8"),
            # To [-1, 1]: uncentred inputs make this rule much slower to learn.
            keras.layers.Rescaling(1 / 127.5, offset=-1),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@tf.function
def drain(dataset):
    # Summing every element makes TF read every byte, as a model would (the
    # uint8 sums may wrap around; only the reading matters).
    total = tf.constant(0, tf.int64)
    for image, label in dataset:
        total += tf.cast(tf.reduce_sum(image), tf.int64) + tf.cast(tf.reduce_sum(label), tf.int64)
    return total


def rates(stats, seconds):
    """Batches/s and GB/s that tfray delivered over ``stats``, a list."""
    return (
        sum(s.batches for s in stats) / seconds,
        sum(s.bytes for s in stats) / seconds / 1e9,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    if not ray.is_initialized():
        # A Ray of its own: never one that another program (or `ray start`) runs here.
        ray.init(address="local", num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False)

    # The tasks run in parallel on Ray's workers; tfray waits for each ref only
    # when training is about to need it, so training starts before all exist.
    refs = [make_batch.remote(i, args.batch_size) for i in range(args.batches)]
    source = tfray.Dataset(refs)  # Kept: stats() lives on the tfray dataset.
    ds = source.map(
        lambda b: (b["image"], b["label"]), num_parallel_calls=tf.data.AUTOTUNE
    ).prefetch(tf.data.AUTOTUNE)

    model = build_model()
    history, recorder, epochs = training.fit(model, ds, source, args.epochs)
    losses = history["loss"]

    print()
    for i, (loss, stats, seconds) in enumerate(zip(losses, epochs, recorder.seconds), 1):
        batches_s, gb_s = rates([stats], seconds)
        print(
            f"epoch {i}: loss {loss:.3f}; {stats.batches} batches in {seconds:.2f} s: "
            f"{batches_s:.0f} batches/s, {gb_s:.2f} GB/s; "
            f"{stats.bytes_zero_copy / 1e6:.0f} MB zero-copy, "
            f"{stats.bytes_copied / 1e6:.0f} MB copied; "
            f"TF waited {stats.consumer_wait_s:.2f} s for input"
        )

    # Traced first, so that the timed pass measures moving data only.
    drain.get_concrete_function(ds)
    start = time.perf_counter()
    drain(ds)
    batches_s, gb_s = rates(source.stats()[-1:], time.perf_counter() - start)
    print(f"input only, no model: {batches_s:.0f} batches/s, {gb_s:.2f} GB/s")

    # From the untrained model's loss to the last epoch's mean: a fair drop.
    first, last = recorder.first_loss, losses[-1]
    batches_s, gb_s = rates(epochs, sum(recorder.seconds))
    zero_copy = sum(s.bytes_zero_copy for s in epochs)
    moved = zero_copy + sum(s.bytes_copied for s in epochs)
    print(
        f"tfray demo: loss {first:.2f} -> {last:.2f} over {args.epochs} epochs; "
        f"{batches_s:.0f} batches/s, {gb_s:.2f} GB/s; {zero_copy / moved:.0%} zero-copy"
    )
    training.exit_unless_loss_fell("tfray demo", first, last)
    if zero_copy != moved:  # Every batch here is aligned and C-contiguous.
        sys.exit(f"tfray demo: FAILED: {moved - zero_copy} bytes were copied")


if __name__ == "__main__":
    main()
