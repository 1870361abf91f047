"""Reads numpy batches out of Ray's serialized objects without Ray's Python per object.

``ray.get`` deserializes each object in Python under the trainer's GIL:
msgpack, pickle with out-of-band buffers, numpy's ``_frombuffer`` per array
(which first asks Ray's buffer for a writable view and is refused: an
exception and a traceback each time). That is 20 to 30 us an object of 16 KB
here, and it leaves six objects per batch that the cyclic GC tracks; a
window of thousands of batches held ahead lets them reach the oldest
generation, whose collections (over every object of a TensorFlow process)
then cost another 12 to 34 us a batch.

Batches of one stream are alike: the same structure, dtypes and shapes. In
Ray's layout (a header slot holding the msgpack data's length, the msgpack
data, then pickle5's sizes, in-band pickle and the protobuf describing each
out-of-band buffer, then the buffers, 64-byte aligned) everything but the
arrays' bytes comes before the first array. So once Ray has deserialized
one object, its arrays' offsets and the bytes before them are a template:
another object whose description is the same bytes, of the same size and
metadata, at the same alignment, is the same structure with its arrays at
the same offsets. Ray writes neither the header slot's bytes after the
length nor the padding before the buffers (a reused store block keeps what
was there), so those are not compared. It is read by building the arrays over Ray's own buffer (which
pins the object, as Ray's arrays do), read-only as Ray's are, with no
Python call per object. Anything else (another structure, an error, an
object that is not a plain nest of numpy arrays) goes through Ray's own
deserialization, and may become a template.
"""

import ctypes
import itertools
import struct

import numpy as np
import ray.exceptions

try:  # Ray's private helper, read only when a template is learnt (Ray 2.59 and 2.60).
    from ray._private.serialization import split_buffer
except ImportError:  # pragma: no cover - a Ray without it reads every object its own way.
    split_buffer = None

# Templates kept: a stream's full batches, its last short one, a few bundle sizes.
_MOST = 4
# Templates learnt per window at most.
_LEARN_PER_CALL = 2
# The bytes a msgpack unsigned int takes, by its first byte (a fixint: 1).
_MSGPACK_UINT = {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}
_ALIGN = 64  # Ray aligns the out-of-band buffers' segment to this (kMajorBufferAlign).
# Program steps that rebuild a value from its arrays (post-order).
_LEAF, _DICT, _TUPLE, _LIST = range(4)


class NotPlain(Exception):
    """A value that is not a nest of dicts, tuples and lists of numpy arrays in its object."""


class Template:
    """What one object's bytes say about every object whose description is the same.

    Args:
        metadata: the object's Ray metadata.
        size: its size in bytes.
        align: its address modulo ``_ALIGN``.
        head: the bytes of the msgpack data's length, at the start.
        start: where the msgpack data starts.
        body: its bytes from ``start`` to the end of its description (the
            protobuf).
        program: the steps that rebuild its value (``_LEAF``: offset,
            dtype, shape; ``_DICT``: keys; ``_TUPLE``/``_LIST``: length).
    """

    __slots__ = ("align", "body", "end", "head", "key", "metadata", "program", "size", "start")

    def __init__(self, metadata, size, align, head, start, body, program):
        self.metadata = metadata
        self.size = size
        self.align = align
        self.head = head
        self.start = start
        self.end = start + len(body)
        self.body = body
        self.program = program
        self.key = (metadata, size, align, head, body)  # Equal keys read objects alike.


