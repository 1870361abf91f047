"""The code a ``from_generators`` producer runs on a Ray worker.

It imports nothing at module level and is pickled by value (see
generators.py), so a producer process never imports tfray, and with it
TensorFlow.

A producer yields its batches in bundles: each object it puts in the store
is a list of consecutive batches. Every object costs Ray a round of work in
the producer and in the trainer (its report, ``next``, ``ray.get``: about
half a millisecond), which small batches would pay one by one. A bundle
holds at most ``BUNDLE_BATCHES`` batches and ``BUNDLE_BYTES``; the first
of an epoch holds one batch and each next twice as many, so the first
batches are not held back. A batch over half of ``BUNDLE_BYTES`` goes in a
pair if it is at most ``pair_limit`` bytes (the trainer sets it, up to
``PAIR_BYTES``, so that its backpressure's pairs fit the producer's share
of the store), else alone: a pair costs a copy of its first batch and
saves a Ray object, which costs more (BUILD_NOTES.md has the figures).
Where bundles close depends on the batches and ``pair_limit`` alone, never
on timing, so a deterministic generator's bundles are the same every epoch
(Ray's retry of a producer relies on that too: it skips the objects
already delivered). A batch that waits in a bundle while the generator
runs on is copied first.
"""

import copy

# A bundle's bounds (see above).
BUNDLE_BATCHES = 256
BUNDLE_BYTES = 4 << 20
# The batches of a pair: how many a bundle may hold past BUNDLE_BYTES.
PAIR = 2
# The largest batch worth its copy to share an object: a Ray object costs
# about 3 ms of CPU over the producer, the raylet and the trainer, and a
# copy about 1.3 ms per 10 MB (BUILD_NOTES.md).
PAIR_BYTES = 16 << 20


