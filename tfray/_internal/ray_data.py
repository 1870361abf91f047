"""Batches from a Ray Data ``Dataset`` or ``DataIterator``, shaped as ``to_tf`` shapes them.

Two ways to read an epoch:

- ``BlockBatches`` (a ``Dataset`` without local shuffling): Ray Data's
  streaming execution yields block refs; tfray resolves them ahead in bulk
  like any refs and slices each block into batches itself. A batch that lies
  within one block is a view of the block in the object store, so fixed-shape
  numeric and tensor columns reach TF without a copy (where aligned); a batch
  spanning blocks is concatenated, one copy.
- ``IterBatches`` (a ``DataIterator``, e.g. a Ray Train shard, or local
  shuffling): Ray Data's own ``iter_batches``, one batch per Python call.
"""

import collections

import numpy as np

from tfray._internal.lookahead import LookAhead
from tfray._internal.resolver import RefResolver
from tfray._internal.status import BatchError, Code


def select(batch, columns):
    """``batch[columns]`` as ``to_tf`` builds it: a column's array, or a dict."""
    if columns is None:
        check(batch, list(batch))
        return dict(batch)
    check(batch, [columns] if isinstance(columns, str) else columns)
    if isinstance(columns, str):
        return batch[columns]
    return {column: batch[column] for column in columns}


def check(batch, names):
    """Raises BatchError unless each named column is a fixed-shape array."""
    for name in names:
        if name not in batch:
            raise BatchError(
                Code.INVALID_ARGUMENT,
                f"column {name!r} is not in the Ray dataset; its columns are {sorted(batch)}",
            )
        if batch[name].dtype == object:
            raise BatchError(
                Code.INVALID_ARGUMENT,
                f"column {name!r} is variable-length or not numeric (numpy dtype object); "
                "tfray needs fixed-shape numeric columns: pad or resize it in Ray "
                "Data first (e.g. with map_batches).",
            )


def preserves_order(data, iter_batches_args):
    """Whether each run of ``data`` yields its rows in the same order."""
    import ray.data

    context = getattr(data, "context", None) or ray.data.DataContext.get_current()
    if not context.execution_options.preserve_order:
        return False
    shuffled = iter_batches_args.get("local_shuffle_buffer_size") is not None
    return not shuffled or iter_batches_args.get("local_shuffle_seed") is not None


class Elements:
    """Turns Ray Data batches (dicts of columns) into tfray elements."""

    def __init__(self, feature_columns, label_columns):
        self._features = feature_columns
        self._labels = label_columns
        self._index = 0

    def item(self, make_batch):
        """A ``(label, element, error)`` item for the batch ``make_batch()`` makes."""
        label = f"batch {self._index}"
        self._index += 1
        try:
            batch = make_batch()
            features = select(batch, self._features)
            element = features if self._labels is None else (features, select(batch, self._labels))
        except BatchError as e:
            return (label, None, BatchError(e.code, f"tfray: {label}: {e.message}"))
        return (label, element, None)


class IterBatches:
    """One epoch as one run of Ray Data's ``iter_batches``."""

    in_flight = 0  # Ray Data keeps its own pipeline; nothing is pending here.

    def __init__(self, data, elements, iter_batches_args):
        self._batches = iter(data.iter_batches(batch_format="numpy", **iter_batches_args))
        self._elements = elements

    def next_ready(self, timeout):
        """Waits for Ray Data's next batch (it has no timeout)."""
        batch = next(self._batches, None)
        return None if batch is None else [self._elements.item(lambda: batch)]

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
        for entry in bundle.blocks:
            out.append((f"block {self._index}", entry.ref))
            self._index += 1
        return out

    def close(self):
        close = getattr(self._bundles, "close", None)
        if close is not None:
            close()
        self.done = True


class BlockBatches:
    """One epoch sliced from resolved blocks into batches of ``batch_size`` rows."""

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
            while self._rows >= self._batch_size:
                out.append(self._elements.item(lambda: self._take(self._batch_size)))
        return out

    def close(self):
        self._chunks.clear()
        self._blocks.close()

    def _add(self, block):
        from ray.data.block import BlockAccessor

        accessor = BlockAccessor.for_block(block)
        rows = accessor.num_rows()
        if rows:
            names = accessor.column_names()
            for name in self._columns or ():
                if name not in names:
                    raise BatchError(
                        Code.INVALID_ARGUMENT,
                        f"column {name!r} is not in the Ray dataset; its columns are {sorted(names)}",
                    )
            # Views of the block's buffers for fixed-shape numeric columns.
            columns = accessor.to_numpy(self._columns)
            check(columns, list(columns))  # Before concatenating across blocks.
            self._chunks.append(columns)
            self._rows += rows

    def _take(self, n):
        """The next n rows: a view of one chunk where it holds them, else a copy."""
        first = self._chunks[0]
        rows = len(next(iter(first.values())))
        if rows >= n:
            batch = {c: a[:n] for c, a in first.items()}
            if rows == n:
                self._chunks.popleft()
            else:
                self._chunks[0] = {c: a[n:] for c, a in first.items()}
            self._rows -= n
            return batch
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
        return {c: _concatenate(c, [p[c] for p in pieces]) for c in first}


def _concatenate(column, arrays):
    """Rows from several blocks, in one copy; rows must agree in shape."""
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) > 1:
        raise BatchError(
            Code.INVALID_ARGUMENT,
            f"column {column!r} is variable-length (rows of shapes "
            f"{sorted(shapes)}); tfray needs fixed-shape columns: pad or resize "
            "it in Ray Data first (e.g. with map_batches).",
        )
    return np.concatenate(arrays)
