"""The two interfaces an epoch is read through, and the base of streams that wrap one.

A source opens an ``ItemStream`` per epoch, which its feeder pushes into the
epoch's channel. Sources of refs build theirs as a ``RefResolver`` over a
``RefStream`` (a list of refs, producers' generators, Ray Data's blocks).

A ref may stand for several batches (a producer's bundle, see
``sources/bundles.py``): its stream then says how many each resolved ref
holds, and where a failed one stands; the resolver hands such a ref on
whole.
"""

import dataclasses
from typing import Any, List, Optional, Protocol, Tuple

import ray

from tfray._internal.runtime.lookahead import LookAhead
from tfray._internal.runtime.status import BatchError

# (label, ref): label says where the batch is, for messages ("shard 3 batch 7"),
# or is its stream's own (a bundle's).
LabelledRef = Tuple[Any, ray.ObjectRef]
# (label, value, error): a batch, or in its place the error that replaces it;
# from a RefResolver, a ref that holds several batches has them as its value.
Item = Tuple[Any, Any, Optional[BatchError]]


@dataclasses.dataclass(frozen=True)
class Unplaced:
    """An epoch's producers that no alive node can run now (sources/placement.py)."""

    producers: int
    since: float  # time.monotonic() of the epoch's last progress.


class RefStream(Protocol):
    """The refs of one epoch, in order."""

    done: bool  # Nothing more to take.

    def take(self, n: int, timeout: Optional[float]) -> List[LabelledRef]:
        """Up to ``n`` refs; waits at most ``timeout`` (None: no limit) for the first."""

    def close(self) -> None:
        """Stops its producers; nothing more is taken."""

    # A stream whose refs hold several batches each (sources/bundles.py)
    # also has ``batches_held(label, value)``, how many a resolved ref
    # holds, and ``where(label, earlier)``, where a failed ref stands after
    # the resolved ``(label, value)`` pairs ``earlier``. Without them, a
    # ref is one batch, and a failed one is told by its label.
    # A stream of producers also has ``unplaced``: an Unplaced while none
    # can be placed, else None.


class ItemStream(Protocol):
    """The resolved items of one epoch, in order: what a feeder pushes."""

    # An adaptive look-ahead the feeder keeps its channel's capacity at, or
    # None: the channel's capacity is the stream's fixed bound.
    lookahead: Optional[LookAhead]
    in_flight: int  # Refs being resolved ahead now.
    # An Unplaced while the epoch's producers cannot be placed (a stream
    # that starts producers has it; for others the feeder reads None).
    unplaced: Optional[Unplaced]

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
