"""Resolves a stream of ObjectRefs ahead of the consumer, in bulk and in order.

Refs for up to a look-ahead's ``limit`` of batches wait in a window; each
call hands back the longest run of resolved refs at the window's head (one
``ray.get``, or one ``ray.wait`` and one ``ray.get``, for many batches, so the
GIL is taken per window, not per batch); the get reads objects like those
it read before without Ray's deserialization (decoder.py).
Where a ref holds several batches (a producer's bundle, streams.py), the
look-ahead still counts batches: a ref stands for as many as those resolved
so far held, on average.
"""

import collections
import itertools

from tfray._internal.runtime import decoder, ray_api


class RefResolver:
    """An ItemStream of a RefStream's values, resolved in the stream's order.

    Args:
        refs: a RefStream (streams.py).
        lookahead: a LookAhead; its ``limit`` bounds the batches of the refs
            taken but not yet handed on.
    """

    def __init__(self, refs, *, lookahead):
        self._refs = refs
        self.lookahead = lookahead
        self._window = collections.deque()  # (label, ref); feeder thread only.
        # How the head's polls start: by the last waits for a head (a batch
        # from another node takes as long as its transfer), not at 0.5 ms.
        self._pace = ray_api.Pace()
        self._per_ref = 1.0  # Batches a ref stands for, on average.
        # How many refs at the window's head _get_window asks for at once:
        # all (None), none (0: the next call polls the head) or a span that
        # doubles with each success after a miss (_get_window).
        self._span = None
        # Reads objects like those read before without Ray's deserialization (decoder.py).
        self._decoder = decoder.BatchDecoder()
        # Refs that hold several batches say how many, and where a failed one stands.
        self._batches_held = getattr(refs, "batches_held", None)
        self._where = getattr(refs, "where", lambda label, earlier: label)

    @property
    def in_flight(self):
        return len(self._window)

    @property
    def unplaced(self):
        """The RefStream's (streams.py), or None if its refs come from no producers of its own."""
        return getattr(self._refs, "unplaced", None)

    def next_ready(self, timeout):
        """Resolved ``(label, value, error)`` items, [] if none yet, None at the end."""
        if not ray_api.ray_running():  # Before a stream's own calls into Ray (Ray Data's).
            raise ray_api.shutdown_error()
        room = self.lookahead.limit - len(self._window) * self._per_ref
        if room > 0 and not self._refs.done:
            wanted = max(1, int(room / self._per_ref))
            self._window.extend(self._refs.take(wanted, 0 if self._window else timeout))
        if not self._window:
            return None if self._refs.done else []
        items = self._get_window() if self._span != 0 else None
        if items is None:
            ready = self._ready_prefix(timeout)
            if not ready:
                return []
            items = self._resolve(ready)
        if self._batches_held is not None:
            batches = sum(self._batches_held(label, value) for label, value, _ in items)
            self._per_ref += 0.5 * (batches / len(items) - self._per_ref)
        return items

    def close(self):
        with ray_api.held():  # Dropping refs calls into Ray.
            self._window.clear()
        self._refs.close()

    def _get_window(self):
        """The items of the window's first ``_span`` refs if every one is ready now; else None.

        One Ray call where ``ray.wait`` then ``ray.get`` takes two: each gives
        up the GIL and takes it back, which takes up to a switch interval
        (5 ms) while another Python thread is busy. But a get of a ref that
        is not local asks Ray to fetch it, and gives up at once: Ray restores
        or receives the object all the same, and leaves it in the store for
        nobody, the first to go when the store is full. So after a miss the
        head is polled alone (_ready_prefix), and the gets grow back from
        one ref, doubling with each success, to the whole window.
        """
        span = len(self._window) if self._span is None else min(self._span, len(self._window))
        taken = list(itertools.islice(self._window, span))
        try:
            values = ray_api.get_decoded([ref for _, ref in taken], self._decoder, timeout=0)
        except Exception:  # Not every one ready, or one failed: the slow path says which.
            # But not once Ray is going: a Ray call that its shutdown
            # overtakes ends the process (ray_api).
            if not ray_api.ray_running():
                raise ray_api.shutdown_error() from None
            self._span = 0
            return None
        for _ in range(span):
            self._window.popleft()
        if self._span is not None:
            self._span = None if 2 * self._span >= self.lookahead.limit else 2 * self._span
        return [(label, value, None) for (label, _), value in zip(taken, values)]

    def _ready_prefix(self, timeout):
        """The head's run of the window (a bundle's batches share a ref) once it is local; [] if not yet.

        Ray is asked to fetch the head alone: asked for the whole window at
        every poll, it pulled, restored or received objects nobody had taken
        yet, and in a full store such an unpinned copy is the first evicted,
        so spilled batches came back from disk and went again, over and over.
        In order, one at a time (as Ray's own loop of ``ray.get`` does), each
        comes back once and is pinned by the get that takes it.
        """
        head = self._window[0][1]
        if not ray_api.poll([head], timeout, pace=self._pace):  # Never blocks in Ray (ray_api).
            return []
        ready = []
        while self._window and self._window[0][1] == head:
            ready.append(self._window.popleft())
        self._span = 1  # The next call gets the next ref, if it is ready.
        return ready

    def _resolve(self, ready):
        refs = [ref for _, ref in ready]
        try:
            values = ray_api.get_decoded(refs, self._decoder)
            return [(label, value, None) for (label, _), value in zip(ready, values)]
        except Exception:  # Find out which ones failed, and why.
            out = []
            earlier = []  # (label, value) resolved before the one failing.
            for label, ref in ready:
                try:
                    value = ray_api.get(ref)
                except Exception as e:  # noqa: PERF203
                    out.append((label, None, ray_api.translate(e, self._where(label, earlier))))
                    continue
                out.append((label, value, None))
                earlier.append((label, value))
            return out
