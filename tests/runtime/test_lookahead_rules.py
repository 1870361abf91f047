"""The look-ahead's rules, without Ray: when it grows, shrinks and stays."""


import pytest

from tfray._internal.runtime import lookahead as lookahead_lib
from tfray._internal.runtime.lookahead import LookAhead

pytestmark = pytest.mark.timeout(30)

MB = 1 << 20


# The look-ahead.


def test_lookahead_doubles_only_while_tensorflow_waits_up_to_its_cap():
    la = LookAhead(start=2, cap=16)
    waited = 0.0
    limits = []
    for _ in range(6):
        waited += 0.01  # TF waited 10 ms since the last check.
        limits.append(la.update(waited))
    assert limits == [4, 8, 16, 16, 16, 16]
    assert la.update(waited) == 16  # No new wait: it stays.


def test_lookahead_keeps_what_it_pins_within_the_budget_and_shrinks_to_it():
    changes = []
    la = LookAhead(start=8, cap=64, budget_bytes=64 * MB, on_change=changes.append)
    la.observe(16 * MB)  # Twice the look-ahead (window and channel) must fit in 64 MB.
    assert la.update(0.0) == 2
    la.update(1.0)
    assert la.limit == 2 and changes == [2]
    small = LookAhead(start=2, cap=64, budget_bytes=64 * MB)
    small.observe(MB)
    assert small.update(1.0) == 4  # Room for 32 batches of 1 MB: it may grow.


def test_lookahead_never_falls_below_one_batch():
    la = LookAhead(start=2, budget_bytes=MB)
    la.observe(100 * MB)
    assert la.update(1.0) == 1


def test_a_fixed_lookahead_does_not_adapt():
    la = LookAhead(fixed=5)
    assert not la.adaptive
    la.observe(100 * MB)
    assert la.update(10.0) == 5


def test_short_waits_are_noise():
    la = LookAhead(start=2)
    assert la.update(lookahead_lib._WAIT_S / 2) == 2
