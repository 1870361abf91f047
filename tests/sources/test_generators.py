"""tfray.Dataset.from_generators: parallel producers, ordered and bounded."""

import os
import threading
import time

import numpy as np
import pytest
import ray
import tensorflow as tf
from conftest import store_bytes_created, store_bytes_used, wait_until, without_prefetch

import tfray
from tfray._internal.sources import generators

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]

MB = 1 << 20


def counting(batches, rows=2):
    """A generator function: shard s yields batches filled with s*100 + i."""

    def gen(shard):
        for i in range(batches):
            yield {"x": np.full((rows, 3), shard * 100 + i, np.int64)}

    return gen


def endless_noting_its_end(closed, width):
    """A generator function that never ends by itself; each producer that returns writes an "x" to ``closed``."""

    def endless(shard):
        try:
            while True:
                yield np.zeros(width, np.int64)
        finally:
            with open(closed, "a") as f:
                f.write("x")

    return endless


def ids(ds):
    return [int(b["x"][0, 0]) for b in ds]


@ray.remote(num_returns="streaming", num_cpus=0)
def _stream(state):
    if state == "waiting":
        time.sleep(120)
    if state == "made after 50 ms":
        time.sleep(0.05)
    if state == "failed":
        raise ValueError("a producer's error")
    if state != "ended":
        yield 1


def test_a_poll_of_producers_streams_tells_what_ray_wait_tells_without_calling_it(monkeypatch):
    """The feeder's poll of producers' streams reads them (no ``ray.wait``, which costs 15-30x more).

    In each state a stream's next item can be in: not made yet, made, the
    stream's end, the producer's error.
    """
    from tfray._internal.runtime import ray_api

    streams = {state: _stream.remote(state) for state in ("waiting", "made", "ended", "failed")}
    try:
        settled = [g for state, g in streams.items() if state != "waiting"]
        ready, _ = ray.wait(settled, num_returns=len(settled), timeout=60, fetch_local=False)
        assert len(ready) == len(settled)
        expected = {state: ray.wait([g], timeout=0, fetch_local=False)[0] == [g] for state, g in streams.items()}
        assert expected == {"waiting": False, "made": True, "ended": True, "failed": True}

        def no_wait(*args, **kwargs):
            raise AssertionError("a poll of streams called ray.wait")

        monkeypatch.setattr(ray_api, "_wait", no_wait)
        got = {state: ray_api.poll([g], 0, fetch_local=False) == [g] for state, g in streams.items()}
        assert got == expected
        assert ray_api.poll(list(streams.values()), 0, fetch_local=False) == settled
    finally:
        ray.cancel(streams["waiting"])


def _pauses_on_this_thread(monkeypatch):
    """The pauses ``ray_api.poll`` makes on the calling thread, in order, as they are made."""
    from tfray._internal.runtime import ray_api

    me, pauses, sleep = threading.get_ident(), [], time.sleep

    def noting(seconds):
        if threading.get_ident() == me:
            pauses.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(ray_api.time, "sleep", noting)
    return pauses


def test_a_paced_poll_pauses_half_its_last_wait_within_its_bounds(monkeypatch):
    from tfray._internal.runtime import ray_api

    pace = ray_api.Pace()
    assert pace.first == ray_api._FIRST_PAUSE_S  # Nothing learned: poll's own start.
    pauses = _pauses_on_this_thread(monkeypatch)
    stream = _stream.remote("waiting")  # Never ready.
    try:
        assert ray_api.poll([stream], 0.05, fetch_local=False, pace=pace) == []
        assert pace.first == ray_api._FIRST_PAUSE_S  # A poll that found nothing teaches nothing.
        assert pauses[0] == ray_api._FIRST_PAUSE_S
        made = _stream.remote("made after 50 ms")
        assert ray_api.poll([made], 60, fetch_local=False, pace=pace) == [made]
        # Half its wait (over 50 ms): past the 10 ms an unpaced poll backs off to.
        assert ray_api._LAST_PAUSE_S < pace.first <= ray_api._PACED_PAUSE_S
        learned = pace.first
        del pauses[:]
        assert ray_api.poll([stream], 0.5, fetch_local=False, pace=pace) == []
        assert pauses[0] == learned  # It starts where the last wait said,
        assert pauses[1] == learned  # and stays there, not at 10 ms.
        assert ray_api.poll([made], 0, fetch_local=False, pace=pace) == [made]
        assert pace.first == learned  # Found at once: nothing waited, nothing learned.
    finally:
        ray.cancel(stream)
    pace.waited(0.004)
    assert pace.first == 0.002  # Shorter waits bring it down.
    pace.waited(0.0)
    assert pace.first == ray_api._FIRST_PAUSE_S
    pace.waited(10.0)
    assert pace.first == ray_api._PACED_PAUSE_S  # A stall's wait: an item is still seen within 50 ms.


