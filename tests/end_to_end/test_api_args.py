"""Wrong arguments to every public entry point fail at the call, naming the argument.

Each case calls ``tfray.Dataset(...)``, a ``from_*`` constructor, ``shard`` or
``stats`` with a wrong type or value and expects a TypeError / ValueError
raised by that call (not a TF error from a later ``next()``, not a hang),
whose message names the argument and what was expected.
"""

import gc
import inspect
import types

import numpy as np
import pytest
import ray
import ray.data
import tensorflow as tf

import tfray

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(60)]

SPEC = tf.TensorSpec([None, 3], tf.float32)


def gen(shard):
    yield np.ones((2, 3), np.float32)


@pytest.fixture(scope="module")
def env(ray_session):
    refs = [ray.put(np.ones((2, 3), np.float32)) for _ in range(3)]
    yield types.SimpleNamespace(
        refs=refs, rds=ray.data.range(8), ds=tfray.Dataset(refs, element_spec=SPEC)
    )
    # Ray Data executors that failed calls started must go while Ray is up.
    gc.collect()


D = tfray.Dataset


def tf_pipeline(shard):
    return tf.data.Dataset.from_tensors(tf.ones([2, 3]))


# (id, call, exception, what the message must say)
CASES = [
    # tfray.Dataset(source, ...): the source's kind picks the constructor.
    ("source None", lambda e: D(None), TypeError, "from_refs: expected a list of ray.ObjectRef"),
    ("source int", lambda e: D(42), TypeError, "got int"),
    ("source str", lambda e: D("abc"), TypeError, "expected ray.ObjectRef items, got str"),
    ("source array", lambda e: D(np.arange(3)), TypeError, "expected ray.ObjectRef items"),
    ("refs with non-refs", lambda e: D([e.refs[0], 3]), TypeError, "ray.ObjectRef items, got int"),
    ("generator, no shards", lambda e: D(gen), TypeError, "shards: required for a generator"),
    (
        "refs with a Ray Data option",
        lambda e: D(e.refs, batch_size=2),
        TypeError,
        "takes the options of Dataset.from_refs (max_inflight, max_inflight_bytes), not batch_size",
    ),
    (
        "generator with a refs option",
        lambda e: D(gen, shards=2, max_inflight=3),
        TypeError,
        "options of Dataset.from_generators",
    ),
    ("ray data, type spec not a spec", lambda e: D(e.rds, feature_columns="id", feature_type_spec=3), TypeError, "feature_type_spec: expected a tf.TypeSpec"),
    ("element_spec str", lambda e: D(e.refs, element_spec="x"), TypeError, "element_spec element: expected a tf.TensorSpec, got str"),
    ("element_spec dtype", lambda e: D(e.refs, element_spec=tf.float32), TypeError, "got DType"),
    (
        "element_spec sparse",
        lambda e: D(e.refs, element_spec={"x": tf.SparseTensorSpec([None, 3], tf.float32)}),
        TypeError,
        "element_spec x: expected a tf.TensorSpec, got SparseTensorSpec",
    ),
    (
        "element_spec string dtype",
        lambda e: D(e.refs, element_spec=tf.TensorSpec([None], tf.string)),
        TypeError,
        "element_spec element: dtype string is not supported",
    ),
    ("element_spec empty", lambda e: D(e.refs, element_spec={}), ValueError, "element_spec: expected at least one"),
    ("sharding bogus", lambda e: D(e.refs, sharding="bogus"), ValueError, "sharding: expected one of"),
    ("input_context str", lambda e: D(e.refs, input_context="x"), TypeError, "input_context: expected"),
    # from_refs
    ("from_refs a generator", lambda e: D.from_refs(gen), TypeError, "from_refs: refs: expected a list or iterator of ray.ObjectRef, got function"),
    ("from_refs ray data", lambda e: D.from_refs(e.rds), TypeError, "from_refs: refs: expected"),
    ("max_inflight 0", lambda e: D.from_refs(e.refs, max_inflight=0), ValueError, "max_inflight: expected >= 1, got 0"),
    ("max_inflight float", lambda e: D.from_refs(e.refs, max_inflight=1.5), TypeError, "max_inflight: expected an int, got float"),
    ("max_inflight bool", lambda e: D.from_refs(e.refs, max_inflight=True), TypeError, "max_inflight: expected an int, got bool"),
    ("max_inflight str", lambda e: D.from_refs(e.refs, max_inflight="4"), TypeError, "max_inflight: expected an int, got str"),
    ("max_inflight_bytes <0", lambda e: D.from_refs(e.refs, max_inflight_bytes=-5), ValueError, "max_inflight_bytes: expected >= 1"),
    ("max_inflight_bytes float", lambda e: D.from_refs(e.refs, max_inflight_bytes=1e6), TypeError, "max_inflight_bytes: expected an int"),
    ("from_refs no refs", lambda e: D.from_refs([]), ValueError, "cannot infer element_spec from no refs; pass element_spec"),
    # from_tf_data
    ("tf_data fn int", lambda e: D.from_tf_data(3, 2), TypeError, "from_tf_data: fn: expected a function, got int"),
    ("tf_data fn not a dataset", lambda e: D.from_tf_data(lambda s: [s], 2), TypeError, "from_tf_data: fn must return a tf.data.Dataset; fn(0) returned a list"),
    ("tf_data shards bool", lambda e: D.from_tf_data(tf_pipeline, True), TypeError, "from_tf_data: shards must be an int or a list, got bool"),
    ("tf_data shards empty", lambda e: D.from_tf_data(tf_pipeline, []), ValueError, "from_tf_data: shards is empty"),
    ("producers_on bogus", lambda e: D.from_generators(gen, 2, element_spec=SPEC, producers_on="here"), ValueError, "producers_on: expected one of 'cluster', 'other_nodes', 'this_node', got 'here'"),
    ("placement_timeout_s str", lambda e: D.from_generators(gen, 2, element_spec=SPEC, placement_timeout_s="60"), TypeError, "placement_timeout_s: expected None or seconds (a number), got str"),
    ("placement_timeout_s zero", lambda e: D.from_tf_data(tf_pipeline, 2, placement_timeout_s=0), ValueError, "placement_timeout_s: expected more than 0 seconds, got 0"),
    ("tf_data deterministic str", lambda e: D.from_tf_data(tf_pipeline, 2, deterministic="yes"), TypeError, "deterministic: expected None or a bool"),
    (
        "tf_data string of rank 2",
        lambda e: D.from_tf_data(lambda s: tf.data.Dataset.from_tensors({"s": tf.constant([["a"]])}), 2),
        TypeError,
        "from_tf_data: element_spec s: tfray carries string columns of one string per row (shape [None])",
    ),
    # from_generators
    ("fn int", lambda e: D.from_generators(3, 2), TypeError, "from_generators: fn: expected a generator function, got int"),
    ("fn refs", lambda e: D.from_generators(e.refs, 2), TypeError, "from_generators: fn: expected a generator function, got list"),
    ("shards 0", lambda e: D.from_generators(gen, 0), ValueError, "shards: expected >= 1, got 0"),
    ("shards float", lambda e: D.from_generators(gen, 2.0), TypeError, "shards must be an int or a list, got float"),
    ("shards bool", lambda e: D.from_generators(gen, True), TypeError, "shards must be an int or a list, got bool"),
    ("shards empty", lambda e: D.from_generators(gen, []), ValueError, "shards is empty"),
    (
        "max_inflight_per_producer 0",
        lambda e: D.from_generators(gen, 2, element_spec=SPEC, max_inflight_per_producer=0),
        ValueError,
        "max_inflight_per_producer: expected >= 1, got 0",
    ),
    ("deterministic str", lambda e: D.from_generators(gen, 2, element_spec=SPEC, deterministic="yes"), TypeError, "deterministic: expected None or a bool"),
    ("ray_remote_args list", lambda e: D.from_generators(gen, 2, element_spec=SPEC, ray_remote_args=[1]), TypeError, "ray_remote_args: expected a dict, got list"),
    (
        "ray_remote_args unknown key",
        lambda e: D.from_generators(gen, 2, element_spec=SPEC, ray_remote_args={"bogus": 1}),
        ValueError,
        "ray_remote_args: Invalid option keyword bogus",
    ),
    (
        "ray_remote_args bad value",
        lambda e: D.from_generators(gen, 2, element_spec=SPEC, ray_remote_args={"num_cpus": "x"}),
        TypeError,
        "ray_remote_args: The type of keyword 'num_cpus'",
    ),
    # from_ray_data
    ("ray_ds refs", lambda e: D.from_ray_data(e.refs, batch_size=2), TypeError, "from_ray_data: ray_ds: expected a ray.data.Dataset or DataIterator, got list"),
    ("batch_size 0", lambda e: D.from_ray_data(e.rds, batch_size=0), ValueError, "batch_size: expected >= 1, got 0"),
    ("batch_size str", lambda e: D.from_ray_data(e.rds, batch_size="2"), TypeError, "batch_size: expected an int, got str"),
    ("feature_columns int", lambda e: D.from_ray_data(e.rds, batch_size=2, feature_columns=3), TypeError, "feature_columns: expected a column name"),
    ("label_columns empty", lambda e: D.from_ray_data(e.rds, batch_size=2, label_columns=[]), TypeError, "label_columns: expected a column name, a non-empty list"),
    ("label_columns non-str", lambda e: D.from_ray_data(e.rds, batch_size=2, label_columns=["id", 1]), TypeError, "label_columns: expected"),
    ("feature column missing", lambda e: D.from_ray_data(e.rds, batch_size=2, feature_columns="nope"), ValueError, "feature_columns: there's no column named 'nope' in the dataset; valid column names are ['id']"),
    ("drop_last str", lambda e: D.from_ray_data(e.rds, batch_size=2, drop_last="x"), TypeError, "drop_last: expected a bool, got str"),
    ("shuffle buffer -1", lambda e: D.from_ray_data(e.rds, batch_size=2, local_shuffle_buffer_size=-1), ValueError, "local_shuffle_buffer_size: expected >= 1"),
    ("shuffle seed str", lambda e: D.from_ray_data(e.rds, batch_size=2, local_shuffle_seed="x"), TypeError, "local_shuffle_seed: expected an int, got str"),
    ("prefetch_batches -1", lambda e: D.from_ray_data(e.rds, batch_size=2, prefetch_batches=-1), ValueError, "prefetch_batches: expected >= 0, got -1"),
    ("prefetch_batches str", lambda e: D.from_ray_data(e.rds, batch_size=2, prefetch_batches="x"), TypeError, "prefetch_batches: expected an int, got str"),
    ("ray data shard", lambda e: D.from_ray_data(e.rds, batch_size=2).shard(2, 0), TypeError, "cannot be sharded at the source"),
    # shard
    ("num_shards 0", lambda e: e.ds.shard(0, 0), ValueError, "num_shards: expected >= 1, got 0"),
    ("index too big", lambda e: e.ds.shard(2, 2), ValueError, "index: expected 0 <= index < 2, got 2"),
    ("index negative", lambda e: e.ds.shard(2, -1), ValueError, "index: expected 0 <= index < 2, got -1"),
    ("num_shards str", lambda e: e.ds.shard("2", 0), TypeError, "num_shards: expected an int, got str"),
    ("index str", lambda e: e.ds.shard(2, "0"), TypeError, "index: expected an int, got str"),
    ("index float", lambda e: e.ds.shard(2, 0.0), TypeError, "index: expected an int, got float"),
    ("num_shards None", lambda e: e.ds.shard(None, 0), TypeError, "num_shards: expected an int, got NoneType"),
    ("num_shards float tensor", lambda e: e.ds.shard(tf.constant(2.0), 0), TypeError, "num_shards: expected an int, got float32"),
    ("num_shards vector", lambda e: e.ds.shard(tf.constant([2]), 0), TypeError, "num_shards: expected an int, got ndarray"),
    (
        "one-shot refs shard",
        lambda e: D(iter(e.refs), element_spec=SPEC).shard(2, 0),
        TypeError,
        "a one-shot iterator of refs cannot be sharded; pass a list of refs",
    ),
    # DynamicSharding, the options of sharding="dynamic".
    ("dynamic name int", lambda e: tfray.DynamicSharding(name=3), TypeError, "DynamicSharding.name: expected a non-empty str or None, got 3"),
    ("dynamic name empty", lambda e: tfray.DynamicSharding(name=""), TypeError, "DynamicSharding.name: expected a non-empty str"),
    ("dynamic lease str", lambda e: tfray.DynamicSharding(lease_timeout_s="10"), TypeError, "DynamicSharding.lease_timeout_s: expected seconds, got str"),
    ("dynamic lease 0", lambda e: tfray.DynamicSharding(lease_timeout_s=0), ValueError, "DynamicSharding.lease_timeout_s: expected > 0, got 0"),
    # stats and IteratorStats take no arguments.
    ("stats arg", lambda e: e.ds.stats(1), TypeError, "stats() takes 1 positional argument"),
    ("verdict arg", lambda e: tfray.IteratorStats(*[0] * 17).verdict(1), TypeError, "verdict() takes 1 positional argument"),
]


