"""Image batches and their augmentation: the per-batch Python work of ``augment.py``.

A batch is ``images`` encoded images (JPEG or PNG through Pillow, or raw
``uint8`` bytes when Pillow is absent or ``fmt="raw"``) and their labels.
Augmenting one means, all in Python and numpy: decode every image, crop a
random ``crop x crop`` window, flip it left-right with probability 1/2, and
normalize to float32 with per-channel mean and standard deviation. The
randomness of batch ``i`` is seeded by ``i``, so every pipeline that
augments batch ``i`` makes the same tensors.

This module imports only numpy (and Pillow when it decodes), so that the
processes that run it (a ``multiprocessing`` pool's, Ray's workers) start
without TensorFlow or Ray.
"""

import dataclasses
import io

import numpy as np

try:
    from PIL import Image
except ImportError:  # pragma: no cover - depends on the environment.
    Image = None

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
FORMATS = ("jpeg", "png", "raw")


def default_format():
    """JPEG, as image datasets mostly are, when Pillow is installed; else raw bytes."""
    return "jpeg" if Image is not None else "raw"


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Distinct encoded batches, each ``(list of images' bytes, int32 labels)``."""

    format: str
    size: int
    batches: list = dataclasses.field(repr=False)


def make_encoded(count, images, size, fmt, seed=0):
    """``count`` distinct batches of ``images`` pictures ``size x size`` RGB, encoded as ``fmt``.

    The pictures are smooth gradients with noise, so that JPEG and PNG
    compress them as they do photographs rather than as pure noise.
    """
    if fmt != "raw" and Image is None:
        raise RuntimeError(f"format {fmt!r} needs Pillow (pip install pillow); 'raw' does not")
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    batches = []
    for _ in range(count):
        encoded = []
        for _ in range(images):
            a, b, c = rng.uniform(0, 255, 3)
            picture = np.stack([a * xx, b * yy, c * (1 - xx) * yy], axis=-1)
            picture += rng.normal(0, 12, picture.shape)
            picture = np.clip(picture, 0, 255).astype(np.uint8)
            if fmt == "raw":
                encoded.append(picture.tobytes())
            else:
                out = io.BytesIO()
                Image.fromarray(picture).save(out, format=fmt.upper(), quality=90)
                encoded.append(out.getvalue())
        batches.append((encoded, rng.integers(0, 1000, images).astype(np.int32)))
    return Encoded(fmt, size, batches)


def decode(data, fmt, size):
    """One image as a ``uint8[size, size, 3]`` array."""
    if fmt == "raw":
        return np.frombuffer(data, np.uint8).reshape(size, size, 3)
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def augment(encoded, i, crop):
    """Batch ``i``: ``encoded.batches[i % len]`` decoded, cropped, flipped, normalized.

    Returns ``{"image": float32[images, crop, crop, 3], "label": int32[images]}``.
    """
    pictures, labels = encoded.batches[i % len(encoded.batches)]
    size = encoded.size
    rng = np.random.default_rng(i)
    out = np.empty((len(pictures), crop, crop, 3), np.uint8)
    for k, data in enumerate(pictures):
        picture = decode(data, encoded.format, size)
        top, left = rng.integers(0, size - crop + 1, 2)
        window = picture[top : top + crop, left : left + crop]
        out[k] = window[:, ::-1] if rng.random() < 0.5 else window
    image = (out.astype(np.float32) * np.float32(1 / 255) - MEAN) / STD
    return {"image": image, "label": labels}


def produce(encoded, crop, count, producers, shard):
    """A ``from_generators`` producer: batches ``shard, shard + producers, ...``, ``count`` in all."""
    for n in range(count):
        yield augment(encoded, shard + n * producers, crop)


# A pool process's batches and crop, set once by ``pool_init``.
_pool_args = None


def pool_init(encoded, crop):
    global _pool_args
    _pool_args = (encoded, crop)


def pool_augment(i):
    """Batch ``i`` in a pool process (after ``pool_init``)."""
    encoded, crop = _pool_args
    return augment(encoded, i, crop)
