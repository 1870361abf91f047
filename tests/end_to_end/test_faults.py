"""Faults survived: a full object store, KeyboardInterrupt in Keras fit, errors that end an epoch.

Producer exceptions, killed producers, lost objects, ray.shutdown() and
dropped iterators are covered in test_errors.py, test_generators.py and
test_shutdown.py; this module adds what they do not.
"""

import gc
import logging
import os
import signal
import threading

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import tensorflow as tf  # noqa: E402
from conftest import OBJECT_STORE_BYTES, store_bytes_used, store_stats, wait_store_back_to, wait_until  # noqa: E402
from support.dlpack_util import assert_zero_copy  # noqa: E402

import tfray  # noqa: E402
from tfray._internal.runtime import native, runtime  # noqa: E402
from tfray._internal.runtime.batch import Checks  # noqa: E402
from tfray._internal.runtime.feeder import Feeder  # noqa: E402
from tfray._internal.runtime.pins import Pins  # noqa: E402
from tfray._internal.runtime.spec import FlatSpec  # noqa: E402
from tfray._internal.runtime.status import BatchError, Code, EpochError  # noqa: E402

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]

MB = 1 << 20


def _settled_baseline():
    gc.collect()
    wait_until(lambda: runtime.get().pins.count() == 0)
    return store_bytes_used()


