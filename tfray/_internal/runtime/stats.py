"""Per-iterator statistics, read from the native channel and the feeder.

A plain record (a dict of ``tfray.IteratorStats``' fields): the public face
makes the public type of it.
"""

import time


def of_feeder(feeder):
    """The statistics of ``feeder``'s epoch (a feeder, or a replayed epoch), as a dict."""
    s = feeder.channel.stats()
    # Zero-copy is where the bytes are (the store, by address); a copy is
    # anything else. tfray's own copies lie outside the store too.
    copied = s["bytes_delivered"] - s["bytes_in_store"]
    unplaced = feeder.unplaced
    return dict(
        batches=s["batches_delivered"],
        bytes=s["bytes_delivered"],
        bytes_zero_copy=s["bytes_in_store"],
        bytes_copied=copied,
        bytes_copied_by_tfray=s["bytes_copied"],
        bytes_copied_upstream=copied - s["bytes_copied"],
        arrays_copied=s["arrays_delivered"] - s["arrays_in_store"],
        arrays_copied_by_tfray=s["arrays_copied"],
        consumer_wait_s=s["consumer_wait_s"],
        producer_wait_s=s["producer_wait_s"],
        active_s=s["active_s"],
        refs_in_flight=feeder.refs_in_flight,
        lookahead=feeder.lookahead,
        queued=s["queued"],
        bytes_held=s["bytes_held"],
        object_store_bytes=feeder.store_capacity,
        get_next_calls=s["get_next_calls"],
        producers_unplaced=0 if unplaced is None else unplaced.producers,
        unplaced_s=0.0 if unplaced is None else time.monotonic() - unplaced.since,
        finished=feeder.done.is_set(),
        cancelled=s["cancelled"],
    )
