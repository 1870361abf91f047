"""Element specs: inferring them from a batch and checking batches against them.

A batch is a numpy array or a dict / tuple / list nest of them. Leaves are
flattened in tf.nest's order (dict keys sorted), which is the order of the
op's output components. Lists become tuples: tf.data has no list structure.
"""

import numpy as np
import tensorflow as tf

from tfray._internal.runtime.status import BatchError, Code

try:  # bfloat16 as numpy sees it; TensorFlow itself depends on ml_dtypes.
    import ml_dtypes

    _BFLOAT16 = [(np.dtype(ml_dtypes.bfloat16), tf.bfloat16)]
except ImportError:  # pragma: no cover
    _BFLOAT16 = []

_DTYPES = dict(
    [
        (np.dtype(np.bool_), tf.bool),
        (np.dtype(np.int8), tf.int8),
        (np.dtype(np.int16), tf.int16),
        (np.dtype(np.int32), tf.int32),
        (np.dtype(np.int64), tf.int64),
        (np.dtype(np.uint8), tf.uint8),
        (np.dtype(np.uint16), tf.uint16),
        (np.dtype(np.uint32), tf.uint32),
        (np.dtype(np.uint64), tf.uint64),
        (np.dtype(np.float16), tf.float16),
        (np.dtype(np.float32), tf.float32),
        (np.dtype(np.float64), tf.float64),
        (np.dtype(np.complex64), tf.complex64),
        (np.dtype(np.complex128), tf.complex128),
    ]
    + _BFLOAT16
)
_TF_TO_NP = {tf_dtype: np_dtype for np_dtype, tf_dtype in _DTYPES.items()}

SUPPORTED_DTYPES = ", ".join(d.name for d in _TF_TO_NP)
ELEMENT = "element"  # The path of a batch that is a single array.


def flatten(nest, path=""):
    """Yields (path, leaf) in tf.nest order; paths look like ``features/image``."""
    if isinstance(nest, dict):
        for key in _sorted_keys(nest, path):
            yield from flatten(nest[key], _join(path, key))
    elif isinstance(nest, (tuple, list)):
        for i, value in enumerate(nest):
            yield from flatten(value, _join(path, i))
    else:
        yield path or ELEMENT, nest


def _join(path, key):
    return f"{path}/{key}" if path else str(key)


def _sorted_keys(nest, path):
    try:
        return sorted(nest)
    except TypeError:  # e.g. str and int keys: tf.nest cannot order them either.
        raise BatchError(
            Code.INVALID_ARGUMENT,
            f"{path or ELEMENT}: dict keys {sorted(map(repr, nest))} cannot be "
            "sorted; tf.nest orders a dict by its keys, so use keys of one type "
            "(e.g. all str).",
        ) from None


def _map_structure(fn, nest, path=""):
    if isinstance(nest, dict):
        _sorted_keys(nest, path)  # Refuses keys that tf.nest cannot order.
        return {k: _map_structure(fn, nest[k], _join(path, k)) for k in nest}
    if isinstance(nest, (tuple, list)):
        values = [_map_structure(fn, v, _join(path, i)) for i, v in enumerate(nest)]
        return type(nest)(*values) if _is_namedtuple(nest) else tuple(values)
    return fn(path or ELEMENT, nest)


def _is_namedtuple(value):
    return isinstance(value, tuple) and hasattr(value, "_fields")


def format_shape(shape):
    dims = tf.TensorShape(shape)
    if dims.rank is None:
        return "[...]"
    return "[" + ",".join("?" if d is None else str(d) for d in dims.as_list()) + "]"


def as_array(path, leaf):
    """Returns ``leaf`` as an ndarray of a supported dtype, or raises BatchError."""
    if isinstance(leaf, np.generic):
        leaf = np.asarray(leaf)
    if not isinstance(leaf, np.ndarray):
        raise BatchError(
            Code.INVALID_ARGUMENT,
            f"{path}: expected a numpy array, got {type(leaf).__name__}. A batch "
            "is a numpy array or a dict / tuple / list nest of them.",
        )
    if leaf.dtype not in _DTYPES:
        raise BatchError(
            Code.INVALID_ARGUMENT,
            f"{path}: dtype {leaf.dtype} is not supported; tfray carries numeric "
            f"and bool arrays ({SUPPORTED_DTYPES}).",
        )
    return leaf


