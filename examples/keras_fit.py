"""Train a Keras model on batches that Ray tasks put in the object store.

Shows tfray end to end: ``@ray.remote`` tasks make batches of a synthetic,
learnable image task in parallel; ``tfray.Dataset`` feeds them to
``model.fit`` straight from Ray's object store, zero-copy and without the
GIL; then the dataset's own ``stats()`` tell how fast the input pipeline
delivered and how many bytes it did (not) copy. A pass over the input alone,
with no model, shows what the pipeline can deliver when nothing else runs.

Run it with ``make demo``, or ``python examples/keras_fit.py --epochs 5``.
It is sized for a small machine (2 CPUs, a 300 MB object store) and exits
non-zero if the loss did not fall.
"""

import argparse
import os
import sys
import time

# tf.data input needs Keras' TensorFlow backend; quiet TF's C++ start-up logs.
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfray  # noqa: E402

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
    image = rng.random((batch_size, *IMAGE_SHAPE), dtype=np.float32)
    # Centre the pixels so that every class wins about equally often.
    logits = (image.reshape(batch_size, pixels) - 0.5) @ projection
    return {"image": image, "label": logits.argmax(axis=1).astype(np.int32)}


class EpochTimer(keras.callbacks.Callback):
    """Wall time per epoch: what the input pipeline had to keep up with."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def build_model():
    # Small on purpose: two CPU cores should spend their time moving data,
    # not in convolutions, so the input pipeline's rate shows.
    model = keras.Sequential(
        [
            keras.Input(IMAGE_SHAPE),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
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
    # Reading every element makes TF touch every byte, as a model would.
    total = tf.constant(0.0)
    for image, label in dataset:
        total += tf.reduce_sum(image) + tf.cast(tf.reduce_sum(label), tf.float32)
    return total


def rate(stats, seconds):
    return stats.batches / seconds, stats.bytes / seconds / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    if not ray.is_initialized():
        ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False)

    # The tasks run in parallel on Ray's workers; tfray resolves each ref as
    # training reaches it, so training can start before the last one is done.
    refs = [make_batch.remote(i, args.batch_size) for i in range(args.batches)]
    source = tfray.Dataset(refs)  # Keep it: stats() lives on the tfray dataset.
    ds = source.map(
        lambda b: (b["image"], b["label"]), num_parallel_calls=tf.data.AUTOTUNE
    ).prefetch(tf.data.AUTOTUNE)

    model = build_model()
    timer = EpochTimer()
    seen = len(source.stats())
    history = model.fit(ds, epochs=args.epochs, callbacks=[timer], verbose=2)
    # Keras starts one iterator per epoch, in order (and may start one more,
    # ahead of an epoch that never comes), so the first `epochs` new ones are
    # the epochs.
    epochs = source.stats()[seen : seen + args.epochs]
    losses = history.history["loss"]

    print()
    for i, (loss, stats, seconds) in enumerate(zip(losses, epochs, timer.seconds), 1):
        batches_s, gb_s = rate(stats, seconds)
        print(
            f"epoch {i}: loss {loss:.3f}; {stats.batches} batches in {seconds:.2f} s: "
            f"{batches_s:.0f} batches/s, {gb_s:.2f} GB/s; "
            f"{stats.bytes_zero_copy / 1e6:.0f} MB zero-copy, "
            f"{stats.bytes_copied / 1e6:.0f} MB copied; "
            f"TF waited {stats.consumer_wait_s:.2f} s for input"
        )

    # Trace first, so the timed pass measures moving data, not building a graph.
    drain.get_concrete_function(ds)
    start = time.perf_counter()
    drain(ds)
    seconds = time.perf_counter() - start
    batches_s, gb_s = rate(source.stats()[-1], seconds)
    print(f"input only (no model): {batches_s:.0f} batches/s, {gb_s:.2f} GB/s")

    total = sum(s.bytes_zero_copy + s.bytes_copied for s in epochs)
    zero_copy = sum(s.bytes_zero_copy for s in epochs) / total if total else 0.0
    batches_s, gb_s = rate(
        tfray.IteratorStats(
            **{
                **vars(epochs[0]),
                "batches": sum(s.batches for s in epochs),
                "bytes": sum(s.bytes for s in epochs),
            }
        ),
        sum(timer.seconds),
    )
    print(
        f"tfray demo: loss {losses[0]:.2f} -> {losses[-1]:.2f} over {args.epochs} epochs; "
        f"{batches_s:.0f} batches/s, {gb_s:.1f} GB/s; {zero_copy:.0%} zero-copy"
    )
    if not losses[-1] < losses[0]:
        sys.exit(f"tfray demo: FAILED: the loss did not fall ({losses[0]:.3f} -> {losses[-1]:.3f})")


if __name__ == "__main__":
    main()
