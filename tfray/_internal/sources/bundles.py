"""Producers' bundles: one Ray object holding several consecutive batches of a shard.

A ``from_generators`` producer puts its batches in the store in bundles
(see ``producer.py``). A ref to one is labelled with a ``Bundle`` of its
shard; the resolver hands the bundle on whole, asking its stream how many
batches it holds and where a failed one stands (``BundledRefs``), and
``unbundle`` then makes each batch an item of its own.
"""

from tfray._internal.runtime.streams import Wrapped


class BatchLabel(str):
    """A bundled batch's label, ``shard 3 batch 17``, that knows its origin.

    ``origin`` is ``(unit, index, size)``: the shard's number, and the
    batch's place in its bundle of ``size`` batches. The feeder hands it to
    the channel with the batch, so that a checkpoint counts what TF took of
    each shard (channel.h's Progress). A ``str``, so messages use it as is.
    """


class Shard:
    """A producer's shard: its number, and the batches of it handed on so far.

    ``handed`` starts where a resumed epoch starts the shard.
    """

    __slots__ = ("number", "handed")

    def __init__(self, number, handed=0):
        self.number = number
        self.handed = handed

    def labels(self, n, offset=0):
        """The labels of the shard's next ``n`` batches, a bundle past its first ``offset``."""
        first, self.handed = self.handed, self.handed + n
        labels = [BatchLabel(f"shard {self.number} batch {i}") for i in range(first, first + n)]
        size = offset + n
        for index, label in enumerate(labels, offset):
            label.origin = (self.number, index, size)
        return labels


class Bundle:
    """The label of a ref to a bundle of ``shard``'s batches (one per ref).

    ``offset``: batches of the bundle a checkpoint's epoch already handed out
    (a resumed shard's first bundle holds the rest of one).
    """

    __slots__ = ("offset", "shard")

    def __init__(self, shard, offset=0):
        self.shard = shard
        self.offset = offset

    def first(self, after=0):
        """Its first batch's label, ``after`` more of the shard's batches ahead of it not yet handed on."""
        return f"shard {self.shard.number} batch {self.shard.handed + after}"

    def __str__(self):
        return self.first()


def batches_in(label, value):
    """How many batches the resolved ref ``label`` holds (a bundle's, else 1)."""
    return len(value) if isinstance(label, Bundle) and value is not None else 1


class BundledRefs:
    """What a RefStream of bundles tells the resolver (runtime/streams.py)."""

    @staticmethod
    def batches_held(label, value):
        return batches_in(label, value)

    @staticmethod
    def where(label, earlier):
        """Where the failed ref ``label`` stands, after the resolved ``(label, value)`` pairs ``earlier``."""
        if not isinstance(label, Bundle):
            return label
        same_shard = (
            batches_in(other, value)
            for other, value in earlier
            if isinstance(other, Bundle) and other.shard is label.shard
        )
        return label.first(sum(same_shard))


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
            out.extend(zip(label.shard.labels(len(value), label.offset), value, [None] * len(value)))
    return out


class Unbundled(Wrapped):
    """An ItemStream (a RefResolver's) whose bundles are handed on a batch at a time."""

    def next_ready(self, timeout):
        items = self._stream.next_ready(timeout)
        return items if not items else unbundle(items)
