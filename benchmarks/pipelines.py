"""The input pipelines compared, all over the same batches.

Every scenario makes ``N`` distinct batches (a dict ``{"x": features, "y":
int32 labels}``) once, puts them in Ray's object store with ``ray.put``, and
each pipeline below delivers those same batches, cycled, as a
``tf.data.Dataset`` whose elements hold every byte of a batch:

``ceiling``
    The batches as in-memory ``tf.Tensor`` s, no Ray at all:
    ``tf.data.Dataset.from_tensors(batch).repeat()`` for each of the ``N``
    batches, taken round-robin (``choose_from_datasets``). This is the
    reference: nothing can feed the consumer faster than tensors already in
    TensorFlow's memory. It cycles the same ``N`` distinct batches as the
    other pipelines, so it reads as much distinct memory per cycle as they do.
``ceiling_1``
    ``tf.data.Dataset.from_tensors(batches[0]).repeat()``: one batch, read
    over and over. Shown for reference only: a single 12 MB batch stays in
    the CPU's last-level cache, so this reads cache, not memory, and flatters
    the consumer by up to ~2x over anything that cycles distinct batches.
``from_generator``
    ``tf.data.Dataset.from_generator`` over a Python generator that cycles
    the refs and yields ``ray.get(ref)``, with ``output_signature`` set: the
    usual hand-written bridge. Python runs (under the GIL) for every batch.
``to_tf``
    Ray Data's ``Dataset.to_tf(feature_columns="x", label_columns="y",
    batch_size=rows)`` over a Ray Data dataset of the same batches, one Arrow
    block per batch, already in the object store before anything is timed
    (so Ray Data never re-batches across blocks and its production is not
    timed). Its epoch lists the ``N`` blocks over and over (by reference, not
    copied) for 4096 batches, so the timed run rarely crosses an epoch
    boundary and Ray Data's per-epoch start-up is not charged to it. (Far
    longer epochs slow Ray Data's executor down: 65536 blocks measured 4x
    slower than 4096 to 16384; a new epoch every ``N`` blocks, 2x slower.)
``tfray``
    ``tfray.Dataset.from_refs(refs).repeat()``: the ``N`` refs, one epoch
    each, repeated. Unlike ``to_tf`` above, tfray *does* pay its per-epoch
    start (a new iterator, hence a new feeder and look-ahead) every ``N``
    batches inside the timed run.
``tfray_1epoch``
    ``tfray.Dataset.from_refs(refs * K)``: the same ``N`` refs listed many
    times over in one list, so the timed run stays within one epoch, as
    ``to_tf`` does. A variant, to show the cost of tfray's epoch starts. A
    look-ahead window longer than ``N`` holds some refs twice, which Ray gets
    a little more cheaply than distinct ones. The ``@K`` suffix
    (``tfray_1epoch@16``, ``tfray@8``) sets ``max_inflight=K``.
``tfray_generators``
    ``tfray.Dataset.from_generators(fn, 2)``: two producers (Ray tasks, one
    per core) whose generators yield the ``N`` batches, producer ``s`` the
    batches ``s, s + 2, ...`` round and round, so that tfray's deterministic
    round-robin delivers them in the same order as the others. A producer
    takes its batches from the object store once (``ray.get`` of the refs,
    zero-copy) and yields them as they are: production is as cheap as it can
    be, and what remains is ``from_generators``' own path, Ray's put of each
    yielded batch included (a copy into a new object in the producer's
    process, or, under 100 KB, the batch sent inline to the trainer). Like
    ``tfray_1epoch`` it runs one long epoch (``TFRAY_1EPOCH_BATCHES``
    batches, then ``.repeat()``) rather than an epoch of ``N`` repeated:
    every epoch start launches new producer tasks, whose start-up would then
    be timed every ``N`` batches and hide the delivery path this row is
    about (the ``tfray`` row shows what epoch starts cost a list of refs).
``ray_loop``
    Ray's own loop over the same producers, no TensorFlow: the two
    streaming-generator tasks ``tfray_generators`` runs (the same function,
    the same backpressure as tfray's default gives them), read round-robin
    with ``ray.get(next(generator))``; every byte of each batch is summed
    with numpy, as ``consume`` sums it in TensorFlow (the sums' CPU time is
    kept: numpy's and TensorFlow's differ). The floor of the producers'
    path: what Ray itself delivers from those tasks.
``from_generator_tasks``
    ``tf.data.Dataset.from_generator`` over that same loop: the hand-written
    bridge a user would put between those tasks and TensorFlow.
    That long epoch is the dataset's second: an epoch of one batch runs
    first, as in training's epochs after the first, where each producer's
    backpressure follows the size of the batches read before (16 objects
    at 16 KB and 12 MB, 6 at 38 MB, in the 2 GB store here).
    The ``@K`` suffix sets ``max_inflight_per_producer=K`` (``@2``: the
    count of producers started before a batch was read).

What is not the same, by necessity: Ray Data keeps its own copy of the data
in its block format (Arrow tensor columns), made from the same arrays.
"""

