"""Synthetic JPEG files and their Python augmentation, for ``end_to_end.py``.

The set: ``count`` JPEG files of varied sizes (each side 256 to 512 pixels,
about ImageNet's spread), ``<root>/<class>/<index>.jpg`` with the label in
the folder's name, made once and kept (the folder is git-ignored).

Augmenting an image means, all in Python and numpy: decode it with Pillow,
crop a random ``crop x crop`` window, flip it left-right with probability
1/2, and normalize to float32 with per-channel mean and standard deviation.
A batch is its images augmented into one ``float32[n, crop, crop, 3]``
array, and their labels as ``int32[n]``.

This module imports only numpy and Pillow, so that the processes that run
it (a ``multiprocessing`` pool's, Ray's workers) start without TensorFlow or
Ray.
"""

import io
import itertools
import os
import shutil

import numpy as np
from PIL import Image

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
SIDES = (256, 512)  # Each side of a picture, drawn uniformly in this range.
CLASSES = 100
QUALITY = 90


def picture(rng, height, width):
    """A ``uint8[height, width, 3]`` gradient with noise.

    Smooth gradients with noise, so that JPEG compresses them as it does
    photographs rather than as pure noise.
    """
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    yy, xx = yy / height, xx / width
    a, b, c = rng.uniform(0, 255, 3)
    pixels = np.stack([a * xx, b * yy, c * (1 - xx) * yy], axis=-1)
    pixels += rng.normal(0, 12, pixels.shape).astype(np.float32)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def make_files(root, count, seed=0):
    """The paths of ``count`` JPEG files under ``root``, made unless already there.

    The set is written to a temporary folder and renamed into place when
    complete, so an interrupted run leaves no half set behind.
    """
    folder = os.path.join(root, f"jpeg-{count}-{SIDES[0]}-{SIDES[1]}-seed{seed}")
    if not os.path.isdir(folder):
        partial = folder + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        rng = np.random.default_rng(seed)
        for index in range(count):
            label = int(rng.integers(CLASSES))
            height, width = (int(x) for x in rng.integers(SIDES[0], SIDES[1] + 1, 2))
            os.makedirs(os.path.join(partial, f"{label:03d}"), exist_ok=True)
            path = os.path.join(partial, f"{label:03d}", f"{index:06d}.jpg")
            Image.fromarray(picture(rng, height, width)).save(path, quality=QUALITY)
        os.rename(partial, folder)
    return sorted(
        os.path.join(folder, label, name)
        for label in os.listdir(folder)
        for name in os.listdir(os.path.join(folder, label))
    )


def label_of(path):
    """The label of a file: the name of its folder."""
    return int(os.path.basename(os.path.dirname(path)))


def read(path):
    with open(path, "rb") as f:
        return f.read()


def decode(data):
    """An encoded image as ``uint8[height, width, 3]``."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def crop_flip(pixels, crop, rng):
    """A random ``crop x crop`` window of ``pixels``, flipped left-right half the time."""
    top = rng.integers(0, pixels.shape[0] - crop + 1)
    left = rng.integers(0, pixels.shape[1] - crop + 1)
    window = pixels[top : top + crop, left : left + crop]
    return window[:, ::-1] if rng.random() < 0.5 else window


def normalize(pixels):
    """``uint8[..., 3]`` to float32, per-channel mean 0 and standard deviation 1."""
    return (pixels.astype(np.float32) * np.float32(1 / 255) - MEAN) / STD


def augment_image(data, crop, rng):
    """One encoded image decoded, cropped, flipped and normalized: ``float32[crop, crop, 3]``."""
    return normalize(crop_flip(decode(data), crop, rng))


def augment_batch(encoded, labels, crop, rng):
    """Encoded images augmented: ``{"image": float32[n, crop, crop, 3], "label": int32[n]}``."""
    out = np.empty((len(encoded), crop, crop, 3), np.uint8)
    for k, data in enumerate(encoded):
        out[k] = crop_flip(decode(data), crop, rng)
    return {"image": normalize(out), "label": np.asarray(labels, np.int32)}


def load_batch(paths, crop, seed):
    """The files ``paths`` read and augmented into one batch (see ``augment_batch``)."""
    rng = np.random.default_rng(seed)
    return augment_batch([read(p) for p in paths], [label_of(p) for p in paths], crop, rng)


def ray_data_batch(batch, crop):
    """A Ray Data ``map_batches`` function over ``read_binary_files(include_paths=True)``."""
    labels = [label_of(p) for p in batch["path"]]
    return augment_batch(batch["bytes"], labels, crop, np.random.default_rng())


def produce(batches, crop, producers, shard):
    """A ``from_generators`` producer: batches ``shard, shard + producers, ...``, cycled.

    ``batches`` is a list of lists of paths; batch ``i`` of the long epoch is
    ``batches[i % len(batches)]``, seeded by ``i``.
    """
    for i in itertools.count(shard, producers):
        yield load_batch(batches[i % len(batches)], crop, i)


# A pool process's batches and crop, set once by ``pool_init``.
_pool_args = None


def pool_init(batches, crop):
    global _pool_args
    _pool_args = (batches, crop)


def pool_batch(i):
    """Batch ``i`` in a pool process (after ``pool_init``)."""
    batches, crop = _pool_args
    return load_batch(batches[i % len(batches)], crop, i)
