"""Pure unit tests, no Ray: the look-ahead, the coordinator's leases, the epoch offer, bundles.

They pin down the rules those pieces follow, so a change to one shows here
first, without a cluster.
"""

import asyncio
import threading
import time

import numpy as np
import pytest

import conftest
from tfray._internal.distribute import coordinator
from tfray._internal.runtime import lookahead as lookahead_lib
from tfray._internal.runtime import ray_api
from tfray._internal.runtime.lookahead import LookAhead
from tfray._internal.runtime.registry import SourceEpochs
from tfray._internal.sources.bundles import Bundle, Shard
from tfray._internal.sources import inflight, producer

pytestmark = pytest.mark.timeout(30)

MB = 1 << 20


# The look-ahead.


def test_lookahead_doubles_only_while_tensorflow_waits_up_to_its_cap():
    la = LookAhead(start=2, cap=16)
    waited = 0.0
    limits = []
    for _ in range(6):
        waited += 0.01  # TF waited 10 ms since the last check.
        limits.append(la.update(waited))
    assert limits == [4, 8, 16, 16, 16, 16]
    assert la.update(waited) == 16  # No new wait: it stays.


def test_lookahead_keeps_what_it_pins_within_the_budget_and_shrinks_to_it():
    changes = []
    la = LookAhead(start=8, cap=64, budget_bytes=64 * MB, on_change=changes.append)
    la.observe(16 * MB)  # Twice the look-ahead (window and channel) must fit in 64 MB.
    assert la.update(0.0) == 2
    la.update(1.0)
    assert la.limit == 2 and changes == [2]
    small = LookAhead(start=2, cap=64, budget_bytes=64 * MB)
    small.observe(MB)
    assert small.update(1.0) == 4  # Room for 32 batches of 1 MB: it may grow.


def test_lookahead_never_falls_below_one_batch():
    la = LookAhead(start=2, budget_bytes=MB)
    la.observe(100 * MB)
    assert la.update(1.0) == 1


def test_a_fixed_lookahead_does_not_adapt():
    la = LookAhead(fixed=5)
    assert not la.adaptive
    la.observe(100 * MB)
    assert la.update(10.0) == 5


def test_short_waits_are_noise():
    la = LookAhead(start=2)
    assert la.update(lookahead_lib._WAIT_S / 2) == 2


# The coordinator's leases and unit accounting (the actor's class, run on a local loop).


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(coordinator.time, "monotonic", clock)
    return clock


def run(coordinator_calls):
    return asyncio.run(coordinator_calls())


def make(num_units, lease_s=10.0):
    cls = coordinator.Coordinator.__ray_actor_class__
    return cls(num_units, lease_s, 3600.0)


async def two_workers(c):
    """Workers a and b join and begin epoch 0."""
    for worker in ("a", "b"):
        await c.join(worker)
    for worker in ("a", "b"):
        assert await c.begin(worker) == 0


def test_each_unit_goes_to_one_worker_and_a_worker_holds_at_most_half_its_share(clock):
    async def calls():
        c = make(8)
        await two_workers(c)
        a, over = await c.acquire("a", 0, 8, [], 0)
        assert a == [0, 1] and not over  # Half of a fair share of 4.
        b, _ = await c.acquire("b", 0, 8, [], 0)
        assert b == [2, 3]
        more, _ = await c.acquire("a", 0, 8, a, 0)  # Finishing frees room.
        assert more == [4, 5]
        rest, _ = await c.acquire("b", 0, 8, b, 0)
        assert rest == [6, 7]
        done_a, over = await c.acquire("a", 0, 8, more, 0)
        assert done_a == [] and not over  # b still holds two.
        _, over = await c.acquire("b", 0, 8, rest, 0)
        assert over
        taken = await c.taken()
        assert sorted(taken[0]["a"] + taken[0]["b"]) == list(range(8))
        assert await c.begin("a") == 0  # a has not seen epoch 0 end yet.
        assert await c.acquire("a", 0, 8, [], 0) == ([], True)
        assert await c.begin("a") == 1  # Now its next iterator reads the next epoch.

    run(calls)


