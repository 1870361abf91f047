"""How many bundles a ``from_generators`` producer may have waiting in the store.

Ray pauses a producer once that many of its objects wait unconsumed (its
generator backpressure, a count fixed when the task starts). At 2, the
trainer finds at most 2 objects per producer each time it looks: with a
busy Python thread in the trainer each look costs GIL hand-offs, and the
producers sit paused between looks (BUILD_NOTES.md has the figures).

Unless the user sets ``max_inflight_per_producer``, the count follows the
bytes: as many objects as fit in ``AHEAD_BYTES`` per producer, and within
a quarter of the object store over the running producers, from 2 to 16. An
object's size is that of the largest bundle the batches make (batches up
to 2 MB go up to 4 MB together; bigger ones up to 16 MB in pairs, or alone
where 2 pairs would not fit a producer's share: ``pair_limit``), from the
first batch an epoch reads. Producers started before any was read (the
first ones of a new dataset's first epoch) get 2.
"""

import threading

from tfray._internal.sources import producer

AHEAD_BYTES = 256 << 20
FEWEST = 2
MOST = 16


class Inflight:
    """A source's count, as the user set it (``fixed``) or learned from its bundles.

    Shared by a source's epochs: a feeder thread reads the first bundle of
    an epoch (``learn``), the next producer to start asks ``count``.
    """

    def __init__(self, fixed=None):
        self.fixed = fixed
        self._lock = threading.Lock()
        self._batch_bytes = None  # The largest seen; guarded by _lock.

    def learn(self, bundle):
        """Notes the size of batches from the first bundle (a list of them) an epoch read."""
        if not bundle:
            return
        size = producer.nbytes(bundle[0])
        with self._lock:
            self._batch_bytes = max(self._batch_bytes or 0, size)

    def count(self, share_bytes):
        """Bundles a producer may have waiting; ``share_bytes``: its share of the store (None: unknown)."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            size = self._batch_bytes
        size = size and producer.largest_bundle(size, self.pair_limit(share_bytes))
        if not size:
            return FEWEST
        ahead = AHEAD_BYTES if not share_bytes else min(AHEAD_BYTES, share_bytes)
        return max(FEWEST, min(MOST, ahead // size))

    def pair_limit(self, share_bytes):
        """The largest batch a producer pairs (producer.py): 0 if the share is unknown.

        At most ``producer.PAIR_BYTES``, and as many pairs of it as the
        producer may have waiting fit ``share_bytes``: ``FEWEST`` by
        default, whatever the count learned later; the count the user set
        otherwise.
        """
        fitting = (share_bytes or 0) // ((self.fixed or FEWEST) * producer.PAIR)
        return min(producer.PAIR_BYTES, fitting)


def share(budget_bytes, producers):
    """A producer's share of ``budget_bytes`` (a quarter of the store; None: unknown) among ``producers``."""
    return None if not budget_bytes else budget_bytes // max(1, producers)