def infer(batch):
    """The element spec of ``batch``, its leading (batch) dimension unknown."""

    def spec(path, leaf):
        array = as_array(path, leaf)
        shape = (None,) + array.shape[1:] if array.ndim else ()
        return tf.TensorSpec(shape, _DTYPES[array.dtype], name=None)

    try:
        return _map_structure(spec, batch)
    except BatchError as e:
        raise TypeError(f"Cannot infer element_spec from the first batch: {e}") from None


class FlatSpec:
    """An element spec flattened for fast per-batch checks."""

    def __init__(self, element_spec):
        try:
            leaves = list(flatten(element_spec))
        except BatchError as e:
            raise TypeError(f"element_spec {e.message}") from None
        if not leaves:
            raise ValueError(
                f"element_spec: expected at least one tf.TensorSpec, got {element_spec!r}. "
                "A batch must hold at least one array."
            )
        for path, leaf in leaves:
            if not isinstance(leaf, tf.TensorSpec):
                raise TypeError(
                    f"element_spec {path}: expected a tf.TensorSpec, got "
                    f"{type(leaf).__name__}. tfray sources produce dense tensors."
                )
            if leaf.dtype not in _TF_TO_NP:
                raise TypeError(
                    f"element_spec {path}: dtype {leaf.dtype.name} is not supported; "
                    f"tfray carries numeric and bool arrays ({SUPPORTED_DTYPES})."
                )
        self.paths = [path for path, _ in leaves]
        self.specs = [leaf for _, leaf in leaves]
        self.np_dtypes = [_TF_TO_NP[s.dtype] for s in self.specs]
        self.dtype_enums = [s.dtype.as_datatype_enum for s in self.specs]
        self._shapes = [
            None if s.shape.rank is None else tuple(s.shape.as_list()) for s in self.specs
        ]
        self._structure = _template(element_spec, iter(range(len(leaves))))
        self._native = None

    def native(self, lib, alignment):
        """This spec as the native library's SpecTemplate (window.h), made once."""
        if self._native is None:
            leaves = [
                (np_dtype, shape, enum)
                for np_dtype, shape, enum in zip(self.np_dtypes, self._shapes, self.dtype_enums)
            ]
            self._native = lib.SpecTemplate(self._structure, leaves, alignment)
        return self._native

    def check(self, batch):
        """Flattens ``batch`` and checks it; returns its arrays or raises BatchError."""
        leaves = list(flatten(batch))
        paths = [path for path, _ in leaves]
        if paths != self.paths:
            raise BatchError(
                Code.INVALID_ARGUMENT,
                f"structure: expected fields {_abbreviate(self.paths)}, got {_abbreviate(paths)}",
            )
        arrays = []
        for (path, leaf), np_dtype, shape, spec in zip(
            leaves, self.np_dtypes, self._shapes, self.specs
        ):
            array = as_array(path, leaf)
            if array.dtype != np_dtype or not _compatible(shape, array.shape):
                raise BatchError(
                    Code.INVALID_ARGUMENT,
                    f"{path}: expected {spec.dtype.name} {format_shape(spec.shape)}, "
                    f"got {_DTYPES[array.dtype].name} {format_shape(array.shape)}",
                )
            arrays.append(array)
        return arrays


def _template(nest, indices):
    """``nest`` with each leaf replaced by its flat index (dicts in sorted key order)."""
    if isinstance(nest, dict):
        return {key: _template(nest[key], indices) for key in sorted(nest)}
    if isinstance(nest, (tuple, list)):
        return tuple(_template(value, indices) for value in nest)
    return next(indices)


def _abbreviate(paths, limit=10):
    """``paths`` for a message: a batch that is a long list has a path per item."""
    if len(paths) <= limit:
        return str(paths)
    return f"{str(paths[:limit])[:-1]}, ... ({len(paths)} fields)]"


def _compatible(expected, actual):
    if expected is None:
        return True
    if len(expected) != len(actual):
        return False
    return all(e is None or e == a for e, a in zip(expected, actual))