def test_a_wait_that_outlasts_a_poll_is_learned_whole(monkeypatch):
    """A poll right after one that gave up goes on with its wait; one that starts later does not."""
    from tfray._internal.runtime import ray_api

    ready_at = [None]

    def ready_now(refs, fetch_local):
        return refs if time.monotonic() >= ready_at[0] else []

    monkeypatch.setattr(ray_api, "_ready_now", ready_now)

    def two_polls(gap):
        """Polls that give up at 20 ms, then (``gap`` s later) find an item made at 60 ms."""
        pace = ray_api.Pace()
        start = time.monotonic()
        ready_at[0] = start + 0.06
        assert ray_api.poll(["item"], 0.02, pace=pace) == []
        time.sleep(gap)
        resumed = time.monotonic()
        assert ray_api.poll(["item"], 5, pace=pace) == ["item"]
        return pace.first, start, resumed, time.monotonic()

    first, start, _, found = two_polls(0)
    assert first == pytest.approx((found - start) / 2, abs=0.002)  # The whole wait, not its last 40 ms.
    first, _, resumed, found = two_polls(0.015)
    assert first == pytest.approx((found - resumed) / 2, abs=0.002)  # Not right after: a wait of its own.


def test_a_feeder_waiting_on_a_steady_producer_asks_it_less_often(monkeypatch):
    """An object every 30 ms: polls that each started at 0.5 ms asked 7 times an object in vain.

    Paced by the last wait, 4 (3 pauses of 10 ms, and the turn's ask after
    each object). Each ask that finds nothing costs the trainer a pause, a
    wake-up and the GIL.
    """
    from tfray._internal.runtime import ray_api

    asks, ready_now = {True: 0, False: 0}, ray_api._ready_now

    def counting(refs, fetch_local):
        ready = ready_now(refs, fetch_local)
        asks[bool(ready)] += 1
        return ready

    def steady(shard):
        for i in range(15):
            time.sleep(0.03)
            yield np.full(640 << 10, i, np.float32)  # 2.5 MB: an object each (no pairs at 16 ahead).

    ds = tfray.Dataset.from_generators(
        steady, 1, element_spec=tf.TensorSpec([640 << 10], tf.float32), max_inflight_per_producer=16
    )
    assert sum(1 for _ in ds) == 15  # Warms the producer's worker up.
    monkeypatch.setattr(ray_api, "_ready_now", counting)
    assert sum(1 for _ in ds) == 15
    assert asks[True] >= 15, asks  # Each object, and the end.
    assert asks[False] <= 5.5 * asks[True], f"{asks[False] / asks[True]:.1f} asks in vain an object"


def test_deterministic_round_robin_is_the_same_every_epoch():
    """deterministic=True interleaves running shards in turn, a bundle at a time, every epoch alike."""
    ds = tfray.Dataset.from_generators(counting(4), 2, deterministic=True)
    first = ids(ds)
    # Each producer's bundles hold 1, 2, 4, ... batches (producer.py).
    assert first == [0, 100, 1, 2, 101, 102, 3, 103]
    assert ids(ds) == first
    assert ids(ds) == first


