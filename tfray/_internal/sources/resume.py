"""Resuming an epoch from a checkpointed position.

A restored TF iterator asks its source for the epoch again with what it had
handed out: the number of items (batches, or per-batch errors), and, for a
source made of work units (a generator's or a tf.data pipeline's shards),
what it handed out of each unit (a ``runtime.progress.Progress``, which the
iterator counts natively: channel.h). With the units' progress, ``plan`` says where each
shard starts and where the interleave stands, so that the resumed epoch
makes only what is left, in the order an uninterrupted epoch would have
delivered it. Without it (a checkpoint of a source without units, or one
saved before units were counted), sources pass over the position: a list of
refs by slicing (nothing is resolved), producers' and Ray Data's streams by
dropping batches after they are read; exact when the epoch yields the same
items in the same order each time it is run.
"""

import collections
import logging
from typing import Dict, List, NamedTuple

from tfray._internal.runtime.status import BatchError, Code
from tfray._internal.runtime.streams import Wrapped

logger = logging.getLogger("tfray")


class Start(NamedTuple):
    """Where a resumed shard starts (producer.run_shard's ``start``, less ``asks``)."""

    batch: int  # Its first batch to make.
    ordinal: int  # Bundles it began before.
    rest: int  # Batches left of its last bundle, which its first bundle holds; or 0.


class Plan(NamedTuple):
    """A resumed epoch of shards: which run, in what rotation, and where each starts.

    ``running``: shard indexes in rotation order (producers to start now);
    ``turn``: the position in ``running`` whose bundle comes next;
    ``pending``: shard indexes to start, in order, as running ones end;
    ``starts``: shard index -> Start (a shard without one starts at 0);
    ``offsets``: shard index -> batches of its first bundle handed out before.
    """

    running: List[int]
    turn: int
    pending: List[int]
    starts: Dict[int, Start]
    offsets: Dict[int, int]


def of_another_share(progress, numbers, whole):
    """Whether ``progress`` is of shards of the whole dataset (``whole`` shards) outside this share's ``numbers``."""
    units = set(progress.units)
    return not units <= set(numbers) and all(0 <= unit < whole for unit in units)


def plan(numbers, concurrency, progress, *, in_order):
    """The Plan of an epoch over shards ``numbers`` that resumes from ``progress``.

    ``in_order`` (the epoch saved interleaved its shards deterministically,
    as many at once, and this worker's progress is its own): the rotation
    is rebuilt, so the rest of the epoch comes in the order an
    uninterrupted epoch would have delivered it. Shards take turns a bundle
    at a time, a shard that ends replaced in its place by the next
    (generators.GeneratorShards), and the batches handed out are a prefix
    of that order: the rotation is replayed bundle by bundle, each shard's
    turn taking one of the bundles it began, until every bundle begun is
    placed. A shard whose turn comes with none left while others are still
    to place had ended there. Otherwise (the job came back with another
    number of workers, or on a cluster that runs another number of
    producers at once) none can be known to have ended: shards with
    progress go first, the others after, each from where it was, so each
    batch comes once.

    Raises a FAILED_PRECONDITION BatchError if ``progress`` cannot have come
    from this dataset (another dataset's checkpoint).
    """
    units = progress.units
    unknown = sorted(set(units) - set(numbers))
    if unknown:
        raise BatchError(
            Code.FAILED_PRECONDITION,
            f"tfray: the checkpoint has batches of shard(s) {unknown[:5]} that this "
            "dataset does not have. Restore into a tfray.Dataset built with the same "
            "function and shards.",
        )
    starts, offsets = {}, {}
    for index, number in enumerate(numbers):
        if number not in units:
            continue
        batches, bundles = units[number]
        done, size = progress.partial.get(number, (0, 0))
        starts[index] = Start(batches, bundles, size - done)
        if done:
            offsets[index] = done
    if not in_order:
        order = [i for i in range(len(numbers)) if i in starts] + [i for i in range(len(numbers)) if i not in starts]
        running = order[:concurrency]
        return Plan(running, 0, order[len(running) :], starts, offsets)
    running, turn, pending = _rotation(numbers, concurrency, units)
    if len(offsets) == 1:  # An iterator's bundle handed out in part comes first: its turn was the last.
        turn = (turn - 1) % len(running)
    return Plan(running, turn, pending, starts, offsets)


def _rotation(numbers, concurrency, units):
    """``(running, turn, pending)`` once every bundle begun in ``units`` is placed (see plan)."""
    owed = {i: units[n][1] for i, n in enumerate(numbers) if n in units}
    left = sum(owed.values())
    running = list(range(min(concurrency, len(numbers))))
    pending = collections.deque(range(len(running), len(numbers)))
    turn = 0
    while left and running:
        index = running[turn]
        if owed.get(index, 0):
            owed[index] -= 1
            left -= 1
            turn = (turn + 1) % len(running)
        elif pending:  # It had ended: the next shard took its place.
            running[turn] = pending.popleft()
        else:
            running.pop(turn)
            turn = turn % len(running) if running else 0
    return running, turn, list(pending)


class SkippedItems(Wrapped):
    """An ItemStream whose first ``skip`` items are dropped once read."""

    def __init__(self, stream, skip):
        super().__init__(stream)
        self._skip = skip

    def next_ready(self, timeout):
        items = self._stream.next_ready(timeout)
        if items and self._skip:
            dropped = min(self._skip, len(items))
            self._skip -= dropped
            items = items[dropped:]
        return items


def warn_inexact(source, skip, why):
    logger.warning(
        "tfray: resuming %s at batch %d by passing over the first %d; %s, so "
        "they may not be the batches delivered before the checkpoint.",
        source,
        skip,
        skip,
        why,
    )
