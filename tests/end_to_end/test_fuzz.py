"""Bad input, fuzzed: every batch gives exactly the right tensors or a clear error.

Guards spec.py (inference, checks, messages) and the feeder's per-batch path:
hypothesis draws nests (dict / tuple / list, nested, some empty) of arrays of
every supported dtype (bfloat16 through ml_dtypes), shapes from 0-d and
0-size to 6 dims, and layouts that reach the feeder as they are: C order,
Fortran order, strided and reversed views and dtype-unaligned buffers (the
last three rebuilt by a reducer as views into the Ray object, which is
read-only, so Ray's pickling does not make them contiguous first). Arrays
under 2 KB come from Ray only 8-byte aligned, so the copy path for unaligned
data is drawn often. Unsupported dtypes (strings, bytes, object, structured,
datetime, big-endian, ...) and element_specs that do not match must give a
TypeError / ValueError at construction when tfray infers the spec, or an
InvalidArgumentError from ``next()`` naming the field, and the stream goes on.

The CI profile is derandomized (the same examples every run) and small; the
slow profile draws many more, at random.
"""

import datetime
import operator

import ml_dtypes
import numpy as np
import pandas as pd
import pytest
import ray
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support.dlpack_util import address_in_object_store

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600)]

SUPPORTED = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ml_dtypes.bfloat16,
]  # fmt: skip
# Each makes an array of an unsupported dtype with the given shape.
UNSUPPORTED = {
    "<U3": lambda shape: np.full(shape, "abc"),
    "|S2": lambda shape: np.full(shape, b"ab"),
    "object": lambda shape: np.full(shape, None, dtype=object),
    "structured": lambda shape: np.zeros(shape, dtype=[("a", np.int32), ("b", np.float32)]),
    "datetime64[D]": lambda shape: np.zeros(shape, dtype="datetime64[D]"),
    "timedelta64[s]": lambda shape: np.zeros(shape, dtype="timedelta64[s]"),
    ">i4": lambda shape: np.zeros(shape, dtype=">i4"),  # Big-endian.
    "float128": lambda shape: np.zeros(shape, dtype=np.longdouble),
    "float8_e4m3fn": lambda shape: np.zeros(shape, dtype=ml_dtypes.float8_e4m3fn),
}
LAYOUTS = ["C", "F", "strided", "reversed", "unaligned"]
KEYS = st.sampled_from(["a", "b", "image", "label", "x_1"])

CI = settings(
    max_examples=100,
    deadline=datetime.timedelta(seconds=20),
    derandomize=True,
    database=None,
)
BIG = settings(CI, max_examples=1000, derandomize=False)


# Reducers: Ray unpickles these into views of the (read-only) object buffer.
class _View:
    def __init__(self, base, index):
        self.base, self.index = base, index

    def __reduce__(self):
        return operator.getitem, (self.base, self.index)


def _unaligned(raw, dtype, shape):
    return raw[1:].view(dtype).reshape(shape)


class _Unaligned:
    """An array whose data starts one byte into a uint8 buffer."""

    def __init__(self, array):
        self.raw = np.zeros(array.nbytes + 1, np.uint8)
        self.raw[1:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.dtype, self.shape = array.dtype, array.shape

    def __reduce__(self):
        return _unaligned, (self.raw, self.dtype, self.shape)


def _laid_out(array, layout):
    """What to ray.put so that ray.get gives ``array``'s values in ``layout``."""
    if array.ndim == 0 or layout == "C":
        return array
    if layout == "F":
        return np.asfortranarray(array)
    if layout == "strided":
        base = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), array.dtype)
        base[..., ::2] = array
        return _View(base, (Ellipsis, slice(None, None, 2)))
    if layout == "reversed":
        return _View(np.ascontiguousarray(array[..., ::-1]), (Ellipsis, slice(None, None, -1)))
    if array.dtype.itemsize == 1:
        return array  # Every byte offset is aligned for one-byte items.
    return _Unaligned(array)


