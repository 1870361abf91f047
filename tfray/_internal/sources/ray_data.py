"""Batches from a Ray Data ``Dataset`` or ``DataIterator``, shaped as ``to_tf`` shapes them.

Two ways to read an epoch:

- ``BlockBatches`` (a ``Dataset`` without local shuffling): Ray Data's
  streaming execution yields block refs; tfray resolves them ahead in bulk
  like any refs and slices each block into batches itself, chunk by chunk
  (a block is an Arrow table whose columns may be several chunks). A batch
  that lies within one chunk is a view of the block in the object store, so
  fixed-shape numeric and tensor columns reach TF without a copy (where
  aligned); a batch spanning chunks or blocks is concatenated, one copy,
  counted as tfray's.
- ``IterBatches`` (a ``DataIterator``, e.g. a Ray Train shard, or local
  shuffling): Ray Data's own ``iter_batches``, one batch per Python call.
"""

import collections

import numpy as np
import tensorflow as tf

from tfray._internal.runtime.batch import Copied
from tfray._internal.runtime.lookahead import LookAhead
from tfray._internal.runtime.resolver import RefResolver
from tfray._internal.runtime.status import BatchError, Code
from tfray._internal.sources import columns as columns_lib
from tfray._internal.sources import resume
from tfray._internal.sources.base import Source, as_int, positive_int

GROUPS = ("feature_columns", "label_columns", "additional_columns")
TYPE_SPECS = ("feature_type_spec", "label_type_spec", "additional_type_spec")
# Batches each epoch's channel holds.
CAPACITY = 4


def names(columns):
    """A group's column names: ``"x"`` -> ``["x"]``."""
    return [columns] if isinstance(columns, str) else list(columns)


def _group_nest(columns):
    """A group as ``to_tf`` structures it: a name, or a dict of them (keys sorted)."""
    return columns if isinstance(columns, str) else {c: c for c in sorted(columns)}


def _to_tf_type_spec():
    """The private function ``to_tf`` types a column group with.

    Ray 2.60 has it in ``ray.data._internal.utils.tensorflow_utils``; older
    Ray (2.50 checked) in ``ray.air._internal.tensorflow_utils``, with the
    same signature. Should a Ray have neither, the ImportError names the module.
    """
    try:
        from ray.data._internal.utils.tensorflow_utils import get_type_spec
    except ImportError:
        from ray.air._internal.tensorflow_utils import get_type_spec
    return get_type_spec


def layout(data, groups, type_specs, element_spec):
    """The ``Layout`` of ``data``'s elements, typed as ``to_tf`` types them.

    Like ``to_tf``, a group's spec comes from the schema unless given (the
    schema is known without execution for most sources; otherwise Ray Data
    runs the pipeline to its first block to learn it, as for ``to_tf``), and
    the named columns are checked against it then.

    Args:
        data: a ``ray.data.Dataset`` or ``DataIterator``.
        groups: ``(feature_columns, label_columns, additional_columns)``.
        type_specs: ``(feature_type_spec, label_type_spec, additional_type_spec)``.
        element_spec: the whole element's spec, or None.
    """
    get_type_spec = _to_tf_type_spec()
    wanted = [g is not None and s is None for g, s in zip(groups, type_specs)]
    wanted[0] = type_specs[0] is None
    if groups[0] is None or (element_spec is None and any(wanted)):
        schema = data.schema()
        if schema is None:
            raise ValueError(
                "from_ray_data: the dataset's schema is unknown (it has no blocks); "
                "pass feature_type_spec and label_type_spec, or element_spec"
            )
        valid = list(schema.names)
        if groups[0] is None:
            groups = (valid,) + tuple(groups[1:])
        for group, columns in zip(GROUPS, groups):
            for name in names(columns) if columns is not None else ():
                if name not in valid:
                    raise ValueError(
                        f"{group}: there's no column named {name!r} in the dataset; "
                        f"valid column names are {valid}"
                    )
        if element_spec is None:
            type_specs = [
                get_type_spec(schema, columns=g) if want else s
                for g, s, want in zip(groups, type_specs, wanted)
            ]
    if element_spec is None:
        specs = [s for g, s in zip(groups, type_specs) if g is not None]
        element_spec = specs[0] if len(specs) == 1 else tuple(specs)
    return Layout(groups, element_spec)


