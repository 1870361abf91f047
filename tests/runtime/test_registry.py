"""The registry: a source's epochs (SourceEpochs) and the offer of one started ahead, without
Ray; a dataset collected in the middle of the registry's work, with it."""

import threading

import numpy as np
import pytest
import ray
from conftest import wait_until

import tfray
from tfray._internal.runtime import registry, runtime
from tfray._internal.runtime.registry import SourceEpochs

pytestmark = pytest.mark.timeout(30)

MB = 1 << 20


# The offer of an epoch started ahead (the dispatcher's side of it).


class FakeChannel:
    claimed = False  # The native registry sets it when an iterator takes the offer.

    def stats(self):
        return {"queued": 1}


class FakeFeeder:
    def __init__(self):
        self.channel = FakeChannel()
        self.done = threading.Event()  # Set once it has filled its channel.


@pytest.fixture
def epochs():
    return SourceEpochs(source=None)


def test_one_offer_at_a_time_and_only_when_published(epochs):
    first, second = FakeFeeder(), FakeFeeder()
    assert not epochs.offer(first, publish=lambda: False)  # The native registry refused it.
    assert not epochs.view(replayed=False).offered
    assert epochs.offer(first, publish=lambda: True)
    assert epochs.view(replayed=False).offered
    assert not epochs.offer(second, publish=lambda: True)  # One at a time.


def test_an_offer_counts_as_an_epoch_once_taken(epochs):
    offered = FakeFeeder()
    epochs.offer(offered, publish=lambda: True)
    view = epochs.view(replayed=False)
    assert view.recent == () and view.epochs == 0  # Not read yet: not an epoch in stats().
    assert view.offered_queued == 1
    offered.channel.claimed = True  # An iterator took it natively.
    view = epochs.view(replayed=False)
    assert not view.offered  # The next epoch may be offered already.
    assert view.recent == (offered,)
    # The dispatcher heard of it: it counts, and is the feeder it finds.
    assert epochs.offer_taken(offered.channel) is offered
    view = epochs.view(replayed=False)
    assert not view.offered and view.recent == (offered,) and view.epochs == 1


def test_an_offered_epoch_is_found_by_its_channel_before_and_after_it_is_taken(epochs):
    """Its end may reach the dispatcher either side of an iterator taking it."""
    offered, other = FakeFeeder(), FakeFeeder()
    epochs.began(other)
    epochs.offer(offered, publish=lambda: True)
    assert epochs.find(offered.channel) is offered
    offered.channel.claimed = True
    assert epochs.find(offered.channel) is offered
    assert epochs.find(FakeChannel()) is None


def test_forgetting_an_offer_no_iterator_took(epochs):
    epochs.offer(FakeFeeder(), publish=lambda: True)
    epochs.forget_offer()
    view = epochs.view(replayed=False)
    assert not view.offered and view.recent == ()


# A dataset collected while the registry works on its source.


@pytest.mark.usefixtures("ray_session")
def test_a_dataset_collected_inside_the_registrys_lock_hangs_nothing(monkeypatch):
    """Its finalizer runs in whichever thread the collector ran, holding whatever lock that held.

    Here the last reference goes while a view of its source is being made,
    under that source's lock, as the garbage collector may do at any
    allocation: the registry must only note it then (and forget it later).
    """
    refs = [ray.put(np.full((4, 4), i, np.float32)) for i in range(3)]
    held = [tfray.Dataset(refs)]
    assert len(list(held[0])) == 3
    key = held[0].source_key
    made_view = registry.SourceView

    def view_as_the_dataset_goes(**fields):
        held.clear()  # Its last reference: its finalizer runs here, in this thread.
        return made_view(**fields)

    monkeypatch.setattr(registry, "SourceView", view_as_the_dataset_goes)
    viewer = threading.Thread(target=runtime.get().registry.view, args=(key,), daemon=True)
    viewer.start()
    viewer.join(10)
    assert not viewer.is_alive(), "making a view hung: the finalizer waited on the lock its thread held"
    assert not held
    monkeypatch.undo()
    wait_until(lambda: runtime.get().registry.view(key) is None)