@pytest.mark.parametrize(
    "call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_wrong_argument_fails_at_the_call(env, call, error, message):
    """The call itself raises TypeError / ValueError saying what was wrong."""
    with pytest.raises(error) as info:
        call(env)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "num_shards, index",
    [(np.int64(2), np.int32(1)), (tf.constant(2), tf.constant(1, tf.int64)), (2, 1)],
    ids=["numpy ints", "int tensors", "ints"],
)
def test_shard_takes_any_integer(env, num_shards, index):
    """shard() takes Python, numpy and scalar-tensor ints alike."""
    got = [b.numpy() for b in env.ds.shard(num_shards, index)]
    assert len(got) == 1  # Batches 1 of 0..2.


def test_the_valid_calls_behind_these_cases_work(env):
    """The same calls with right arguments succeed: each case fails for its argument."""
    assert len(list(D(env.refs, max_inflight=2))) == 3
    assert len(list(D.from_refs(env.refs, max_inflight_bytes=1 << 20))) == 3
    def local_gen(shard):  # Nested: pickled by value, Ray workers cannot import tests.
        yield np.ones((2, 3), np.float32)

    ds = D.from_generators(
        local_gen, [0, 1], max_inflight_per_producer=1, deterministic=True, ray_remote_args={"num_cpus": 1}
    )
    assert len(list(ds)) == 2
    ds = D.from_ray_data(
        env.rds,
        batch_size=4,
        feature_columns="id",
        drop_last=True,
        local_shuffle_buffer_size=4,
        local_shuffle_seed=np.int64(1),
        prefetch_batches=0,
    )
    assert sorted(np.concatenate([b.numpy() for b in ds]).tolist()) == list(range(8))
    stats = env.ds.stats()
    assert all(isinstance(s, tfray.IteratorStats) for s in stats)
    assert tfray.IteratorStats(*[0] * 17).verdict().startswith("idle")