class Layout:
    """What ``to_tf`` makes of a batch, and the wire form tfray carries it in.

    An element is ``(features, labels[, additional])`` (a group left None is
    left out; features alone are not wrapped in a tuple), each group a
    column's value when it is a name, or a dict of them when a list.

    Args:
        groups: ``feature_columns, label_columns, additional_columns``; for
            ``feature_columns=None``, the dataset's column names.
        element_spec: the element's spec, a ``tf.TypeSpec`` per column.
    """

    def __init__(self, groups, element_spec):
        nests = [_group_nest(g) for g in groups if g is not None]
        self.columns = nests[0] if len(nests) == 1 else tuple(nests)
        try:
            tf.nest.assert_same_structure(self.columns, element_spec)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"element_spec: expected the structure of the columns, {self.columns!r}; {e}"
            ) from None
        self.element_spec = element_spec
        self._names = tf.nest.flatten(self.columns)
        self._codecs = [
            columns_lib.codec(n, s) for n, s in zip(self._names, tf.nest.flatten(element_spec))
        ]
        self.wire_spec = tf.nest.pack_sequence_as(self.columns, [c.wire_spec for c in self._codecs])
        self.dense = all(isinstance(c, columns_lib.Dense) for c in self._codecs)

    def read(self):
        """The columns a batch is made of, each once."""
        return list(dict.fromkeys(self._names))

    def wire(self, batch, copied):
        """The wire element of ``batch`` (a dict of columns); copies counted.

        Args:
            batch: a dict of column arrays.
            copied: names of the columns already copied to make ``batch``.

        Returns:
            The element (a ``batch.Copied`` when anything was copied).
        """
        copies = columns_lib.Copies()
        leaves = []
        for name, codec in zip(self._names, self._codecs):
            if name not in batch:
                raise BatchError(
                    Code.INVALID_ARGUMENT,
                    f"column {name!r} is not in the Ray dataset; its columns are {sorted(batch)}",
                )
            column = batch[name]
            encoded = codec.encode(name, column, copies)
            if encoded is column and name in copied:
                encoded = copies.add(column)
            leaves.append(encoded)
        element = _pack(self.columns, iter(leaves))
        return Copied(element, copies.bytes, copies.arrays) if copies.arrays else element

    @tf.autograph.experimental.do_not_convert
    def decode(self, *parts):
        """The ``to_tf`` element of a wire element (a function for ``map``)."""
        wire = parts if isinstance(self.columns, tuple) else parts[0]
        decoded = [c.decode(w) for c, w in zip(self._codecs, _leaves(self.columns, wire))]
        return _pack(self.columns, iter(decoded))


def _leaves(nest, element):
    """The parts of ``element`` at ``nest``'s names, in order (a wire part may be a tuple)."""
    if isinstance(nest, str):
        return [element]
    if isinstance(nest, dict):
        return [leaf for k, v in nest.items() for leaf in _leaves(v, element[k])]
    return [leaf for v, e in zip(nest, element) for leaf in _leaves(v, e)]


def _pack(nest, leaves):
    """``nest`` (names; dict keys sorted) with each name replaced by the next leaf."""
    if isinstance(nest, str):
        return next(leaves)
    if isinstance(nest, dict):
        return {k: _pack(v, leaves) for k, v in nest.items()}
    return tuple(_pack(v, leaves) for v in nest)


