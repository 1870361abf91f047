"""Train a Keras model while N Ray producers augment its images in parallel.

Shows ``tfray.Dataset.from_generators``: a plain Python generator function,
``augment(shard)``, makes a shard's batches and spends several milliseconds of
numpy CPU work on each (random crops, flips, brightness, noise). tfray runs
one producer per shard as a streaming Ray task, in its own process, so the
augmentation neither holds the trainer's GIL nor waits for its turn: batches
go into Ray's object store while the model trains, and reach ``model.fit``
zero-copy. Every epoch re-runs the producers, so each epoch sees new crops.

The point to check is that the trainer never waits: per epoch it prints the
fraction of the epoch's wall time TensorFlow spent waiting for input (tfray's
``consumer_wait_s``), and how fast the producers delivered; a last pass with
no model shows how fast they can go flat out.

Run it with ``python examples/parallel_generators.py`` (``--producers 4`` on
a bigger machine). It is sized for a small machine (2 CPUs, a 300 MB object
store, two producers) and exits non-zero if the loss did not fall.
"""

import argparse
import functools
import os
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

IMAGE_SIZE = 32
PAD = 4  # Source images are PAD larger on each side, for random crops.
NUM_CLASSES = 10
# The task: class c is colour c % 5 with faint stripes across (c < 5) or down
# (c >= 5) the image. Crops, flips, brightness and noise all keep the class;
# the colours are close and the noise strong, so it takes a few epochs.
COLOURS = np.random.default_rng(0).uniform(90, 165, (5, 3)).astype(np.float32)


def source_images(rng, batch_size):
    """A batch of "decoded" images and their labels, before augmentation."""
    labels = rng.integers(0, NUM_CLASSES, batch_size)
    size = IMAGE_SIZE + 2 * PAD
    period = rng.uniform(4, 8, (batch_size, 1)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, (batch_size, 1)).astype(np.float32)
    wave = np.sin(np.float32(2 * np.pi) * np.arange(size, dtype=np.float32) / period + phase)
    across = labels < 5
    stripes = np.empty((batch_size, size, size), np.float32)
    stripes[across] = wave[across][:, :, None]  # Varies down the rows.
    stripes[~across] = wave[~across][:, None, :]  # Varies along the columns.
    images = stripes[..., None] * np.float32(15) + COLOURS[labels % 5][:, None, None, :]
    return images, labels.astype(np.int32)


def augment_batch(rng, images):
    """Random crop and flip per image, brightness jitter, Gaussian noise; to uint8."""
    n = len(images)
    ys = rng.integers(0, 2 * PAD + 1, n)
    xs = rng.integers(0, 2 * PAD + 1, n)
    flips = rng.random(n) < 0.5
    out = np.empty((n, IMAGE_SIZE, IMAGE_SIZE, 3), np.float32)
    for i in range(n):
        crop = images[i, ys[i] : ys[i] + IMAGE_SIZE, xs[i] : xs[i] + IMAGE_SIZE]
        out[i] = crop[:, ::-1] if flips[i] else crop
    out *= rng.uniform(0.7, 1.3, (n, 1, 1, 1)).astype(np.float32)
    out += rng.standard_normal(out.shape, dtype=np.float32) * np.float32(60)
    # uint8, as real images are stored: a quarter of float32's bytes to move.
    return np.clip(out, 0, 255).astype(np.uint8)


def augment(shard, *, batches, batch_size):
    """The producer: shard ``shard``'s batches, augmented, one dict at a time.

    The source images are the shard's own and the same every epoch (seeded by
    shard and batch, as if read from the shard's files); the augmentation
    draws fresh randomness on every run, so every epoch sees new variants.
    """
    augmentation = np.random.default_rng()
    for i in range(batches):
        images, labels = source_images(np.random.default_rng([shard, i]), batch_size)
        yield {"image": augment_batch(augmentation, images), "label": labels}


def build_model():
    # A small convolutional net: it must see stripe directions, not just
    # colours. Its training step costs more CPU than a batch's augmentation,
    # as in real training, so the producers can keep ahead of it.
    model = keras.Sequential(
        [
            keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3), dtype="uint8"),
            keras.layers.Rescaling(1 / 127.5, offset=-1),
            keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@tf.function