def nbytes(batch):
    """The bytes of a batch's arrays (a dict, tuple or list of them, nested, or one)."""
    if isinstance(batch, dict):
        return sum(nbytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(nbytes(v) for v in batch)
    return getattr(batch, "nbytes", 0)


def largest_bundle(batch_bytes, pair_limit=0):
    """The bytes of the largest bundle that batches of ``batch_bytes`` make (see bundles)."""
    if batch_bytes > BUNDLE_BYTES // 2:
        return PAIR * batch_bytes if batch_bytes <= pair_limit else batch_bytes
    return min(BUNDLE_BATCHES, BUNDLE_BYTES // max(1, batch_bytes)) * batch_bytes


def _room(held, count, size, pair_limit):
    """Whether a bundle of ``count`` batches and ``held`` bytes takes a batch of ``size`` more."""
    return held + size <= BUNDLE_BYTES or (count < PAIR and max(held, size) <= pair_limit)


class _StopCheck:
    """Whether the trainer stopped this producer's epoch: one parked call to its stop board.

    The call's reply fulfils a future from Ray's own thread, so the check
    after each batch reads a flag: no Ray call per batch, and a producer
    that backpressure paused sees a stop as soon as it resumes.
    """

    def __init__(self, board, token):
        self._reply = board.wait.remote(token).future()

    def requested(self):
        if self._reply is None or not self._reply.done():
            return False
        if self._reply.exception() is not None:
            # The board went with its trainer process; Ray ends this task
            # with its owner.
            self._reply = None
            return False
        return self._reply.result()


def _copy(batch, spare):
    """A copy of ``batch``, made in ``spare``'s arrays where they match it.

    ``spare`` is a copy made for an earlier bundle, which Ray's put copied
    into the store when it was yielded: refilling its arrays spares fresh
    memory, whose pages the kernel would zero first (over 32 MB, every
    allocation maps new pages). Ray serializes a yielded value, into the
    store or into the reply it inlines, before it resumes the generator
    (``execute_streaming_generator_sync`` in Ray's ``_raylet.pyx``; its
    async twin waits for the same reason): refilling ``spare`` cannot
    change an object already made.
    """
    kind = type(batch)
    if kind is not type(spare):
        return copy.deepcopy(batch)
    if kind is dict and batch.keys() == spare.keys():
        return {k: _copy(v, spare[k]) for k, v in batch.items()}
    if kind in (list, tuple) and len(batch) == len(spare):
        return kind(_copy(v, w) for v, w in zip(batch, spare))
    if (
        kind.__name__ == "ndarray"  # numpy's, which this module does not import.
        and batch.shape == spare.shape
        and batch.dtype == spare.dtype
        and not batch.dtype.hasobject
    ):
        spare[...] = batch
        return spare
    return copy.deepcopy(batch)


def most_batches(ordinal):
    """The most batches the shard's bundle number ``ordinal`` holds: 1, 2, 4, ... up to BUNDLE_BATCHES."""
    return min(1 << min(ordinal, 30), BUNDLE_BATCHES)


def bundles(batches, stop, pair_limit=0, ordinal=0, rest=0):
    """The bundles of ``batches`` (see above), until they end or ``stop`` is requested.

    A resumed shard's bundles close where its first run's did: ``ordinal``
    bundles came before, and ``rest`` (if not 0) batches are left of the last
    of them, which the first bundle here holds alone.
    """
    bundle, held = [], 0
    most = rest or most_batches(ordinal)
    if rest:
        ordinal -= 1  # The first bundle here ends bundle ``ordinal - 1``.
    # The copies in the bundle being made, and those of the last one yielded.
    copies, spares = [], []

    def closed():
        """The bundle made so far; the next one starts empty, up to twice its count."""
        nonlocal bundle, held, most, ordinal, copies, spares
        ordinal += 1
        done, bundle, held, most = bundle, [], 0, most_batches(ordinal)
        copies, spares = [], copies
        return done

    while True:
        try:
            batch = next(batches)
        except StopIteration:
            break
        except Exception:
            if bundle:  # Its batches came before the error: they go first.
                yield bundle
            raise
        size = nbytes(batch)
        if bundle and not _room(held, len(bundle), size, pair_limit):  # It would pass the bound.
            yield closed()
        bundle.append(batch)
        held += size
        # Closed once another batch of this size would pass the bound: a
        # batch over half of it, unpaired, goes at once, not after the next
        # is made.
        if len(bundle) >= most or not _room(held, len(bundle), size, pair_limit):
            yield closed()
        else:
            # It waits while the generator makes the next: a generator may
            # refill the same arrays for each batch, as it may before Ray's
            # put of a batch yielded alone.
            spare = spares[len(copies)] if len(copies) < len(spares) else None
            bundle[-1] = _copy(batch, spare)
            copies.append(bundle[-1])
        if stop.requested():  # Asked after every batch: one may take long.
            return
    if bundle:
        yield bundle


def run_shard(fn, shard, board, token, pair_limit=0, start=None):
    """Yields the bundles of ``fn(shard)``'s batches.

    ``start``, for a resumed epoch: ``(batch, ordinal, rest, asks)``, the
    first batch to put, the bundles before it and the batches left of the
    last (see bundles), and whether ``fn`` takes ``start=`` to begin there
    itself; if not, the batches before ``batch`` are made and passed over
    here, never put in the store.
    """
    first, ordinal, rest, asks = start or (0, 0, 0, False)
    batches = fn(shard, start=first) if asks else fn(shard)
    if not hasattr(batches, "__next__"):  # A function that returned a batch, or a list.
        # generators.NOT_A_GENERATOR's words: this module imports nothing.
        raise TypeError(
            "from_generators: fn must be a generator function (use `yield`), so that "
            f"each producer yields its shard's batches one at a time; fn({shard!r}) "
            f"returned a {type(batches).__name__}."
        )
    try:
        if first and not asks:
            for _ in zip(range(first), batches):  # Made, and dropped.
                pass
        yield from bundles(batches, _StopCheck(board, token), pair_limit, ordinal, rest)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:  # Runs the generator's own finally blocks now.
            close()