def reads_blocks(data):
    """Whether epochs of ``data`` can be read as block refs (``BlockBatches``).

    That reading uses Ray Data's developer APIs ``Dataset.iter_internal_ref_bundles``
    and ``RefBundle.block_refs`` (Ray 2.33 and newer). A Ray without them is
    read through the public ``iter_batches`` (``IterBatches``): the same
    batches, each copied by Ray Data.
    """
    return hasattr(data, "iter_internal_ref_bundles")


def preserves_order(data, iter_batches_args):
    """Whether each run of ``data`` yields its rows in the same order."""
    import ray.data

    context = getattr(data, "context", None) or ray.data.DataContext.get_current()
    if not context.execution_options.preserve_order:
        return False
    shuffled = iter_batches_args.get("local_shuffle_buffer_size") is not None
    return not shuffled or iter_batches_args.get("local_shuffle_seed") is not None


class Elements:
    """Turns Ray Data batches (dicts of columns) into the op's wire elements.

    Args:
        layout: the ``Layout`` of this dataset's elements.
    """

    def __init__(self, layout):
        self._layout = layout
        self._index = 0

    def item(self, make_batch):
        """A ``(label, element, error)`` item for the batch ``make_batch()`` makes.

        ``make_batch`` returns the batch and the names of the columns it
        copied to make it (rows gathered from several blocks).
        """
        label = f"batch {self._index}"
        self._index += 1
        try:
            batch, copied = make_batch()
            element = self._layout.wire(batch, copied)
        except BatchError as e:
            return (label, None, BatchError(e.code, f"tfray: {label}: {e.message}"))
        return (label, element, None)


class IterBatches:
    """One epoch as one run of Ray Data's ``iter_batches``."""

    in_flight = 0  # Ray Data keeps its own pipeline; nothing is pending here.
    lookahead = None  # Fixed: the channel's capacity.

    def __init__(self, data, elements, iter_batches_args):
        self._batches = iter(data.iter_batches(batch_format="numpy", **iter_batches_args))
        self._elements = elements

    def next_ready(self, timeout):
        """Waits for Ray Data's next batch (it has no timeout)."""
        batch = next(self._batches, None)
        return None if batch is None else [self._elements.item(lambda: (batch, ()))]

    def close(self):
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()  # Shuts down this run's streaming execution.
        self._batches = iter(())


class BlockRefs:
    """A ref stream over the blocks one streaming execution produces."""

    def __init__(self, data):
        self._bundles = data.iter_internal_ref_bundles()
        self._index = 0
        self.done = False

    def take(self, n, timeout):
        """The blocks of the next bundle (waits for the execution to make it)."""
        bundle = next(self._bundles, None)
        if bundle is None:
            self.done = True
            return []
        out = []
        for ref in bundle.block_refs:
            out.append((f"block {self._index}", ref))
            self._index += 1
        return out

    def close(self):
        close = getattr(self._bundles, "close", None)
        if close is not None:
            close()
        self.done = True


