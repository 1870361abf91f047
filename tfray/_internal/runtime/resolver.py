"""Resolves a stream of ObjectRefs ahead of the consumer, in bulk and in order.

Refs for up to a look-ahead's ``limit`` of batches wait in a window; each
call hands back the longest run of resolved refs at the window's head (one
``ray.get``, or one ``ray.wait`` and one ``ray.get``, for many batches, so the
GIL is taken per window, not per batch); the get reads objects like those
it read before without Ray's deserialization (decoder.py).
Where a ref holds several batches (a producer's bundle, streams.py), the
look-ahead still counts batches: a ref stands for as many as those resolved
so far held, on average.

Each call asks Ray to fetch the window's refs that are not local (a wait or
get with ``fetch_local``), and gives the request up at once. Ray restores
or receives those objects all the same and leaves them in the store for
nobody: with room, that is how the window's transfers overlap; in a store
that TensorFlow's pins have filled, such a copy is the first evicted, and
spilled batches came back from disk and went again, over and over. So the
calls ask for as many refs as the store has room for (``LookAhead.pulls``,
StoreWatch.check), and spilled objects one at a time, in order, as Ray's own
loop of ``ray.get`` does: each comes back from disk once, pinned by the get
that takes it.
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
        self._all_ready = True  # Try the fetchable refs in one ray.get (_get_window).
        # After a spilled head, how many refs a call may fetch: one, doubling
        # with each window found local, back to no limit (None) at the look-ahead.
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
        # How many refs at the window's head one call may ask Ray to fetch:
        # all of them, but for what the store has room for (LookAhead.pulls)
        # and, after a spilled head, ``_span``. Objects on another node come
        # a window at a time, so that their transfers overlap; restores from
        # disk overlap little, and a full store evicts what nobody took yet.
        # (Inline: this runs every turn, tests/runtime/test_per_window.py.)
        fetchable = len(self._window)
        pulls = self.lookahead.pulls  # In batches; None: no limit.
        if pulls is not None:
            fetchable = min(fetchable, max(1, int(pulls / self._per_ref)))
        if self._span is not None:
            fetchable = min(fetchable, self._span)
        items = self._get_window(fetchable) if self._all_ready else None
        if items is None:
            ready = self._ready_prefix(timeout, fetchable)
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

    def _get_window(self, fetchable):
        """The items of the window's first ``fetchable`` refs if each is ready now; else None.

        One Ray call where ``ray.wait`` then ``ray.get`` takes two: each gives
        up the GIL and takes it back, which takes up to a switch interval
        (5 ms) while another Python thread is busy. Once it finds a ref not
        ready, it waits until the slow path finds a whole window ready, so
        that refs on their way (from another node, or spilled) cost no extra
        call per window.
        """
        taken = list(itertools.islice(self._window, fetchable))
        try:
            values = ray_api.get_decoded([ref for _, ref in taken], self._decoder, timeout=0)
        except Exception:  # Not every one ready, or one failed: the slow path says which.
            # But not once Ray is going: a Ray call that its shutdown
            # overtakes ends the process (ray_api).
            if not ray_api.ray_running():
                raise ray_api.shutdown_error() from None
            self._all_ready = False
            return None
        for _ in taken:
            self._window.popleft()
        if self._span is not None:
            self._span = None if 2 * self._span >= self.lookahead.limit else 2 * self._span
        return [(label, value, None) for (label, _), value in zip(taken, values)]

    def _ready_prefix(self, timeout, fetchable):
        # One call when the window is resolved (the common case); every Ray
        # call releases and retakes the GIL, slow when it is contended.
        unique = list(dict.fromkeys([ref for _, ref in self._window]))[:fetchable]
        done, _ = ray_api.wait(unique, num_returns=len(unique), timeout=0, fetch_local=True)
        done = set(done)
        head = self._window[0][1]
        waited = head not in done
        if waited:
            if len(unique) > 1 and ray_api.spilled(head):  # From disk: one at a time (next_ready).
                self._span = 1
            if not ray_api.poll([head], timeout, pace=self._pace):  # Never blocks in Ray (ray_api).
                return []
            done.add(head)  # What came meanwhile, the next call finds.
        # A head that had to be waited for is the stream's pace (a producer,
        # a transfer): the next call asks no get of a window that would fail.
        self._all_ready = not waited and len(done) == len(unique)
        ready = []
        while self._window and self._window[0][1] in done:
            ready.append(self._window.popleft())
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