import itertools
import time

import numpy as np
import tensorflow as tf

import ray

PIPELINES = (
    "ceiling",
    "ceiling_1",
    "from_generator",
    "to_tf",
    "tfray",
    "tfray_1epoch",
    "tfray_generators",
    "ray_loop",
    "from_generator_tasks",
)
TO_TF_EPOCH_BATCHES = 4096
TFRAY_1EPOCH_BATCHES = 60000
GENERATOR_PRODUCERS = 2


def make_batches(rows, x_shape, x_dtype, count, seed=0):
    """``count`` distinct batches ``{"x": [rows, *x_shape] x_dtype, "y": [rows] int32}``."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        shape = (rows, *x_shape)
        if np.dtype(x_dtype).kind == "f":
            x = rng.standard_normal(shape, dtype=np.float32).astype(x_dtype, copy=False)
        else:
            x = rng.integers(0, 256, shape, dtype=np.uint8).astype(x_dtype, copy=False)
        y = rng.integers(0, 1000, rows).astype(np.int32)
        batches.append({"x": x, "y": y})
    return batches


def batch_bytes(batch):
    return sum(a.nbytes for a in batch.values())


def element_spec(batch):
    """The spec every Ray-backed pipeline declares (batch dimension unknown)."""
    return {
        k: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)) for k, a in batch.items()
    }


def ceiling(batches):
    """The ``N`` batches as in-memory tensors, round-robin, no copies per element."""
    tensors = [{k: tf.constant(a) for k, a in b.items()} for b in batches]
    if len(tensors) == 1:
        return tf.data.Dataset.from_tensors(tensors[0]).repeat()
    return tf.data.Dataset.choose_from_datasets(
        [tf.data.Dataset.from_tensors(t).repeat() for t in tensors],
        tf.data.Dataset.range(len(tensors)).repeat(),
    )


def ceiling_1(batches):
    """One batch as an in-memory tensor, repeated (cache-resident if it fits)."""
    return tf.data.Dataset.from_tensors({k: tf.constant(a) for k, a in batches[0].items()}).repeat()


def from_generator(refs, spec):
    """``from_generator`` over ``ray.get`` of the refs, cycled forever."""

    def generate():
        for ref in itertools.cycle(refs):
            yield ray.get(ref)

    return tf.data.Dataset.from_generator(generate, output_signature=spec)


class RayDataSource:
    """A materialized Ray Data dataset of the batches: one Arrow block each.

    The blocks are made from the same arrays and put in the object store once,
    here, before anything is timed. ``to_tf(epoch_batches)`` gives a Ray Data
    dataset whose single epoch lists the ``N`` blocks over and over (by
    reference: no data is copied) and returns its ``to_tf``.

    Built like ``ray.data.from_blocks`` (which keeps one block per input and
    computes the metadata locally, with no tasks), except that the block refs
    are repeated; ``ray.data.from_blocks`` itself would ``ray.put`` every
    repetition anew. If Ray's internals move, this falls back to
    ``from_blocks`` of the ``N`` blocks, to_tf'd and ``.repeat()`` ed.
    """

    def __init__(self, batches):
        from ray.data.block import BlockAccessor, BlockMetadataWithSchema

        self.rows = len(batches[0]["y"])
        blocks = [BlockAccessor.batch_to_block(b) for b in batches]
        self._refs = [ray.put(b) for b in blocks]
        self._meta = [BlockMetadataWithSchema.from_block(b) for b in blocks]
        self._blocks = blocks  # Only for the fallback.
        self.fallback = False
        self.spec_x = element_spec(batches[0])["x"]
        self.spec_y = element_spec(batches[0])["y"]

    def _dataset(self, epoch_batches):
        try:
            from ray.data._internal.logical.interfaces import LogicalPlan
            from ray.data._internal.logical.operators.from_operators import FromBlocks
            from ray.data._internal.stats import DatasetStats
            from ray.data.context import DataContext
            from ray.data.dataset import MaterializedDataset

            repeats = -(-epoch_batches // len(self._refs))
            refs, meta = self._refs * repeats, self._meta * repeats
            op = FromBlocks(refs, meta)
            stats = DatasetStats(metadata={"FromBlocks": meta}, parent=None)
            context = DataContext.get_current().copy()
            return MaterializedDataset(LogicalPlan(op, context), context, stats), False
        except Exception:  # pragma: no cover - Ray internals changed.
            return ray.data.from_blocks(self._blocks), True

    def to_tf(self, epoch_batches, prefetch_batches=1):
        ds, self.fallback = self._dataset(epoch_batches)
        tf_ds = ds.to_tf(
            feature_columns="x",
            label_columns="y",
            batch_size=self.rows,
            prefetch_batches=prefetch_batches,
            feature_type_spec=self.spec_x,
            label_type_spec=self.spec_y,
        )
        return tf_ds.repeat()


def to_tf(source, epoch_batches=TO_TF_EPOCH_BATCHES, prefetch_batches=1):
    """Ray Data's ``to_tf`` over ``source`` (a :class:`RayDataSource`), repeated."""
    return source.to_tf(epoch_batches, prefetch_batches=prefetch_batches)


