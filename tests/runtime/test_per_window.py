"""tfray's Python in the trainer runs per window of batches, not per batch.

A profiler on every feeder thread tfray starts counts the calls into tfray's
own modules over an epoch (tests/support/python_calls.py, in a process of
its own so that it sees the threads start; one process for every case). Were
any of tfray's Python to run per batch (a spec check, a pin, an entry built
per batch), the calls would grow with the batches; they grow with the
windows. Ray's own calls are reported beside them (its deserialization, per
object, now only for objects unlike those read before: runtime/decoder.py).
Where every object is ready from the start, a window costs one call into Ray
that gives up the GIL (the core worker's get, no ``ray.wait`` first): with a
busy Python thread each such call can cost a switch interval.

``from_generators`` producers put their batches in the store in bundles
(sources/producer.py): there tfray's calls grow with the windows and the
bundles, and so do Ray's (a streaming generator's ``next`` and ``ray.get``
per object), but for the one call Ray makes per array it deserializes.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "python_calls.py")
# Per window: the resolver's and the feeder's few calls, one native push.
CALLS_PER_WINDOW = 20
# Per turn of the feeder that found nothing resolved yet (how many depends
# on how long Ray takes, not on the batches); a poll's own calls are
# counted apart. Each such turn waited the feeder's whole poll interval in
# a poll, or found a bundle or the epoch's end on its way (see
# idle_rounds): a feeder that spins, asking again without waiting, would
# loosen the bound by its turns instead.
CALLS_PER_IDLE_ROUND = 10
# Per bundle: its turn at the producers' streams, its label, its batches'.
CALLS_PER_BUNDLE = 15
# Per turn of the feeder over producers' streams that found nothing: the
# turn's poll and the unbundling wrapper's own, besides the above.
CALLS_PER_IDLE_PRODUCER_ROUND = 15


def idle_rounds(got):
    """The feeder's turns that pushed nothing, checked to be turns that waited.

    A turn finds nothing when a poll waited the feeder's whole interval
    (``waits``), and at most once per producer's bundle (a bundle ready
    whose batches the next turn takes) and at the epoch's end.
    """
    idle = got["rounds"] - got["windows"]
    assert 0 <= idle <= got["waits"] + got["bundles"] + 2, got
    return idle


# Each test's case: batches, window, rows, source (tests/support/python_calls.py).
CASES = {
    "inline": (3200, 256, 16, "refs"),  # 16 KB, in this process's heap.
    # 140 MB in a 200 MB store: none spilled. Restoring spilled objects
    # makes the epoch Ray-bound, with windows as short as the restores
    # allow (a clean-clone CI run saw 1,434 windows for 3,200 batches).
    "store": (560, 256, 256, "refs"),  # 256 KB, in the object store.
    "generators": (3200, 16, 16, "generators"),
}


@pytest.fixture(scope="module")
def counted():
    """Every case's counts, by case, from one run of the script."""
    args = [",".join(map(str, case)) for case in CASES.values()]
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(CASES), out.stdout[-3000:]
    return dict(zip(CASES, map(json.loads, lines)))


@pytest.mark.parametrize(
    "case, where",
    [("inline", "inline (16 KB, in this process's heap)"), ("store", "in the object store (256 KB, 140 MB of them)")],
    ids=["inline", "store"],
)
def test_tfray_python_runs_per_window_not_per_batch(counted, case, where):
    got = counted[case]
    batches, _, rows, _ = CASES[case]
    print(
        f"{where}: {got['batches']} batches in {got['windows']} windows; calls into "
        f"tfray {got['tfray']} ({got['tfray'] / got['batches']:.3f} a batch), into Ray "
        f"{got['ray']} ({got['ray'] / got['batches']:.1f} a batch); {got['rounds']} turns of "
        f"the feeder, {got['waits']} idle polls, {got['polls']} calls in polls; tfray's calls into Ray {got['ray_api']}"
    )
    assert got["batches"] == batches and got["copied"] == 0  # Every batch took the native path: tfray copied none.
    assert got["windows"] < got["batches"] / 8, got  # Windows of many batches.
    idle = idle_rounds(got)
    assert got["tfray"] <= CALLS_PER_WINDOW * got["windows"] + CALLS_PER_IDLE_ROUND * idle + 20, got
    if rows == 16:
        # Every object is ready from the start: a window costs one Ray call
        # that gives up the GIL (the core worker's get), with no ray.wait
        # before it; and Ray deserializes only the first window's objects.
        assert "wait" not in got["ray_api"] and "get" not in got["ray_api"], got
        assert got["door"]["get_decoded"] == got["windows"], got
        assert got["ray"] < got["batches"], got


def test_from_generators_python_runs_per_bundle_not_per_batch(counted):
    got = counted["generators"]
    per_batch = {k: round(got[k] / got["batches"], 3) for k in ("tfray", "ray")}
    print(
        f"from_generators (16 KB): {got['batches']} batches in {got['bundles']} bundles, "
        f"{got['windows']} windows; calls into tfray {got['tfray']} ({per_batch['tfray']} a "
        f"batch), into Ray {got['ray']} ({per_batch['ray']} a batch); {got['rounds']} turns of "
        f"the feeder, {got['waits']} idle polls, {got['polls']} calls in polls ({got['ray_in_polls']} into Ray)"
    )
    batches = CASES["generators"][0]
    assert got["batches"] == batches and got["copied"] == 0
    # Bundles of up to 256 batches (4 MB): 1, 2, 4, ... 128 then 256s, per producer.
    assert 0 < got["bundles"] <= 2 * (8 + batches // 2 // 256 + 1), got
    idle = idle_rounds(got)
    assert (
        got["tfray"]
        <= CALLS_PER_WINDOW * got["windows"]
        + CALLS_PER_BUNDLE * got["bundles"]
        + CALLS_PER_IDLE_PRODUCER_ROUND * idle
        + 20
    ), got
    # Ray's (but in polls, which follow how long Ray takes): one call per
    # batch (each array it deserializes), the rest per bundle or window; an
    # object per batch cost about 45 calls a batch.
    assert got["ray"] <= got["batches"] + 80 * got["bundles"] + 30 * got["rounds"], got
