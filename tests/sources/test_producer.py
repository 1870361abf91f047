"""A from_generators producer's bundles and its backpressure count, without Ray."""


import numpy as np
import pytest

from tfray._internal.sources import inflight, producer

pytestmark = pytest.mark.timeout(30)

MB = 1 << 20


# A producer's bundles.


class NeverStopped:
    def __init__(self, after=None):
        self.asked = 0
        self._after = after

    def requested(self):
        self.asked += 1
        return self._after is not None and self.asked >= self._after


def sizes(bundles):
    return [len(bundle) for bundle in bundles]


def test_bundles_double_from_one_up_to_their_batch_bound():
    """The first batch goes alone, so an epoch starts at once; then 2, 4, ... up to 256."""
    small = np.zeros(4, np.float32)
    got = list(producer.bundles(iter([small] * 1000), NeverStopped()))
    assert sizes(got) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 233]
    assert all(np.array_equal(batch, small) for bundle in got for batch in bundle)


def test_a_bundle_never_passes_its_byte_bound_but_a_bigger_batch_goes_alone():
    quarter = np.zeros(producer.BUNDLE_BYTES // 4, np.uint8)
    big = np.zeros(producer.BUNDLE_BYTES + 1, np.uint8)
    three_quarters = {"x": quarter, "y": (quarter, quarter)}
    batches = [quarter] * 3 + [three_quarters] * 2 + [quarter] * 4 + [big, quarter]
    got = list(producer.bundles(iter(batches), NeverStopped()))
    # 1, 2, then the byte bound closes them: three quarters alone (three
    # more would pass it), twice; four quarters; big alone.
    assert sizes(got) == [1, 2, 1, 1, 4, 1, 1]
    assert [sum(producer.nbytes(b) for b in bundle) for bundle in got] == [
        q * producer.BUNDLE_BYTES // 4 for q in (1, 2, 3, 3, 4)
    ] + [big.nbytes, producer.BUNDLE_BYTES // 4]


def test_a_batch_over_half_the_byte_bound_goes_at_once_uncopied():
    """It is not held (and copied) until the next batch shows it would not fit beside it."""
    batches = [np.zeros(producer.BUNDLE_BYTES * 6 // 10, np.uint8) for _ in range(5)]
    got = list(producer.bundles(iter(batches), NeverStopped()))
    assert sizes(got) == [1, 1, 1, 1, 1]
    assert all(bundle[0] is batch for bundle, batch in zip(got, batches))


def test_batches_over_half_the_byte_bound_go_in_pairs_up_to_the_pair_limit():
    """The first of a pair is copied (the generator refills it); a bigger batch goes alone."""
    refilled = np.zeros(12 * MB, np.uint8)
    bigger = np.zeros(13 * MB, np.uint8)

    def gen():
        for i in range(6):
            refilled[:] = i
            yield refilled
        yield bigger
        yield np.ones(MB, np.uint8)
        yield np.full(MB, 2, np.uint8)

    got, values = [], []
    for bundle in producer.bundles(gen(), NeverStopped(), pair_limit=12 * MB):
        got.append(bundle)
        values += [int(batch[0]) for batch in bundle]  # Read as Ray's put would, at once.
    # The first alone, then pairs; the bigger batch does not pair, nor does
    # a small one with it: 13 MB and 1 MB pass the byte bound.
    assert sizes(got) == [1, 2, 2, 1, 1, 2]
    assert values == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert got[1][1] is refilled and got[1][0] is not refilled  # Held, so copied.
    # Into the arrays of the last pair's copy, which Ray's put has copied.
    assert got[2][0] is got[1][0]
    assert got[4][0] is bigger  # Unpaired: it went at once, uncopied.


def test_a_held_batch_is_copied_into_the_last_bundles_copy_where_it_matches():
    """Arrays of the same shape and dtype are refilled, anything else copied afresh."""
    x = np.zeros((2, 3), np.float32)

    def gen():
        for i in range(5):
            x[:] = i
            # Batch 3's "x" has another shape.
            yield {"x": np.full(4, 3, np.float32) if i == 3 else x, "i": i, "parts": (x[0].copy(), [np.int64(i)])}

    got, seen = [], []
    for bundle in producer.bundles(gen(), NeverStopped()):  # Bundles of 1, 2, 2.
        got.append(bundle)
        seen += [(float(b["x"].flat[0]), b["i"], float(b["parts"][0][0]), int(b["parts"][1][0])) for b in bundle]
    assert seen == [(i, i, i, i) for i in range(5)]
    assert got[2][0]["parts"][0] is got[1][0]["parts"][0]  # Same shape: refilled.
    assert got[2][0]["x"] is not got[1][0]["x"]  # Another shape: a new copy.


def test_a_generator_error_comes_after_the_batches_made_before_it():
    def gen():
        for i in range(5):
            yield i
        raise KeyError("no such record")

    bundles = producer.bundles(gen(), NeverStopped())
    assert [next(bundles), next(bundles), next(bundles)] == [[0], [1, 2], [3, 4]]
    with pytest.raises(KeyError, match="no such record"):
        next(bundles)


@pytest.mark.parametrize("pair_limit", [0, 12 << 20])
@pytest.mark.parametrize("batch_bytes", [1, 1000, 16 << 10, 1 << 20, 3 << 19, 2 << 20, (2 << 20) + 1, 12 << 20, 13 << 20])
def test_largest_bundle_is_the_largest_that_bundling_makes(batch_bytes, pair_limit):
    batches = [np.zeros(batch_bytes, np.uint8)] * 600
    made = max(producer.nbytes(bundle) for bundle in producer.bundles(iter(batches), NeverStopped(), pair_limit))
    assert producer.largest_bundle(batch_bytes, pair_limit) == made


def test_inflight_as_set_or_by_the_bytes_of_the_batches_an_epoch_read():
    """A count the user sets stands; by default, objects in 256 MB per producer and its share of the store."""
    assert inflight.share(512 * MB, 2) == 256 * MB
    assert inflight.share(None, 2) is None
    assert inflight.Inflight(5).count(256 * MB) == 5
    learned = inflight.Inflight()
    assert learned.count(256 * MB) == 2  # Nothing read yet.
    learned.learn([np.zeros(12 * MB, np.uint8)])
    assert learned.count(256 * MB) == 10  # In pairs: 256 MB // 24 MB.
    assert learned.count(None) == 16  # Alone (no pairs without a share): 256 MB // 12 MB = 21, at most 16.
    assert learned.count(96 * MB) == 4  # In pairs.
    assert learned.count(40 * MB) == 3  # Alone: 2 pairs would not fit.
    assert learned.count(20 * MB) == 2  # Never fewer than 2.
    big = inflight.Inflight()
    big.learn([{"x": np.zeros(38 * MB, np.uint8), "y": np.zeros(256, np.int32)}])
    assert big.count(256 * MB) == 6  # Alone: over PAIR_BYTES.
    assert big.count(1 << 40) == 6  # 256 MB at most, however big the store.
    assert learned.pair_limit(256 * MB) == producer.PAIR_BYTES  # 16 MB, though 2 pairs of 64 MB fit.
    assert learned.pair_limit(48 * MB) == 12 * MB  # 2 pairs of 12 MB.
    assert learned.pair_limit(None) == 0
    assert inflight.Inflight(8).pair_limit(256 * MB) == 16 * MB  # As set: 8 pairs of 16 MB.
    small = inflight.Inflight()
    small.learn([np.zeros(16 << 10, np.uint8)] * 3)  # Bundles of 256 batches, 4 MB.
    assert small.count(256 * MB) == 16
    assert small.count(18 * MB) == 4
    small.learn([np.zeros(1 << 10, np.uint8)])  # Smaller batches later: the larger size stands.
    assert small.count(18 * MB) == 4


def test_a_stop_is_asked_after_every_batch_not_every_bundle():
    """A producer of slow batches stops at its next batch, not at the end of a bundle."""
    stop = NeverStopped(after=5)
    got = list(producer.bundles(iter(range(100)), stop))
    assert stop.asked == 5
    assert sizes(got) == [1, 2]  # The batches of the bundle it was filling are dropped.


def test_a_batch_waiting_in_a_bundle_is_kept_as_it_was_yielded():
    """A generator that refills one array for every batch: each bundled batch keeps its values."""

    def refilling():
        buffer = {"x": np.zeros(3, np.int64)}
        for i in range(7):
            buffer["x"][:] = i
            yield buffer

    # Read as each bundle is yielded, as Ray's put of it reads it.
    bundles = producer.bundles(refilling(), NeverStopped())
    got = [[int(batch["x"][0]) for batch in bundle] for bundle in bundles]
    assert got == [[0], [1, 2], [3, 4, 5, 6]]



@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 40, 300, 900])
def test_a_resumed_shard_closes_its_bundles_where_its_first_run_did(cut):
    """Started mid-shard with the bundles before and what is left of the last, the bounds fall as before."""
    batches = [np.zeros(4 if i % 7 else producer.BUNDLE_BYTES // 3, np.uint8) for i in range(1000)]
    whole = sizes(producer.bundles(iter(batches), NeverStopped()))
    ends = np.cumsum(whole)
    ordinal = int(np.searchsorted(ends, cut, side="right"))  # Bundles begun before `cut`, whole ones.
    begun_before = int(ends[ordinal - 1]) if ordinal else 0
    rest = 0 if begun_before == cut else whole[ordinal] - (cut - begun_before)
    if rest:
        ordinal += 1  # The bundle cut in two was begun too.
    resumed = sizes(producer.bundles(iter(batches[cut:]), NeverStopped(), ordinal=ordinal, rest=rest))
    after = [rest] if rest else []
    assert resumed == after + whole[len(whole) - len(resumed) + len(after) :]
    assert sum(resumed) == len(batches) - cut
