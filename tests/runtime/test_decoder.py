"""The decoder reads Ray's objects as ``ray.get`` would, through templates, without Ray's deserialization."""

import struct

import numpy as np
import pytest
import ray
import ray.exceptions

from tfray._internal.runtime import decoder, ray_api

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]


def same(got, want):
    """``got`` is ``want``'s structure, its arrays at the same addresses, read-only as Ray's."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        if not want.dtype.hasobject:
            assert got.ctypes.data == want.ctypes.data  # Ray's store, not a copy.
            assert not got.flags.writeable
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            same(got[key], want[key])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            same(g, w)
    else:
        assert got == want


def batch(i, rows=16):
    return {"x": np.full((rows, 256), i, np.float32), "y": np.arange(rows, dtype=np.int32) + i}


STRUCTURES = {
    "dict": batch,
    "array": lambda i: np.full((8, 3), i, np.int64),
    "0-d": lambda i: np.array(i, np.float64),
    "nested": lambda i: (
        np.full(5, i, np.uint8),
        [np.full((2, 2), i, np.float16), {"a": np.full(3, i, bool), "b": np.full((1, 7), i, np.int8)}],
    ),
    "bundle": lambda i: [batch(i + k) for k in range(4)],
    "empty dict inside": lambda i: {"x": np.full(4, i, np.int32), "meta": {}},
}


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_read_through_a_template_as_ray_get_reads(name):
    """The first window learns from Ray's deserialization; the next is read by template, alike."""
    make = STRUCTURES[name]
    refs = [ray.put(make(i)) for i in range(12)]
    d = decoder.BatchDecoder()
    first = ray_api.get_decoded(refs[:4], d)
    assert d.deserialized == 4 and d.read == 0
    rest = ray_api.get_decoded(refs[4:], d)
    assert d.read == 8 and d.deserialized == 4  # Every object after the first window.
    for got, want in zip(first + rest, ray.get(refs)):
        same(got, want)


def test_objects_unlike_a_template_are_rays_to_read():
    """Other shapes, Fortran order, object dtypes, other leaves: Ray's deserialization, same values."""
    values = [
        batch(0),
        batch(1, rows=3),  # A short last batch: another template.
        np.asfortranarray(np.ones((3, 4))),
        np.array(["a", "bc"], dtype=object),
        {"x": np.ones(3), "name": "batch"},
        np.zeros(0, np.float32),
        7,
    ]
    refs = [ray.put(v) for v in values] * 2
    d = decoder.BatchDecoder()
    got = ray_api.get_decoded(refs[: len(values)], d) + ray_api.get_decoded(refs[len(values) :], d)
    for g, w in zip(got, ray.get(refs)):
        same(g, w)
    assert d.read == 2  # The two dict batches, the second time; nothing else.


def test_failures_raise_as_ray_get_raises():
    """A failed task's object raises its cause's type; one not ready raises GetTimeoutError."""

    @ray.remote
    def fails():
        raise KeyError("boom")

    @ray.remote
    def waits():
        import time

        time.sleep(30)

    d = decoder.BatchDecoder()
    ok = ray.put(batch(0))
    ray_api.get_decoded([ok], d)
    with pytest.raises(KeyError, match="boom") as raised:
        ray_api.get_decoded([ok, fails.remote()], d)
    assert isinstance(raised.value, ray.exceptions.RayTaskError)
    slow = waits.remote()
    with pytest.raises(ray.exceptions.GetTimeoutError):
        ray_api.get_decoded([ok, slow], d, timeout=0)
    ray.cancel(slow, force=True)


def test_inline_task_results_read_through_a_template():
    """Results under Ray's inline size live in this process's heap: read alike, in place."""

    @ray.remote
    def make(i):  # batch(i), in the task (this module is not importable there).
        return {"x": np.full((16, 256), i, np.float32), "y": np.arange(16, dtype=np.int32) + i}

    refs = [make.remote(i) for i in range(20)]
    ray.wait(refs, num_returns=len(refs))
    d = decoder.BatchDecoder()
    got = ray_api.get_decoded(refs[:2], d) + ray_api.get_decoded(refs[2:], d)
    assert d.read == 18
    for g, w in zip(got, ray.get(refs)):
        same(g, w)


def test_decoded_arrays_keep_their_object():
    """An array read by template holds Ray's buffer: its bytes outlive the ref and the store's reuse."""
    d = decoder.BatchDecoder()
    refs = [ray.put(batch(i)) for i in range(4)]
    got = ray_api.get_decoded(refs, d)
    got = ray_api.get_decoded(refs, d)
    assert d.read == 4
    del refs
    for i in range(20):  # Objects that would take the freed blocks.
        ray.get(ray.put(batch(100 + i, rows=64)))
    for i, value in enumerate(got):
        assert (value["x"] == i).all() and (value["y"] == np.arange(16) + i).all()


def copy_aligned(data):
    """A writable, 64-byte aligned copy of a Ray object's bytes."""
    raw = np.frombuffer(data, np.uint8)
    room = np.empty(raw.size + 64, np.uint8)
    start = -room.ctypes.data % 64
    out = room[start : start + raw.size]
    out[:] = raw
    return out


def test_only_the_description_is_compared():
    """Bytes Ray never writes (the header slot's rest, the padding) may differ; a description may not."""
    ref = ray.put(batch(3))
    (data, metadata, transport), *_ = ray._private.worker.global_worker.core_worker.get_objects([ref], -1)
    d = decoder.BatchDecoder()
    ray_api.get_decoded([ref], d)
    calls = []

    def deserialize(serialized, refs):
        calls.append(len(serialized))
        return [batch(3)] * len(serialized)

    # Ray's layout: a 9-byte slot holding the msgpack data's length (here a
    # one-byte fixint), the msgpack data, pickle5's in-band and protobuf
    # sizes, the in-band pickle, the protobuf, padding, the buffers.
    raw = np.frombuffer(data, np.uint8)
    assert raw[0] < 0x80
    pickled = 9 + int(raw[0])
    in_band, protobuf = struct.unpack_from("<qq", raw, pickled)
    end = pickled + 16 + in_band + protobuf
    first = ray.get(ref)["x"].ctypes.data - raw.ctypes.data
    assert end < first  # Some padding to scribble on.

    junk = copy_aligned(data)
    junk[1:9] = 0xAB  # The header slot after the length.
    junk[end:first] = 0xCD  # The padding before the first array.
    (value,) = d.decode([(junk, metadata, transport)], [ref], deserialize)
    assert not calls and value["x"].ctypes.data == junk.ctypes.data + first
    np.testing.assert_array_equal(value["x"], batch(3)["x"])

    changed = copy_aligned(data)
    changed[end - 1] ^= 0xFF  # The description's last byte.
    d.decode([(changed, metadata, transport)], [ref], deserialize)
    assert calls == [1]
