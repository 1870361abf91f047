"""Producers for ``from_generators``: one streaming-generator Ray task per shard.

Each shard's generator runs as a Ray task whose yields go straight into the
object store. Ray pauses a generator once ``max_inflight_per_producer`` of its
batches wait unconsumed (``_generator_backpressure_num_objects``), so a slow
trainer stalls the producers instead of filling the store.
"""

import ray


def _run_shard(fn, shard):
    yield from fn(shard)


_remote_run_shard = ray.remote(_run_shard)


class GeneratorShards:
    """The ref stream of one epoch: every shard's generator, interleaved.

    ``deterministic`` (set before the first ``take``): round-robin over the
    shards, the same order every epoch for deterministic generators; else
    whichever batch is ready first.
    """

    def __init__(self, fn, shards, *, max_inflight_per_producer, ray_remote_args):
        options = dict(ray_remote_args or {})
        options["num_returns"] = "streaming"
        options["_generator_backpressure_num_objects"] = max_inflight_per_producer
        runner = _remote_run_shard.options(**options)
        self._generators = [runner.remote(fn, shard) for shard in shards]
        self._taken = [0] * len(shards)  # Batches taken per shard.
        self._active = list(range(len(shards)))  # Shards not yet exhausted.
        self._turn = 0  # Index into _active of the next round-robin shard.
        self.deterministic = True
        self.done = not shards

    def take(self, n, timeout):
        """Up to n ``(label, ref)`` pairs; waits at most ``timeout`` for the first."""
        out = []
        while len(out) < n and self._active:
            shard = self._next_ready_shard(timeout if not out else 0)
            if shard is None:
                break
            try:
                ref = next(self._generators[shard])
            except StopIteration:
                self._exhaust(shard)
                continue
            out.append((f"shard {shard} batch {self._taken[shard]}", ref))
            self._taken[shard] += 1
            if self.deterministic:
                self._turn = (self._turn + 1) % len(self._active)
        self.done = not self._active
        return out

    def close(self):
        for shard in self._active:
            ray.cancel(self._generators[shard])
        self._active = []
        self._generators = []
        self.done = True

    def _next_ready_shard(self, timeout):
        """A shard whose next ref (or end) is ready, per the ordering mode."""
        if self.deterministic:
            shard = self._active[self._turn]
            ready, _ = ray.wait([self._generators[shard]], num_returns=1, timeout=timeout)
            return shard if ready else None
        candidates = [self._generators[s] for s in self._active]
        ready, _ = ray.wait(candidates, num_returns=1, timeout=timeout)
        return self._active[candidates.index(ready[0])] if ready else None

    def _exhaust(self, shard):
        position = self._active.index(shard)
        self._active.pop(position)
        if self._active and position < self._turn:
            self._turn -= 1
        if self._active:
            self._turn %= len(self._active)
        else:
            self._turn = 0
