"""Which share of a source this process reads under ``tf.distribute``.

tf.data's auto-shard cannot shard a tfray source by files, so under AUTO it
would fall back to DATA: every worker would produce every batch and drop
(n-1)/n of them. tfray shards at the source instead (the native source also
sets ``auto_shard_policy=OFF`` so TF adds nothing on top). The share comes
from the ``tf.distribute.InputContext`` when one is given, else from
``TF_CONFIG``, read exactly as ``MultiWorkerMirroredStrategy`` reads it.

An auto-sharded source reports an unknown cardinality: the workers' shares
may differ by a batch, and Keras would otherwise run a different number of
steps on each worker and hang in a collective. With an unknown cardinality
each worker reads to its end of data, and TF's partial-batch handling (on for
every multi-worker strategy) ends the epoch on all workers together.
"""

import copy
import hashlib
import logging

import tensorflow as tf
from tensorflow.python.distribute import multi_worker_util

from tfray._internal import sources
from tfray._internal.distribute import position
from tfray._internal.distribute.dynamic import DynamicSource
from tfray._internal.sharding import DynamicSharding

logger = logging.getLogger("tfray")

SHARDING_MODES = ("auto", "off", "dynamic")
# TF_CONFIG task types that read input; MWMS numbers chief and workers
# together, and an evaluator forms a cluster of its own.
_INPUT_TASK_TYPES = ("chief", "worker", "evaluator")


def share_of(source, *, sharding, input_context, heartbeat):
    """The source this process reads, and which share of the whole it is.

    Args:
        source: a ``sources.Source``.
        sharding: ``"auto"``, ``"off"``, ``"dynamic"`` or a ``DynamicSharding``.
        input_context: a ``tf.distribute.InputContext`` or None.
        heartbeat: the runtime's Heartbeat, which renews dynamic sharding's leases.

    Returns:
        ``(source, share)``: ``source`` itself or its part, and
        ``(num_shards, index)`` when it is a part, else None.
    """
    check_options(sharding, input_context)
    if sharding == "off":
        return source, None
    if sharding == "dynamic" or isinstance(sharding, DynamicSharding):
        return dynamic_share(source, sharding, heartbeat)
    share = worker_share(input_context)
    if share is None:
        # One worker: its checkpoints say where the job is, unless it restores
        # one saved by a job of several (then it goes on recording the job's).
        source.job = job_position(source, (1, 0))
        return source, None
    num_shards, index = share
    try:
        part = source.shard(num_shards, index)
    except TypeError as e:
        # Ray Data and one-shot iterators: under auto these are taken to be
        # this worker's part already (e.g. Ray Train's get_dataset_shard).
        logger.info(
            "tfray: worker %d of %d reads its %s as given, unsharded (%s)",
            index,
            num_shards,
            type(source).__name__,
            e,
        )
        return source, None
    part.cardinality = sources.UNKNOWN_CARDINALITY
    part.job = job_position(source, share)
    logger.info("tfray: worker %d of %d reads its share at the source", index, num_shards)
    return part, share


def job_position(source, share):
    """This worker's client of the job's position of ``source`` (position.py), or None.

    For a source with units whose name is the same in every worker process;
    without one (a lambda), a restore resumes each worker's share at the
    chief's position of its own epoch.
    """
    if not source.has_units:
        return None
    key = source.work_units()[0]
    if key is None:
        return None
    num_shards, index = share
    name = "tfray-position-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    return position.Client(name, worker=index, workers=num_shards)


def check_options(sharding, input_context):
    """Raises a clear error for a bad ``sharding`` or ``input_context``."""
    if not isinstance(sharding, DynamicSharding) and sharding not in SHARDING_MODES:
        raise ValueError(
            f"sharding: expected one of {', '.join(map(repr, SHARDING_MODES))} or a "
            f"tfray.DynamicSharding, got {sharding!r}"
        )
    if input_context is None:
        return
    if not isinstance(input_context, tf.distribute.InputContext):
        raise TypeError(
            "input_context: expected the tf.distribute.InputContext that "
            "strategy.distribute_datasets_from_function passes to its function, "
            f"got {type(input_context).__name__}"
        )
    if sharding == "off":
        raise ValueError(
            "input_context is used only to shard: pass sharding='auto' with it, "
            "or leave it out to read the whole source on every worker."
        )


