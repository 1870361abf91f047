"""The code a ``from_tf_data`` producer runs: the user's tf.data pipeline, its elements as numpy.

Pickled by value, like producer.py, so a producer process imports
TensorFlow (once: Ray reuses a worker process for the next task) but never
tfray, which the nodes running producers need not have built.

A producer builds ``fn(shard)``'s pipeline and iterates it in eager mode,
in TensorFlow's own threads (its ``map``, ``interleave`` and ``prefetch``
run as they would locally). Each element reaches Ray's put as numpy views
of the tensors TensorFlow made (``as_numpy_iterator``: no copy), in the
wire form the trainer's op carries: a string component as its bytes and
row splits, a ragged one as its flat values and row splits (a ``map``
appended to the pipeline makes them, in TensorFlow's threads).

A batch that waits in a bundle is copied (producer.py), as any
generator's: held uncopied, its tensor's memory cannot be reused for the
next batch, and TensorFlow's allocation of fresh pages for it cost the
producer more than the copy (BUILD_NOTES.md).
"""

STRING = "string"
RAGGED = "ragged"
DENSE = "dense"


class PipelineBatches:
    """``fn(shard)``'s pipeline as a generator function of wire elements.

    Args:
        fn: the user's ``fn(shard)`` returning a ``tf.data.Dataset``.
        element_spec: the dataset's element spec, as the trainer has it:
            each shard's pipeline must agree with it.
        kinds: per leaf of ``element_spec`` (tf.nest order), how it
            crosses the op: ``DENSE``, ``STRING`` or ``RAGGED``.
        asks_start: whether ``fn`` takes ``start=``, the index of the first
            element its pipeline yields (a resumed epoch's shard).
    """

    def __init__(self, fn, element_spec, kinds, asks_start=False):
        self.fn = fn
        self.element_spec = element_spec
        self.kinds = kinds
        self.asks_start = asks_start

    def __call__(self, shard, start=0):
        """The shard's wire elements from element ``start`` on.

        A pipeline that cannot start there itself is passed over with
        tf.data's ``skip``, in the producer: its elements before ``start``
        are made (tf.data's own sources, ``interleave`` and ``flat_map``
        skip without making them; a ``map`` before them runs) and never put.
        """
        return _wire_elements(self.fn, shard, self.element_spec, self.kinds, start, self.asks_start)


def built(fn, shard, start=None):
    """``fn(shard)`` (``fn(shard, start=start)`` if given), which must be a ``tf.data.Dataset``."""
    import tensorflow as tf

    dataset = fn(shard) if start is None else fn(shard, start=start)
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"from_tf_data: fn must return a tf.data.Dataset; fn({shard!r}) returned a "
            f"{type(dataset).__name__}."
        )
    return dataset


def _pipeline(fn, shard, element_spec, start=0, asks_start=False):
    """``fn(shard)`` from element ``start``, checked: a ``tf.data.Dataset`` whose elements match ``element_spec``."""
    import tensorflow as tf

    dataset = built(fn, shard, start if asks_start else None)
    if start and not asks_start:
        dataset = dataset.skip(start)
    got = dataset.element_spec
    try:
        tf.nest.assert_same_structure(element_spec, got)
        matches = all(
            type(e) is type(g) and e.is_compatible_with(g)
            for e, g in zip(tf.nest.flatten(element_spec), tf.nest.flatten(got))
        )
    except (TypeError, ValueError):
        matches = False
    if not matches:
        raise TypeError(
            f"from_tf_data: fn({shard!r}) built a pipeline whose element_spec is {got}, "
            f"but the dataset's is {element_spec}; every shard's pipeline must have "
            "the same structure, dtypes and compatible shapes (pass element_spec to "
            "state one that covers them all)."
        )
    return dataset


def _encoder(element_spec, kinds):
    """A function for ``map``: an element in its wire form, or None if it is its own."""
    import tensorflow as tf

    if all(kind == DENSE for kind in kinds):
        return None

    def encode_leaf(kind, value):
        if kind == STRING:
            lengths = tf.cast(tf.strings.length(value), tf.int64)
            splits = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(lengths)], 0)
            return tf.io.decode_raw(tf.strings.reduce_join(value), tf.uint8), splits
        if kind == RAGGED:
            return (value.flat_values, *value.nested_row_splits)
        return value

    def encode(*parts):
        # tf.data passes a tuple element's components as arguments.
        element = parts if type(element_spec) is tuple else parts[0]
        leaves = tf.nest.flatten(element)
        wire = [encode_leaf(kind, leaf) for kind, leaf in zip(kinds, leaves)]
        return tf.nest.pack_sequence_as(element_spec, wire)

    return encode


def _wire_elements(fn, shard, element_spec, kinds, start, asks_start):
    import tensorflow as tf

    dataset = _pipeline(fn, shard, element_spec, start, asks_start)
    encode = _encoder(element_spec, kinds)
    if encode is not None:
        dataset = dataset.map(encode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # A generator built here, not a `yield` in this function: a wrong fn
    # fails the producer at once, before its first batch is asked for.
    return iter(dataset.as_numpy_iterator())
