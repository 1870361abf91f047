"""The two interfaces an epoch is read through, and the base of streams that wrap one.

A source opens an ``ItemStream`` per epoch, which its feeder pushes into the
epoch's channel. Sources of refs build theirs as a ``RefResolver`` over a
``RefStream`` (a list of refs, producers' generators, Ray Data's blocks).
"""

from typing import Any, List, Optional, Protocol, Tuple

import ray

from tfray._internal.runtime.lookahead import LookAhead
from tfray._internal.runtime.status import BatchError

# (label, ref): label says where the batch is, for messages ("shard 3 batch 7").
LabelledRef = Tuple[str, ray.ObjectRef]
# (label, value, error): a batch, or in its place the error that replaces it.
Item = Tuple[str, Any, Optional[BatchError]]


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