@pytest.mark.parametrize("batch_mb, order", [
    (3, [0, 100, 1, 2, 101, 102, 3, 4, 103, 104]),  # In pairs after the first.
    (5, [0, 100, 1, 101, 2, 102, 3, 103, 4, 104]),  # Alone: over the pair limit.
])
def test_batches_over_2_mb_go_in_pairs_that_fit_the_producers_share(batch_mb, order):
    """A pair holds two batches over half a bundle's 4 MB while FEWEST of them fit a producer's share.

    The test store (150 MB) gives each of 2 running producers 18.75 MB of
    its quarter: pairs of batches up to 4.7 MB (Inflight.pair_limit).
    deterministic=True takes turns a bundle at a time, so the order shows
    the bundles.
    """

    def gen(shard):
        for i in range(5):
            yield np.full(batch_mb * MB // 8, shard * 100 + i, np.int64)

    ds = tfray.Dataset.from_generators(gen, 2, deterministic=True)
    assert [int(batch[0]) for batch in ds] == order


def test_non_deterministic_delivers_everything_once():
    """deterministic=False takes whichever batch is ready; none lost or repeated."""
    ds = tfray.Dataset.from_generators(counting(5), [0, 1, 2], deterministic=False)
    got = ids(ds)
    assert sorted(got) == sorted(s * 100 + i for s in range(3) for i in range(5))
    # Each shard's own batches keep their order.
    for s in range(3):
        own = [v for v in got if v // 100 == s]
        assert own == sorted(own)


def late_first_shard():
    """A generator function like ``counting(3)`` whose shard 0 starts 3 s late."""

    def gen(shard):
        if shard == 0:
            time.sleep(3)
        for i in range(3):
            yield {"x": np.full((2, 3), shard * 100 + i, np.int64)}

    return gen


def test_deterministic_none_follows_tf_data_options():
    """deterministic=None follows tf.data.Options().deterministic, after an injected prefetch too."""
    ds = tfray.Dataset.from_generators(late_first_shard(), 2)
    round_robin = [0, 100, 1, 2, 101, 102]  # A bundle at a time: 1, then 2 batches.
    assert ids(ds) == round_robin  # No option set: deterministic.
    options = tf.data.Options()
    options.deterministic = True
    assert ids(ds.with_options(options)) == round_robin
    options.deterministic = False
    got = ids(ds.with_options(options).map(lambda b: b))
    assert sorted(got) == sorted(round_robin)
    assert got[0] == 100  # Whichever is ready first: shard 1, while shard 0 sleeps.


def test_shard_arguments_and_dispatch():
    """A list of shard arguments; tfray.Dataset(fn, shards=...) dispatches here."""

    def gen(path):
        yield {"x": np.full((1, 3), len(path), np.int64)}

    ds = tfray.Dataset(gen, shards=["a", "bb", "ccc"])
    assert ids(ds) == [1, 2, 3]
    assert ds.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY


def test_many_epochs():
    """Every new iterator reruns the producers: 10 epochs, all complete."""
    ds = tfray.Dataset.from_generators(counting(3), 2)
    for _ in range(10):
        assert sorted(ids(ds)) == [0, 1, 2, 100, 101, 102]
    assert len(ds.stats()) == 10


def test_producer_exception_names_shard_type_message_and_traceback():
    """A producer that raises: next() says which shard, what and where."""

    def gen(shard):
        yield {"x": np.zeros((1, 3), np.int64)}
        if shard == 1:
            raise KeyError(f"no such record in shard {shard}")
        yield {"x": np.ones((1, 3), np.int64)}

    ds = tfray.Dataset.from_generators(gen, 2, deterministic=True)
    it = iter(ds)
    next(it), next(it), next(it)  # shard 0 b0, shard 1 b0, shard 0 b1
    with pytest.raises(tf.errors.UnknownError) as info:
        next(it)
    message = info.value.message
    assert "shard 1 batch 1: the Ray task that produced it raised KeyError" in message
    assert "no such record in shard 1" in message
    assert "in gen" in message  # The producer's traceback.


def test_a_producer_error_comes_after_every_batch_it_made_before():
    """Batches bundled with the one before a raise still arrive, then the error, labelled by batch."""

    def gen(shard):
        for i in range(6):
            yield {"x": np.full((1, 3), i, np.int64)}
        raise KeyError("no such record")

    it = iter(tfray.Dataset.from_generators(gen, 1))
    # Bundles of 1, 2, then 3 cut short by the raise.
    assert [int(next(it)["x"][0, 0]) for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    with pytest.raises(tf.errors.UnknownError, match="shard 0 batch 6: .*KeyError.*no such record"):
        next(it)


def test_a_generator_that_refills_one_array_delivers_every_batch_as_yielded():
    """Bundled batches are kept as they were yielded, though the generator reuses its arrays."""

    def gen(shard):
        buffer = {"x": np.zeros((1, 3), np.int64)}
        for i in range(20):
            buffer["x"][:] = i
            yield buffer

    assert ids(tfray.Dataset.from_generators(gen, 1)) == list(range(20))


def test_killed_producer_is_retried_and_each_batch_arrives_once(tmp_path):
    """A producer whose process dies is retried by Ray: no loss, no duplicate."""
    marker = str(tmp_path / "died")

    def gen(shard):
        for i in range(6):
            if shard == 1 and i == 3 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)  # The worker process dies mid-epoch.
            yield {"x": np.full((1, 3), shard * 100 + i, np.int64)}

    spec = {"x": tf.TensorSpec([None, 3], tf.int64)}
    ds = tfray.Dataset.from_generators(gen, 2, element_spec=spec, deterministic=True)
    # Bundles of 1, 2 and 3 batches: shard 1 died making its third, which
    # its retry makes again, the first two skipped.
    assert ids(ds) == [0, 100, 1, 2, 101, 102, 3, 4, 5, 103, 104, 105]
    assert os.path.exists(marker)  # It did die.


@pytest.mark.parametrize("slow", ["first-attempt", "retry"])
def test_a_retry_that_runs_at_another_pace_delivers_each_batch_once(tmp_path, slow):
    """Ray's retry skips the objects its first attempt delivered: the retry must bundle alike.

    One attempt takes 0.1 s a batch, the other none. Were where a bundle
    closes to depend on timing, the attempts would bundle the same batches
    differently and the skip would drop batches (a slow first attempt) or
    repeat them (a slow retry). The first attempt dies before yielding
    batch 6 (slow) or 7: after bundles of 1, 2 and 4 batches, only the
    first two delivered, or all three.
    """
    marker = str(tmp_path / "died")
    dies_at = 6 if slow == "first-attempt" else 7

    def gen(shard):
        retry = os.path.exists(marker)
        for i in range(9):
            if retry == (slow == "retry"):
                time.sleep(0.1)
            if not retry and i == dies_at:
                open(marker, "w").close()
                time.sleep(0.5)  # Ray's report of the last bundle yielded reaches the trainer.
                os._exit(1)  # The worker process dies mid-epoch.
            yield {"x": np.full((1, 3), i, np.int64)}

    spec = {"x": tf.TensorSpec([None, 3], tf.int64)}
    ds = tfray.Dataset.from_generators(gen, 1, element_spec=spec)
    assert ids(ds) == list(range(9))
    assert os.path.exists(marker)  # It did die.


def test_a_producer_that_raises_is_not_retried(tmp_path):
    """A producer's exception ends its shard once: Ray does not run it again."""
    attempts = str(tmp_path / "attempts")

    def gen(shard):
        with open(attempts, "a") as f:
            f.write("x")
        yield np.full(2, shard, np.int64)
        raise ValueError("bad shard")

    ds = tfray.Dataset.from_generators(gen, 1, element_spec=tf.TensorSpec([None], tf.int64))
    it = iter(ds)
    assert int(next(it)[0]) == 0
    with pytest.raises(tf.errors.UnknownError, match="ValueError: bad shard"):
        next(it)
    with open(attempts) as f:
        assert f.read() == "x", "the producer ran again after raising"


def test_a_producer_whose_process_keeps_dying_is_retried_three_times(tmp_path):
    """max_retries defaults to 3: four attempts, then an error, not a hang."""
    attempts = str(tmp_path / "attempts")

    def gen(shard):
        with open(attempts, "a") as f:
            f.write("x")
        os._exit(1)
        yield np.zeros(2, np.int64)

    ds = tfray.Dataset.from_generators(gen, 1, element_spec=tf.TensorSpec([None], tf.int64))
    # Ray gives up on the task: its error in the shard's place, as any Ray error's.
    with pytest.raises(tf.errors.UnknownError, match="shard 0 batch 0: .*WorkerCrashedError"):
        next(iter(ds))
    with open(attempts) as f:
        assert f.read() == "xxxx", "expected the first run and 3 retries"


def test_backpressure_bounds_the_store_while_the_consumer_sleeps():
    """Producers pause: the store holds a bounded number of bundles, not all batches."""
    wait_until(lambda: store_bytes_used() == 0)
    shards, per_producer, batches = 2, 2, 100  # 200 MB if unbounded, more than the store.

    def gen(shard):
        for i in range(batches):
            yield np.full(MB // 8, shard * 100_000 + i, np.float64)  # 1 MB: 4 to a full bundle.

    # With the spec given, no producer runs to learn it: the store holds
    # this epoch's batches alone.
    ds = tfray.Dataset.from_generators(
        gen,
        shards,
        max_inflight_per_producer=per_producer,
        deterministic=True,
        element_spec=tf.TensorSpec([None], tf.float64),
    )
    created = store_bytes_created()
    it = iter(without_prefetch(ds))
    next(it)
    # The consumer sleeps while the producers run ahead (a bundle each at
    # least), and 3 s more: time to run on, were they not paused.
    wait_until(lambda: store_bytes_created() - created >= shards * MB, timeout=60)
    time.sleep(3)
    # What the producers made meanwhile bounds the store's peak, however
    # briefly it lasted (sampling the store's use could miss it): nothing
    # was freed but the first batch's bundle.
    made = store_bytes_created() - created
    # Ray's generator backpressure per producer, tfray's window, its channel
    # (same size) and the batch TF holds, each a bundle at most; generous for
    # bookkeeping.
    bound = (shards * per_producer * 3 + 2) * generators.producer.BUNDLE_BYTES
    assert made <= bound, f"the producers made {made / MB:.1f} MB, bound {bound / MB:.0f} MB"
    assert sorted(int(t[0]) for t in it) == sorted(
        s * 100_000 + i for s in range(shards) for i in range(batches)
    )[1:]


def test_dropping_an_iterator_stops_its_producers_and_frees_the_store(tmp_path, monkeypatch):
    """Dropped mid-epoch: producers return (their finally blocks run), the store empties.

    Never through ray.cancel: cancelling a task that is completing ends the
    trainer's process in Ray's core worker (see sources/stops.py).
    """
    wait_until(lambda: store_bytes_used() == 0)

    def never(*args, **kwargs):
        raise AssertionError("tfray cancelled a producer")

    monkeypatch.setattr(ray, "cancel", never)
    yields, closed = tmp_path / "yields", tmp_path / "closed"

    def endless(shard):
        i = 0
        try:
            while True:
                with open(yields, "a") as f:
                    f.write("x")
                yield np.full(MB // 8, i, np.float64)
                i += 1
        finally:
            with open(closed, "a") as f:
                f.write(str(shard))

    ds = tfray.Dataset.from_generators(endless, 2, element_spec=tf.TensorSpec([None], tf.float64))
    it = iter(ds)
    for _ in range(5):
        next(it)
    del it
    wait_until(lambda: ds.stats()[-1].finished)
    # Each producer ran its generator's finally: it returned, it was not killed.
    wait_until(lambda: closed.exists() and sorted(closed.read_text()) == ["0", "1"])
    made = yields.stat().st_size
    time.sleep(0.5)
    assert yields.stat().st_size == made, "a producer kept yielding after it returned"
    wait_until(lambda: store_bytes_used() == 0)


def test_an_epoch_that_stops_early_stops_its_producers(tmp_path):
    """take(n) over endless producers, epoch after epoch: each epoch's producers return."""
    closed = tmp_path / "closed"
    endless = endless_noting_its_end(closed, 4)
    ds = tfray.Dataset.from_generators(endless, 2, element_spec=tf.TensorSpec([4], tf.int64))
    for epoch in range(1, 4):
        assert len(list(ds.take(3))) == 3
        wait_until(lambda: closed.exists() and len(closed.read_text()) == 2 * epoch)


def test_producers_do_not_import_tensorflow():
    """A producer process runs the user's generator without importing TF or tfray."""

    def gen(shard):
        import sys

        yield np.array([int("tensorflow" in sys.modules), int("tfray" in sys.modules)])

    (imported,) = list(tfray.Dataset.from_generators(gen, 1))
    assert imported.numpy().tolist() == [0, 0]


def test_learning_the_spec_makes_no_batch_twice(tmp_path):
    """Without element_spec, the epoch that learned it serves the first iterator.

    Two workers' automatic shares (as under MultiWorkerMirroredStrategy):
    every batch is made once, and each is read once.
    """
    made = tmp_path / "made"

    def gen(shard):
        for i in range(4):
            with open(made, "a") as f:
                f.write(f"{shard}:{i}\n")
            yield np.full(3, shard * 10 + i, np.int64)

    got = []
    for worker in range(2):
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=worker)
        ds = tfray.Dataset.from_generators(gen, 6, input_context=context)
        got += [int(b[0]) for b in ds]
    assert sorted(got) == [s * 10 + i for s in range(6) for i in range(4)]
    lines = made.read_text().split()
    assert len(lines) == 24 and len(set(lines)) == 24, sorted(lines)


def test_an_unread_learning_epoch_is_stopped_with_its_dataset(tmp_path):
    """The epoch spec learning began stops when its dataset goes unread."""
    import gc

    closed = tmp_path / "closed"
    endless = endless_noting_its_end(closed, 2)
    ds = tfray.Dataset.from_generators(endless, 2)  # Learns the spec: producers run.
    assert ds.element_spec.shape.as_list() == [None]
    del ds
    gc.collect()
    wait_until(lambda: closed.exists() and len(closed.read_text()) == 2)


def test_inferring_specs_holds_no_cpu_for_later_datasets():
    """Datasets built before any is read (train, validation, test) all start.

    Learning a spec runs one producer to its first batch and stops it; a
    producer left paused would hold its CPU, and with 2 CPUs the third
    dataset's producers could never run.
    """
    datasets = [tfray.Dataset.from_generators(counting(3), 2) for _ in range(3)]
    for ds in datasets:
        assert sorted(ids(ds)) == [0, 1, 2, 100, 101, 102]


class _RemoteWithout:
    """A stand-in remote function whose Ray knows only the options it is given."""

    def __init__(self, known):
        self.known, self.given = known, None

    def options(self, **options):
        for key in options:
            if key not in self.known:
                raise ValueError(f"Invalid option keyword {key} for remote functions. ")
        self.given = options
        return self


def test_backpressure_option_is_passed_and_its_absence_warns(caplog):
    """Ray's private backpressure option is set; a Ray without it runs producers unpaused, with a warning."""
    options = {"num_cpus": 0, "num_returns": "streaming"}
    with_it = _RemoteWithout({"num_returns", "num_cpus", generators.BACKPRESSURE_OPTION})
    generators.with_backpressure(with_it, options, 3)
    assert with_it.given == dict(options, **{generators.BACKPRESSURE_OPTION: 3})
    without = _RemoteWithout({"num_returns", "num_cpus"})
    generators.with_backpressure(without, options, 3)
    assert without.given == options
    assert "producers are not paused" in caplog.text
    with pytest.raises(ValueError, match="num_gpus"):
        generators.with_backpressure(without, {"num_gpus": 1}, 3)  # Other refusals still raise.