@st.composite
def leaves(draw):
    """A Leaf: a random array of a supported dtype and shape, in a random layout."""
    dtype = np.dtype(draw(st.sampled_from(SUPPORTED)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=6, min_side=0, max_side=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    size = int(np.prod(shape))
    if dtype == np.bool_:
        array = rng.integers(0, 2, size).astype(np.bool_).reshape(shape)
    else:  # Any bit pattern: NaNs, infinities and subnormals too.
        array = rng.integers(0, 256, size * dtype.itemsize, dtype=np.uint8)
        array = array.view(dtype).reshape(shape)
    layout = draw(st.sampled_from(LAYOUTS))
    return Leaf(_laid_out(array, layout), array, f"{dtype.name}{list(shape)} {layout}")


class Leaf:
    """What to ray.put, the array TF must give back, and how to show it."""

    def __init__(self, put, expected, description):
        self.put, self.expected, self.description = put, expected, description

    def __repr__(self):
        return self.description


def nests(leaf_strategy, min_leaves=1):
    def extend(children):
        return st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(KEYS, children, max_size=3),
        )

    nest = st.recursive(leaf_strategy, extend, max_leaves=5)
    return nest.filter(lambda n: len(_paths(n)) >= min_leaves)


def _map(fn, nest, path=""):
    """Maps ``fn(path, leaf)`` over a nest (of Leaf, or of specs); lists become tuples."""
    if isinstance(nest, dict):
        return {k: _map(fn, v, f"{path}/{k}" if path else k) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return tuple(_map(fn, v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(nest))
    return fn(path or "element", nest)


def _paths(nest):
    out = []
    _map(lambda path, leaf: out.append(path), nest)
    return out


def _put(nest):
    """The batch to ray.put: the nest, lists kept as lists."""
    if isinstance(nest, dict):
        return {k: _put(v) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return type(nest)(_put(v) for v in nest)
    return nest.put


def _spec_of(path, leaf):
    return tf.TensorSpec(leaf.expected.shape, tf.as_dtype(leaf.expected.dtype))


def assert_delivered(got, nest):
    """``got`` (tensors) holds exactly ``nest``'s arrays: dtype, shape, bytes."""
    expected = _map(lambda path, leaf: Leaf(leaf.put, leaf.expected, f"{path}: {leaf}"), nest)
    tf.nest.assert_same_structure(got, expected, check_types=False)
    for tensor, leaf in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
        value = tensor.numpy()
        assert value.dtype == leaf.expected.dtype, leaf
        assert value.shape == leaf.expected.shape, leaf
        assert value.tobytes() == leaf.expected.tobytes(), leaf


def _relax(spec, how):
    if how == "unknown rank":
        return tf.TensorSpec(None, spec.dtype)
    if how == "unknown dims" and spec.shape.rank:
        return tf.TensorSpec([None] * spec.shape.rank, spec.dtype)
    return spec


def check_round_trip(nest, spec_mode):
    """Valid batches come out exactly as they went in, whatever their layout."""
    ref = ray.put(_put(nest))
    if spec_mode == "inferred":
        element_spec = None
    else:
        element_spec = _map(lambda p, leaf: _relax(_spec_of(p, leaf), spec_mode), nest)
    ds = tfray.Dataset([ref, ref], element_spec=element_spec)
    got = list(ds)
    assert len(got) == 2
    for element in got:
        assert_delivered(element, nest)
    # Arrays that are not C-contiguous, or not aligned even for their dtype,
    # are copied (once per batch) and counted; others only if Ray placed them
    # off TF's 64-byte alignment. Where it places an object's arrays is fixed
    # in the store but may differ between two reads of an inline object.
    arrays = tf.nest.flatten(ray.get(ref))
    forced = sum(not a.flags.c_contiguous or not a.flags.aligned for a in arrays)
    maybe = sum(
        a.flags.c_contiguous and a.flags.aligned and (a.ctypes.data % 64 != 0 or not address_in_object_store(a.ctypes.data))
        for a in arrays
    )
    copied = ds.stats()[-1].arrays_copied
    assert 2 * forced <= copied <= 2 * (forced + maybe), f"{copied} copies; {forced} forced, {maybe} maybe, per batch"


def check_unsupported_leaf(nest, where, kind):
    """An unsupported leaf: TypeError when inferring, else an error in its place."""
    paths = _paths(nest)
    path = paths[where % len(paths)]
    bad_array = UNSUPPORTED[kind]((2, 3))
    good_batch = _put(nest)
    # The same nest with lists as tuples (both are accepted).
    bad_batch = _map(lambda p, leaf: bad_array if p == path else leaf.put, nest)
    good, bad = ray.put(good_batch), ray.put(bad_batch)
    with pytest.raises(TypeError) as info:
        tfray.Dataset([bad, good])  # Infers the spec from the bad batch.
    assert f"first batch: {path}: dtype {bad_array.dtype} is not supported" in str(info.value)

    spec = _map(_spec_of, nest)
    it = iter(tfray.Dataset([good, bad, good], element_spec=spec))
    assert_delivered(next(it), nest)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        next(it)
    assert f"batch 1: {path}: dtype {bad_array.dtype} is not supported" in info.value.message
    assert_delivered(next(it), nest)  # The stream goes on.
    with pytest.raises(StopIteration):
        next(it)


def check_mismatched_spec(nest, where, how):
    """A spec that does not fit the batch: an InvalidArgumentError naming the field."""
    paths = _paths(nest)
    path = paths[where % len(paths)]
    spec = _map(_spec_of, nest)

    def mutate(p, s):
        if p != path:
            return s
        if how == "dtype":
            others = [d for d in SUPPORTED if tf.as_dtype(np.dtype(d)) != s.dtype]
            return tf.TensorSpec(s.shape, tf.as_dtype(np.dtype(others[where % len(others)])))
        if how == "rank":
            return tf.TensorSpec(s.shape.as_list() + [1], s.dtype)
        if s.shape.rank == 0:  # "dim" on a scalar: make it a vector.
            return tf.TensorSpec([None], s.dtype)
        dims = s.shape.as_list()
        dims[where % len(dims)] += 1
        return tf.TensorSpec(dims, s.dtype)

    if how == "extra field":
        spec = {"extra": tf.TensorSpec([], tf.float32), "batch": spec}
        expected = "structure: expected fields"
    else:
        spec = _map(mutate, spec)
        expected = f"batch 0: {path}: expected "
    it = iter(tfray.Dataset([ray.put(_put(nest))], element_spec=spec))
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        next(it)
    assert expected in info.value.message
    assert "got" in info.value.message


SPEC_MODES = st.sampled_from(["inferred", "exact", "unknown dims", "unknown rank"])
MISMATCHES = st.sampled_from(["dtype", "dim", "rank", "extra field"])
UNSUPPORTED_KINDS = st.sampled_from(sorted(UNSUPPORTED))
WHERE = st.integers(0, 100)


@CI
@given(nests(leaves()), SPEC_MODES)
def test_valid_batches_round_trip(nest, spec_mode):
    check_round_trip(nest, spec_mode)


@CI
@given(nests(leaves()), WHERE, UNSUPPORTED_KINDS)
def test_unsupported_dtypes_are_refused_naming_the_field(nest, where, kind):
    check_unsupported_leaf(nest, where, kind)


@CI
@given(nests(leaves()), WHERE, MISMATCHES)
def test_mismatched_specs_name_the_field(nest, where, how):
    check_mismatched_spec(nest, where, how)


@pytest.mark.slow
@BIG
@given(nests(leaves()), SPEC_MODES, WHERE, UNSUPPORTED_KINDS, MISMATCHES)
def test_many_more_examples(nest, spec_mode, where, kind, how):
    check_round_trip(nest, spec_mode)
    check_unsupported_leaf(nest, where, kind)
    check_mismatched_spec(nest, where, how)


def _cannot_rebuild():
    raise ModuleNotFoundError("No module named 'producer_only_module'")


class _OnlyOnTheProducer:
    """Unpickles by raising, as a class the trainer cannot import would."""

    def __reduce__(self):
        return _cannot_rebuild, ()


NOT_BATCHES = [
    (None, "element: expected a numpy array, got NoneType"),
    (3, "element: expected a numpy array, got int"),
    (b"raw bytes", "element: expected a numpy array, got bytes"),
    (pd.DataFrame({"x": [1.0]}), "element: expected a numpy array, got DataFrame"),
    ({"x": [1.0, 2.0]}, "structure: expected fields ['element'], got ['x/0', 'x/1']"),
    (
        list(range(5000)),  # The message lists ten of its 5000 paths, not all.
        "structure: expected fields ['element'], got "
        "['0', '1', '2', '3', '4', '5', '6', '7', '8', '9', ... (5000 fields)]",
    ),
    ({1: np.ones(2), "a": np.ones(2)}, "element: dict keys [\"'a'\", '1'] cannot be sorted"),
    (_OnlyOnTheProducer(), "its Ray object cannot be deserialized in this process (ModuleNotFoundError"),
]


@pytest.mark.timeout(60)
def test_copies_are_exactly_the_arrays_tf_cannot_alias():
    """In the store, an aligned C array is never copied; Fortran, strided and unaligned ones once each."""
    big = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)  # 256 KB: the object is in the store.
    value = {
        "c": big,
        "f": np.asfortranarray(big[:8]),
        "strided": _View(big[:4].copy(), (Ellipsis, slice(None, None, 2))),
        "unaligned": _Unaligned(big[0]),
    }
    ref = ray.put(value)
    resolved = ray.get(ref)
    assert address_in_object_store(resolved["c"].ctypes.data) and resolved["c"].ctypes.data % 64 == 0
    ds = tfray.Dataset([ref, ref])
    got = list(ds)
    assert len(got) == 2
    for element in got:
        np.testing.assert_array_equal(element["c"].numpy(), big)
        np.testing.assert_array_equal(element["unaligned"].numpy(), big[0])
    stats = ds.stats()[-1]
    assert stats.arrays_copied == 2 * 3, stats
    assert stats.bytes_zero_copy == 2 * big.nbytes, stats


def test_ray_objects_that_are_not_batches():
    """Objects that are no batch each fail in place, clearly; the stream goes on."""
    refs = [ray.put(obj) for obj, _ in NOT_BATCHES]
    refs.append(ray.put({"inner": ray.put(np.ones(2, np.float32))}))  # A ref, not a batch.
    refs.append(ray.put(np.ones(2, np.float32)))
    it = iter(tfray.Dataset(refs, element_spec=tf.TensorSpec([None], tf.float32)))
    for i, (_, message) in enumerate(NOT_BATCHES):
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            next(it)
        assert f"batch {i}: {message}" in info.value.message
    with pytest.raises(tf.errors.InvalidArgumentError, match="structure: expected fields"):
        next(it)
    np.testing.assert_array_equal(next(it).numpy(), [1.0, 1.0])
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("batch", [{}, (), [], {"a": {}, "b": ()}])
def test_a_batch_without_arrays_is_refused_at_construction(batch):
    """A nest with no array at all cannot be a tf.data element: ValueError, not a TF attr error."""
    with pytest.raises(ValueError, match="expected at least one tf.TensorSpec"):
        tfray.Dataset([ray.put(batch)])
    with pytest.raises(ValueError, match="expected at least one tf.TensorSpec"):
        tfray.Dataset([], element_spec=batch)


def test_dict_keys_tf_nest_cannot_order_are_refused_at_construction():
    """Mixed str / int keys: a TypeError naming the dict, when inferring or in a spec."""
    with pytest.raises(TypeError, match="element: dict keys .* cannot be sorted"):
        tfray.Dataset([ray.put({1: np.ones(2), "a": np.ones(2)})])
    spec = {"x": {1: tf.TensorSpec([2], tf.float64), "a": tf.TensorSpec([2], tf.float64)}}
    with pytest.raises(TypeError, match="element_spec x: dict keys .* cannot be sorted"):
        tfray.Dataset([], element_spec=spec)