def test_refs_worth_twice_the_object_store_are_spilled_and_read_back():
    """Batches that do not fit in the store at once: Ray spills, tfray reads them all, in order."""

    @ray.remote
    def make(i):
        return np.full(4 * MB // 4, i, np.int32)  # 4 MB, in the store.

    count = 2 * OBJECT_STORE_BYTES // (4 * MB)  # 300 MB of batches, 150 MB of store.
    before = store_stats()
    refs = [make.remote(i) for i in range(count)]
    ray.wait(refs, num_returns=count, fetch_local=False)
    spilled = store_stats().spilled_bytes_total - before.spilled_bytes_total
    assert spilled >= count * 4 * MB - OBJECT_STORE_BYTES  # What did not fit went to disk.
    ds = tfray.Dataset(refs)
    for epoch in range(2):
        seen = []
        for batch in ds:
            values = batch.numpy()
            assert values[0] == values[-1] == len(seen), f"epoch {epoch}"
            seen.append(int(values[0]))
        assert seen == list(range(count))
    assert all(s.finished for s in ds.stats())
    assert store_stats().restored_bytes_total > before.restored_bytes_total


def test_a_shuffle_buffer_bigger_than_the_store_restores_each_spilled_batch_about_once(caplog):
    """TensorFlow holding more batches than the store: the epoch reads each from disk once, and tfray says why.

    A batch TensorFlow holds pins its object; fetches asked of Ray beyond
    the store's room came back and were evicted again before anyone took
    them, so the same spilled batches were restored over and over (5x the
    epoch). Counted, not timed: Ray's restored objects against the batches.
    """
    baseline = _settled_baseline()

    @ray.remote
    def make(i):
        return np.full(2 * MB // 4, i, np.int32)  # 2 MB, in the store.

    count, buffer = 100, 90  # 200 MB of batches; the buffer holds 180 MB of a 150 MB store.
    refs = [make.remote(i) for i in range(count)]
    ray.wait(refs, num_returns=count, fetch_local=False)
    before = store_stats()
    source = tfray.Dataset(refs)
    held = 0
    seen = []
    with caplog.at_level(logging.WARNING, logger="tfray"):
        for batch in source.shuffle(buffer, seed=1):
            values = batch.numpy()
            assert values[0] == values[-1]
            seen.append(int(values[0]))
            held = max(held, source.stats()[-1].bytes_held)
    del batch
    assert sorted(seen) == list(range(count))  # Every batch, once.
    restored = store_stats().restored_objects_total - before.restored_objects_total
    assert restored <= 1.2 * count, f"{restored} objects restored from disk for an epoch of {count}"
    # While the buffer was full, TensorFlow held more than the store, and the
    # warning said so, once, with the figures.
    stats = source.stats()[-1]
    assert stats.object_store_bytes == OBJECT_STORE_BYTES and held >= OBJECT_STORE_BYTES
    warned = [r.getMessage() for r in caplog.records if "more than this node's object store" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"({OBJECT_STORE_BYTES // MB} MB)" in warned[0] and "shuffle buffer" in warned[0]
    assert source.stats()[-1].bytes_held == 0  # Released with the buffer and the last batch.
    del refs, source
    gc.collect()
    wait_store_back_to(baseline)


def test_a_batch_bigger_than_the_whole_store_is_delivered_zero_copy():
    """Ray puts an object larger than the store in fallback (file-backed) memory; TF gets it as is."""

    @ray.remote
    def make(i, mb):
        return np.full(mb * MB // 8, i, np.float64)

    big = OBJECT_STORE_BYTES // MB + 10  # 160 MB in a 150 MB store.
    before = store_stats().object_store_bytes_fallback
    refs = [make.remote(1, 1), make.remote(2, big), make.remote(3, 1)]
    ds = tfray.Dataset(refs)
    batches = list(ds)
    got = [(float(b[0]), float(b[-1]), b.shape[0]) for b in batches]
    assert got == [(1, 1, MB // 8), (2, 2, big * MB // 8), (3, 3, MB // 8)]
    # The big batch lies, whole, in the fallback file Ray mapped for it (not
    # its shared-memory store); the others in the store. A copy is in neither.
    paths = [assert_zero_copy(b, f"batch {i}") for i, b in enumerate(batches)]
    assert paths[0] == paths[2] != paths[1], paths
    del batches
    stats = ds.stats()[-1]
    assert stats.bytes == (big + 2) * MB and stats.bytes_copied == 0
    assert store_stats().object_store_bytes_fallback >= before + big * MB


def test_generators_into_a_nearly_full_store_are_held_back_not_failed():
    """With most of the store pinned by others, producers of 4x the free space still deliver."""
    baseline = _settled_baseline()
    ballast = [ray.put(np.ones(10 * MB, np.uint8)) for _ in range(11)]  # 110 of 150 MB.
    free = OBJECT_STORE_BYTES - store_bytes_used()
    shards, per_shard = 2, 20  # 2 x 20 x 4 MB = 160 MB: 4x what is free.

    def gen(shard):
        for i in range(per_shard):
            yield np.full(MB, shard * 100 + i, np.int32)  # 4 MB

    ds = tfray.Dataset.from_generators(gen, shards, deterministic=True)
    got = [int(b[0]) for b in ds]
    # In turns a bundle at a time: the first batch alone, then pairs (producer.py).
    bundles = [range(0, 1)] + [range(i, i + 2) for i in range(1, per_shard - 1, 2)] + [range(per_shard - 1, per_shard)]
    assert got == [s * 100 + i for bundle in bundles for s in range(shards) for i in bundle]
    assert shards * per_shard * 4 * MB > 4 * free
    del ballast, ds
    gc.collect()
    wait_store_back_to(baseline)


# Keras fit and KeyboardInterrupt.

ROWS, FEATURES, BATCHES = 32, 8, 40


@ray.remote
def make_batch(i):
    rng = np.random.default_rng(i)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return {"x": x, "y": (x.sum(axis=1) > 0).astype(np.int32)}


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


class _InterruptAt(keras.callbacks.Callback):
    """Interrupts fit after ``batch`` steps, as Ctrl-C would."""

    def __init__(self, batch, how):
        super().__init__()
        self.batch, self.how = batch, how

    def on_train_batch_end(self, batch, logs=None):
        if batch != self.batch:
            return
        if self.how == "raise":
            raise KeyboardInterrupt
        # A real SIGINT from another thread: Python's handler raises
        # KeyboardInterrupt in the main thread once it is back in Python.
        main = threading.main_thread().ident
        threading.Thread(target=signal.pthread_kill, args=(main, signal.SIGINT)).start()


PAD = 3 << 20  # Over half of producer.BUNDLE_BYTES: a batch travels alone or in a pair.


def _generated_batches(ends):
    """make_batch's batches from 2 shards (made in a function: pickled by value).

    A producer that returns appends to the file ``ends`` how many it made.
    Each batch carries ``PAD`` bytes the model never reads, over half a
    bundle's bound, so that it travels alone or in a pair (producer.py
    bundles smaller ones by the hundred) and the look-ahead, bounded by
    bytes, stays well short of a shard: else a whole shard is made before
    fit has even traced its step.
    """

    def shard_batches(shard):
        made = 0
        try:
            for i in range(shard, BATCHES, 2):
                rng = np.random.default_rng(i)
                x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
                yield {"x": x, "y": (x.sum(axis=1) > 0).astype(np.int32), "pad": np.zeros(PAD, np.uint8)}
                made += 1
        finally:
            with open(ends, "a") as f:
                f.write(f"{made}\n")

    return shard_batches


def _interruptible_source(kind, ends):
    if kind == "refs":
        return tfray.Dataset([make_batch.remote(i) for i in range(BATCHES)], max_inflight=4)
    spec = {
        "x": tf.TensorSpec([None, FEATURES], tf.float32),
        "y": tf.TensorSpec([None], tf.int32),
        "pad": tf.TensorSpec([PAD], tf.uint8),
    }
    return tfray.Dataset.from_generators(_generated_batches(ends), 2, element_spec=spec, max_inflight_per_producer=2)


def _producer_ends(ends):
    """How many batches each producer that returned made (read from the file ``ends``)."""
    if not os.path.exists(ends):
        return []
    with open(ends) as f:
        return [int(n) for n in f.read().split()]


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, as in a terminal (a background job ignores it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("kind, how", [("refs", "raise"), ("refs", "sigint"), ("generators", "sigint")])
def test_keyboard_interrupt_in_fit_stops_feeders_and_a_new_fit_works(kind, how, ctrl_c_raises, tmp_path):
    """Ctrl-C in model.fit (from_refs or from_generators): fit stops, the feeder and
    producers stop, pins go; the next fit reads everything."""
    baseline = _settled_baseline()
    ends = str(tmp_path / "ends")
    source = _interruptible_source(kind, ends)
    ds = source.map(lambda b: (b["x"], b["y"])).prefetch(2)
    model = _model()

    with pytest.raises(KeyboardInterrupt):
        model.fit(ds, epochs=3, verbose=0, callbacks=[_InterruptAt(5, how)])
        for _ in range(100):  # A SIGINT lands at the next Python bytecode.
            pass
    interrupted = source.stats()[-1]
    assert 6 <= interrupted.batches < BATCHES  # Stopped mid-epoch.
    gc.collect()  # The iterator fit made is gone with the traceback.
    wait_until(lambda: source.stats()[0].finished and source.stats()[0].cancelled)
    assert source.stats()[0].refs_in_flight == 0
    wait_until(lambda: runtime.get().pins.count() == 0)
    if kind == "generators":
        # The interrupted epoch's producers returned, stopped early: not
        # left paused, nor run on to their shard's end.
        wait_until(lambda: len(_producer_ends(ends)) >= 2)
        print(f"interrupted at batch {interrupted.batches}: producers made {_producer_ends(ends)}")
        assert all(made < BATCHES // 2 for made in _producer_ends(ends)), _producer_ends(ends)

    history = model.fit(ds, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert [s.batches for s in source.stats()[1:]] == [BATCHES, BATCHES]
    del source, ds, model
    gc.collect()
    wait_until(lambda: runtime.get().pins.count() == 0)
    wait_store_back_to(baseline)


# An error that ends the epoch, met among resolved batches.


class _RecordingChannel:
    """Stands in for the native channel: records what the feeder pushes."""

    capacity = 4
    cancelled = False

    def __init__(self):
        self.pushed, self.errors, self.closed = [], [], False

    def push(self, entries, dtype_enums):
        self.pushed.extend(entries)
        return len(entries)

    def push_error(self, code, message):
        self.errors.append((code, message))

    def close(self):
        self.closed = True


class _Stream:
    """An ItemStream of the given windows of items."""

    lookahead = None

    def __init__(self, windows):
        self._windows = list(windows)
        self.in_flight = 0

    def next_ready(self, timeout):
        return self._windows.pop(0) if self._windows else None

    def close(self):
        pass


@pytest.mark.parametrize(
    "error, pushes",
    [
        (EpochError(Code.UNAVAILABLE, "tfray: batch 1: Ray failed"), 1),
        (BatchError(Code.INVALID_ARGUMENT, "tfray: batch 1: bad"), 2),
    ],
    ids=["epoch error", "batch error"],
)
def test_an_error_in_a_resolved_window_is_reported_once_in_its_place(error, pushes):
    """A batch error sits between its neighbours; an epoch error ends the epoch, reported once."""
    batch = np.zeros(3, np.float32)
    stream = _Stream([[("batch 0", batch, None), ("batch 1", None, error), ("batch 2", batch, None)]])
    channel = _RecordingChannel()
    own_pins = Pins(native.load().lib)  # Not the runtime's: nothing here is released by TF.
    checks = Checks(FlatSpec(tf.TensorSpec([None], tf.float32)), native=None, alignment=64)
    feeder = Feeder(stream, channel, checks, pins=own_pins)
    feeder.run()
    assert channel.errors == [(int(error.code), error.message)]
    assert len(channel.pushed) == pushes  # An epoch error drops what follows it.
    assert channel.closed and feeder.done.is_set()
    assert own_pins.count() == pushes
