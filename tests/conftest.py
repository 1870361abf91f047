"""Shared fixtures: a small local Ray that test modules share while they leave it clean, and polling helpers."""

import collections
import contextlib
import gc
import importlib.metadata
import json
import os
import sys
import threading
import time

import pytest

SOURCE_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def installed_as_a_copy():
    """Whether tfray is pip-installed as a copy (a regular install or a wheel).

    An editable install (``make test``) or an in-place build is the source
    tree itself; a regular install puts a copy, with its native library, in
    site-packages.
    """
    try:
        dist = importlib.metadata.distribution("tfray")
    except importlib.metadata.PackageNotFoundError:
        return False
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    return not direct_url.get("dir_info", {}).get("editable", False)


# `python -m pytest` puts the current directory first on sys.path: run from
# the source tree it would import the source `tfray/`, which has no native
# library after `pip install .`. When tfray is installed as a copy, the tests
# import that copy.
if installed_as_a_copy():
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != SOURCE_TREE]

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray  # noqa: E402

OBJECT_STORE_BYTES = 150 * 1024 * 1024


# The running Ray if start_ray() started it: its GCS address (None if none).
_started = {"gcs": None}


def start_ray():
    """A new local Ray with the tests' defaults (2 CPUs, a 150 MB object store)."""
    ray.init(
        # Always a new instance: never join another process's Ray that
        # /tmp/ray/ray_current_cluster points at (e.g. a concurrent test run).
        address="local",
        num_cpus=2,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    _started["gcs"] = ray.get_runtime_context().gcs_address


# How long the feeders of the iterators a test dropped may take to end:
# a generator epoch's close reads its stopping producers for up to 2 s,
# and asks the stop board, which waits up to 30 s for Ray (sources/stops.py).
FEEDERS_IDLE_S = 40.0


def _runtime_if_started():
    """This process's tfray Runtime if one runs, without starting one."""
    if not any(t.name == "tfray-dispatch" for t in threading.enumerate()):
        return None
    from tfray._internal.runtime import runtime

    return runtime.get()


def assert_feeders_idle(timeout=FEEDERS_IDLE_S):
    """Fails unless every feeder of tfray's runtime ends within ``timeout`` s.

    A feeder still running once its test's iterators are gone is a leak: an
    epoch nothing reads, holding its thread, its pins and its producers.
    """
    # pytest keeps a failed test's traceback for a post-mortem, and with it
    # the test's frames and the iterators in them: not a leak of tfray's.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()  # Drops the iterators the test left, cancelling their epochs.
    rt = _runtime_if_started()
    if rt is None:
        return
    deadline = time.monotonic() + timeout
    while not rt.feeders.wait_idle(1.0):
        gc.collect()
        if time.monotonic() > deadline:
            names = sorted(t.name for t in threading.enumerate() if t.name.startswith("tfray"))
            raise AssertionError(f"tfray's feeders still run {timeout:.0f} s after their test; threads: {names}")


# The runtime's own threads, one each while it runs (runtime/runtime.py).
RUNTIME_THREADS = ("tfray-dispatch", "tfray-release", "tfray-lease")


def tfray_threads():
    """The names of the live Python threads tfray started, in a Counter."""
    return collections.Counter(t.name for t in threading.enumerate() if t.name.startswith("tfray"))


def _unaccounted_threads():
    """tfray's threads beyond the runtime's own and its pool's (empty when none)."""
    rt = _runtime_if_started()
    extra = tfray_threads()
    if rt is not None:
        extra.subtract({name: 1 for name in RUNTIME_THREADS})
        extra.subtract({"tfray-feeder": rt.feeders.threads})
    return {name: n for name, n in extra.items() if n > 0}


def assert_no_stray_threads(timeout=10.0):
    """Fails if a tfray thread outlives its test module, bar the runtime's by design.

    The runtime keeps its dispatcher, release and heartbeat threads for the
    life of the process, and its feeder pool keeps threads it counts (idle
    ones end after a while, tests/runtime/test_feeder_pool.py). Any other tfray
    thread (a second runtime's, a pool a test started and never stopped, a
    feeder thread the pool lost count of) is a leak. A thread that is ending
    has ``timeout`` s to go.
    """
    deadline = time.monotonic() + timeout
    while _unaccounted_threads():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"tfray threads outlived their test module: {_unaccounted_threads()} beyond the "
                f"runtime's own and its feeder pool's; all: {dict(tfray_threads())}"
            )
        time.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def no_tfray_thread_outlives_the_module():
    """After each test module: tfray's feeders idle, and no tfray thread left over."""
    yield
    assert_feeders_idle()
    assert_no_stray_threads()


def shutdown_ray():
    """``ray.shutdown()`` once tfray's feeders have ended; fails if one does not.

    Iterators a test dropped are still winding down on feeder threads; the
    shutdown would wait for their calls into Ray (runtime/ray_api.py), but
    a test's Ray is cleaner gone with nothing of tfray's still in it.
    """
    if ray.is_initialized():
        try:
            assert_feeders_idle()
        finally:
            ray.shutdown()


# Actors a Ray session keeps once started, whoever used it: tfray's stop
# board (sources/stops.py) and Ray Data's statistics and autoscaling actors.
SESSION_ACTORS = {"StopBoard", "_StatsActor", "_AutoscalingCoordinatorActor"}
# What those actors may hold in the store (Ray Data's statistics).
SESSION_STORE_BYTES = 2 * 1024 * 1024