def learn(data, metadata, value):
    """The Template of ``value``, deserialized by Ray from ``data``; None if it makes none."""
    if split_buffer is None or not metadata or b"," in metadata:
        return None
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(data))
    except (TypeError, ValueError):  # A read-only or empty buffer.
        return None
    size = len(data)
    try:
        program, first = _steps(value, base, size)
    except NotPlain:
        return None
    # Where the description starts and ends: after the header slot, and
    # after pickle5's protobuf (its data starts with the in-band and
    # protobuf sizes). Checked against where Ray put the first array.
    packed, pickled = split_buffer(data)
    view = memoryview(data)
    if len(packed) == 0 or view[0] > 0x7F and view[0] not in _MSGPACK_UINT:
        return None
    head = _MSGPACK_UINT.get(view[0], 1)
    start = np.frombuffer(packed, np.uint8).ctypes.data - base
    pickle_start = np.frombuffer(pickled, np.uint8).ctypes.data - base
    in_band, protobuf = struct.unpack_from("<qq", data, pickle_start)
    end = pickle_start + 16 + in_band + protobuf
    segment = -(-(base + end) // _ALIGN) * _ALIGN - base
    if not head <= start < end <= segment == first:
        return None
    return Template(metadata, size, base % _ALIGN, bytes(view[:head]), start, bytes(view[start:end]), program)


def _steps(value, base, size):
    """The steps that rebuild ``value`` (post-order), and its first array's offset.

    Iterative, without a call per item: a producer's bundle holds hundreds
    of batches, and tfray's Python runs per window, not per batch
    (test_per_window.py).
    """
    program = []
    first = size
    pending = [(value, False)]
    while pending:
        value, done = pending.pop()
        kind = type(value)
        if done:
            program.append((_DICT, tuple(value)) if kind is dict else (_TUPLE if kind is tuple else _LIST, len(value)))
        elif kind is np.ndarray:
            offset = value.ctypes.data - base
            if (
                not value.flags.c_contiguous
                or value.dtype.hasobject
                or value.nbytes == 0
                or offset < 0
                or offset + value.nbytes > size
            ):
                raise NotPlain
            program.append((_LEAF, offset, value.dtype, value.shape))
            first = min(first, offset)
        elif kind is dict or kind is tuple or kind is list:
            pending.append((value, True))
            items = value.values() if kind is dict else value
            pending.extend(zip(reversed(list(items)), itertools.repeat(False)))
        else:
            raise NotPlain
    if first == size:  # No array.
        raise NotPlain
    return tuple(program), first


class BatchDecoder:
    """Reads a stream's objects through templates learnt from Ray's own deserialization.

    Counts (for tests): ``read``, the objects read through a template;
    ``deserialized``, those Ray deserialized.
    """

    def __init__(self):
        # By key, oldest first; the feeder's thread only.
        self._templates = {}
        self.read = 0
        self.deserialized = 0

    def decode(self, serialized, refs, deserialize):
        """The values of ``serialized`` (Ray's ``(data, metadata, transport)`` per ref).

        ``deserialize(serialized, refs)`` is Ray's own, for the objects no
        template reads. Raises what Ray's ``get`` raises for a failed
        object; None where only Ray's ``get`` itself can read them (an
        object with a tensor transport, or a debugger's metadata).
        """
        values = []
        misses = []
        templates = list(reversed(self._templates.values()))
        ndarray = np.ndarray
        # One loop, no Python call per object (tests/runtime/test_per_window.py).
        for data, metadata, transport in serialized:
            if transport is not None:
                return None
            value = None
            for t in templates:
                if metadata != t.metadata or len(data) != t.size:
                    continue
                view = memoryview(data)
                if bytes(view[t.start : t.end]) != t.body or bytes(view[: len(t.head)]) != t.head:
                    continue
                if ctypes.addressof(ctypes.c_char.from_buffer(data)) % _ALIGN != t.align:
                    continue
                stack = []
                for step in t.program:
                    op = step[0]
                    if op == _LEAF:
                        array = ndarray(step[3], step[2], data, step[1])
                        array.flags.writeable = False  # As Ray's are.
                        stack.append(array)
                    else:
                        n = len(step[1]) if op == _DICT else step[1]
                        items = stack[len(stack) - n :]
                        del stack[len(stack) - n :]
                        if op == _DICT:
                            stack.append(dict(zip(step[1], items)))
                        else:
                            stack.append(tuple(items) if op == _TUPLE else items)
                value = stack[0]
                break
            if value is None:
                if metadata is not None and b"," in metadata:  # Ray's get reads a debugger's breakpoint from it.
                    return None
                misses.append(len(values))
            values.append(value)
        self.read += len(values) - len(misses)
        if misses:
            self._deserialize(values, misses, serialized, refs, deserialize)
        return values

    def _deserialize(self, values, misses, serialized, refs, deserialize):
        got = deserialize(list(map(serialized.__getitem__, misses)), list(map(refs.__getitem__, misses)))
        self.deserialized += len(misses)
        for i, value in zip(misses, got):
            if isinstance(value, ray.exceptions.RayError):  # As ray.get raises it.
                if isinstance(value, ray.exceptions.RayTaskError):
                    raise value.as_instanceof_cause()
                raise value
            values[i] = value
        # From a window's first misses only: where objects vary (ragged
        # shapes), each would cost a template's work and make none that serves.
        for i in misses[:_LEARN_PER_CALL]:
            data, metadata, _ = serialized[i]
            template = learn(data, metadata, values[i])
            if template is not None and template.key not in self._templates:
                self._templates[template.key] = template
                if len(self._templates) > _MOST:
                    del self._templates[next(iter(self._templates))]
