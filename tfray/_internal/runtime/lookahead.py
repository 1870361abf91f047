"""How far ahead of the consumer an iterator resolves batches.

Fixed, or adaptive (``from_refs`` by default, ``from_generators`` always):
it starts small and doubles whenever TensorFlow had to wait on an empty
channel, until the consumer stops waiting, a cap is reached, or the batches
pinned ahead (in the resolver's window and in the channel, so twice the
look-ahead) would pass the memory budget; it shrinks back within the budget
once batches turn out bigger than it allows. A source's next epoch starts where its last one got to,
so short epochs do not each start small again.
"""

START = 2
# In batches: small ones travel in windows of thousands (one ray.get, one
# native push each); the memory budget bounds big ones.
CAP = 4096
# Waiting less than this between two checks is noise, not input-boundness.
_WAIT_S = 0.001


class LookAhead:
    """The look-ahead of one iterator (used on its feeder's thread only).

    Args:
        fixed: a fixed look-ahead in batches, or None to adapt.
        budget_bytes: with ``fixed=None``, the object-store bytes the
            batches pinned ahead may take.
        start: with ``fixed=None``, the look-ahead to start from.
        on_change: with ``fixed=None``, called with each new limit.
        cap: with ``fixed=None``, the most batches it may grow to.
    """

    def __init__(self, fixed=None, budget_bytes=None, start=START, on_change=None, cap=CAP):
        self.adaptive = fixed is None
        self.limit = start if self.adaptive else fixed
        self._most = cap
        self._budget = budget_bytes
        self._on_change = on_change
        self.batch_bytes = 0.0  # Running mean of a batch's size (0: none seen).
        self._waited = 0.0
        # How many batches the resolver may ask Ray to fetch at once (None:
        # the whole look-ahead); the feeder sets it per window from the
        # store's room (StoreWatch.check).
        self.pulls = None

    def observe(self, batch_bytes):
        """Records the size of a batch on its way to the consumer."""
        self.batch_bytes += 0.1 * (batch_bytes - self.batch_bytes) if self.batch_bytes else batch_bytes

    def update(self, consumer_wait_s):
        """Adapts to the consumer's total wait so far; returns the limit."""
        if not self.adaptive:
            return self.limit
        waited, self._waited = consumer_wait_s - self._waited, consumer_wait_s
        cap = self._cap()
        limit = min(cap, self.limit * 2) if waited > _WAIT_S else min(cap, self.limit)
        if limit != self.limit:
            self.limit = limit
            if self._on_change is not None:
                self._on_change(limit)
        return self.limit

    def _cap(self):
        if not self._budget or not self.batch_bytes:
            return self._most
        return max(1, min(self._most, int(self._budget // (2 * self.batch_bytes))))
