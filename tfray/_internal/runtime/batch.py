"""A batch on its way to the channel: the push entry, and what TensorFlow takes as it is.

TensorFlow takes an array's memory as a tensor's only if it is C-contiguous
and aligned to ``alignment()`` bytes; anything else is copied once, into
memory that is (and the copy is counted). Every source and the feeder ask
``fits`` and copy with ``aligned_copy``: one rule, also kept by the native
window push (csrc/window.cc).
"""

from typing import Any, List, NamedTuple, Optional, Tuple

import numpy as np

from tfray._internal.runtime import native


def alignment():
    """The byte alignment TensorFlow tensors need (the native library's)."""
    return native.load().lib.TENSOR_ALIGNMENT


def fits(array, align):
    """Whether TensorFlow can take ``array``'s memory as it is: C-contiguous and ``align``-ed."""
    return array.flags.c_contiguous and array.ctypes.data % align == 0


def aligned_copy(array, align):
    """An ``align``-ed, C-contiguous copy of ``array``."""
    raw = np.empty(array.nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    out = raw[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
    np.copyto(out, array)
    return out


class Entry(NamedTuple):
    """One batch as ``Channel.push`` takes it (bindings.cc reads these fields in order)."""

    arrays: List[np.ndarray]  # C-contiguous and aligned, in the spec's flat order.
    token: int  # The pin that keeps the arrays alive while TF uses them (pins.py).
    bytes_copied: int  # What tfray copied to make the batch, for stats().
    arrays_copied: int
    # Its work unit and place in its bundle, ``(unit, index, size)``, or None
    # (bundles.BatchLabel): what a checkpoint counts per unit.
    origin: Optional[Tuple[int, int, int]] = None


class Copied:
    """A batch its stream already copied (in part) to make, and how much.

    The copies are counted in the stats like the feeder's own.
    """

    __slots__ = ("arrays_copied", "bytes_copied", "value")

    def __init__(self, value, bytes_copied, arrays_copied):
        self.value = value
        self.bytes_copied = bytes_copied
        self.arrays_copied = arrays_copied


class Checks(NamedTuple):
    """How a feeder checks its source's batches before they go to TensorFlow."""

    flat_spec: Any  # The source's FlatSpec (spec.py): the checks in Python, with messages.
    # ``flat_spec.native(...)``: a window's batches checked and pushed in one
    # native call (window.h); None: every batch in Python.
    native: Optional[Any]
    alignment: int  # What ``fits`` asks of each array.
