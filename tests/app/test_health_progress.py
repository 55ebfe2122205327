"""/health while the real loader reads the embedded demo model: the byte count moves through
intermediate values (expert banks, then dense weights) without going back, then ok."""

from __future__ import annotations

import threading
import time
from itertools import pairwise

import httpx
import pytest

from adapters.checkpoint.loader import PhaseCounter
from app.containers import Container
from app.runtime import LoadingProgress
from tests.app.conftest import start_server


def poll_health(url: str, stop: threading.Event, seen: list[dict]) -> None:
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            body = client.get(url).json()
            seen.append(body)
            if body["status"] != "loading":
                return
            time.sleep(0.002)


def test_health_reports_real_load_progress_then_ok(monkeypatch):
    report = PhaseCounter._report
    calls: list[tuple[str, int, int]] = []
    seen: list[dict] = []

    def slowed(self):
        # NOTE: slowed at the loader's side, so how the app folds the counts is what is tested. Each report
        # waits for two more /health answers (the first may predate it), not a fixed sleep: the demo model
        # loads in well under a second, and a slow machine's poller must still see each step.
        calls.append((self.phase, self.done, self.total))
        report(self)
        answers, deadline = len(seen), time.monotonic() + 2
        while len(seen) < answers + 2 and time.monotonic() < deadline:
            time.sleep(0.002)

    monkeypatch.setattr(PhaseCounter, "_report", slowed)
    srv = start_server(Container(), wait=False)
    stop = threading.Event()
    poller = threading.Thread(target=poll_health, args=(srv.base_url + "/health", stop, seen), daemon=True)
    poller.start()
    try:
        assert srv.runtime.wait_ready(60), srv.runtime.error
        poller.join(10)
    finally:
        stop.set()
        srv.stop()

    loading = [b for b in seen if b["status"] == "loading"]
    assert seen[-1]["status"] == "ok" and seen[-1]["bytes_done"] == seen[-1]["bytes_total"] > 0
    assert all(b["bytes_done"] <= b["bytes_total"] for b in seen)
    dones = [b["bytes_done"] for b in seen]
    back = [(a, b) for a, b in pairwise(dones) if b < a]
    assert not back, f"bytes_done went back {len(back)} times, first {back[0]}"
    totals = [b["bytes_total"] for b in seen]
    assert totals == sorted(totals)
    middle = [b for b in loading if 0 < b["bytes_done"] < b["bytes_total"]]
    assert middle, f"no intermediate progress seen in {len(loading)} loading answers"
    assert {b["phase"] for b in middle} <= {"expert banks", "dense weights"}
    assert len({b["bytes_done"] for b in middle}) >= 3, "progress should move in steps, not jump"

    spec = srv.runtime.engine.spec
    assert {p for p, _, _ in calls} == {"expert banks", "dense weights"}
    assert len([c for c in calls if c[0] == "expert banks"]) == 1 + spec.total_experts  # announce + a row each
    assert seen[-1]["bytes_total"] == sum({phase: total for phase, _, total in calls}.values())


def test_advance_folds_phases_into_one_running_count():
    p = LoadingProgress()
    p.advance("expert banks", 0, 100)
    p.advance("expert banks", 60, 100)
    assert (p.phase, p.bytes_done, p.bytes_total) == ("expert banks", 60, 100)
    p.advance("expert banks", 100, 100)
    p.advance("dense weights", 0, 30)
    assert (p.bytes_done, p.bytes_total) == (100, 130)
    p.advance("dense weights", 30, 30)
    assert (p.phase, p.bytes_done, p.bytes_total) == ("dense weights", 130, 130)
    p.update("planning pools", p.bytes_done, p.bytes_total)
    p.check_valid()


@pytest.mark.parametrize(("before", "bad"), [
    ([("expert banks", 60, 100)], ("expert banks", 50, 100)),  # count goes back
    ([("expert banks", 60, 100)], ("expert banks", 70, 120)),  # a phase's total changes
    ([], ("expert banks", 5, 4)),  # more done than total
    ([("expert banks", 100, 100), ("dense weights", 0, 30)], ("expert banks", 100, 100)),  # phase revisited
])
def test_advance_refuses_counts_that_go_back_or_out_of_order(before, bad):
    p = LoadingProgress()
    for call in before:
        p.advance(*call)
    assert not p.can_advance(*bad)
    with pytest.raises(ValueError, match="went back or out of order"):
        p.advance(*bad)
    p.check_valid()
