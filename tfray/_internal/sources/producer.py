"""The code a ``from_generators`` producer runs on a Ray worker.

It imports nothing at module level and is pickled by value (see
generators.py), so a producer process never imports tfray, and with it
TensorFlow.
"""

import time

# How often a running producer asks whether it was stopped (see stops.py).
_STOP_CHECK_S = 0.05
# A yield that took longer than this was a pause (Ray's backpressure): the
# producer asks at once when it resumes, which is when a stopping trainer
# resumes it.
_PAUSE_S = 0.002


class _StopCheck:
    """Whether the trainer stopped this producer's epoch: one parked call to its stop board."""

    def __init__(self, board, token):
        import ray

        self._ray = ray
        self._reply = board.wait.remote(token)
        self._next = time.monotonic() + _STOP_CHECK_S

    def requested(self, paused=False):
        if self._reply is None:
            return False
        now = time.monotonic()
        if now < self._next and not paused:
            return False
        self._next = now + _STOP_CHECK_S
        ready, _ = self._ray.wait([self._reply], timeout=0, fetch_local=False)
        if not ready:
            return False
        try:
            return self._ray.get(self._reply)
        except self._ray.exceptions.RayError:
            # The board went with its trainer process; Ray ends this task
            # with its owner.
            self._reply = None
            return False


def run_shard(fn, shard, board, token):
    batches = fn(shard)
    if not hasattr(batches, "__next__"):  # A function that returned a batch, or a list.
        # generators.NOT_A_GENERATOR's words: this module imports nothing.
        raise TypeError(
            "from_generators: fn must be a generator function (use `yield`), so that "
            f"each producer yields its shard's batches one at a time; fn({shard!r}) "
            f"returned a {type(batches).__name__}."
        )
    stop = _StopCheck(board, token)
    try:
        for batch in batches:
            before = time.monotonic()
            yield batch
            if stop.requested(paused=time.monotonic() - before > _PAUSE_S):
                return
    finally:
        close = getattr(batches, "close", None)
        if close is not None:  # Runs the generator's own finally blocks now.
            close()
