"""Soak: many epochs and iterators, created, dropped mid-epoch and run to the end.

Guards invariant 3 over time: after a warm-up, the object store, the
process's own resident memory, its open file descriptors and its threads
stay flat however many batches pass and iterators come and go. The slow
variant pushes 20,000 batches; the CI one 1,600.

Resident memory is the anonymous part (RssAnon): the object store's shared
pages that reading a batch maps in are the store's, measured by the store.
"""

import gc
import os
import re
import threading

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import store_bytes_used, wait_store_back_to, wait_until

import tfray
from tfray._internal.runtime import native, runtime

pytestmark = [
    pytest.mark.usefixtures("ray_session"),
    pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc"),
]

MB = 1 << 20
COLUMNS = 384
REFS = 40  # Half under Ray's 100 KB inline limit (in this process's heap), half in the store.
SHARDS, PER_SHARD = 2, 10

INLINE_ROWS, STORE_ROWS = 64, 170  # 96 KB (under the inline limit) and 255 KB.
INLINE_BYTES = INLINE_ROWS * COLUMNS * 4
# Growth of RssAnon allowed between the end of the warm-up and the end of
# the run, as a share of what leaking every new inline batch read meanwhile
# would add: generator shard 0 makes new ones each epoch, in this process's
# heap (a leaked batch in the store shows in the store's bytes instead; the
# refs' inline batches are held by their refs throughout, so a leak of them
# adds nothing). Allocator arenas and TF's caches settle in steps of a few
# MB; the leak the bound is for grows with the run.
RSS_LEAK_SHARE = 0.5
# gRPC (inside Ray's core worker) grows and shrinks elastic thread pools,
# with an event fd or two each, and connects to worker processes it leases
# from, which Ray may replace when idle: these come and go by a few.
FD_TOLERANCE = 8
GRPC_POOLS = ("event_engine", "lifeguard", "default-executo", "grpc_global_tim")
GRPC_THREAD_TOLERANCE = 8
# tfray's feeder threads are reused; the pool holds as many as epochs ever
# ran at once: one being read, one offered ahead, and one of a dropped
# iterator whose feeder has not noticed yet. That may first happen after
# the warm-up, so they have a bound of their own rather than staying flat.
FEEDER_THREADS_MAX = 4
# Every other thread (TF's, Ray's fixed ones).
THREAD_TOLERANCE = 1


def _thread_names():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except (FileNotFoundError, ProcessLookupError):  # It ended meanwhile (ESRCH once open).
            pass
    return names


def _resources():
    with open("/proc/self/status") as f:
        status = f.read()
    names = _thread_names()
    grpc = sum(name in GRPC_POOLS for name in names)
    feeders = sum(t.name == "tfray-feeder" for t in threading.enumerate())
    return {
        "rss_anon": int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) * 1024,
        "threads": len(names) - grpc - feeders,
        "feeder_threads": feeders,
        "grpc_threads": grpc,
        "fds": len(os.listdir("/proc/self/fd")),
        "store": store_bytes_used(),
    }


@ray.remote
def make(i):
    rows = INLINE_ROWS if i % 2 else STORE_ROWS  # Inline (odd i) or in the store.
    return {"x": np.full((rows, COLUMNS), i, np.float32), "i": np.array([i], np.int64)}


def generator():
    # Made in a function: pickled by value, as Ray workers cannot import tests.
    def gen(shard):
        rows = INLINE_ROWS if shard == 0 else STORE_ROWS  # Shard 0's are inline.
        for j in range(PER_SHARD):
            yield {"x": np.full((rows, COLUMNS), shard * 100 + j, np.float32)}

    return gen


@tf.function
def count(ds):
    return ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1)