def test_released_units_go_back_to_the_front_for_others(clock):
    async def calls():
        c = make(4)
        await two_workers(c)
        a, _ = await c.acquire("a", 0, 4, [], 0)
        assert a == [0]
        await c.release("a", 0, [], a)  # Dropped before TF took its batches.
        b, _ = await c.acquire("b", 0, 4, [], 0)
        assert b == [0]

    run(calls)


def test_a_worker_that_stops_renewing_loses_its_units(clock):
    async def calls():
        c = make(4, lease_s=10.0)
        await two_workers(c)
        a, _ = await c.acquire("a", 0, 4, [], 0)
        assert a == [0]
        clock.now += 6
        await c.renew(["b"])
        clock.now += 6  # a last called 12 s ago: past its 10 s lease.
        b, _ = await c.acquire("b", 0, 4, [], 0)
        assert b[0] == 0  # a's unit went back to the front, to b.

    run(calls)


def test_a_late_worker_joins_the_oldest_epoch_not_over(clock):
    async def calls():
        c = make(2)
        await c.join("a")
        await c.begin("a")
        await c.acquire("a", 0, 2, [], 0)
        await c.join("b")
        assert await c.begin("b") == 0

    run(calls)


# The offer of an epoch started ahead (the dispatcher's side of it).


class FakeChannel:
    claimed = False  # The native registry sets it when an iterator takes the offer.

    def stats(self):
        return {"queued": 1}


class FakeFeeder:
    def __init__(self):
        self.channel = FakeChannel()
        self.done = threading.Event()  # Set once it has filled its channel.


@pytest.fixture
def epochs():
    return SourceEpochs(source=None)


def test_one_offer_at_a_time_and_only_when_published(epochs):
    first, second = FakeFeeder(), FakeFeeder()
    assert not epochs.offer(first, publish=lambda: False)  # The native registry refused it.
    assert not epochs.view(replayed=False).offered
    assert epochs.offer(first, publish=lambda: True)
    assert epochs.view(replayed=False).offered
    assert not epochs.offer(second, publish=lambda: True)  # One at a time.


def test_an_offer_counts_as_an_epoch_once_taken(epochs):
    offered = FakeFeeder()
    epochs.offer(offered, publish=lambda: True)
    view = epochs.view(replayed=False)
    assert view.recent == () and view.epochs == 0  # Not read yet: not an epoch in stats().
    assert view.offered_queued == 1
    offered.channel.claimed = True  # An iterator took it natively.
    view = epochs.view(replayed=False)
    assert not view.offered  # The next epoch may be offered already.
    assert view.recent == (offered,)
    # The dispatcher heard of it: it counts, and is the feeder it finds.
    assert epochs.offer_taken(offered.channel) is offered
    view = epochs.view(replayed=False)
    assert not view.offered and view.recent == (offered,) and view.epochs == 1


def test_an_offered_epoch_is_found_by_its_channel_before_and_after_it_is_taken(epochs):
    """Its end may reach the dispatcher either side of an iterator taking it."""
    offered, other = FakeFeeder(), FakeFeeder()
    epochs.began(other)
    epochs.offer(offered, publish=lambda: True)
    assert epochs.find(offered.channel) is offered
    offered.channel.claimed = True
    assert epochs.find(offered.channel) is offered
    assert epochs.find(FakeChannel()) is None


def test_forgetting_an_offer_no_iterator_took(epochs):
    epochs.offer(FakeFeeder(), publish=lambda: True)
    epochs.forget_offer()
    view = epochs.view(replayed=False)
    assert not view.offered and view.recent == ()


# The feeder pool.


class FakeRun:
    """A feeder that runs ``work`` on a pool thread."""

    def __init__(self, work):
        import threading

        self.work = work
        self.done = threading.Event()
        self.channel = None

    def run(self):
        try:
            self.work()
        finally:
            self.done.set()


def test_a_feeder_that_raises_leaves_its_thread_to_the_next():
    """A pool thread outlives a feeder that raises: the next feeder still runs."""
    from tfray._internal.runtime.feeder import FeederPool

    pool = FeederPool()

    def fail():
        raise RuntimeError("stopping the producers failed")

    try:
        first = FakeRun(fail)
        pool.start(first)
        assert first.done.wait(5)
        conftest.wait_until(lambda: pool.idle == 1, timeout=5)  # The thread counts itself idle.
        ran = FakeRun(lambda: None)
        pool.start(ran)
        assert ran.done.wait(5), "the next feeder was queued for a thread that had died"
        assert pool.threads == 1
    finally:
        pool.stop(5)