class BlockBatches:
    """One epoch sliced from resolved blocks into batches of ``batch_size`` rows."""

    lookahead = None  # Fixed: the channel's capacity.

    def __init__(self, data, elements, *, batch_size, drop_last, columns, max_inflight):
        self._blocks = RefResolver(BlockRefs(data), lookahead=LookAhead(fixed=max_inflight))
        self._elements = elements
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._columns = columns  # Columns to read; None: all.
        self._chunks = collections.deque()  # Column dicts not yet batched.
        self._rows = 0  # Rows in _chunks.
        self._ended = False

    @property
    def in_flight(self):
        return self._blocks.in_flight

    def next_ready(self, timeout):
        if self._ended:
            return None
        items = self._blocks.next_ready(timeout)
        out = []
        if items is None:
            self._ended = True
            if self._rows and not self._drop_last:
                out.append(self._elements.item(lambda: self._take(self._rows)))
            return out or None
        for label, block, error in items:
            if error is None:
                try:
                    self._add(block)
                except BatchError as e:
                    error = BatchError(e.code, f"tfray: {label}: {e.message}")
            if error is not None:
                out.append((label, None, error))
                continue
            if self._batch_size is None:  # A batch per block, as it is.
                if self._rows:
                    out.append(self._elements.item(lambda: self._take(self._rows)))
                continue
            while self._rows >= self._batch_size:
                out.append(self._elements.item(lambda: self._take(self._batch_size)))
        return out

    def close(self):
        self._chunks.clear()
        self._blocks.close()

    def _add(self, block):
        from ray.data.block import BlockAccessor

        accessor = BlockAccessor.for_block(block)
        if not accessor.num_rows():
            return
        names = accessor.column_names()
        for name in self._columns or ():
            if name not in names:
                raise BatchError(
                    Code.INVALID_ARGUMENT,
                    f"column {name!r} is not in the Ray dataset; its columns are {sorted(names)}",
                )
        for piece in _single_chunk_pieces(block, self._columns or names):
            # Views of the piece's buffers for fixed-shape numeric columns.
            columns = BlockAccessor.for_block(piece).to_numpy(self._columns)
            self._chunks.append(columns)
            self._rows += len(next(iter(columns.values())))

    def _take(self, n):
        """The next n rows and the columns copied: a view of one chunk where it holds them."""
        first = self._chunks[0]
        rows = len(next(iter(first.values())))
        if rows >= n:
            batch = {c: a[:n] for c, a in first.items()}
            if rows == n:
                self._chunks.popleft()
            else:
                self._chunks[0] = {c: a[n:] for c, a in first.items()}
            self._rows -= n
            return batch, ()
        pieces, needed = [], n
        while needed:
            chunk = self._chunks[0]
            rows = len(next(iter(chunk.values())))
            if rows <= needed:
                pieces.append(self._chunks.popleft())
                needed -= rows
            else:
                pieces.append({c: a[:needed] for c, a in chunk.items()})
                self._chunks[0] = {c: a[needed:] for c, a in chunk.items()}
                needed = 0
        self._rows -= n
        return {c: _concatenate(c, [p[c] for p in pieces]) for c in first}, first.keys()