class Soak:
    def __init__(self):
        self.refs = [make.remote(i) for i in range(REFS)]
        ray.wait(self.refs, num_returns=REFS)
        wait_until(lambda: runtime.get().pins.count() == 0)
        self.resting_store = store_bytes_used()  # The refs' own objects, held throughout.
        self.refs_ds = tfray.Dataset(self.refs)
        self.gen_ds = tfray.Dataset.from_generators(generator(), SHARDS, deterministic=True)
        self.batches = 0
        self.inline_batches = 0  # New batches read into this process's heap.
        self.gen_order = None  # The values of gen_ds's epoch, in order.

    def cycle(self, n):
        """One round of every way to read; ``n`` varies where iterators are dropped."""
        for position, batch in enumerate(self.refs_ds):  # A full epoch, checked.
            assert int(batch["i"][0]) == position and float(batch["x"][0, 0]) == position
        self.batches += REFS
        self._drop_after(self.refs_ds, 1 + n % (REFS - 1))
        got = [int(b["x"][0, 0]) for b in self.gen_ds]
        # Round-robin a bundle at a time (deterministic): each shard's in order,
        # the same order every epoch.
        for shard in range(SHARDS):
            assert [v for v in got if v // 100 == shard] == [shard * 100 + j for j in range(PER_SHARD)]
        assert got == (self.gen_order or got)
        self.gen_order = got
        self.batches += SHARDS * PER_SHARD
        self.inline_batches += PER_SHARD
        self._drop_after(self.gen_ds, 1 + n % (SHARDS * PER_SHARD - 1))
        assert int(count(self.refs_ds)) == REFS  # Iterator made inside a tf.function.
        self.batches += REFS

    def _drop_after(self, ds, k):
        it = iter(ds)
        for _ in range(k):
            next(it)
        self.batches += k
        if ds is self.gen_ds:
            self.inline_batches += sum(v // 100 == 0 for v in self.gen_order[:k])  # Shard 0's.
        del it

    def settle(self):
        # Every epoch's feeder is done, so an epoch of refs_ds that ran to
        # its end has either set a replay (its batches kept, pinned, while
        # refs_ds lives) or made its offer: the next epoch, started ahead and
        # pinned until an iterator takes it. Take that and drop it mid-epoch
        # (which offers nothing), so that any other pin left is a leak.
        wait_until(lambda: all(s.finished for s in self.refs_ds.stats() + self.gen_ds.stats()))
        registry = runtime.get().registry
        assert registry.settled(10)  # Each end has been kept or has had its next epoch offered.
        if registry.view(self.refs_ds.source_key).offered:
            it = iter(self.refs_ds)
            next(it)
            del it
        gc.collect()
        lib = native.load().lib
        wait_until(lambda: runtime.get().pins.count() == lib.replayed_batches())
        wait_until(lambda: all(s.finished for s in self.refs_ds.stats() + self.gen_ds.stats()))
        # Frees reach the store's counters a little later; a leak never does.
        wait_store_back_to(self.resting_store)
        return _resources()


def soak(total_batches, warmup_batches):
    """Reads ``total_batches``.

    Returns the resources after warm-up and at the end, the batches read,
    and the bytes of inline batches read in between.
    """
    run = Soak()
    n = 0
    while run.batches < warmup_batches:
        run.cycle(n)
        n += 1
    before = run.settle()
    inline_at_warmup = run.inline_batches
    while run.batches < total_batches:
        run.cycle(n)
        n += 1
    after = run.settle()
    return before, after, run.batches, (run.inline_batches - inline_at_warmup) * INLINE_BYTES


def check_flat(before, after, inline_bytes):
    """Everything flat; RssAnon grew by under half of leaking every inline batch."""
    mb = {k: round(v / MB, 1) for k, v in after.items() if k in ("rss_anon", "store")}
    tolerance = RSS_LEAK_SHARE * inline_bytes
    report = (
        f"after warm-up {before}, at the end {after} ({mb} MB); RssAnon may grow "
        f"{tolerance / MB:.1f} MB, half of the {inline_bytes / MB:.1f} MB of inline batches read"
    )
    print(report)  # Shown with -s: the figures behind the verdict.
    assert after["store"] <= before["store"], report
    assert after["rss_anon"] - before["rss_anon"] <= tolerance, report
    assert after["fds"] - before["fds"] <= FD_TOLERANCE, report
    assert after["threads"] - before["threads"] <= THREAD_TOLERANCE, report
    assert after["feeder_threads"] <= FEEDER_THREADS_MAX, report
    assert after["grpc_threads"] - before["grpc_threads"] <= GRPC_THREAD_TOLERANCE, report


@pytest.mark.timeout(120)
def test_soak_1600_batches():
    """1,600 batches, ~60 iterators: store, memory, fds and threads stay flat."""
    before, after, batches, inline_bytes = soak(total_batches=1_600, warmup_batches=250)
    assert batches >= 1_600
    check_flat(before, after, inline_bytes)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_20000_batches():
    """20,000 batches, ~800 iterators over many epochs: everything stays flat."""
    before, after, batches, inline_bytes = soak(total_batches=20_000, warmup_batches=1_000)
    assert batches >= 20_000
    check_flat(before, after, inline_bytes)