def test_a_feeder_that_meets_rays_system_exit_leaves_its_thread_to_the_next():
    """Ray raises SystemExit from a call that ray.shutdown() overtakes: the thread lives on."""
    from tfray._internal.runtime.feeder import FeederPool

    def exit_():
        raise SystemExit(0)

    pool = FeederPool()
    try:
        first = FakeRun(exit_)
        pool.start(first)
        assert first.done.wait(5)
        conftest.wait_until(lambda: pool.idle == 1, timeout=5)  # Else the thread died with the feeder.
        ran = FakeRun(lambda: None)
        pool.start(ran)
        assert ran.done.wait(5)
        assert pool.threads == 1
    finally:
        pool.stop(5)


# Dynamic sharding: which units TensorFlow has taken whole.


class ScriptedResolver:
    """Hands on the scripted items, one list per read."""

    def __init__(self, reads):
        self.reads = list(reads)
        self.lookahead, self.in_flight = None, 0

    def instead_of(self, units, lookahead):
        """Stands for ``RefResolver(units, lookahead=...)``."""
        return self

    def next_ready(self, timeout):
        return self.reads.pop(0) if self.reads else None

    def close(self):
        pass


class RecordingUnits:
    def __init__(self):
        self.taken = []

    def taken_by_tf(self, labels):
        self.taken.extend(labels)


def test_dynamic_epoch_counts_errors_in_their_places(monkeypatch):
    """TF takes items in the order they were handed on, errors included.

    A refused batch is an item too: counting only batches would take every
    later unit as finished one batch early (a dying worker would lose it).
    """
    from tfray._internal.distribute import dynamic

    error = ValueError("refused")
    resolver = ScriptedResolver([[("a", 1, None), ("b", None, error), ("c", 3, None)], []])
    monkeypatch.setattr(dynamic, "RefResolver", resolver.instead_of)
    units = RecordingUnits()
    taken = [0]
    epoch = dynamic.DynamicEpoch(units, None, lambda: taken[0])
    epoch.next_ready(0)
    assert units.taken == []  # Handed on, not yet taken.
    taken[0] = 2  # TF took a's batch and b's error.
    epoch.next_ready(0)
    assert units.taken == ["a", "b"]
    taken[0] = 3
    epoch.close()
    assert units.taken == ["a", "b", "c"]


def test_dynamic_epoch_counts_a_bundle_taken_once_tf_took_all_its_batches(monkeypatch):
    """A producer's bundle is one ref of its unit: finished only once TF took its last batch."""
    from tfray._internal.distribute import dynamic

    shard = Shard(3)
    first, second = Bundle(shard), Bundle(shard)
    resolver = ScriptedResolver([[(first, [10, 11, 12], None), (second, [13], None)], []])
    monkeypatch.setattr(dynamic, "RefResolver", resolver.instead_of)
    units = RecordingUnits()
    taken = [0]
    epoch = dynamic.DynamicEpoch(units, None, lambda: taken[0])
    assert epoch.next_ready(0) == [
        ("shard 3 batch 0", 10, None),
        ("shard 3 batch 1", 11, None),
        ("shard 3 batch 2", 12, None),
        ("shard 3 batch 3", 13, None),
    ]
    taken[0] = 2
    epoch.next_ready(0)
    assert units.taken == []  # One batch of the first bundle is still to be taken.
    taken[0] = 4
    epoch.close()
    assert units.taken == [first, second]


# A producer's bundles.


class NeverStopped:
    def __init__(self, after=None):
        self.asked = 0
        self._after = after

    def requested(self, paused=False):
        self.asked += 1
        return self._after is not None and self.asked >= self._after


def sizes(bundles):
    return [len(bundle) for bundle in bundles]


def test_bundles_double_from_one_up_to_their_batch_bound():
    """The first batch goes alone, so an epoch starts at once; then 2, 4, ... up to 256."""
    small = np.zeros(4, np.float32)
    got = list(producer._bundles(iter([small] * 1000), NeverStopped()))
    assert sizes(got) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 233]
    assert all(np.array_equal(batch, small) for bundle in got for batch in bundle)