def test_counts_take_numpy_ints(env):
    """Counts given as numpy ints (e.g. from a config array) work like ints."""
    assert len(list(D(env.refs, max_inflight=np.int32(2)))) == 3

    def local_gen(shard):  # Nested: pickled by value.
        yield np.ones((2, 3), np.float32)

    ds = D.from_generators(local_gen, np.int64(2), max_inflight_per_producer=np.int64(1), element_spec=SPEC)
    assert len(list(ds)) == 2


def test_a_function_that_returns_instead_of_yielding_is_refused():
    """A ``def`` that returns a batch is refused at construction; a lambda at its first batch."""

    def returns(shard):
        return np.zeros((2, 3), np.float32)

    with pytest.raises(TypeError, match=r"fn must be a generator function \(use `yield`\).*returns"):
        tfray.Dataset.from_generators(returns, 2)
    ds = tfray.Dataset.from_generators(
        lambda shard: np.zeros((2, 3), np.float32), 2, element_spec=tf.TensorSpec([3], tf.float32)
    )
    with pytest.raises(tf.errors.UnknownError, match=r"generator function \(use `yield`\).*returned a ndarray"):
        next(iter(ds))
    # A lambda that returns a generator is fine.
    ds = tfray.Dataset.from_generators(
        lambda shard: (np.full(3, shard, np.float32) for _ in range(2)), 2, element_spec=tf.TensorSpec([3], tf.float32)
    )
    assert len(list(ds)) == 4


def test_pickling_a_dataset_says_what_to_send_instead():
    """``pickle.dumps(ds)`` is a TypeError that says a dataset lives in its process."""
    import pickle

    ds = tfray.Dataset([ray.put(np.zeros(3, np.float32))])
    with pytest.raises(TypeError, match="lives in the process that built it.*Send what builds it"):
        pickle.dumps(ds)


@pytest.mark.parametrize("kind", ["from_refs", "from_generators", "from_ray_data"])
def test_the_constructor_takes_the_options_of_the_one_it_dispatches_to(env, kind):
    # tfray.Dataset(source, **options) names, when refusing an option, the
    # options it takes for that kind: exactly those of the public constructor.
    source = {"from_refs": env.refs, "from_generators": gen, "from_ray_data": env.rds}[kind]
    with pytest.raises(TypeError) as refused:
        D(source, shards=2, not_an_option=1) if kind == "from_generators" else D(source, not_an_option=1)
    listed = str(refused.value).split(f"Dataset.{kind} (")[1].split(")")[0].split(", ")
    common = {"element_spec", "sharding", "input_context"}
    params = list(inspect.signature(getattr(D, kind)).parameters)[1:]
    assert listed == [p for p in params if p not in common]
