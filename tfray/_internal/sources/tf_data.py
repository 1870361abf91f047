"""``from_tf_data``: the user's tf.data pipelines, one per shard, run as Ray producers.

Each shard's pipeline (``fn(shard)``, a ``tf.data.Dataset``) runs in a
``from_generators`` producer (pipeline.py holds the code it runs), so this
source is a ``GeneratorSource`` whose generator function iterates the
pipeline: placement, backpressure, bundles, stopping, ``deterministic``,
sharding, resume and retries are the same. What it adds is the spec: the
pipeline's own ``element_spec``, read from ``fn(shards[0])`` built in the
trainer (built, not run), and the wire form of its string and ragged
components (columns.py's codecs, as for Ray Data), which a ``map`` on the
trainer turns back into ``tf.string`` and ``tf.RaggedTensor``.
"""

import tensorflow as tf
from ray import cloudpickle

from tfray._internal.runtime import spec as spec_lib
from tfray._internal.sources import columns, generators, pipeline
from tfray._internal.sources.generators import GeneratorSource, shard_list

# By value, as producer.py: a producer process imports TensorFlow, not tfray.
cloudpickle.register_pickle_by_value(pipeline)

# Dataset.from_tf_data's options: from_generators' (``shards`` required).
OPTIONS = generators.OPTIONS


class Pipelines:
    """What ``Dataset(...)`` is handed for ``from_tf_data``: the user's ``fn``."""

    def __init__(self, fn):
        self.fn = fn


def _kind(spec):
    if isinstance(spec, tf.RaggedTensorSpec):
        return pipeline.RAGGED
    if isinstance(spec, tf.TensorSpec) and spec.dtype == tf.string:
        return pipeline.STRING
    return pipeline.DENSE


def _wire_leaves(element_spec, wire):
    """The wire parts of each leaf of ``element_spec`` (a part may be a tuple), in tf.nest order."""
    if isinstance(element_spec, dict):
        return [part for key in sorted(element_spec) for part in _wire_leaves(element_spec[key], wire[key])]
    if isinstance(element_spec, (tuple, list)):
        return [part for spec, w in zip(element_spec, wire) for part in _wire_leaves(spec, w)]
    return [wire]


class TfDataSource(GeneratorSource):
    """``fn(shard)`` tf.data pipelines, each run by a streaming Ray task per epoch."""

    kind = "from_tf_data"

    def __init__(self, fn, shards, *, element_spec=None, **options):
        if not callable(fn):
            raise TypeError(f"from_tf_data: fn must be callable, got {type(fn).__name__}")
        self._pipeline_fn = fn
        self._options = options
        if element_spec is None:
            # Built here, not run: its spec is the pipeline's own.
            element_spec = pipeline.built(fn, shard_list(self.kind, shards)[0]).element_spec
        self._codecs, kinds = [], []
        for path, spec in spec_lib.flatten(element_spec):
            try:
                self._codecs.append(columns.codec(path, spec))
            except TypeError as e:
                raise TypeError(f"from_tf_data: element_spec {e}") from None
            kinds.append(_kind(spec))
        producer_fn = pipeline.PipelineBatches(fn, element_spec, kinds, generators.takes_start(fn))
        super().__init__(producer_fn, shards, element_spec=element_spec, **options)
        if any(kind != pipeline.DENSE for kind in kinds):
            self.decode = self._decode

    def _wire_spec(self):
        wire = [codec.wire_spec for codec in self._codecs]
        return tf.nest.pack_sequence_as(self._element_spec, wire)

    @tf.autograph.experimental.do_not_convert
    def _decode(self, *parts):
        """The pipeline's element of a wire element (a function for ``map``)."""
        wire = parts if type(self._element_spec) is tuple else parts[0]
        leaves = _wire_leaves(self._element_spec, wire)
        decoded = [codec.decode(leaf) for codec, leaf in zip(self._codecs, leaves)]
        return tf.nest.pack_sequence_as(self._element_spec, decoded)

    def _user_fn(self):
        return self._pipeline_fn

    def _remake(self, shards, shard_numbers):
        options = {**self._options, "shard_numbers": shard_numbers, "whole_shards": self._whole_shards}
        return TfDataSource(self._pipeline_fn, shards, element_spec=self._element_spec, **options)

