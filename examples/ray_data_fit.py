"""Train a Keras model on a Ray Data pipeline, fed through tfray.

Shows ``tfray.Dataset.from_ray_data``, the drop-in for Ray Data's
``ds.to_tf(...)``: a Ray Data pipeline (``ray.data.range`` then
``map_batches``) makes a tensor column of features and a column of labels
for a synthetic, learnable task; tfray batches it as ``to_tf`` would, into
``(features, label)`` elements of the same structure, dtypes and shapes, and
feeds ``model.fit`` through its native op: no Python on TensorFlow's threads,
and batches that lie within one Ray Data block reach TF without a copy. Each
epoch is one streaming run of the pipeline, on Ray's workers, while the
model trains.

It prints the element_spec next to ``to_tf``'s, then per epoch the loss,
the rate, how long TF waited for input, and how many bytes reached TF
zero-copy versus copied.

Run it with ``python examples/ray_data_fit.py`` (``--rows``, ``--batch-size``,
``--epochs``). It is sized for a small machine (2 CPUs, a 300 MB object
store) and exits non-zero if the loss did not fall.
"""

import argparse
import logging
import os
import sys

# Keras must train with TensorFlow for tf.data tensors to reach the model
# as they are; another backend would convert (copy) every batch.
os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import ray.data  # noqa: E402

import tfray  # noqa: E402
import training  # noqa: E402

FEATURES = 64
NUM_CLASSES = 4
# The task: a row's label is the largest of NUM_CLASSES fixed random
# projections of its features (seeded, so every Ray worker uses the same).
PROJECTION = np.random.default_rng(0).standard_normal((FEATURES, NUM_CLASSES)).astype(np.float32)


def make_rows(batch):
    """A ``map_batches`` step: row ids in, a feature tensor and a label out.

    Seeded by the first row id, so each epoch's run of the pipeline makes the
    same rows (Ray Data hands this function the same row ranges every run).
    """
    ids = batch["id"]
    rng = np.random.default_rng(int(ids[0]))
    features = rng.standard_normal((len(ids), FEATURES), dtype=np.float32)
    label = (features @ PROJECTION).argmax(axis=1).astype(np.int64)
    # A 2-D array becomes a tensor column: one (FEATURES,) tensor per row.
    return {"features": features, "label": label}


def build_model():
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument(
        "--blocks",
        type=int,
        default=8,
        help="Ray Data blocks the rows start in (try 7: batches then straddle blocks, "
        "and arrays that end up unaligned cost tfray a copy, which stats() counts)",
    )
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    if not ray.is_initialized():
        # A Ray of its own: never one that another program (or `ray start`) runs here.
        ray.init(address="local", num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False)
    # Quiet: Ray Data would log every epoch's execution plan and progress.
    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)

    # Lazy: nothing runs until a consumer iterates. By default each of the 8
    # blocks holds 8192 rows, a multiple of the batch size: no batch spans two.
    data = ray.data.range(args.rows, override_num_blocks=args.blocks).map_batches(
        make_rows, batch_format="numpy"
    )

    # The drop-in: the same arguments as to_tf, and the same elements.
    source = tfray.Dataset.from_ray_data(
        data, batch_size=args.batch_size, feature_columns="features", label_columns="label"
    )  # Kept: stats() lives on the tfray dataset.
    theirs = data.to_tf(
        feature_columns="features", label_columns="label", batch_size=args.batch_size
    )
    same = source.element_spec == theirs.element_spec
    print(f"tfray element_spec: {source.element_spec}")
    print(f"to_tf element_spec: {theirs.element_spec}")
    print(f"same structure, names, dtypes and shapes: {same}")
    if not same:
        sys.exit("ray_data_fit: FAILED: tfray's element_spec differs from to_tf's")
    del theirs  # Only its element_spec was wanted.

    model = build_model()
    # Fed as it is, with no tf.data prefetch: tfray's channel already holds
    # batches ahead of TF, and without one, consumer_wait_s is exactly the time
    # the training step waited for its batch.
    history, recorder, epochs = training.fit(model, source, source, args.epochs)
    losses, accuracies = history["loss"], history["accuracy"]

    print()
    for i, (loss, accuracy, stats, seconds) in enumerate(
        zip(losses, accuracies, epochs, recorder.seconds), 1
    ):
        print(
            f"epoch {i}: loss {loss:.3f}, accuracy {accuracy:.2f}; {stats.batches} batches "
            f"in {seconds:.2f} s, {stats.batches / seconds:.0f} batches/s; "
            f"{stats.bytes_zero_copy / 1e6:.1f} MB zero-copy, "
            f"{stats.bytes_copied / 1e6:.1f} MB copied ({stats.arrays_copied} arrays); "
            f"TF waited {stats.consumer_wait_s:.2f} s for input"
        )

    # Epochs after the first may wait a little at their start: each is a new run
    # of the pipeline, which Ray Data starts when Keras opens the epoch's
    # iterator (the first run started at construction, to learn element_spec).
    zero_copy = sum(s.bytes_zero_copy for s in epochs)
    copied = sum(s.bytes_copied for s in epochs)
    first, last = recorder.first_loss, losses[-1]
    batches_s = sum(s.batches for s in epochs) / sum(recorder.seconds)
    print(
        f"ray_data_fit: loss {first:.2f} -> {last:.2f} over {args.epochs} epochs; "
        f"{batches_s:.0f} batches/s; {zero_copy / 1e6:.1f} MB zero-copy, "
        f"{copied / 1e6:.1f} MB copied ({zero_copy / max(zero_copy + copied, 1):.0%} zero-copy); "
        f"element_spec the same as to_tf's"
    )
    training.exit_unless_loss_fell("ray_data_fit", first, last)


if __name__ == "__main__":
    main()
