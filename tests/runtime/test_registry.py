"""A source's epochs in the registry (SourceEpochs): the offer of an epoch started ahead, without Ray."""

import threading

import pytest

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
