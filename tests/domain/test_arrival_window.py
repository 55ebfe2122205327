"""domain.arrival_window: how long an idle engine's first step waits for the rest of a burst."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.arrival_window import QUIET_S, ArrivalWindow


def test_a_burst_ends_when_quiet_or_at_the_cap():
    w = ArrivalWindow(0.010, quiet_s=0.002)
    assert w.remaining(now=0.0, first=0.0, last=0.0) == pytest.approx(0.002)  # one submission: wait quiet_s
    assert w.remaining(now=0.0015, first=0.0, last=0.0015) == pytest.approx(0.002)  # another came: again
    assert w.remaining(now=0.0035, first=0.0, last=0.0015) == 0.0  # quiet for 2 ms: go
    assert w.remaining(now=0.0095, first=0.0, last=0.0095) == pytest.approx(0.0005)  # the cap cuts the quiet wait
    assert w.remaining(now=0.011, first=0.0, last=0.0105) == 0.0


def test_zero_never_waits_and_the_default_quiet_gap():
    assert ArrivalWindow(0.0).remaining(5.0, 5.0, 5.0) == 0.0
    assert ArrivalWindow(1.0).quiet_s == QUIET_S


@pytest.mark.parametrize("bad", [-0.001, math.inf, math.nan, "5", None])
def test_bad_windows_are_refused(bad):
    with pytest.raises(ValueError, match="arrival window"):
        ArrivalWindow(bad)
    with pytest.raises(ValueError, match="arrival window"):
        ArrivalWindow(0.01, quiet_s=bad)


@given(st.floats(0, 1), st.floats(0, 1), st.lists(st.floats(0, 0.1), max_size=20))
def test_the_wait_never_passes_the_cap_nor_the_quiet_gap(max_s, quiet_s, gaps):
    w = ArrivalWindow(max_s, quiet_s=quiet_s)
    last = 0.0
    for gap in gaps:
        last += gap
        left = w.remaining(now=last, first=0.0, last=last)
        assert 0.0 <= left <= quiet_s + 1e-12 and last + left <= max_s + 1e-12 or left == 0.0
