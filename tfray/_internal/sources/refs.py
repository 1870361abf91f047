"""``from_refs``: ObjectRefs a program already has, a list (replayable) or an iterator (read once)."""

import itertools

import ray

from tfray._internal.runtime import spec
from tfray._internal.runtime.lookahead import CAP, START, LookAhead
from tfray._internal.runtime.resolver import RefResolver
from tfray._internal.runtime.status import BatchError, Code
from tfray._internal.sources.base import Source, default_budget, positive_int


# Dataset.from_refs' options, as RefsSource takes them.
OPTIONS = ("max_inflight", "max_inflight_bytes")


class RefsSource(Source):
    """ObjectRefs: a sequence (replayable) or an iterator (read once)."""

    kind = "from_refs"

    def __init__(self, refs, *, element_spec=None, max_inflight=None, max_inflight_bytes=None):
        self._options = dict(max_inflight=max_inflight, max_inflight_bytes=max_inflight_bytes)
        self._max_inflight = None if max_inflight is None else positive_int("max_inflight", max_inflight)
        self._budget = None if max_inflight_bytes is None else positive_int("max_inflight_bytes", max_inflight_bytes)
        self._learned = START  # The adaptive look-ahead the last epoch reached.
        if isinstance(refs, ray.ObjectRef):
            refs = [refs]
        if isinstance(refs, (list, tuple)):
            self._refs, self._iterator = list(refs), None
            self.replays = True
            self.cardinality = len(self._refs)
            first = self._refs[0] if self._refs else None
        else:
            try:
                iterator = iter(refs)
            except TypeError:
                raise TypeError(
                    "from_refs: expected a list of ray.ObjectRef or an iterator of "
                    f"them, got {type(refs).__name__}"
                ) from None
            first = next(iterator, None)
            self._refs = None
            self._iterator = iterator if first is None else _prepend(first, iterator)
        for ref in self._refs if self._refs is not None else [first] * (first is not None):
            if not isinstance(ref, ray.ObjectRef):
                raise TypeError(f"from_refs: expected ray.ObjectRef items, got {type(ref).__name__}")
        if element_spec is None:
            if first is None:
                raise ValueError("from_refs: cannot infer element_spec from no refs; pass element_spec.")
            element_spec = spec.infer(ray.get(first))
        super().__init__(element_spec, capacity=self._max_inflight or START)

    def work_units(self):
        """For ``sharding="dynamic"``: ``(key, count, at_once)``, a unit per ref.

        ``key`` is the same in every process that holds the same refs;
        ``at_once`` is None: as many units as refs are wanted.
        """
        if self._refs is None:
            raise TypeError("sharding='dynamic' needs a list of refs; a one-shot iterator cannot be handed out")
        return "refs:" + ",".join(ref.hex() for ref in self._refs), len(self._refs), None

    def unit_refs(self, unit):
        """The ref stream of work unit ``unit``: its one ref."""
        return RefList([self._refs[unit]], start=unit)

    def shard(self, num_shards, index):
        if self._refs is None:
            raise TypeError("a one-shot iterator of refs cannot be sharded; pass a list of refs")
        return RefsSource(
            self._refs[index::num_shards], element_spec=self.element_spec, **self._options
        )

    def open_epoch(self, *, deterministic, skip=0, progress=None, resume_info=None, taken=None):
        if self._refs is not None:
            refs = self._refs[skip:]
        elif self._iterator is not None:
            refs, self._iterator = itertools.islice(self._iterator, skip, None), None
        else:
            raise BatchError(
                Code.FAILED_PRECONDITION,
                "tfray: this dataset was built from a one-shot iterator of refs and "
                "has been read once already. Pass a list of refs to from_refs to "
                "read it again (each iterator is a new epoch).",
            )
        return RefResolver(RefList(refs, start=skip), lookahead=self.lookahead())

    def replay_bounds(self):
        """An epoch its look-ahead could hold at once: ``max_inflight``, or the byte budget."""
        if self._refs is None:
            return None
        if self._max_inflight is not None:
            return self._max_inflight, None
        # The adaptive look-ahead holds up to half its budget (lookahead.py).
        return CAP, None if self._budget is None else self._budget // 2

    def _remember(self, limit):
        self._learned = limit

    def lookahead(self):
        """Fixed at ``max_inflight``, or adapting from where the last epoch got to."""
        if self._max_inflight is None and self._budget is None:
            self._budget = default_budget()  # Once: it asks the cluster.
        return LookAhead(
            fixed=self._max_inflight,
            budget_bytes=self._budget,
            start=self._learned,
            on_change=self._remember,
        )


def _prepend(first, iterator):
    yield first
    yield from iterator


class RefList:
    """The refs of one epoch of ``from_refs``, labelled by position.

    ``start`` is the position of the first ref in the epoch (after a resume).
    """

    def __init__(self, refs, start=0):
        self._refs = iter(refs)
        self._index = start
        self.done = False

    def take(self, n, timeout):
        out = []
        while len(out) < n:
            ref = next(self._refs, None)
            if ref is None:
                self.done = True
                break
            out.append((f"batch {self._index}", ref))
            self._index += 1
        return out

    def close(self):
        self._refs = iter(())
