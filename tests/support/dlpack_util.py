"""Reads a tensor's data pointer through DLPack.

``tensor.numpy()`` copies a tensor whose buffer TensorFlow does not own, so
it cannot show zero-copy; the DLPack capsule carries the buffer's address.
"""

import ctypes

import tensorflow as tf


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def data_pointer(tensor):
    """The address of ``tensor``'s first byte, as TensorFlow holds it."""
    capsule = tf.experimental.dlpack.to_dlpack(tensor)
    dl = _DLTensor.from_address(_get_pointer(capsule, b"dltensor"))
    return dl.data + dl.byte_offset


def object_store_mappings():
    """``(low, high, path)`` of this process's shared mappings of Ray's object store.

    Ray maps its store's shared memory (``/dev/shm/plasma*``) and, for
    objects the store cannot hold, fallback files (``plasma*`` in its
    session directory); both are shared (``s``) mappings named ``plasma``.
    """
    mappings = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and "plasma" in fields[5] and fields[1].endswith("s"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                mappings.append((low, high, fields[5].strip()))
    return mappings


def object_store_ranges():
    """The address ranges of this process's mappings of Ray's shared-memory store."""
    return [(low, high) for low, high, _ in object_store_mappings()]


def store_mapping_of(tensor):
    """The path of the object store mapping ``tensor``'s bytes lie in, or None.

    The whole tensor must lie inside it, not only its first byte.
    """
    address = data_pointer(tensor)
    nbytes = tensor.dtype.size * int(tf.size(tensor))
    for low, high, path in object_store_mappings():
        if low <= address and address + nbytes <= high:
            return path
    return None


def address_in_object_store(address):
    """True if ``address`` lies in a mapping of Ray's object store."""
    return any(low <= address < high for low, high in object_store_ranges())


def in_object_store(tensor):
    """True if ``tensor``'s first byte lies in Ray's shared-memory object store."""
    return address_in_object_store(data_pointer(tensor))


def assert_zero_copy(tensor, what="the tensor"):
    """Fails unless all of ``tensor``'s bytes lie in an object store mapping.

    A copy anywhere between Ray and TensorFlow (the feeder's, numpy's, TF's)
    lands in the heap, outside every such mapping, and fails this.
    """
    path = store_mapping_of(tensor)
    assert path is not None, (
        f"{what} at {data_pointer(tensor):#x} lies outside all "
        f"{len(object_store_mappings())} mappings of Ray's object store: it was copied"
    )
    return path


def bytes_by_address(elements):
    """``(bytes, bytes in Ray's object store)`` of every tensor in ``elements``, by address.

    Independent of tfray: each tensor's data pointer (DLPack) against this
    process's store mappings now. Hold the elements while calling, so no
    buffer is freed and its address reused first.
    """
    stores = object_store_mappings()
    total = in_store = 0
    for element in elements:
        for tensor in tf.nest.flatten(element):
            address = data_pointer(tensor)
            nbytes = tensor.dtype.size * int(tf.size(tensor))
            total += nbytes
            if any(low <= address and address + nbytes <= high for low, high, _ in stores):
                in_store += nbytes
    return total, in_store


def assert_stats_match_addresses(stats, elements, what="the epoch"):
    """Fails unless ``stats`` (one IteratorStats) says what the addresses of ``elements`` say."""
    total, in_store = bytes_by_address(elements)
    assert total > 0, f"{what}: nothing delivered"
    assert stats.bytes == total, f"{what}: stats count {stats.bytes} bytes delivered, TF holds {total}"
    assert (stats.bytes_zero_copy, stats.bytes_copied) == (in_store, total - in_store), (
        f"{what}: stats say {stats.bytes_zero_copy} of {total} bytes zero-copy; "
        f"by address, {in_store} lie in Ray's object store"
    )
    assert stats.bytes_copied == stats.bytes_copied_by_tfray + stats.bytes_copied_upstream
    return total, in_store
