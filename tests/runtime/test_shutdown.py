"""Ray going away under a live iterator, and tfray starting Ray when needed."""

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import wait_until

import tfray
from tfray._internal.runtime import runtime

pytestmark = pytest.mark.timeout(180)


def test_ray_shutdown_mid_epoch_is_a_clear_error(fresh_ray):
    """After ray.shutdown(), next() delivers what was resolved, then Unavailable."""
    refs = [ray.put(np.full((256, 256), i, np.float32)) for i in range(40)]
    ds = tfray.Dataset(refs, max_inflight=4)
    it = iter(ds)
    first = next(it)
    wait_until(lambda: ds.stats()[-1].queued == 4)
    ray.shutdown()
    values = []
    # Says what to do: the dataset cannot be read again, build a new one.
    with pytest.raises(tf.errors.UnavailableError, match="Ray was shut down while it was reading.*after ray.init\\(\\), build a new tfray.Dataset"):
        for _ in range(40):
            values.append(float(next(it)[0, 0]))
    # The batches resolved before the shutdown (4 were queued) come first,
    # intact and in order.
    assert len(values) >= 4, f"only {values} were delivered before the error"
    assert values == list(range(1, 1 + len(values)))
    assert float(first[0, 0]) == 0
    assert not ray.is_initialized()  # tfray did not start a new Ray.


def test_ray_shutdown_under_running_producers_is_a_clear_error(fresh_ray):
    """Producers die with Ray: Unavailable, and stopping them starts no new Ray.

    A shutdown can land between the feeder's Ray-is-up check and its next Ray
    call. tfray's calls skip Ray's auto-init (runtime/ray_api.py), so that
    call raises instead of starting a new local Ray, and the feeder reports
    the shutdown.
    """

    def endless(shard):
        import numpy as np

        i = 0
        while True:
            yield np.full((64, 64), shard * 1000 + i, np.float32)
            i += 1

    ds = tfray.Dataset.from_generators(endless, 2, element_spec=tf.TensorSpec([None, 64], tf.float32))
    it = iter(ds)
    next(it)
    ray.shutdown()
    with pytest.raises(tf.errors.UnavailableError, match="Ray was shut down"):
        for _ in range(1000):
            next(it)
    del it
    wait_until(lambda: ds.stats()[-1].finished)
    assert not ray.is_initialized()  # Closing the producers did not start a Ray.


def test_tfray_starts_a_local_ray_and_says_so(caplog):
    """With no Ray running, building a dataset starts one and logs it."""
    if ray.is_initialized():
        ray.shutdown()
    spec = tf.TensorSpec([None], tf.float32)
    try:
        with caplog.at_level(logging.WARNING, logger="tfray"):
            ds = tfray.Dataset([], element_spec=spec)
        assert ray.is_initialized()
        assert "started a local Ray instance" in caplog.text
        assert list(ds) == []
    finally:
        ray.shutdown()


def test_a_program_exits_cleanly_with_an_epoch_offered_ahead(tmp_path):
    """Exiting while a feeder fills an epoch offered ahead: exit status 0.

    tfray's threads must leave their native waits before the interpreter
    finalizes (a thread that retakes the GIL then aborts the process).
    """
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, ray, tfray
        ray.init(address="local", num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)
        ds = tfray.Dataset([ray.put(np.full((256, 256), i, np.float32)) for i in range(8)])
        for _ in range(3):
            assert len(list(ds)) == 8
        print("done")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("kind", ["refs", "refs replayed", "generators"])
def test_new_iterators_after_a_shutdown_or_a_restart_are_unavailable(fresh_ray, kind):
    """After ray.shutdown(), and after a new ray.init(), a new iterator is UnavailableError.

    The message names the dataset and says to rebuild it: its refs and
    producers went with the old Ray, so a new iterator over it cannot work.
    Even a list replayed natively (test_replay.py): the shutdown drops it.
    """
    if kind.startswith("refs"):
        ds = tfray.Dataset([ray.put(np.zeros(4, np.float32))])
    else:

        def gen(shard):
            yield np.zeros(4, np.float32)

        ds = tfray.Dataset.from_generators(gen, 2, element_spec=tf.TensorSpec([4], tf.float32))
    assert len(list(ds)) >= 1
    if kind == "refs replayed":
        assert len(list(ds)) == 1
        wait_until(lambda: runtime.get().registry.view(ds.source_key).replayed)
    ray.shutdown()
    name = f"from_{kind.split()[0]} dataset"
    with pytest.raises(tf.errors.UnavailableError, match=f"{name}.*shut down before it started.*build a new tfray.Dataset"):
        next(iter(ds))
    from conftest import start_ray

    start_ray()
    with pytest.raises(tf.errors.UnavailableError, match=f"{name}.*built in a Ray session that has since been shut down"):
        next(iter(ds))
    rebuilt = tfray.Dataset([ray.put(np.ones(4, np.float32))])  # What the message advises.
    assert [t.numpy().tolist() for t in rebuilt] == [[1, 1, 1, 1]]



def test_tfrays_own_ray_calls_never_start_a_ray_after_a_shutdown(fresh_ray):
    """Ray's public get and wait start a new local Ray after ray.shutdown(); tfray's threads must not.

    The deterministic part of the shutdown-under-producers race (whose
    timing a test cannot force): the calls tfray's threads make raise.
    """
    from tfray._internal.runtime import decoder, ray_api

    ref = ray.put(1)
    ray.shutdown()
    from tfray._internal.runtime.status import Code, EpochError

    calls = {
        "get": lambda: ray_api.get(ref, timeout=1),
        "get_decoded": lambda: ray_api.get_decoded([ref], decoder.BatchDecoder(), timeout=1),
        "wait": lambda: ray_api.wait([ref], num_returns=1, timeout=0),
        "call": lambda: ray_api.call(ray.put, 1),
        "poll": lambda: ray_api.poll([ref], 0),
    }
    for name, call in calls.items():
        # The shutdown error, which the feeder pushes as an UnavailableError.
        with pytest.raises(EpochError, match="Ray was shut down") as raised:
            call()
        assert raised.value.code == Code.UNAVAILABLE, name
        assert not ray.is_initialized(), name


RACE_SOURCES = ["refs", "generators"]


@pytest.fixture(scope="module")
def race():
    """tests/support/shutdown_race.py's run over every source (one process): (exit status, lines, stderr)."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "shutdown_race.py")
    proc = subprocess.run([sys.executable, script, *RACE_SOURCES], capture_output=True, text=True, timeout=200)
    return proc.returncode, proc.stdout.strip().splitlines(), proc.stderr[-3000:]


@pytest.mark.parametrize("source", RACE_SOURCES)
def test_a_shutdown_never_overtakes_a_call_of_tfrays(race, source):
    """ray.shutdown() while a feeder's Ray call is under way: no crash, the documented error.

    tests/support/shutdown_race.py widens the window between Ray's is-connected
    check and the core worker's shutdown on purpose; a tfray call caught in
    it ends the process in Ray ("The core worker process is not initialized
    yet or already shutdown"), as it did before tfray made its calls under
    Ray's connect/shutdown lock.
    """
    code, lines, err = race
    mine = [line for line in lines if line.startswith(f"{source}: ")] or ["(nothing: the process died)"]
    assert mine == [f"{source}: UnavailableError"] and code == 0, f"exit status {code}; {mine[-1]}\n{err}"
