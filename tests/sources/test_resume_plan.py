"""resume.plan: where a restored epoch's shards start, and the rotation it rebuilds, without Ray.

A small model of GeneratorShards' deterministic interleave (a bundle a turn,
a shard that ends replaced in its place by the next) makes an epoch; every
prefix of it, as the native Progress counts it, must plan a rest that the
same model continues into exactly the epoch's rest.
"""

import pytest

from tfray._internal.runtime.progress import Progress
from tfray._internal.runtime.status import BatchError
from tfray._internal.sources import resume

pytestmark = pytest.mark.timeout(30)


def interleave(bundles, concurrency, plan=None):
    """The (shard, batch index) order of a deterministic epoch of ``bundles[shard]`` sizes.

    With ``plan``, the rest of it from there (each shard from its Start).
    """
    shards = len(bundles)
    if plan is None:
        running, turn, pending = list(range(min(concurrency, shards))), 0, list(range(concurrency, shards))
        starts = {}
    else:
        running, turn, pending, starts = list(plan.running), plan.turn, list(plan.pending), plan.starts
    # Per running shard: its bundles left, as (first batch, size).
    queues = {}

    def begin(shard):
        start = starts.get(shard, resume.Start(0, 0, 0))
        batch, out = 0, []
        for size in bundles[shard]:
            out.append((batch, size))
            batch += size
        done = start.ordinal - (1 if start.rest else 0)
        left = out[done:]
        if start.rest:
            first, size = left[0]
            left[0] = (start.batch, start.rest)
            assert first + size - start.rest == start.batch
        queues[shard] = left

    for shard in running:
        begin(shard)
    order = []
    while running:
        shard = running[turn]
        if queues[shard]:
            first, size = queues[shard].pop(0)
            order += [(shard, first + i) for i in range(size)]
            turn = (turn + 1) % len(running)
        elif pending:
            running[turn] = pending.pop(0)
            begin(running[turn])
        else:
            running.pop(turn)
            turn = turn % len(running) if running else 0
    return order


def progress_of(order, bundles):
    """The native Progress of having handed out ``order`` (its encoding's fields)."""
    starts = {}
    for shard, sizes in enumerate(bundles):
        batch = 0
        for size in sizes:
            starts[(shard, batch)] = size
            batch += size
    units, bundle_of, last = {}, {}, None
    for shard, index in order:
        batches, begun = units.get(shard, (0, 0))
        if (shard, index) in starts:
            begun += 1
            bundle_of[shard] = (index, starts[(shard, index)])
        units[shard] = (batches + 1, begun)
        first, size = bundle_of[shard]
        last = (shard, index - first + 1, size)
    shard, done, size = last
    return Progress(units, {shard: (done, size)} if done < size else {})


BUNDLES = [[1, 2, 4, 3], [1, 2], [1, 2, 4, 8, 1], [1], [1, 2, 4], [1, 2, 2]]


@pytest.mark.parametrize("concurrency", [1, 2, 3, 6, 8])
def test_every_prefix_plans_the_epochs_rest(concurrency):
    epoch = interleave(BUNDLES, concurrency)
    assert len(epoch) == sum(map(sum, BUNDLES))
    for k in range(1, len(epoch)):
        progress = progress_of(epoch[:k], BUNDLES)
        plan = resume.plan(list(range(len(BUNDLES))), concurrency, progress, in_order=True)
        assert interleave(BUNDLES, concurrency, plan) == epoch[k:], k


def test_first_ready_plan_starts_shards_with_progress_first():
    epoch = interleave(BUNDLES, 2)
    progress = progress_of(epoch[:9], BUNDLES)
    plan = resume.plan(list(range(len(BUNDLES))), 2, progress, in_order=False)
    begun = sorted(progress.units)
    assert (plan.running + plan.pending)[: len(begun)] == begun
    assert sorted(plan.running + plan.pending) == list(range(len(BUNDLES)))
    assert {i: s.batch for i, s in plan.starts.items()} == {i: progress.units[i][0] for i in begun}


def test_progress_of_a_shard_the_dataset_lacks_is_refused():
    progress = Progress({9: (1, 1)}, {})
    with pytest.raises(BatchError, match=r"shard\(s\) \[9\]"):
        resume.plan([0, 1, 2], 2, progress, in_order=True)


def test_progress_of_another_workers_share_is_told_apart():
    progress = Progress({0: (3, 2), 2: (1, 1)}, {})
    assert resume.of_another_share(progress, [1, 3], 4)
    assert not resume.of_another_share(progress, [0, 2], 4)
    assert not resume.of_another_share(progress, [1, 3], 2)  # Shard 2 is in no share of 2 shards.