def _single_chunk_pieces(block, columns):
    """``block`` cut where any of ``columns`` starts a new Arrow chunk.

    Ray Data's ``to_numpy`` concatenates a column's chunks, a copy; a piece
    whose columns are one chunk each converts to numpy as views of the
    block's own buffers. A pandas block, or an Arrow block of one chunk per
    column, is one piece.
    """
    import pyarrow as pa

    if not isinstance(block, pa.Table):
        return [block]
    cuts = set()
    for name in columns:
        offset = 0
        for chunk in block.column(name).chunks:
            offset += len(chunk)
            cuts.add(offset)
    bounds = sorted(cuts | {0, block.num_rows})
    if len(bounds) == 2:
        return [block]
    return [block.slice(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def _concatenate(column, arrays):
    """Rows from several blocks, in one copy.

    Blocks whose rows differ in shape (a variable-shaped column that Ray Data
    stacked within a block) are joined as one object array of rows.
    """
    if len({a.shape[1:] for a in arrays}) > 1 or any(a.dtype == object for a in arrays):
        rows = np.empty(sum(len(a) for a in arrays), dtype=object)
        for i, row in enumerate(row for a in arrays for row in a):
            rows[i] = row  # One by one: a slice assignment would broadcast rows.
        return rows
    return np.concatenate(arrays)


class RayDataSource(Source):
    """A Ray Data Dataset or DataIterator, streamed once per epoch.

    Nothing runs until an iterator reads: the spec comes from the schema
    (see ``layout``), and each epoch starts at its first read.
    """

    kind = "from_ray_data"

    def __init__(self, data, *, layout, capacity, iter_batches_args):
        self._data = data
        self._layout = layout
        self._capacity = capacity
        self._iter_batches_args = iter_batches_args
        if not layout.dense:
            self.decode = layout.decode
        super().__init__(layout.element_spec, capacity=capacity)

    def _wire_spec(self):
        return self._layout.wire_spec

    def _start(self):
        import ray.data

        elements = Elements(self._layout)
        args = self._iter_batches_args
        if (
            isinstance(self._data, ray.data.Dataset)
            and args["local_shuffle_buffer_size"] is None
            and reads_blocks(self._data)
        ):
            return BlockBatches(
                self._data,
                elements,
                batch_size=args["batch_size"],
                drop_last=args["drop_last"],
                columns=self._layout.read(),
                max_inflight=self._capacity,
            )
        return IterBatches(self._data, elements, args)

    def open_epoch(self, *, deterministic, skip=0, progress=None, resume_info=None, taken=None):
        stream = self._start()
        if skip:
            if not preserves_order(self._data, self._iter_batches_args):
                resume.warn_inexact(
                    "from_ray_data",
                    skip,
                    "Ray Data may order blocks differently each run (set "
                    "DataContext.get_current().execution_options.preserve_order = True, "
                    "and seed any shuffle)",
                )
            stream = resume.SkippedItems(stream, skip)
        return stream


# Dataset.from_ray_data's options (to_tf's), in its order, with its defaults.
DEFAULTS = {
    "feature_columns": None,
    "label_columns": None,
    "additional_columns": None,
    "prefetch_batches": 1,
    "batch_size": 1,
    "drop_last": False,
    "local_shuffle_buffer_size": None,
    "local_shuffle_seed": None,
    "feature_type_spec": None,
    "label_type_spec": None,
    "additional_type_spec": None,
}
OPTIONS = tuple(DEFAULTS)


def source(ray_ds, *, element_spec=None, **options):
    """The RayDataSource of ``Dataset.from_ray_data``'s options, checked as ``to_tf`` checks them.

    ``options``: those of ``OPTIONS`` given; the others take ``DEFAULTS``.
    """
    given = {**DEFAULTS, **options}
    groups = tuple(given[name] for name in GROUPS)
    for name, columns in zip(GROUPS, groups):
        listed = [columns] if isinstance(columns, str) else columns
        if columns is not None and not (
            isinstance(listed, (list, tuple)) and listed and all(isinstance(c, str) for c in listed)
        ):
            raise TypeError(
                f"{name}: expected a column name, a non-empty list of them, or None; got {columns!r}"
            )
    type_specs = tuple(given[name] for name in TYPE_SPECS)
    for name, type_spec in zip(TYPE_SPECS, type_specs):
        leaves = tf.nest.flatten(type_spec)
        if type_spec is not None and not all(isinstance(t, tf.TypeSpec) for t in leaves):
            raise TypeError(f"{name}: expected a tf.TypeSpec, a dict of them, or None; got {type_spec!r}")
    batch_size, drop_last = given["batch_size"], given["drop_last"]
    local_shuffle_buffer_size, local_shuffle_seed = (
        given["local_shuffle_buffer_size"],
        given["local_shuffle_seed"],
    )
    prefetch_batches = given["prefetch_batches"]
    if batch_size is not None:
        batch_size = positive_int("batch_size", batch_size)
    if not isinstance(drop_last, bool):
        raise TypeError(f"drop_last: expected a bool, got {type(drop_last).__name__}")
    if local_shuffle_buffer_size is not None:
        positive_int("local_shuffle_buffer_size", local_shuffle_buffer_size)
    if local_shuffle_seed is not None:
        as_int("local_shuffle_seed", local_shuffle_seed)
    if as_int("prefetch_batches", prefetch_batches) < 0:
        raise ValueError(f"prefetch_batches: expected >= 0, got {prefetch_batches}")
    return RayDataSource(
        ray_ds,
        layout=layout(ray_ds, groups, type_specs, element_spec),
        capacity=CAPACITY,
        iter_batches_args={
            "batch_size": batch_size,
            "drop_last": drop_last,
            "local_shuffle_buffer_size": local_shuffle_buffer_size,
            "local_shuffle_seed": local_shuffle_seed,
            "prefetch_batches": prefetch_batches,
        },
    )
