"""The two interfaces an epoch is read through, and the base of streams that wrap one.

A source opens an ``ItemStream`` per epoch, which its feeder pushes into the
epoch's channel. Sources of refs build theirs as a ``RefResolver`` over a
``RefStream`` (a list of refs, producers' generators, Ray Data's blocks).

A ref whose label is a ``Bundle`` holds a list of consecutive batches (a
producer's bundle, see ``sources/producer.py``): the resolver hands it on
whole, and ``unbundle`` makes its batches items of their own.
"""

from typing import Any, List, Optional, Protocol, Tuple, Union

import ray

from tfray._internal.runtime.lookahead import LookAhead
from tfray._internal.runtime.status import BatchError


class Shard:
    """A producer's shard: its number, and the batches of it handed on so far."""

    __slots__ = ("number", "handed")

    def __init__(self, number):
        self.number = number
        self.handed = 0

    def labels(self, n):
        """The labels of the shard's next ``n`` batches."""
        first, self.handed = self.handed, self.handed + n
        return [f"shard {self.number} batch {i}" for i in range(first, first + n)]


class Bundle:
    """The label of a ref to a bundle of ``shard``'s batches (one per ref)."""

    __slots__ = ("shard",)

    def __init__(self, shard):
        self.shard = shard

    def first(self, after=0):
        """Its first batch's label, ``after`` more of the shard's batches ahead of it not yet handed on."""
        return f"shard {self.shard.number} batch {self.shard.handed + after}"

    def __str__(self):
        return self.first()


# (label, ref): label says where the batch is, for messages ("shard 3 batch 7"),
# or is a Bundle.
LabelledRef = Tuple[Union[str, Bundle], ray.ObjectRef]
# (label, value, error): a batch, or in its place the error that replaces it;
# from a RefResolver, a Bundle's value is its list of batches (see unbundle).
Item = Tuple[Union[str, Bundle], Any, Optional[BatchError]]


class RefStream(Protocol):
    """The refs of one epoch, in order."""

    done: bool  # Nothing more to take.

    def take(self, n: int, timeout: Optional[float]) -> List[LabelledRef]:
        """Up to ``n`` refs; waits at most ``timeout`` (None: no limit) for the first."""

    def close(self) -> None:
        """Stops its producers; nothing more is taken."""


class ItemStream(Protocol):
    """The resolved items of one epoch, in order: what a feeder pushes."""

    # An adaptive look-ahead the feeder keeps its channel's capacity at, or
    # None: the channel's capacity is the stream's fixed bound.
    lookahead: Optional[LookAhead]
    in_flight: int  # Refs being resolved ahead now.

    def next_ready(self, timeout: float) -> Optional[List[Item]]:
        """Items ready now ([] if none within ``timeout``), or None at the end."""

    def close(self) -> None:
        """Stops its producers; nothing more is read."""


class Wrapped:
    """A stream over another, which answers whatever this one does not redefine."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    # Set on the wrapped stream, as it is read from it (a generator stream's
    # interleaving, set before its first take).
    @property
    def deterministic(self):
        return self._stream.deterministic

    @deterministic.setter
    def deterministic(self, value):
        self._stream.deterministic = value

    def close(self):
        self._stream.close()


def batches_in(label, value):
    """How many items the resolved ref ``label`` stands for (a bundle's batches, else 1)."""
    return len(value) if isinstance(label, Bundle) and value is not None else 1


def unbundle(items):
    """``items`` with each resolved bundle replaced by an item per batch, in order.

    A bundle that failed stays one item: the error that ends its shard.
    """
    out = []
    for label, value, error in items:
        if not isinstance(label, Bundle):
            out.append((label, value, error))
        elif error is not None:
            out.append((str(label), None, error))
        else:
            out.extend(zip(label.shard.labels(len(value)), value, [None] * len(value)))
    return out


class Unbundled(Wrapped):
    """An ItemStream (a RefResolver's) whose bundles are handed on a batch at a time."""

    def next_ready(self, timeout):
        items = self._stream.next_ready(timeout)
        return items if not items else unbundle(items)
