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


def object_store_ranges():
    """The address ranges of this process's mappings of Ray's shared-memory store."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "plasma" in fields[5] and fields[1].endswith("s"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((low, high))
    return ranges


def in_object_store(tensor):
    """True if ``tensor``'s memory lies in Ray's shared-memory object store."""
    address = data_pointer(tensor)
    return any(low <= address < high for low, high in object_store_ranges())