def test_a_bundle_never_passes_its_byte_bound_but_a_bigger_batch_goes_alone():
    quarter = np.zeros(producer.BUNDLE_BYTES // 4, np.uint8)
    big = np.zeros(producer.BUNDLE_BYTES + 1, np.uint8)
    three_quarters = {"x": quarter, "y": (quarter, quarter)}
    batches = [quarter] * 3 + [three_quarters] * 2 + [quarter] * 4 + [big, quarter]
    got = list(producer._bundles(iter(batches), NeverStopped()))
    # 1, 2, then the byte bound closes them: three quarters alone (three
    # more would pass it), twice; four quarters; big alone.
    assert sizes(got) == [1, 2, 1, 1, 4, 1, 1]
    assert [sum(producer.nbytes(b) for b in bundle) for bundle in got] == [
        q * producer.BUNDLE_BYTES // 4 for q in (1, 2, 3, 3, 4)
    ] + [big.nbytes, producer.BUNDLE_BYTES // 4]


def test_a_batch_over_half_the_byte_bound_goes_at_once_uncopied():
    """It is not held (and copied) until the next batch shows it would not fit beside it."""
    batches = [np.zeros(producer.BUNDLE_BYTES * 6 // 10, np.uint8) for _ in range(5)]
    got = list(producer._bundles(iter(batches), NeverStopped()))
    assert sizes(got) == [1, 1, 1, 1, 1]
    assert all(bundle[0] is batch for bundle, batch in zip(got, batches))


def test_a_generator_error_comes_after_the_batches_made_before_it():
    def gen():
        for i in range(5):
            yield i
        raise KeyError("no such record")

    bundles = producer._bundles(gen(), NeverStopped())
    assert [next(bundles), next(bundles), next(bundles)] == [[0], [1, 2], [3, 4]]
    with pytest.raises(KeyError, match="no such record"):
        next(bundles)


@pytest.mark.parametrize("batch_bytes", [1, 1000, 16 << 10, 1 << 20, 3 << 19, 2 << 20, (2 << 20) + 1, 12 << 20])
def test_largest_bundle_is_the_largest_that_bundling_makes(batch_bytes):
    batches = [np.zeros(batch_bytes, np.uint8)] * 600
    made = max(producer.nbytes(bundle) for bundle in producer._bundles(iter(batches), NeverStopped()))
    assert producer.largest_bundle(batch_bytes) == made


MB = 1 << 20


def test_inflight_as_set_or_by_the_bytes_of_the_batches_an_epoch_read():
    """A count the user sets stands; by default, objects in 256 MB per producer and its share of the store."""
    assert inflight.share(512 * MB, 2) == 256 * MB
    assert inflight.share(None, 2) is None
    assert inflight.Inflight(5).count(256 * MB) == 5
    learned = inflight.Inflight()
    assert learned.count(256 * MB) == 2  # Nothing read yet.
    learned.learn([np.zeros(12 * MB, np.uint8)])
    assert learned.count(256 * MB) == 16  # 256 MB // 12 MB = 21, at most 16.
    assert learned.count(None) == 16
    assert learned.count(64 * MB) == 5
    assert learned.count(20 * MB) == 2  # Never fewer than 2.
    big = inflight.Inflight()
    big.learn([{"x": np.zeros(38 * MB, np.uint8), "y": np.zeros(256, np.int32)}])
    assert big.count(256 * MB) == 6
    assert big.count(1 << 40) == 6  # 256 MB at most, however big the store.
    small = inflight.Inflight()
    small.learn([np.zeros(16 << 10, np.uint8)] * 3)  # Bundles of 256 batches, 4 MB.
    assert small.count(256 * MB) == 16
    assert small.count(18 * MB) == 4
    small.learn([np.zeros(1 << 10, np.uint8)])  # Smaller batches later: the larger size stands.
    assert small.count(18 * MB) == 4


def test_a_stop_is_asked_after_every_batch_not_every_bundle():
    """A producer of slow batches stops at its next batch, not at the end of a bundle."""
    stop = NeverStopped(after=5)
    got = list(producer._bundles(iter(range(100)), stop))
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
    bundles = producer._bundles(refilling(), NeverStopped())
    got = [[int(batch["x"][0]) for batch in bundle] for bundle in bundles]
    assert got == [[0], [1, 2], [3, 4, 5, 6]]
