"""The feeder pool: threads reused from epoch to epoch, and ended once a burst is over."""

import threading
import time

import conftest
import pytest

from tfray._internal.runtime.feeder import FeederPool

pytestmark = pytest.mark.timeout(60)


class Job:
    """A stand-in feeder: runs ``work``, by default until released (or its channel cancelled)."""

    def __init__(self, release=None, work=None):
        self._release = release or threading.Event()
        self._work = work or (lambda: self._release.wait(30))
        self.done = threading.Event()
        self.channel = self

    def run(self):
        try:
            self._work()
        finally:
            self.done.set()

    def cancel(self):
        self._release.set()


def feeder_threads():
    return sum(1 for t in threading.enumerate() if t.name == "tfray-feeder")


def wait_for(condition, timeout=20):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def run_at_once(pool, n):
    """Starts n feeders that run until all n hold a thread, then lets them end."""
    release = threading.Event()
    jobs = [Job(release) for _ in range(n)]
    for job in jobs:
        pool.start(job)
    wait_for(lambda: pool.threads == n)
    release.set()
    assert all(job.done.wait(10) for job in jobs)


def test_a_burst_leaves_the_pool_at_its_resting_size():
    """200 feeders at once take 200 threads; idle, all but the resting ones end."""
    before = feeder_threads()
    pool = FeederPool(idle_s=0.3, resting=2)
    run_at_once(pool, 200)
    assert pool.wait_idle(10)
    wait_for(lambda: pool.threads == 2)
    wait_for(lambda: feeder_threads() == before + 2)
    # The resting threads run the next feeders, and new ones are started as needed.
    run_at_once(pool, 5)
    pool.stop(5)
    wait_for(lambda: feeder_threads() == before)
    assert pool.threads == 0


def test_threads_are_reused_while_feeders_keep_coming():
    """Feeders started one after another run on the same thread: no thread per epoch."""
    pool = FeederPool(idle_s=5, resting=0)
    for _ in range(20):
        release = threading.Event()
        release.set()
        job = Job(release)
        pool.start(job)
        assert job.done.wait(10)
        assert pool.wait_idle(10)
    assert pool.threads == 1
    pool.stop(5)


def test_a_feeder_that_raises_leaves_its_thread_to_the_next():
    """A pool thread outlives a feeder that raises: the next feeder still runs."""
    from tfray._internal.runtime.feeder import FeederPool

    pool = FeederPool()

    def fail():
        raise RuntimeError("stopping the producers failed")

    try:
        first = Job(work=fail)
        pool.start(first)
        assert first.done.wait(5)
        conftest.wait_until(lambda: pool.idle == 1, timeout=5)  # The thread counts itself idle.
        ran = Job(work=lambda: None)
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
        first = Job(work=exit_)
        pool.start(first)
        assert first.done.wait(5)
        conftest.wait_until(lambda: pool.idle == 1, timeout=5)  # Else the thread died with the feeder.
        ran = Job(work=lambda: None)
        pool.start(ran)
        assert ran.done.wait(5)
        assert pool.threads == 1
    finally:
        pool.stop(5)
