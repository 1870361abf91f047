"""Resuming an epoch from a checkpointed position.

A restored TF iterator asks its source for the epoch again, with the number
of items (batches, or per-batch errors) it had already handed out. Sources
pass over that many: a list of refs by slicing (nothing is resolved),
producers' and Ray Data's streams by dropping batches after they are read
(a producer's bundle of batches is counted once it is read). The result is
exact when the epoch yields the same items in the same order each time it
is run.
"""

import logging

from tfray._internal.runtime.streams import Wrapped

logger = logging.getLogger("tfray")


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