def tfray_dataset(refs, spec, max_inflight=None, one_epoch=False):
    """``tfray.Dataset.from_refs``; returns (the tfray dataset, the pipeline).

    ``one_epoch``: list the refs over and over (``TFRAY_1EPOCH_BATCHES`` in
    all) so that one epoch covers the run, instead of one epoch per ``N``.
    Either way the pipeline is ``.repeat()`` ed.
    """
    import tfray

    kwargs = {} if max_inflight is None else {"max_inflight": max_inflight}
    refs = list(refs)
    if one_epoch:
        refs = refs * -(-TFRAY_1EPOCH_BATCHES // len(refs))
    source = tfray.Dataset.from_refs(refs, element_spec=spec, **kwargs)
    return source, source.repeat()


def producer_fn(refs, producers=GENERATOR_PRODUCERS):
    """The producers' generator function: shard ``s`` yields ``refs[s::producers]`` round and round.

    ``TFRAY_1EPOCH_BATCHES / producers`` batches each. A closure, so that it
    pickles by value: Ray's workers need not import this module (nor
    TensorFlow) to run it.
    """
    refs = list(refs)
    per_producer = -(-TFRAY_1EPOCH_BATCHES // producers)

    def produce(shard):
        batches = ray.get(refs[shard::producers])
        for i in range(per_producer):
            yield batches[i % len(batches)]

    return produce


def tfray_generators(refs, spec, max_inflight_per_producer=None, producers=GENERATOR_PRODUCERS):
    """``tfray.Dataset.from_generators`` over the refs' batches; returns (tfray dataset, pipeline).

    The producers are ``producer_fn``'s; the pipeline is ``.repeat()`` ed,
    after an epoch of one batch.
    """
    import tfray

    kwargs = {}
    if max_inflight_per_producer is not None:
        kwargs["max_inflight_per_producer"] = max_inflight_per_producer
    source = tfray.Dataset.from_generators(
        producer_fn(refs, producers),
        producers,
        element_spec=spec,
        ray_remote_args={"num_cpus": 1},
        **kwargs,
    )
    # A first epoch of one batch, as training's epochs after the first: by
    # default each producer's backpressure follows the size of the batches
    # an earlier epoch read (those started before any was read get 2).
    for _ in source.take(1):
        pass
    return source, source.repeat()


def default_backpressure(batch):
    """The backpressure tfray's ``from_generators`` gives each producer of ``batch`` by default.

    Read from tfray's own rule (its producers' count of objects waiting
    unconsumed), so that Ray's loop runs its tasks as tfray does: where
    tfray pairs big batches, as many batches ahead as tfray's pairs hold.
    """
    from tfray._internal.sources import inflight, producer
    from tfray._internal.sources.base import default_budget

    count = inflight.Inflight()
    count.learn([batch])
    share = inflight.share(default_budget(), GENERATOR_PRODUCERS)
    size = producer.nbytes(batch)
    paired = size > producer.BUNDLE_BYTES // 2 and size <= count.pair_limit(share)
    return count.count(share) * (producer.PAIR if paired else 1)


class RayLoop:
    """Ray's own loop over ``producer_fn``'s streaming tasks (see ``ray_loop`` above).

    Each iterator starts the producers afresh and is read with
    ``consume(n)``, which returns the sum of every byte of ``n`` batches.
    """

    def __init__(self, refs, batch, producers=GENERATOR_PRODUCERS):
        self._fn = producer_fn(refs, producers)
        self._producers = producers
        self._options = {
            "num_returns": "streaming",
            # tfray's producers reserve no CPU either (sources/generators.py).
            "num_cpus": 0,
            "_generator_backpressure_num_objects": default_backpressure(batch),
        }

    def __iter__(self):
        return RayLoop.Iterator(
            [
                ray.remote(self._fn).options(**self._options).remote(s)
                for s in range(self._producers)
            ]
        )

    class Iterator:
        def __init__(self, generators):
            self._generators = generators
            self._turns = itertools.cycle(generators)
            # This thread's CPU seconds in the numpy sums: the consumer's own
            # share of the loop, which TensorFlow's sum in the other
            # pipelines costs differently (run.py reports both).
            self.sum_cpu_s = 0.0

        def __iter__(self):
            return self

        def __next__(self):
            """The producers' next batch, round-robin, as Ray's loop gets it."""
            return ray.get(next(next(self._turns)))

        def consume(self, n, light=False):
            """Sums every byte of ``n`` batches (``light``: reads one element of each)."""
            total = 0.0
            for batch in itertools.islice(self, n):
                if light:
                    for array in batch.values():
                        total += float(array.reshape(-1)[0])
                    continue
                start = time.thread_time()
                for array in batch.values():
                    # In the array's own dtype, as TensorFlow's reduce_sum adds.
                    total += float(np.add.reduce(array, axis=None, dtype=array.dtype))
                self.sum_cpu_s += time.thread_time() - start
            return total

        def __del__(self):
            for generator in self._generators:
                ray.cancel(generator)


def from_generator_tasks(refs, spec, batch):
    """``from_generator`` over Ray's loop of ``RayLoop``: the bridge a user writes for producers."""
    loop = RayLoop(refs, batch)

    def generate():
        yield from iter(loop)

    return tf.data.Dataset.from_generator(generate, output_signature=spec)
