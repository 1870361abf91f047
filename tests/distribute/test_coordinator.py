"""The coordinator's leases and unit accounting: the actor's class, run on a local loop, without Ray."""

import asyncio

import pytest

from tfray._internal.distribute import coordinator

pytestmark = pytest.mark.timeout(30)

MB = 1 << 20


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
