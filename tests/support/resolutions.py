"""Counts how often each batch is resolved (deserialized) in this process.

``put(key, array)`` stores an array whose unpickling records ``key``: every
``ray.get`` of the ref, by tfray or anyone else in this process, counts once.
The array arrives as a plain ``np.ndarray`` over the object store's memory,
so tfray sees an ordinary batch. Tests use the counts to show that a batch
outside a reader's share was never fetched, not just never delivered.
"""

import collections

import numpy as np
import ray

_resolved = collections.Counter()


def _rebuild(key, array):
    _resolved[key] += 1
    return array


class _Counted(np.ndarray):
    """An array whose unpickling calls ``_rebuild`` with its key."""

    def __reduce_ex__(self, protocol):
        # The plain array inside still travels out of band (pickle 5): zero-copy.
        return (_rebuild, (self.resolution_key, self.view(np.ndarray)))


def counted(key, array):
    """``array`` wrapped so that each resolution of it records ``key``."""
    wrapped = np.asarray(array).view(_Counted)
    wrapped.resolution_key = key
    return wrapped


def put(key, array):
    """``ray.put`` of ``array``; each later resolution records ``key``."""
    return ray.put(counted(key, array))


def resolved():
    """``{key: times resolved}`` since the last ``reset()``."""
    return dict(_resolved)


def reset():
    _resolved.clear()
