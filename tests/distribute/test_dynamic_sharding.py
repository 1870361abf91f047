"""sharding="dynamic": consumers take work units from one coordinator as they go.

Each batch carries its id, so a test can tell which consumer read which
unit. Consumers are threads of this process (each with its own
``tfray.Dataset``: a worker each) or, where one must die, Ray actors.
"""

import functools
import gc
import sys
import threading
import time

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import wait_until, without_prefetch
from ray import cloudpickle
from support import resolutions

import tfray
from tfray._internal.distribute import coordinator
from tfray._internal.sources import generators

# By value: the consumer actors' processes cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120, method="thread")]

UNITS = 24


def make_refs(n=UNITS):
    return [ray.put({"id": np.array([i], np.int64), "x": np.full((16, 4), i, np.float32)}) for i in range(n)]


def taken(name):
    """``{epoch: {worker: [units]}}`` from the coordinator named ``name``."""
    return ray.get(ray.get_actor(name, namespace=coordinator.NAMESPACE).taken.remote())


def consume(ds, epochs, delay_s, out, barrier=None, after_first=None):
    """Reads ``epochs`` epochs of ``ds``, appending each epoch's ids to ``out``.

    With a ``barrier``, consumers start each epoch together, as the workers
    of a synchronous training job do. ``after_first(epoch)`` runs once the
    epoch's first batch is read.
    """
    for epoch in range(epochs):
        if barrier is not None:
            barrier.wait(timeout=60)
        ids = []
        for batch in ds:
            ids.append(int(batch["id"][0]))
            if after_first is not None and len(ids) == 1:
                after_first(epoch)
            time.sleep(delay_s)
        out.append(ids)


