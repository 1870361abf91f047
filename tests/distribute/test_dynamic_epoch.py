"""Dynamic sharding's epoch: which units TensorFlow has taken whole, without Ray."""


import pytest

from tfray._internal.sources.bundles import Bundle, Shard

pytestmark = pytest.mark.timeout(30)

MB = 1 << 20


# Dynamic sharding: which units TensorFlow has taken whole.


class ScriptedResolver:
    """Hands on the scripted items, one list per read."""

    def __init__(self, reads):
        self.reads = list(reads)
        self.lookahead, self.in_flight = None, 0

    def instead_of(self, units, lookahead):
        """Stands for ``RefResolver(units, lookahead=...)``."""
        return self

    def next_ready(self, timeout):
        return self.reads.pop(0) if self.reads else None

    def close(self):
        pass


class RecordingUnits:
    def __init__(self):
        self.taken = []

    def taken_by_tf(self, labels):
        self.taken.extend(labels)


def test_dynamic_epoch_counts_errors_in_their_places(monkeypatch):
    """TF takes items in the order they were handed on, errors included.

    A refused batch is an item too: counting only batches would take every
    later unit as finished one batch early (a dying worker would lose it).
    """
    from tfray._internal.distribute import dynamic

    error = ValueError("refused")
    resolver = ScriptedResolver([[("a", 1, None), ("b", None, error), ("c", 3, None)], []])
    monkeypatch.setattr(dynamic, "RefResolver", resolver.instead_of)
    units = RecordingUnits()
    taken = [0]
    epoch = dynamic.DynamicEpoch(units, None, lambda: taken[0])
    epoch.next_ready(0)
    assert units.taken == []  # Handed on, not yet taken.
    taken[0] = 2  # TF took a's batch and b's error.
    epoch.next_ready(0)
    assert units.taken == ["a", "b"]
    taken[0] = 3
    epoch.close()
    assert units.taken == ["a", "b", "c"]


def test_dynamic_epoch_counts_a_bundle_taken_once_tf_took_all_its_batches(monkeypatch):
    """A producer's bundle is one ref of its unit: finished only once TF took its last batch."""
    from tfray._internal.distribute import dynamic

    shard = Shard(3)
    first, second = Bundle(shard), Bundle(shard)
    resolver = ScriptedResolver([[(first, [10, 11, 12], None), (second, [13], None)], []])
    monkeypatch.setattr(dynamic, "RefResolver", resolver.instead_of)
    units = RecordingUnits()
    taken = [0]
    epoch = dynamic.DynamicEpoch(units, None, lambda: taken[0])
    assert epoch.next_ready(0) == [
        ("shard 3 batch 0", 10, None),
        ("shard 3 batch 1", 11, None),
        ("shard 3 batch 2", 12, None),
        ("shard 3 batch 3", 13, None),
    ]
    taken[0] = 2
    epoch.next_ready(0)
    assert units.taken == []  # One batch of the first bundle is still to be taken.
    taken[0] = 4
    epoch.close()
    assert units.taken == [first, second]
