"""What one tfray iterator has done: ``tfray.IteratorStats``, from ``Dataset.stats()``."""

import dataclasses

# Waiting for input this share of an epoch or more makes it input-bound.
INPUT_BOUND = 0.1


@dataclasses.dataclass(frozen=True)
class IteratorStats:
    """What one tfray iterator (one epoch) has done so far.

    Attributes:
        batches: batches delivered to TensorFlow.
        bytes: bytes delivered to TensorFlow.
        bytes_zero_copy: of ``bytes``, those TensorFlow reads in Ray's
            object store itself: decided by each array's address when it is
            pushed, not by what tfray did not copy.
        bytes_copied: of ``bytes``, those that lie anywhere else: copies,
            whoever made them (``bytes_copied_by_tfray`` plus
            ``bytes_copied_upstream``).
        bytes_copied_by_tfray: of ``bytes_copied``, tfray's own copies
            (unaligned or non-contiguous arrays, a cast to the spec's dtype,
            strings and ragged columns, a batch gathered from several
            Ray Data blocks or chunks).
        bytes_copied_upstream: of ``bytes_copied``, bytes that reached
            tfray outside the store already: Ray's inline task results
            (under about 100 KB), arrays Ray or Arrow assembled in the
            trainer, Ray Data batches read through ``iter_batches``.
        arrays_copied: how many delivered arrays lie outside the store.
        arrays_copied_by_tfray: of ``arrays_copied``, those tfray copied.
        consumer_wait_s: time TensorFlow waited on an empty channel
            (the pipeline was input-bound).
        producer_wait_s: time the feeder waited on a full channel
            (the pipeline was consumer-bound).
        active_s: from the iterator's creation to its latest batch: the
            part of the epoch TensorFlow was reading.
        refs_in_flight: refs being resolved ahead of the consumer now.
        lookahead: batches the iterator may resolve ahead (it adapts
            unless fixed with ``max_inflight``).
        queued: batches resolved and waiting in the channel now.
        get_next_calls: calls TensorFlow made for the next batch.
        finished: the feeder has pushed the whole epoch, or stopped.
        cancelled: the iterator is gone (dropped, even after a full
            epoch, or cancelled by TensorFlow).
        producers_unplaced: the epoch's producers that no alive node can
            run: none offers what ``ray_remote_args`` asks (GPUs, custom
            resources, memory, labels, a node). They start when one joins;
            ``placement_timeout_s`` fails the epoch instead.
        unplaced_s: how long they have waited, from the epoch's last
            progress (0 when none waits).
        bytes_held: store bytes of this iterator's delivered batches that
            TensorFlow still holds (a shuffle buffer, a ``cache()``,
            tensors kept): each pins its Ray object. Held past
            ``object_store_bytes``, the epoch reads from disk (``verdict``).
        object_store_bytes: this node's object-store capacity (0: unknown).
    """

    batches: int
    bytes: int
    bytes_zero_copy: int
    bytes_copied: int
    bytes_copied_by_tfray: int
    bytes_copied_upstream: int
    arrays_copied: int
    arrays_copied_by_tfray: int
    consumer_wait_s: float
    producer_wait_s: float
    active_s: float
    refs_in_flight: int
    lookahead: int
    queued: int
    get_next_calls: int
    finished: bool
    cancelled: bool
    producers_unplaced: int = 0
    unplaced_s: float = 0.0
    bytes_held: int = 0
    object_store_bytes: int = 0

    def verdict(self):
        """One line saying what bounded this epoch, for a training log.

        Returns:
            A line such as
            ``"input-bound: TensorFlow waited for input 38% of the epoch (1200 batches, 0.95 GB/s)"``.
        """
        if self.producers_unplaced:
            return (
                f"waiting for a node: {self.producers_unplaced} producer(s) cannot be placed "
                f"({self.unplaced_s:.0f} s so far; see the warning logged)"
            )
        if self.object_store_bytes and self.bytes_held >= self.object_store_bytes:
            return (
                f"store full: TensorFlow holds {self.bytes_held / 2**20:.0f} MB of these batches, more than "
                f"the {self.object_store_bytes / 2**20:.0f} MB object store: the epoch reads from disk "
                "(see the warning logged)"
            )
        if self.active_s <= 0:
            return "idle: TensorFlow has not read from this iterator"
        waited = min(1.0, self.consumer_wait_s / self.active_s)
        rate = f"{self.batches} batches, {self.bytes / self.active_s / 1e9:.2f} GB/s"
        if waited >= INPUT_BOUND:
            return f"input-bound: TensorFlow waited for input {waited:.0%} of the epoch ({rate})"
        return (
            f"not input-bound: TensorFlow waited for input {waited:.0%} of the epoch; "
            f"the input pipeline waited for room {min(1.0, self.producer_wait_s / self.active_s):.0%} "
            f"({rate})"
        )
