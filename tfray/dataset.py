"""``tfray.Dataset``: a tf.data source over batches in Ray's object store."""

import weakref

import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops

from tfray._internal import native, sources, stats

_DEFAULT_MAX_INFLIGHT = 8


class Dataset(dataset_ops.DatasetSource):
    """A ``tf.data.Dataset`` whose elements are batches held in Ray's object store.

    Each batch is a numpy array, or a dict / tuple / list nest of them, with a
    numeric or bool dtype. The native source op hands the batch memory to
    TensorFlow as tensors without copying it (aligned, C-contiguous arrays) and
    without taking the GIL on any TensorFlow thread. Each new iterator is a new
    epoch.

    ``tfray.Dataset(source, ...)`` dispatches on ``source``: a list (or one-shot
    iterator) of ``ray.ObjectRef`` goes to :meth:`from_refs`.

    Args:
        source: what the batches come from (see above).
        element_spec: a nest of ``tf.TensorSpec`` matching each batch, or None
            to infer it from the first batch with the leading (batch) dimension
            unknown, so a short last batch is fine.
        max_inflight: batches resolved ahead of the consumer, per iterator.
            They stay pinned in the object store until TensorFlow is done.

    Examples:
        >>> refs = [make_batch.remote(i) for i in range(100)]
        >>> ds = tfray.Dataset(refs).map(lambda b: (b["image"], b["label"]))
        >>> model.fit(ds.prefetch(tf.data.AUTOTUNE), epochs=3)
    """

    def __init__(self, source, *, element_spec=None, max_inflight=_DEFAULT_MAX_INFLIGHT):
        self._name = None  # tf.data's op-name metadata; unnamed.
        sources.ensure_ray()
        self._source = sources.RefsSource(
            source, element_spec=element_spec, max_inflight=max_inflight
        )
        self._structure = self._source.element_spec
        key = sources.register(self._source)
        self._unregister = weakref.finalize(self, sources.unregister, key)
        variant = native.load().ops.tfray_dataset(
            source_key=tf.constant(key, dtype=tf.int64), **self._common_args
        )
        super().__init__(variant)

    @classmethod
    def from_refs(cls, refs, *, element_spec=None, max_inflight=_DEFAULT_MAX_INFLIGHT):
        """A dataset over batches that Ray tasks, actors or ``ray.put`` made.

        Args:
            refs: a list or tuple of ``ray.ObjectRef`` (replayable: every
                iterator reads all of them, in order, and ``cardinality()`` is
                known), or an iterator of them (read once; a second iterator
                raises ``FailedPreconditionError`` from ``next()``).
            element_spec: see :class:`Dataset`.
            max_inflight: see :class:`Dataset`.

        Returns:
            A ``tfray.Dataset``.
        """
        return cls(refs, element_spec=element_spec, max_inflight=max_inflight)

    @property
    def element_spec(self):
        return self._structure

    def stats(self):
        """Statistics of this dataset's recent iterators, oldest first.

        Returns:
            A list of ``tfray.IteratorStats``, one per iterator (epoch).
        """
        return [stats.of_feeder(f) for f in self._source.feeders()]
