"""``tfray.Dataset``: a tf.data source over batches in Ray's object store."""

import weakref

import ray
import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops

from tfray._internal import sources
from tfray._internal.distribute import auto as distribute
from tfray._internal.runtime import native, runtime, stats
from tfray._internal.sources import generators, ray_data, tf_data
from tfray.stats import IteratorStats


def _is_ray_data(source):
    module = type(source).__module__
    if not module.startswith("ray.data"):
        return False
    import ray.data

    return isinstance(source, (ray.data.Dataset, ray.data.DataIterator))


class Dataset(dataset_ops.DatasetSource):
    """A ``tf.data.Dataset`` whose elements are batches made by Ray.

    Each batch is a numpy array, or a dict / tuple / list nest of them, with a
    numeric or bool dtype. The native source op hands the batch memory to
    TensorFlow as tensors without copying it (aligned, C-contiguous arrays) and
    without taking the GIL on any TensorFlow thread. Each new iterator is a new
    epoch.

    ``tfray.Dataset(source, ...)`` dispatches on ``source``:

    - ``ray.ObjectRef``\\ s (a list, or a one-shot iterator): :meth:`from_refs`;
    - a generator function with ``shards=...``: :meth:`from_generators`;
    - a Ray Data ``Dataset`` or ``DataIterator`` (``to_tf``'s keyword options):
      :meth:`from_ray_data`;
    - tf.data pipelines run on the cluster: :meth:`from_tf_data` (only).

    Args:
        source: what the batches come from (see above).
        element_spec: a nest of ``tf.TensorSpec`` matching each batch, or None
            to infer it from the first batch, with the leading (batch)
            dimension unknown so a short last batch is fine.
        sharding: how workers of a ``tf.distribute`` cluster split the
            source. ``"auto"`` (the default): with ``input_context``, read
            its share ``(num_input_pipelines, input_pipeline_id)``; else, in
            a worker of a multi-worker ``TF_CONFIG`` cluster, read that
            worker's share as ``MultiWorkerMirroredStrategy`` numbers it;
            else read everything. The share is read at the source, like
            :meth:`shard` (nothing is produced to be discarded), and its
            cardinality is unknown so that all workers end each epoch
            together. Ray Data and one-shot iterators are read as given
            (taken to be this worker's part already). ``"off"``: every
            worker reads everything. ``"dynamic"`` (or a
            :class:`tfray.DynamicSharding` with options): workers that build
            the same dataset take its work units (refs, or generator shards)
            from one coordinator actor as they go, so a slow worker takes
            less; each epoch every unit is read once (a worker that dies
            leaves its unfinished units to the others).
        input_context: the ``tf.distribute.InputContext`` that
            ``strategy.distribute_datasets_from_function`` passes to its
            function, or None.
        **options: the keyword options of the constructor dispatched to.

    Examples:
        >>> refs = [make_batch.remote(i) for i in range(100)]
        >>> ds = tfray.Dataset(refs).map(lambda b: (b["image"], b["label"]))
        >>> model.fit(ds.prefetch(tf.data.AUTOTUNE), epochs=3)
    """

    def __init__(self, source, *, element_spec=None, sharding="auto", input_context=None, **options):
        self._name = None  # tf.data's op-name metadata; unnamed.
        sources.ensure_ray()
        # shard() shards the whole source: an explicit share replaces the
        # automatic one rather than splitting it again.
        self._whole = _make_source(source, element_spec, options)
        self._source, self._share = self._whole, None  # shard() sets _share.
        if not isinstance(source, sources.Source):  # shard() made it: as is.
            self._source, self._share = distribute.share_of(
                self._whole,
                sharding=sharding,
                input_context=input_context,
                heartbeat=runtime.get().heartbeat,
            )
        self._structure = self._source.wire_spec
        registry = runtime.get().registry
        key = self._key = registry.register(self._source)
        self._unregister = weakref.finalize(self, registry.unregister, key)
        variant = native.load().ops.tfray_dataset(
            source_key=tf.constant(key, dtype=tf.int64), **self._common_args
        )
        self._wire = None
        if self._source.decode is not None:
            # The op carries dense tensors; a map makes the source's types
            # (strings, ragged tensors) of them.
            self._wire = _Wire(variant, self._structure)
            self._decoded = self._wire.map(self._source.decode)
            variant = self._decoded._variant_tensor
        self._structure = self._source.element_spec
        super().__init__(variant)

    def __reduce__(self):
        raise TypeError(
            "a tfray.Dataset cannot be pickled: it lives in the process that built it "
            "(its graph names a source registered there, and its batches are pinned "
            "there). Send what builds it instead (the refs, the generator function "
            "and shards, or the Ray Data dataset) and call tfray.Dataset(...) in the "
            "process that trains."
        )

    def _inputs(self):
        return [] if self._wire is None else [self._wire]

    @property
    def source_key(self):
        """The key this dataset's source is registered under in this process.

        Its graph carries it (the source op's ``source_key`` input) in place
        of the source itself; the runtime's registry holds the source's
        epochs under it.
        """
        return self._key

    @classmethod
    def from_refs(
        cls,
        refs,
        *,
        element_spec=None,
        max_inflight=None,
        max_inflight_bytes=None,
        sharding="auto",
        input_context=None,
    ):
        """A dataset over batches that Ray tasks, actors or ``ray.put`` made.

        Args:
            refs: a list or tuple of ``ray.ObjectRef`` (replayable: every
                iterator reads all of them, in order, and ``cardinality()`` is
                known), or an iterator of them (read once; a second iterator
                raises ``FailedPreconditionError`` from ``next()``).
            element_spec: see :class:`Dataset`.
            max_inflight: batches resolved ahead of the consumer, per
                iterator (pinned in the object store until TensorFlow is done
                with them). None (the default) adapts it: it starts at 2 and
                doubles whenever TensorFlow had to wait for input, up to 4096
                (within ``max_inflight_bytes``).
            max_inflight_bytes: with ``max_inflight=None``, the object-store
                bytes the batches resolved ahead may pin (they are counted
                twice: in resolution and queued). None: a quarter of the
                node's object store.
            sharding: see :class:`Dataset`.
            input_context: see :class:`Dataset`.

        Returns:
            A ``tfray.Dataset``.
        """
        _require_kind("from_refs", "refs", refs)
        common = dict(element_spec=element_spec, sharding=sharding, input_context=input_context)
        return cls(refs, **common, max_inflight=max_inflight, max_inflight_bytes=max_inflight_bytes)

    @classmethod
    def from_generators(
        cls,
        fn,
        shards,
        *,
        element_spec=None,
        sharding="auto",
        input_context=None,
        max_inflight_per_producer=None,
        deterministic=None,
        ray_remote_args=None,
        producers_on="cluster",
        placement_timeout_s=None,
    ):
        """A dataset over batches that generator functions yield, in parallel.

        Each epoch runs ``fn(shard)`` for every shard as a streaming Ray task
        (a producer), whose batches go straight into the object store while
        the trainer trains. Dropping an iterator stops its producers.

        Args:
            fn: a generator function ``fn(shard)`` yielding batches (the forms
                ``from_refs`` takes). It runs on Ray workers: it must pickle.
                One that also takes ``start`` (``fn(shard, start=0)``, the
                index of the shard's first batch to yield) lets an epoch
                restored from a checkpoint begin each shard where it was;
                any other is run from the shard's start and its batches
                before that point are dropped in its producer.
            shards: an int N (shards ``0..N-1``) or a list of per-shard arguments.
            element_spec: see :class:`Dataset`. When None, the first epoch's
                producers start at construction and the first batch gives the
                spec; that running epoch serves the first iterator.
            sharding: see :class:`Dataset`; a worker's share is its shards
                ``index::num_shards``.
            input_context: see :class:`Dataset`.
            max_inflight_per_producer: bundles a producer may have waiting in
                the object store before it pauses (Ray's generator
                backpressure). A producer puts consecutive batches in the store
                together, 1, 2, 4, ... up to 256 in a bundle and at most 4 MB;
                batches over 2 MB and up to 16 MB go in pairs, or alone where
                two pairs (this many, if set) would not fit a producer's share
                of the store (a quarter of it over the running producers). tfray
                also resolves up to this many bundles per producer ahead of the
                consumer. None (the default): as many as fit in 256 MB per
                producer and in a quarter of the object store over the running
                producers, 2 to 16, from the size of the first batch an epoch
                reads (2 for producers that start before one is read).
            deterministic: True interleaves shards round-robin, a bundle at a
                time (the same order every epoch for deterministic
                generators); False takes whichever bundle is ready first;
                None follows ``tf.data.Options().deterministic`` (default True).
            ray_remote_args: options for the producer tasks, e.g.
                ``{"num_cpus": 1, "max_retries": 3}``. Producers reserve no
                CPU whatever ``num_cpus`` says (it sets how many run at once).
                Ray's own placement here (``scheduling_strategy``,
                ``placement_group``, ``resources``, ``label_selector``)
                replaces tfray's.
            producers_on: the nodes producers run on: ``"cluster"`` (the
                default) every alive node that offers CPUs, in proportion to
                its CPUs, so a node started with ``--num-cpus=0`` runs none;
                ``"other_nodes"`` those but this process's node (the
                trainer's); ``"this_node"`` this process's node alone.
            placement_timeout_s: producers that ask for resources no alive
                node offers (``ray_remote_args``: GPUs, custom resources,
                memory, labels, a node) wait for one to join, as Ray's tasks
                do, with a warning a minute and ``stats()`` saying so. With
                seconds here, an epoch whose producers waited that long
                fails instead, with ``tf.errors.UnavailableError`` from
                ``next()``. None (the default): wait.

        Returns:
            A ``tfray.Dataset`` of unknown cardinality.

        Examples:
            >>> def read_shard(shard):
            ...     for i in range(10):
            ...         yield {"x": np.full((32, 8), shard, np.float32)}
            >>> ds = tfray.Dataset.from_generators(read_shard, 4)
        """
        _require_kind("from_generators", "fn", fn)
        return cls(fn, **_producers_args(locals()))

    @classmethod
    def from_tf_data(
        cls,
        fn,
        shards,
        *,
        element_spec=None,
        sharding="auto",
        input_context=None,
        max_inflight_per_producer=None,
        deterministic=None,
        ray_remote_args=None,
        producers_on="cluster",
        placement_timeout_s=None,
    ):
        """A dataset over the batches of tf.data pipelines run on the Ray cluster.

        ``fn(shard)`` builds a ``tf.data.Dataset``: your own input pipeline
        (``list_files``, ``interleave``, ``map(..., num_parallel_calls=AUTOTUNE)``,
        ``batch``). Each epoch runs every shard's pipeline in a producer, a
        streaming Ray task as in :meth:`from_generators`, whose batches go
        through the object store and reach TensorFlow here without a copy.
        A producer process imports TensorFlow once and keeps it for the next
        shards it runs; it needs neither tfray nor its native library.

        The element spec is the pipeline's own: ``fn(shards[0])`` is built
        here (not run) to read it, so ``fn`` must also work in this process.
        ``tf.string`` components of shape ``[batch]`` and ``tf.RaggedTensor``
        components cross the object store as bytes and row splits, copied
        once, and are rebuilt by a ``map`` here, as for :meth:`from_ray_data`.

        Args:
            fn: ``fn(shard)`` returning a ``tf.data.Dataset`` whose elements are
                batches. It runs on Ray workers: it must pickle. One that
                also takes ``start`` (``fn(shard, start=0)``) builds the
                pipeline from element ``start`` on, for an epoch restored
                from a checkpoint; any other gets tf.data's ``skip``.
            shards: an int N (shards ``0..N-1``) or a list of per-shard
                arguments (e.g. lists of file names).
            element_spec: see :class:`Dataset`; None: the pipeline's own.
                Every shard's pipeline must match it.
            sharding: see :class:`Dataset`; a worker's share is its shards
                ``index::num_shards``.
            input_context: see :class:`Dataset`.
            max_inflight_per_producer: see :meth:`from_generators`.
            deterministic: see :meth:`from_generators` (the order of the shards'
                batches; each pipeline's own order is its options').
            ray_remote_args: options for the producer tasks, e.g.
                ``{"num_cpus": 4}``: a producer's pipeline runs in
                TensorFlow's own threads, so say how many CPUs one uses.
            producers_on: see :meth:`from_generators`.
            placement_timeout_s: see :meth:`from_generators`.

        Returns:
            A ``tfray.Dataset`` of unknown cardinality.

        Examples:
            >>> def pipeline(shard):
            ...     files = tf.data.Dataset.list_files(f"/data/train-{shard}-*.jpg", shuffle=False)
            ...     return files.map(decode, num_parallel_calls=tf.data.AUTOTUNE).batch(64)
            >>> ds = tfray.Dataset.from_tf_data(pipeline, 8)
        """
        if not callable(fn):
            raise TypeError(f"from_tf_data: fn: expected a function, got {type(fn).__name__}")
        return cls(tf_data.Pipelines(fn), **_producers_args(locals()))

    @classmethod
    def from_ray_data(
        cls,
        ray_ds,
        feature_columns=None,
        label_columns=None,
        *,
        additional_columns=None,
        prefetch_batches=1,
        batch_size=1,
        drop_last=False,
        local_shuffle_buffer_size=None,
        local_shuffle_seed=None,
        feature_type_spec=None,
        label_type_spec=None,
        additional_type_spec=None,
        element_spec=None,
        sharding="auto",
        input_context=None,
    ):
        r"""A drop-in for ``ray_ds.to_tf(...)``, fed through tfray's op.

        It takes ``to_tf``'s arguments, in its order, with its defaults, and
        gives its element spec (``TensorSpec``\ s named after their
        columns), its batches in its order and its errors for unknown
        columns. Elements are ``(features, labels)``, or ``(features, labels,
        additional)``, each a tensor when its columns are a name and a dict
        when a list. tfray also takes ``label_columns=None`` (elements are
        ``features`` alone) and ``feature_columns=None`` (every column).

        Column types, as ``to_tf`` types them from the schema: numeric, bool
        and fixed-shape tensor columns are ``tf.Tensor``\ s, and those of a
        batch that lies in one block reach TF without a copy (where aligned;
        a batch spanning blocks is gathered in one copy). String and binary
        columns are ``tf.string``; list and variable-shaped tensor columns
        are ``tf.RaggedTensor``\ s (every dimension but the batch's ragged).
        Those, and casts that a ``*_type_spec`` asks for, are copied once and
        counted in ``stats()``.

        Nothing runs at construction: the spec comes from the schema (a
        pipeline whose schema Ray Data cannot tell without running it, e.g.
        after ``map_batches``, runs to its first block to learn it, as for
        ``to_tf``), and each iterator starts one streaming execution of the
        dataset when first read. An empty dataset gives no batches.

        Args:
            ray_ds: a ``ray.data.Dataset`` or ``ray.data.DataIterator`` (e.g.
                ``ray.train.get_dataset_shard("train")``).
            feature_columns: a column name, a list of names, or None (all).
            label_columns: a column name, a list of names, or None (none).
            additional_columns: a column name, a list of names (e.g. sample
                weights), or None: a third part of each element.
            prefetch_batches: as in ``to_tf`` (Ray Data's look-ahead, where
                Ray Data batches: a ``DataIterator`` or local shuffling).
            batch_size: rows per batch; None: one batch per block.
            drop_last: drop a last batch shorter than ``batch_size``.
            local_shuffle_buffer_size: as in ``to_tf``.
            local_shuffle_seed: as in ``to_tf``.
            feature_type_spec: the ``tf.TypeSpec`` of the features (a dict of
                them for a list of columns), or None: from the schema. A
                dtype that differs from the data's casts it. Unlike
                ``to_tf``, a spec given for one group is kept when another
                group's is left to the schema.
            label_type_spec: likewise for the labels.
            additional_type_spec: likewise for ``additional_columns``.
            element_spec: the whole element's spec, replacing the above.
            sharding: see :class:`Dataset`; Ray Data is read as given.
            input_context: see :class:`Dataset`.

        Returns:
            A ``tfray.Dataset`` of unknown cardinality.

        Examples:
            >>> ds = tfray.Dataset.from_ray_data(ray_ds, "features", "label", batch_size=256)
            >>> model.fit(ds, epochs=3)
        """
        _require_kind("from_ray_data", "ray_ds", ray_ds)
        return cls(
            ray_ds,
            element_spec=element_spec,
            sharding=sharding,
            input_context=input_context,
            feature_columns=feature_columns,
            label_columns=label_columns,
            additional_columns=additional_columns,
            prefetch_batches=prefetch_batches,
            batch_size=batch_size,
            drop_last=drop_last,
            local_shuffle_buffer_size=local_shuffle_buffer_size,
            local_shuffle_seed=local_shuffle_seed,
            feature_type_spec=feature_type_spec,
            label_type_spec=label_type_spec,
            additional_type_spec=additional_type_spec,
        )

    @property
    def element_spec(self):
        return self._structure

    def shard(self, num_shards, index, name=None):
        """Keeps batches ``index``, ``index + num_shards``, ... at the source.

        Unlike ``tf.data.Dataset.shard``, which reads every element and
        discards the others, this reads only its share: ``from_refs`` resolves
        only the refs ``index::num_shards``, ``from_generators`` runs only the
        shards ``index::num_shards``. On a dataset that took a worker's
        share by itself (``sharding="auto"``), this splits the whole source:
        the explicit share replaces the automatic one.

        Args:
            num_shards: the number of shards, an int >= 1.
            index: this shard, an int in ``[0, num_shards)``.
            name: unused; tf.data's op name.

        Returns:
            A ``tfray.Dataset``.

        Raises:
            TypeError: for ``from_ray_data`` (use Ray Data's own splitting,
                e.g. Ray Train's ``get_dataset_shard``) and one-shot iterators.
        """
        num_shards = sources.positive_int("num_shards", sources.as_int("num_shards", num_shards))
        index = sources.as_int("index", index)
        if not 0 <= index < num_shards:
            raise ValueError(f"index: expected 0 <= index < {num_shards}, got {index}")
        part = Dataset(self._whole.shard(num_shards, index))
        part._share = (num_shards, index)
        return part

    def with_options(self, options, name=None):
        """``tf.data.Dataset.with_options``, explaining auto-shard policies.

        tfray shards at the source, so tf.data's auto-shard has nothing to
        add: FILE cannot apply (there are no files; TF would fail when
        distributing) and is replaced by OFF, with a warning that says how
        this dataset is split; DATA on top of a worker's share is applied,
        with a warning that it drops (n-1)/n of the share. Policies set
        further down the pipeline are out of tfray's sight.
        """
        return super().with_options(distribute.explain_policy(options, self._share), name=name)

    def stats(self):
        """Statistics of this dataset's recent iterators, oldest first.

        Returns:
            A list of ``tfray.IteratorStats``, one per iterator (epoch).
        """
        return [IteratorStats(**stats.of_feeder(f)) for f in runtime.get().registry.recent(self._key)]