def dynamic_share(source, sharding, heartbeat):
    """``(source, None)``: a worker's share is decided as it reads (dynamic.py).

    An ``input_context`` does not matter: the coordinator hands each worker
    its units, whichever input pipeline it is.
    """
    options = sharding if isinstance(sharding, DynamicSharding) else DynamicSharding()
    return DynamicSource(source, options, heartbeat), None


def worker_share(input_context=None):
    """``(num_shards, index)`` for this process, or None when it reads all.

    Args:
        input_context: a ``tf.distribute.InputContext``; without one, the
            cluster in ``TF_CONFIG`` decides.

    Returns:
        A pair of ints with ``num_shards > 1``, or None.
    """
    if input_context is not None:
        share = (input_context.num_input_pipelines, input_context.input_pipeline_id)
    else:
        share = _cluster_share()
    if share is None or share[0] <= 1:
        return None
    return share


def _cluster_share():
    # The same resolver and numbering MultiWorkerMirroredStrategy uses by
    # default (its _initialize_multi_worker), so worker i here is the
    # strategy's input pipeline i.
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster_spec = resolver.cluster_spec()
    if not cluster_spec.as_dict():
        return None
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type not in _INPUT_TASK_TYPES or task_id is None:
        return None  # E.g. a parameter server: it reads no input.
    return (
        multi_worker_util.worker_count(cluster_spec, task_type),
        multi_worker_util.id_in_cluster(cluster_spec, task_type, task_id),
    )


def explain_policy(options, share):
    """Explains an auto-shard policy set on a tfray dataset, before TF acts on it.

    TF's auto-shard rewrite (grappler's auto_shard.cc) walks from the end of
    the pipeline to a file reader. It finds none in a tfray pipeline, so FILE
    fails with ``NotFoundError: Did not find a shardable source`` when the
    dataset is distributed, and its advice (switch to DATA) is wrong here.
    DATA keeps 1 in n of what reaches it: on top of tfray's share, each
    worker would train on 1/n of its share, 1/n^2 of the data.

    Args:
        options: the ``tf.data.Options`` given to ``with_options``.
        share: ``(num_shards, index)`` this dataset reads, or None.

    Returns:
        The options to apply: ``options``, or a copy with FILE replaced by
        OFF (and a warning that says what tfray does instead).
    """
    policy = options.experimental_distribute.auto_shard_policy
    policies = tf.data.experimental.AutoShardPolicy
    if policy == policies.FILE:
        if share is not None:
            instead = f"tfray already reads only worker {share[1]}'s share of {share[0]} at the source"
        else:
            instead = (
                "this dataset is read whole here (sharding='off', a source tfray cannot "
                "split, or no multi-worker cluster); to split it among workers use "
                "sharding='auto' or ds.shard(n, i), or AutoShardPolicy.DATA to have TF "
                "drop other workers' batches"
            )
        logger.warning(
            "tfray: auto_shard_policy=FILE cannot shard a tfray dataset (it reads no "
            "files: TF would fail with NotFoundError when distributing it), so it is "
            "set to OFF; %s.",
            instead,
        )
        replaced = copy.deepcopy(options)  # merge() would share sub-options.
        replaced.experimental_distribute.auto_shard_policy = policies.OFF
        return replaced
    if policy == policies.DATA and share is not None:
        logger.warning(
            "tfray: auto_shard_policy=DATA on top of tfray's sharding at the "
            "source: worker %d will read its share (1/%d of the data) and then "
            "drop all but 1/%d of it. Remove the policy (tfray already shards), "
            "or pass sharding='off' to let TF shard by data.",
            share[1],
            share[0],
            share[0],
        )
    return options