def _as_start_ray_left_it(timeout=3.0):
    """Whether the running Ray is start_ray()'s, with every CPU free and no test's actor or data left.

    Waits up to ``timeout`` s for what a test dropped to go (Ray frees
    objects and ends tasks and actors asynchronously).
    """
    if not ray.is_initialized() or ray.get_runtime_context().gcs_address != _started["gcs"]:
        return False

    def clean():
        actors = {a["ActorClassName"] for a in ray._private.state.actors().values() if a["State"] != "DEAD"}
        return (
            ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0)
            and actors <= SESSION_ACTORS
            and store_bytes_used() <= SESSION_STORE_BYTES
        )

    deadline = time.monotonic() + timeout
    while not clean():
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.1)
    return True


@contextlib.contextmanager
def shared_ray():
    """start_ray()'s Ray, shared while each user leaves it as it found it.

    A start and a shutdown cost about 6 s. A Ray another fixture started,
    or one still holding objects or CPUs after its user, is shut down: the
    next user gets a new one.
    """
    if not _as_start_ray_left_it(timeout=0):
        shutdown_ray()
        start_ray()
    yield
    assert_feeders_idle()
    if not _as_start_ray_left_it():
        shutdown_ray()


@pytest.fixture(scope="session", autouse=True)
def no_ray_outlives_the_session():
    """The shared Ray ends with the test session."""
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for this module (2 CPUs, a 150 MB object store)."""
    with shared_ray():
        yield


@pytest.fixture
def fresh_ray():
    """A local Ray for one test, for tests that shut it down."""
    with shared_ray():
        yield


@contextlib.contextmanager
def ray_data_in_order():
    """Within it, Ray Data yields a dataset's blocks in order (every run alike)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    before = context.execution_options.preserve_order
    context.execution_options.preserve_order = True
    try:
        yield
    finally:
        context.execution_options.preserve_order = before


def without_prefetch(ds):
    """``ds`` without the prefetch tf.data injects after sources by default."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    return ds.with_options(options)


def wait_until(predicate, timeout=20.0, interval=0.05):
    """Polls ``predicate`` until true; fails the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        gc.collect()
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s: {predicate}")


def store_stats():
    """This node's object store counters: bytes used, spilled, restored, ..."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return get_memory_info_reply(state).store_stats


def store_bytes_used():
    """Bytes in this node's object store (what pins and refs keep there)."""
    return store_stats().object_store_bytes_used


def wait_store_back_to(baseline, timeout=20.0):
    """Waits until the object store holds at most ``baseline`` bytes; fails naming what it holds.

    The failure lists the store's objects with who references them (Ray's
    ``ray memory`` table), so a leak says whose it is.
    """
    try:
        wait_until(lambda: store_bytes_used() <= baseline, timeout=timeout)
    except AssertionError:
        from ray._private.internal_api import memory_summary

        try:
            # This Ray's: the machine may run others.
            held = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=False)
        except Exception as e:  # The summary is only a diagnosis.
            held = f"(no object list: {type(e).__name__}: {e})"
        raise AssertionError(
            f"the object store holds {store_bytes_used()} bytes after {timeout} s, not at most {baseline}:\n{held}"
            f"\n{_held_in_python(held)}"
        ) from None


def _held_in_python(listed):
    """What in this process holds the refs named in ``listed``, and any streaming generator.

    A ref Ray lists as a local reference is held by a Python object, or by
    Ray itself: this says which.
    """
    gc.collect()
    everything = gc.get_objects()
    found = [
        o
        for o in everything
        if isinstance(o, ray.ObjectRefGenerator) or isinstance(o, ray.ObjectRef) and o.hex() in listed
    ]
    del everything
    lines = [f"{len(found)} of those refs, or streaming generators, are alive in this process"]
    shown = found[:20]
    for obj in shown:
        holders = []
        for holder in gc.get_referrers(obj):
            if holder is found or holder is shown:
                continue
            if isinstance(holder, dict):  # An instance's attributes: name the instance.
                owners = [type(o).__name__ for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder]
                holders.append(f"dict of {owners or '?'}")
            else:
                holders.append(type(holder).__name__)
        name = obj.hex() if isinstance(obj, ray.ObjectRef) else repr(obj)
        lines.append(f"  {type(obj).__name__} {name}: held by {holders}")
    return "\n".join(lines)


def store_bytes_created():
    """Bytes ever created in this node's object store, a count that only grows.

    What was created since a moment, with nothing freed meanwhile, is the
    store's peak over that span, which sampling ``store_bytes_used`` could
    miss between two samples.
    """
    return store_stats().cumulative_created_bytes


@contextlib.contextmanager
def cluster_of(*nodes, store_bytes=80 * 1024 * 1024):
    """A Ray cluster on this machine, a node (its own raylet and store) per ``add_node`` options.

    The first node is the head, the driver's. Yields ``(cluster, [node, ...])``.
    """
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster()
    try:
        added = [cluster.add_node(**{"object_store_memory": store_bytes, **options}) for options in nodes]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        yield cluster, added
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextlib.contextmanager
def two_node_cluster(store_bytes, producer_resource):
    """A head node (the driver's) and a producer node, 1 CPU each, own stores.

    Only the producer node has ``producer_resource`` (4 of it), so tasks that
    ask for it run there and their batches must cross to the driver's node.
    Yields ``(cluster, producer_node)``.
    """
    head = {"num_cpus": 1, "include_dashboard": False}
    producer = {"num_cpus": 1, "resources": {producer_resource: 4}}
    with cluster_of(head, producer, store_bytes=store_bytes) as (cluster, (_, producer_node)):
        yield cluster, producer_node
