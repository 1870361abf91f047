"""Ray Data columns as ``to_tf`` types them, and how each crosses the native op.

``to_tf`` gives each column a ``tf.TypeSpec`` from the dataset's schema: a
``TensorSpec`` named after the column (numeric, bool, fixed-shape tensor and
string columns) or a ``RaggedTensorSpec`` (list and variable-shaped tensor
columns). The native op carries dense numeric arrays only, so each column
crosses it in a wire form that a ``map`` tfray adds turns back into its type:

- numeric (a ``TensorSpec`` of a numeric or bool dtype): the column's array
  itself, zero-copy where aligned; cast, with a copy, when the spec's dtype
  differs from the data's (``feature_type_spec`` and the like);
- string: the bytes of every row (UTF-8 for ``str``) in one uint8 array and
  their int64 row splits; the map rebuilds a ``tf.string`` vector;
- ragged: the flat values and the row splits of each ragged dimension; the
  map rebuilds the ``tf.RaggedTensor``.

Strings and ragged columns are copied (once, in the feeder) and counted in
the stats as copies.
"""

import numpy as np
import tensorflow as tf

from tfray._internal.runtime import batch
from tfray._internal.runtime.status import BatchError, Code


class Copies:
    """Bytes and arrays a batch's conversion copied, for the stats."""

    def __init__(self):
        self.bytes = 0
        self.arrays = 0

    def add(self, array):
        """Counts ``array`` as a copy; returns it aligned as TF needs it.

        Realigning copies it again, but it is counted once: it is one array
        delivered that is not the block's own.
        """
        self.bytes += array.nbytes
        self.arrays += 1
        align = batch.alignment()
        return array if batch.fits(array, align) else batch.aligned_copy(array, align)


def _stacked(name, column):
    """An object column of same-shape rows as one array (Ray yields lists so)."""
    try:
        rows = [np.asarray(row) for row in column]
        shapes = {row.shape for row in rows}
        if len(shapes) > 1:
            raise BatchError(
                Code.INVALID_ARGUMENT,
                f"column {name!r} is variable-length (rows of shapes {sorted(shapes)}) "
                "but its spec is a dense tf.TensorSpec: give it a tf.RaggedTensorSpec, "
                "or pad or resize it in Ray Data first.",
            )
        stacked = np.stack(rows) if rows else np.empty((0,), column.dtype)
    except (TypeError, ValueError) as e:
        raise BatchError(
            Code.INVALID_ARGUMENT, f"column {name!r}: cannot make one array of its rows: {e}"
        ) from None
    return stacked


class Dense:
    """A column that reaches TF as its own array (a view, when it can be)."""

    def __init__(self, spec):
        self.dtype = np.dtype(spec.dtype.as_numpy_dtype)
        self.wire_spec = tf.TensorSpec(spec.shape, spec.dtype)

    def encode(self, name, column, copies):
        original = column
        if column.dtype == object:
            column = _stacked(name, column)
        if column.dtype != self.dtype:
            try:
                column = column.astype(self.dtype)
            except (TypeError, ValueError) as e:
                raise BatchError(
                    Code.INVALID_ARGUMENT,
                    f"column {name!r}: cannot cast {column.dtype} to {self.dtype}: {e}",
                ) from None
        return column if column is original else copies.add(column)

    def decode(self, tensor):
        return tensor


# One-byte strings, indexed by byte value: a gather and a join make strings.
_BYTE_VALUES = [bytes([i]) for i in range(256)]


class String:
    """A string column: its rows' bytes and row splits; a map joins them."""

    wire_spec = (tf.TensorSpec([None], tf.uint8), tf.TensorSpec([None], tf.int64))

    def __init__(self, name, spec):
        if spec.shape.rank != 1:
            raise TypeError(
                f"{name}: tfray carries string columns of one string per row "
                f"(shape [None]), got a spec of shape {spec.shape}"
            )

    def encode(self, name, column, copies):
        try:
            rows = [row.encode() if isinstance(row, str) else bytes(row) for row in column]
        except TypeError:
            kinds = sorted({type(row).__name__ for row in column})
            raise BatchError(
                Code.INVALID_ARGUMENT,
                f"column {name!r}: expected str or bytes rows for a tf.string spec, got {kinds}",
            ) from None
        values = np.frombuffer(b"".join(rows), np.uint8)
        splits = np.zeros(len(rows) + 1, np.int64)
        np.cumsum([len(row) for row in rows], out=splits[1:])
        return copies.add(values), copies.add(splits)

    def decode(self, wire):
        values, splits = wire
        table = tf.constant(_BYTE_VALUES)
        chars = tf.RaggedTensor.from_row_splits(
            tf.gather(table, tf.cast(values, tf.int32)), splits, validate=False
        )
        return tf.strings.reduce_join(chars, axis=1)


class Ragged:
    """A ragged column: flat values and each ragged dimension's row splits."""

    def __init__(self, spec):
        self._spec = spec
        self._rank = spec.ragged_rank
        self.dtype = np.dtype(spec.dtype.as_numpy_dtype)
        self._splits_dtype = np.dtype(spec.row_splits_dtype.as_numpy_dtype)
        self._inner = spec.shape[self._rank + 1 :]
        self.wire_spec = (tf.TensorSpec([None] + self._inner.as_list(), spec.dtype),) + (
            tf.TensorSpec([None], spec.row_splits_dtype),
        ) * self._rank

    def encode(self, name, column, copies):
        try:
            items = [np.asarray(row, dtype=self.dtype) for row in column]
            nested_splits = []
            for level in range(self._rank):
                lengths = [len(item) for item in items]
                splits = np.zeros(len(items) + 1, self._splits_dtype)
                np.cumsum(lengths, out=splits[1:])
                nested_splits.append(splits)
                if level < self._rank - 1:
                    items = [part for item in items for part in item]
            if items:
                values = np.concatenate(items)
            else:
                inner = [0 if d is None else d for d in self._inner.as_list()]
                values = np.empty([0] + inner, self.dtype)
        except (TypeError, ValueError) as e:
            raise BatchError(
                Code.INVALID_ARGUMENT,
                f"column {name!r}: expected rows of rank {self._spec.shape.rank - 1} "
                f"for {self._spec}: {e}",
            ) from None
        return (copies.add(values), *(copies.add(s) for s in nested_splits))

    def decode(self, wire):
        values, *nested_splits = wire
        return tf.RaggedTensor.from_nested_row_splits(values, nested_splits, validate=False)


def codec(name, spec):
    """How column ``name`` of type ``spec`` crosses the op."""
    if isinstance(spec, tf.RaggedTensorSpec):
        return Ragged(spec)
    if not isinstance(spec, tf.TensorSpec):
        raise TypeError(
            f"{name}: expected a tf.TensorSpec or tf.RaggedTensorSpec, got {type(spec).__name__}"
        )
    if spec.dtype == tf.string:
        return String(name, spec)
    return Dense(spec)
