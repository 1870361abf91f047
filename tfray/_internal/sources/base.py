"""What every source has: a spec, a bound, and the checks they share.

A source says what to read: its element spec, cardinality and channel
capacity, and a stream per epoch (see ``runtime/streams.py`` for what a
stream is). Its epochs' life (counting, offering, replaying, stats) is the
runtime registry's. One module per kind holds its source, its streams and
its argument checks: ``refs.py``, ``generators.py``, ``ray_data.py``.
"""

import logging
import numbers
import threading

import ray

from tfray._internal.runtime import ray_api, spec
from tfray._internal.runtime.lookahead import LookAhead

logger = logging.getLogger("tfray")

UNKNOWN_CARDINALITY = -2


def ensure_ray():
    """Starts a local Ray if none is running, and says so."""
    if not ray.is_initialized():
        ray.init()
        logger.warning(
            "tfray: Ray was not initialized; started a local Ray instance "
            "(call ray.init() first to choose its resources)."
        )


def as_int(name, value):
    """``value`` as an int: Python and numpy ints, and int scalar tensors."""
    if hasattr(value, "numpy"):  # A tf.Tensor.
        value = value.numpy()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return int(value)


def positive_int(name, value):
    """``value`` as an int >= 1 (numpy ints too), or a TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")
    return int(value)


class Source:
    """What every source has: a spec, a bound, and how to open an epoch."""

    cardinality = UNKNOWN_CARDINALITY
    replays = False  # Every epoch has the same batches: the next may start early.
    kind = "tfray.Dataset"  # What the user built, for messages.
    # A tf function from the op's dense element (``wire_spec``) to the
    # source's (``element_spec``), mapped over the op; None: they are one.
    decode = None
    # Whether its batches carry their work unit (bundles.BatchLabel), so a
    # checkpoint knows what each unit handed out and an epoch can start
    # each unit anywhere.
    has_units = False
    # On a worker's share of a source with units: the job's position
    # (distribute/position.py's Client), which names each epoch's
    # generation (``open(restored, position)`` -> ``(generation, units)``),
    # says what the job handed out of this share (``progress``), and
    # records what this worker hands out (``recorded(stream, generation)``).
    job = None

    def __init__(self, element_spec, capacity):
        self.session = ray_api.session()  # Its refs and producers live in this one.
        self._element_spec = element_spec  # None: learned on first use.
        self._flat_spec = None
        self.capacity = capacity  # Batches each epoch's channel holds.
        self._lock = threading.Lock()  # For a kind's own state (generators' first epoch).

    @property
    def element_spec(self):
        self._learn_spec()
        return self._element_spec

    @property
    def wire_spec(self):
        """The spec of what the op carries: dense tensors only."""
        self._learn_spec()
        return self._wire_spec()

    def _wire_spec(self):
        return self._element_spec

    @property
    def flat_spec(self):
        return self._learn_spec()

    def _learn_spec(self):
        if self._flat_spec is None:
            if self._element_spec is None:
                self._element_spec = self._infer_spec()
            self._flat_spec = spec.FlatSpec(self._wire_spec())  # Checks it, too.
        return self._flat_spec

    def spec_only(self):
        """The element spec, learned without keeping an epoch for a first iterator.

        For a source whose epochs others read (dynamic sharding's whole):
        ``from_generators`` otherwise keeps the epoch that learned the spec.
        """
        return self.element_spec

    def _infer_spec(self):
        raise NotImplementedError

    def open_epoch(self, *, deterministic, skip=0, progress=None, resume_info=None, taken=None):
        """A stream of one epoch, past its first ``skip`` items (see resume.py).

        ``progress``: the restored checkpoint's runtime.progress.Progress,
        or None. A source with units (generators) starts each unit there
        instead of passing over ``skip`` items; the others have none.
        ``resume_info``: what the restored checkpoint's epoch said of how it
        was made (its stream's ``resume_info``: the job's generation, the
        share, the interleave), or None.

        ``taken()``: how many of the items the stream hands on (batches and
        errors, in order) TensorFlow has taken; for a source whose work is
        done only once TF has it (dynamic sharding).
        """
        raise NotImplementedError

    def shard(self, num_shards, index):
        """A source of this one's share ``index`` of ``num_shards``."""
        raise TypeError(
            f"{type(self).__name__} cannot be sharded at the source; shard the "
            "data before it reaches tfray (for Ray Data: Ray Train's "
            "get_dataset_shard, or Dataset.split)."
        )

    def work_units(self):
        """For ``sharding="dynamic"``: ``(key, count, at_once)`` of its work units."""
        raise TypeError(
            f"sharding='dynamic' hands out refs or generator shards; {type(self).__name__} "
            "has neither (for Ray Data: Ray Train's get_dataset_shard, or "
            "Dataset.streaming_split, already hands out blocks on demand)."
        )

    def replay_bounds(self):
        """``(batches, bytes)`` a whole epoch must fit in to be kept to replay; None: never.

        Kept, an epoch stays pinned until the dataset is collected, so only
        one within what the look-ahead may pin at once qualifies (``bytes``
        None: no byte bound). Recording stops as soon as it passes them.
        """
        return None

    def lookahead(self):
        """The look-ahead of a new epoch: fixed, at the channel's capacity."""
        return LookAhead(fixed=self.capacity)

    def close(self):
        """The dataset is gone: stops whatever the source keeps running (subclasses)."""


def default_budget():
    """A quarter of this node's object store."""
    return int(ray.cluster_resources().get("object_store_memory", 0) // 4) or None
