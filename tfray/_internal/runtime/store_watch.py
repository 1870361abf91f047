"""Whether TensorFlow holds more of a dataset's batches than this node's object store.

A batch delivered zero-copy is a Ray object, pinned in the store while any
tensor of it lives: in a shuffle buffer, a ``cache()``, or tensors the
training code keeps. Once those pins pass the store's capacity, Ray puts
the rest of the epoch on disk (spilled, or file-backed fallback memory)
and each batch comes back from there, at the disk's speed. The feeder asks
``check`` per window (the held bytes are one native read); it warns once
per dataset, and ``stats()`` shows the same figures.
"""

import logging
import threading

from tfray._internal.runtime import ray_api

logger = logging.getLogger("tfray")

_MB = 1 << 20


class StoreWatch:
    """One dataset's watch over the store bytes TensorFlow holds of it (a SourceEpochs')."""

    def __init__(self, name):
        self._name = name
        self._lock = threading.Lock()  # Feeders of two iterators may check at once.
        self._warned = False  # Guarded by _lock.
        self.capacity = None  # This node's store bytes; asked by the first feeder.

    def start(self):
        """Learns the store's capacity (a Ray call, once per session): on a feeder's thread, before it feeds."""
        try:
            self.capacity = ray_api.store_capacity()
        except Exception:  # Only a warning rides on it: never fail the epoch for it.
            logger.debug("tfray: the object store's capacity is unknown", exc_info=True)
            self.capacity = 0

    def check(self, held, lookahead):
        """Sets ``lookahead.pulls`` to what the store has room for; warns if ``held`` fills it.

        ``held``: the store bytes TensorFlow holds of one iterator's batches.
        Its resolver may fetch into half the store less those, at least one
        batch at a time: a fetched object nobody has taken yet is the first
        a full store evicts (resolver.py), and the other half is left to
        everything else the store keeps. The warning comes once per dataset.
        """
        capacity = self.capacity
        if not capacity:
            return
        if lookahead is not None and lookahead.batch_bytes:
            lookahead.pulls = max(1, int((capacity // 2 - held) // lookahead.batch_bytes))
        if held >= capacity:
            with self._lock:
                warn, self._warned = not self._warned, True
            if warn:
                logger.warning(
                    f"tfray: {self._name}: TensorFlow holds {held / _MB:.0f} MB of this dataset's batches, "
                    f"more than this node's object store ({capacity / _MB:.0f} MB). Each batch is a Ray "
                    "object, pinned in the store while any tensor of it lives: in a shuffle buffer, a "
                    "cache(), or tensors your code keeps. Ray now puts the rest of the epoch on disk and "
                    "reads every batch back from there, at the disk's speed. To keep it in memory: a smaller "
                    "shuffle buffer (or shuffle in the producers, before tfray), cache() only what fits, "
                    "or a larger store (ray.init(object_store_memory=...), ray start --object-store-memory). "
                    "stats() shows bytes_held against object_store_bytes."
                )