def test_a_slow_consumer_takes_fewer_units_and_each_is_read_once_per_epoch():
    """Two consumers, one slow: per epoch every unit exactly once; the slow one took fewer.

    How much slower "slow" is must not depend on the machine's load (under
    heavy load each batch's own cost outweighs any sleep): after its first
    batch of an epoch, the slow consumer waits until every unit is handed
    out. In the first epoch a worker that asks before the other has ever
    asked may hold half of all units, so the split is checked from the
    second epoch on, when the coordinator knows both.
    """
    name, epochs = "test-slow-fast", 3
    refs = make_refs()
    sharding = tfray.DynamicSharding(name=name)
    fast_ds = tfray.Dataset(refs, sharding=sharding)
    slow_ds = tfray.Dataset(refs, sharding=sharding)
    assert fast_ds.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY

    def all_handed_out(epoch):
        wait_until(
            lambda: sum(map(len, taken(name).get(epoch, {}).values())) == UNITS, timeout=60
        )

    fast, slow = [], []
    barrier = threading.Barrier(2)
    threads = [
        threading.Thread(target=consume, args=(fast_ds, epochs, 0.01, fast, barrier)),
        threading.Thread(
            target=consume, args=(slow_ds, epochs, 0.05, slow, barrier, all_handed_out)
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert len(fast) == len(slow) == epochs, "a consumer did not finish its epochs"
    for epoch in range(epochs):
        both = fast[epoch] + slow[epoch]
        assert sorted(both) == list(range(UNITS)), f"epoch {epoch}: {fast[epoch]} + {slow[epoch]}"
        if epoch > 0:
            assert 0 < len(slow[epoch]) < len(fast[epoch])
    # The coordinator handed each unit once, to the consumer that read it.
    handed = taken(name)
    for epoch in range(epochs):
        assert sorted(map(sorted, handed[epoch].values())) == sorted(
            sorted(ids) for ids in (fast[epoch], slow[epoch]) if ids
        )


def test_each_unit_is_fetched_once_per_epoch_across_consumers():
    """Two consumers of one epoch fetch each ref once between them, none to discard.

    Counted at deserialization, in this process where both consumers run: a
    unit fetched by both, or fetched and dropped, would show here.
    """
    refs = [resolutions.put(("dynamic", i), np.full(2, i, np.int64)) for i in range(UNITS)]
    spec = tf.TensorSpec([None], tf.int64)
    sharding = tfray.DynamicSharding(name="test-fetched-once")
    datasets = [tfray.Dataset(refs, element_spec=spec, sharding=sharding) for _ in range(2)]
    outs = [[], []]

    def read(ds, out):
        out.append([int(t[0]) for t in ds])

    threads = [threading.Thread(target=read, args=(ds, out)) for ds, out in zip(datasets, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert sorted(outs[0][0] + outs[1][0]) == list(range(UNITS))
    fetched = {key[1]: n for key, n in resolutions.resolved().items() if key[0] == "dynamic"}
    assert fetched == {i: 1 for i in range(UNITS)}, f"resolutions by ref index: {fetched}"


def test_generator_shards_are_units_read_once_per_epoch():
    """from_generators: each shard runs on one consumer per epoch; all batches arrive once."""

    def produce(shard):
        for j in range(3):
            yield {"id": np.array([10 * shard + j], np.int64)}

    spec = {"id": tf.TensorSpec([None], tf.int64)}
    assert_each_shard_read_once_per_epoch(
        lambda: tfray.Dataset.from_generators(
            produce, 6, element_spec=spec, sharding="dynamic", ray_remote_args={"num_cpus": 0}
        )
    )


def assert_each_shard_read_once_per_epoch(make, shards=6, batches=3, epochs=2):
    """Two workers read ``epochs`` epochs of ``make()``'s shards (ids ``10 * shard + j``): each shard by one worker."""
    datasets = [make() for _ in range(2)]
    outs = [[], []]
    threads = [threading.Thread(target=consume, args=(ds, epochs, 0.0, out)) for ds, out in zip(datasets, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    expected = sorted(10 * shard + j for shard in range(shards) for j in range(batches))
    for epoch in range(epochs):
        assert sorted(outs[0][epoch] + outs[1][epoch]) == expected
        for out in outs:  # A shard's batches all went to one consumer.
            read = {i // 10 for i in out[epoch]}
            assert sorted(out[epoch]) == sorted(10 * s + j for s in read for j in range(batches))


def test_tf_data_shards_are_units_read_once_per_epoch():
    """from_tf_data: each shard's pipeline runs for one consumer per epoch."""

    def pipeline(shard):
        return tf.data.Dataset.range(10 * shard, 10 * shard + 3).map(lambda i: {"id": tf.reshape(i, [1])})

    assert_each_shard_read_once_per_epoch(
        lambda: tfray.Dataset.from_tf_data(pipeline, 6, sharding="dynamic", ray_remote_args={"num_cpus": 0})
    )


def test_an_iterator_dropped_mid_epoch_leaves_the_rest_to_the_next():
    """Units not taken by TF go back at once; the worker's next iterator finishes that epoch."""
    ds = without_prefetch(tfray.Dataset(make_refs(), sharding=tfray.DynamicSharding(name="test-drop")))
    iterator = iter(ds)
    first = [int(next(iterator)["id"][0]) for _ in range(3)]
    del iterator
    gc.collect()
    rest = [int(b["id"][0]) for b in ds]
    assert sorted(first + rest) == list(range(UNITS))
    assert sorted(int(b["id"][0]) for b in ds) == list(range(UNITS))  # The next epoch: whole.
    assert sorted(taken("test-drop")) == [0, 1]


@ray.remote(num_cpus=0)
class Consumer:
    """A worker process reading a dynamic dataset, telling the test what it read."""

    def __init__(self, refs, name, lease_s):
        self._ds = tfray.Dataset(refs, sharding=tfray.DynamicSharding(name=name, lease_timeout_s=lease_s))
        # Without the prefetch tf.data adds by default: batches TF takes from
        # tfray count as read, and a dead worker's prefetch buffer dies with it.
        options = tf.data.Options()
        options.autotune.enabled = False
        options.experimental_optimization.inject_prefetch = False
        self._ds = self._ds.with_options(options)
        self._read = []  # Ids read so far this epoch.

    def read_epoch(self, delay_s, stop_after=None):
        """Reads an epoch; with ``stop_after``, hangs after that many batches."""
        self._read = []
        for batch in self._ds:
            self._read.append(int(batch["id"][0]))
            if len(self._read) == stop_after:
                threading.Event().wait()  # Until the test kills this process.
            time.sleep(delay_s)
        return self._read

    def read_so_far(self):
        return list(self._read)


@pytest.mark.timeout(480, method="thread")  # Up to 240 s for the two processes to start, then 210 s of waits.
def test_a_dead_consumers_unfinished_units_go_to_the_other():
    """A consumer process killed mid-epoch: the survivor reads every unit it did not finish."""
    refs = make_refs()
    lease_s = 2.0
    # Threaded: the test asks what it read while it reads.
    options = dict(max_concurrency=2)
    doomed = Consumer.options(**options).remote(refs, "test-kill", lease_s)
    survivor = Consumer.options(**options).remote(refs, "test-kill", lease_s)
    # Both processes up (each imports TensorFlow: over a minute on a loaded
    # machine) before the doomed one's reads are timed.
    ray.get([doomed.read_so_far.remote(), survivor.read_so_far.remote()], timeout=240)
    doomed_epoch = doomed.read_epoch.remote(0.1, stop_after=3)
    deadline = time.monotonic() + 60
    while len(ray.get(doomed.read_so_far.remote())) < 3:
        assert time.monotonic() < deadline, "the doomed consumer read nothing"
        time.sleep(0.05)
    read_by_doomed = ray.get(doomed.read_so_far.remote())  # Final: it hangs now.
    # It dies holding units it did not read (its look-ahead's): the survivor,
    # reading from now on, must get those too once their lease runs out.
    wait_until(lambda: sum(len(units) for units in taken("test-kill")[0].values()) > 3, timeout=60)
    survivor_epoch = survivor.read_epoch.remote(0.1)
    ray.kill(doomed)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(doomed_epoch, timeout=30)

    got = ray.get(survivor_epoch, timeout=60)
    assert len(got) == len(set(got))
    # Every unit the dead one did not read, the survivor did.
    assert set(range(UNITS)) - set(read_by_doomed) <= set(got)
    handed = taken("test-kill")[0]
    assert sum(len(units) for units in handed.values()) > UNITS  # Some were handed out again.


def test_dynamic_sharding_refuses_what_it_cannot_hand_out():
    """Ray Data, one-shot iterators, bad options and a name clash get errors saying what to do."""
    import ray.data

    with pytest.raises(TypeError, match="get_dataset_shard"):
        tfray.Dataset(ray.data.range(8), batch_size=4, sharding="dynamic")
    refs = make_refs(4)
    with pytest.raises(TypeError, match="list of refs"):
        tfray.Dataset(iter(refs), sharding="dynamic")
    with pytest.raises(ValueError, match="lease_timeout_s"):
        tfray.DynamicSharding(lease_timeout_s=0)
    with pytest.raises(ValueError, match="DynamicSharding"):
        tfray.Dataset(refs, sharding="dynamc")
    tfray.Dataset(refs, sharding=tfray.DynamicSharding(name="test-clash"))
    with pytest.raises(ValueError, match="own name"):
        tfray.Dataset(make_refs(5), sharding=tfray.DynamicSharding(name="test-clash"))
    spec = tf.TensorSpec([None], tf.int64)
    with pytest.raises(ValueError, match="Name the dataset"):
        tfray.Dataset.from_generators(lambda shard: iter(()), 2, element_spec=spec, sharding="dynamic")


def test_generator_datasets_are_named_alike_in_every_process():
    """The coordinator's name comes from what every process spells the same: not addresses."""

    def produce(shard, rows):
        yield np.zeros(rows, np.int64)

    assert generators.stable_name(produce) == f"{__name__}.{produce.__qualname__}"
    one, other = functools.partial(produce, rows=4), functools.partial(produce, rows=4)
    assert generators.stable_name(one) == generators.stable_name(other) is not None
    assert generators.stable_name(functools.partial(produce, rows=5)) != generators.stable_name(one)
    assert generators.stable_name(lambda shard: iter(())) is None


def test_a_dynamic_iterator_of_refs_refuses_to_be_restored(tmp_path):
    """A checkpoint of a dynamic iterator of refs cannot be restored: no record says which units it read.

    (A dynamic iterator of generators restores: tests/distribute/test_elastic.py.)
    """
    refs = make_refs(4)
    sharding = tfray.DynamicSharding(name="test-no-restore")
    ds = without_prefetch(tfray.Dataset(refs, sharding=sharding))
    it = iter(ds)
    next(it)
    path = str(tmp_path / "ckpt")
    tf.train.Checkpoint(iterator=it).write(path)
    # Gone before the restore, with the units it held: a restored iterator
    # that read on instead of refusing would get them and deliver at once,
    # rather than wait for them until the test's timeout.
    del it
    gc.collect()
    restored = iter(ds)
    tf.train.Checkpoint(iterator=restored).read(path).assert_consumed()
    with pytest.raises(tf.errors.FailedPreconditionError, match="of refs cannot be restored from a checkpoint.*Checkpoint the model"):
        next(restored)
