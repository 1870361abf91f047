"""Batches from a Ray Data ``Dataset`` or ``DataIterator``, shaped as ``to_tf`` shapes them.

Ray Data's streaming execution produces the blocks; its batcher slices them
into numpy batches in the trainer process. A batch that lies within one block
is a view of that block's memory in the object store, so fixed-shape numeric
and tensor columns reach TF without a copy (where aligned); a batch spanning
blocks was concatenated by Ray Data, one copy.
"""


from tfray._internal.status import BatchError, Code


def select(batch, columns):
    """``batch[columns]`` as ``to_tf`` builds it: a column's array, or a dict."""
    if columns is None:
        return dict(batch)
    names = [columns] if isinstance(columns, str) else columns
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
    if isinstance(columns, str):
        return batch[columns]
    return {column: batch[column] for column in columns}


class RayDataBatches:
    """The batch stream of one epoch: one run of ``iter_batches``."""

    in_flight = 0  # Ray Data keeps its own pipeline; nothing is pending here.

    def __init__(self, data, *, feature_columns, label_columns, iter_batches_args):
        self._batches = iter(data.iter_batches(batch_format="numpy", **iter_batches_args))
        self._features = feature_columns
        self._labels = label_columns
        self._index = 0
        self._peeked = None

    def peek(self):
        """The first element, kept to be handed out first; None if there is none."""
        if self._peeked is None:
            self._peeked = self._next_element()
        return self._peeked

    def next_ready(self, timeout):
        """Waits for Ray Data's next batch (it has no timeout)."""
        label = f"batch {self._index}"
        try:
            element, self._peeked = self.peek(), None
        except BatchError as e:
            return [(label, None, BatchError(e.code, f"tfray: {label}: {e.message}"))]
        if element is None:
            return None
        self._index += 1
        return [(label, element, None)]

    def close(self):
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()  # Shuts down this run's streaming execution.
        self._batches = iter(())

    def _next_element(self):
        batch = next(self._batches, None)
        if batch is None:
            return None
        features = select(batch, self._features)
        if self._labels is None:
            return features
        return (features, select(batch, self._labels))