def drain(dataset):
    # Summing every element makes TF read every byte, as a model would.
    total = tf.constant(0, tf.int64)
    for image, label in dataset:
        total += tf.cast(tf.reduce_sum(image), tf.int64) + tf.cast(tf.reduce_sum(label), tf.int64)
    return total


def augment_ms(batch_size, repeats=10):
    """Milliseconds of CPU one batch costs a producer, measured here, alone."""
    producer = augment(0, batches=repeats + 1, batch_size=batch_size)
    next(producer)  # Warm-up.
    start = time.process_time()
    for _ in producer:
        pass
    return (time.process_time() - start) / repeats * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=2, help="parallel augmenting producers")
    parser.add_argument(
        "--batches", type=int, default=120, help="batches per epoch, over all producers"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    if not ray.is_initialized():
        # A Ray of its own: never one that another program (or `ray start`) runs here.
        ray.init(address="local", num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False)

    per_producer = -(-args.batches // args.producers)  # Rounded up.
    cost = augment_ms(args.batch_size)
    print(
        f"augmentation: {cost:.1f} ms of CPU per batch of {args.batch_size}; "
        f"{args.producers} producers x {per_producer} batches an epoch"
    )

    # One producer (a streaming Ray task) per shard, 0..producers-1, per epoch.
    # Each may have max_inflight_per_producer (2) batches waiting in the object
    # store before Ray pauses it, so a slow trainer cannot fill the store.
    source = tfray.Dataset.from_generators(
        functools.partial(augment, batches=per_producer, batch_size=args.batch_size),
        args.producers,
    )  # Kept: stats() lives on the tfray dataset.
    # No tf.data prefetch: tfray's channel already holds batches resolved ahead
    # of TF, and without one, consumer_wait_s is exactly the time the training
    # step waited for its batch (behind a prefetch it would count the waits of
    # the prefetch thread, which the model need not feel).
    ds = source.map(lambda b: (b["image"], b["label"]))

    model = build_model()
    history, recorder, epochs = training.fit(model, ds, source, args.epochs)
    losses, accuracies = history["loss"], history["accuracy"]

    print()
    for i, (loss, accuracy, stats, seconds) in enumerate(
        zip(losses, accuracies, epochs, recorder.seconds), 1
    ):
        print(
            f"epoch {i}: loss {loss:.3f}, accuracy {accuracy:.2f}; "
            f"TF waited {stats.consumer_wait_s:.2f} s of {seconds:.2f} s for input "
            f"({stats.consumer_wait_s / seconds:.1%}); producers delivered "
            f"{stats.batches} batches, {stats.batches / seconds:.0f} batches/s; "
            f"{stats.bytes_zero_copy / 1e6:.0f} MB zero-copy, "
            f"{stats.bytes_copied / 1e6:.0f} MB copied"
        )

    # The producers flat out: the same epoch with nothing but reading.
    drain.get_concrete_function(ds)  # Traced first: the timed pass moves data only.
    start = time.perf_counter()
    drain(ds)
    seconds = time.perf_counter() - start
    flat_out = source.stats()[-1].batches / seconds
    print(
        f"producers alone, no model: {flat_out:.0f} batches/s "
        f"(augmentation's CPU cost alone would allow {args.producers} x {1e3 / cost:.0f})"
    )

    train_seconds = sum(recorder.seconds)
    waited = sum(s.consumer_wait_s for s in epochs)
    batches_s = sum(s.batches for s in epochs) / train_seconds
    first, last = recorder.first_loss, losses[-1]
    print(
        f"parallel_generators: loss {first:.2f} -> {last:.2f} over {args.epochs} epochs; "
        f"TF waited {waited / train_seconds:.1%} of {train_seconds:.1f} s for input; "
        f"{args.producers} producers fed {batches_s:.0f} batches/s "
        f"({flat_out:.0f} flat out)"
    )
    training.exit_unless_loss_fell("parallel_generators", first, last)


if __name__ == "__main__":
    main()