class _Wire(dataset_ops.DatasetSource):
    """The op's own dataset, of dense tensors, under a source's decoding map."""

    def __init__(self, variant, structure):
        self._structure = structure
        super().__init__(variant)

    @property
    def element_spec(self):
        return self._structure


def _kind(source):
    """The constructor ``source`` is for."""
    if _is_ray_data(source):
        return "from_ray_data"
    if isinstance(source, tf_data.Pipelines):
        return "from_tf_data"
    if callable(source) and not isinstance(source, ray.ObjectRef):
        return "from_generators"
    return "from_refs"


_KINDS = {
    "from_refs": "a list or iterator of ray.ObjectRef",
    "from_generators": "a generator function",
    "from_ray_data": "a ray.data.Dataset or DataIterator",
    "from_tf_data": "a function building a tf.data.Dataset",
}


# What the constructors of producer sources take besides ``fn`` (generators.OPTIONS and the common ones).
_PRODUCERS_ARGS = generators.OPTIONS + ("element_spec", "sharding", "input_context")


def _producers_args(arguments):
    """The keyword arguments of ``Dataset(fn, ...)`` among a producer constructor's ``locals()``."""
    return {name: arguments[name] for name in _PRODUCERS_ARGS}


def _require_kind(method, argument, source):
    if _kind(source) != method:
        raise TypeError(
            f"{method}: {argument}: expected {_KINDS[method]}, got {type(source).__name__}"
        )


