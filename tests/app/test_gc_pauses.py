"""The serving process and the garbage collector: start-up's objects frozen out of full collections, every full
collection counted and timed on /v1/stats, the freeze given back when the server stops (app/gc_pauses.py)."""

from __future__ import annotations

import gc

import httpx

from app.gc_pauses import GcPauses
from tests.app.conftest import start_server


def test_a_ready_server_has_frozen_start_up_and_times_each_full_collection():
    gc.unfreeze()
    server = start_server()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # modules, torch, the engine: what start-up built
        before = httpx.get(server.base_url + "/v1/stats").json()["gc"]
        # counted at the freeze: frozen objects still die by reference counting, so never fewer than now
        assert before["frozen_objects"] >= frozen > 10_000
        gc.collect()  # a full collection, as the interpreter runs one under allocation pressure
        after = httpx.get(server.base_url + "/v1/stats").json()["gc"]
        assert after["full_collections"] == before["full_collections"] + 1
        assert after["full_pause_s_total"] > before["full_pause_s_total"]
        assert after["full_pause_s_max"] >= after["full_pause_s_total"] - before["full_pause_s_total"] > 0
    finally:
        server.stop()
    assert gc.get_freeze_count() == 0  # a stopped server's cycles are collectable again


def test_stats_polls_never_walk_the_frozen_heap(monkeypatch):
    """gc.get_freeze_count() walks the whole permanent generation under the GIL (~20 ms for 300k objects): called by
    every /v1/stats, a 20 Hz poll stalled decode by a third. The count is taken once, at the freeze."""
    gc.unfreeze()
    server = start_server()
    try:
        frozen = gc.get_freeze_count()

        def walk():
            raise AssertionError("/v1/stats walked the permanent generation")

        monkeypatch.setattr(gc, "get_freeze_count", walk)
        for _ in range(3):
            r = httpx.get(server.base_url + "/v1/stats")
            assert r.status_code == 200, r.text
            assert r.json()["gc"]["frozen_objects"] >= frozen > 10_000
        monkeypatch.undo()
    finally:
        server.stop()
    assert gc.get_freeze_count() == 0


def test_only_full_collections_are_counted_each_with_its_own_pause():
    ticks = iter([1.0, 1.25, 5.0, 5.5])
    pauses = GcPauses(clock=lambda: next(ticks))
    pauses._on_gc("start", {"generation": 0})  # young collections: not counted, no clock read
    pauses._on_gc("stop", {"generation": 0})
    for phase in ("start", "stop", "start", "stop"):
        pauses._on_gc(phase, {"generation": 2})
    snap = pauses.snapshot()
    assert (snap["full_collections"], snap["full_pause_s_total"], snap["full_pause_s_max"]) == (2, 0.75, 0.5)