def _make_source(source, element_spec, options):
    """The source ``Dataset(source, **options)`` reads, made by its kind's builder.

    Each kind's module declares its options (``OPTIONS``) and their
    defaults (its builder's), which its public constructor here repeats;
    ``test_api_args`` checks that the names agree.
    """
    if isinstance(source, sources.Source):  # From shard(): already made.
        return source
    kind = _kind(source)
    if kind == "from_refs":
        _refuse(kind, options, sources.refs.OPTIONS)
        return sources.RefsSource(source, element_spec=element_spec, **options)
    if kind in ("from_generators", "from_tf_data"):
        _refuse(kind, options, generators.OPTIONS if kind == "from_generators" else tf_data.OPTIONS)
        if "shards" not in options:
            raise TypeError(
                f"tfray.Dataset: shards: required for {_KINDS[kind]} (see Dataset.{kind})"
            )
        # Its producers are stopped through an actor the runtime keeps.
        session_actor = runtime.get().session_actor
        if kind == "from_tf_data":
            return tf_data.TfDataSource(
                source.fn, element_spec=element_spec, session_actor=session_actor, **options
            )
        return generators.GeneratorSource(
            source, element_spec=element_spec, session_actor=session_actor, **options
        )
    _refuse(kind, options, ray_data.OPTIONS)
    return ray_data.source(source, element_spec=element_spec, **options)


def _refuse(kind, options, own):
    """Options of another kind, named with the ones this kind takes."""
    unknown = sorted(set(options) - set(own))
    if unknown:
        raise TypeError(
            f"tfray.Dataset: {_KINDS[kind]} takes the options of Dataset.{kind} "
            f"({', '.join(own)}), not {', '.join(unknown)}"
        )
