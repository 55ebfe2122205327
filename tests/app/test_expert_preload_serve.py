"""Every expert resident from the first request, through the server: the embedded demo model (4 layers x 8
experts) on the CPU, whose plan holds all 32, prints the fill as a start-up phase before it is ready, serves its
first request from hits only (/v1/stats' hit rate 1.0), and a live resize that rebuilds the expert pool at every
expert fills it again (said in the rebuild's answer), one at part of them does not."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from app.bench.cold_start import PHASE_MILESTONES, phase_end, phases
from app.containers import Container
from app.resize_coordinator import experts_note
from app.serving import RunningServer
from app.settings import ServeSettings

pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")
from app.demo_model import DEMO_MODEL_NAME  # noqa: E402

KEYS = 4 * 8


def test_cold_start_records_the_end_of_the_fill_as_experts_resident():
    lines = [(1.0, "[  0.90s] building executor"),
             (1.2, "[  1.10s] making experts resident: 10240 experts from the host bank"),
             (1.8, "[  1.70s] experts resident: 10240/10240 in 0.5 s (10240 copied, 17.0 GiB, 34.0 GB/s)"),
             (1.9, "[  1.80s] capturing decode graphs for batch sizes 1, 2, 4"),
             (4.5, "[  4.40s] decode graphs captured in 2.6 s")]
    ends = {name: phase_end(phases(lines), needle) for name, needle in PHASE_MILESTONES}
    assert ends["experts_resident"] == 1.8 and ends["graph_capture_done"] == 4.5
    # a partial plan fills by use: the server never reports the phase, and the milestone is null
    assert phase_end(phases(lines[:1] + lines[3:]), "making experts resident") is None


def test_the_resize_note_says_whether_a_rebuilt_pool_is_filled():
    full, part = SimpleNamespace(partial_residency=False), SimpleNamespace(partial_residency=True)  # PoolPlan's
    assert experts_note(SimpleNamespace(experts_kept=True, target=full)) == "expert slots kept warm"
    assert experts_note(SimpleNamespace(experts_kept=False, target=full)) == \
        "expert pool rebuilt: every expert made resident"
    assert experts_note(SimpleNamespace(experts_kept=False, target=part)).endswith("expert slots start cold")
    # expert parallelism: every rank's plan (each against the keys it owns) must hold all of them
    assert experts_note(SimpleNamespace(experts_kept=False, target=(full, part))).endswith("start cold")
    assert experts_note(SimpleNamespace(experts_kept=False, target=(full, full))).endswith("made resident")


def _chat(server, question: str) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": DEMO_MODEL_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 4,
        "temperature": 0})
    assert r.status_code == 200, r.text


def test_a_server_holding_every_expert_fills_them_before_it_is_ready(capsys):
    server = RunningServer(Container(), ServeSettings(port=0, device="cpu", moe_slots=KEYS), echo=True)
    server.start(wait_ready=120)
    try:
        order = [p["phase"] for p in phases([(i, line.strip()) for i, line in
                                             enumerate(capsys.readouterr().err.splitlines())])]
        start = order.index(f"making experts resident: {KEYS} experts from the host bank")
        assert order[start + 1].startswith(f"experts resident: {KEYS}/{KEYS} in ")
        assert order[start - 1] == "building executor" and order[-1].startswith("ready: serving")
        executor = server.runtime.engine.executor
        assert executor.expert_preload.resident == KEYS and executor.expert_counters() == (0, 0)
        _chat(server, "What is 19 + 23?")
        window = httpx.get(server.base_url + "/v1/stats").json()["window"]
        assert window["expert_hit_rate"] == 1.0  # the first request already finds every expert resident
        assert executor.expert_counters()[1] == 0
        # a live resize to part of the experts: rebuilt cold, fills by use
        r = httpx.post(server.base_url + "/v1/cache/rebuild", json={"moe_slots": KEYS // 2}, timeout=60)
        assert r.status_code == 200 and r.json()["kept"] == "expert pool rebuilt: expert slots start cold", r.text
        assert executor.expert_preload is None and executor.experts.residency.num_resident == 0
        # ... and back to every expert: filled again before the resize returns
        r = httpx.post(server.base_url + "/v1/cache/rebuild", json={"moe_slots": KEYS}, timeout=60)
        assert r.status_code == 200 and r.json()["kept"] == "expert pool rebuilt: every expert made resident", r.text
        assert executor.expert_preload.resident == KEYS and executor.experts.residency.num_resident == KEYS
        misses = executor.expert_counters()[1]
        _chat(server, "What is 7 - 30?")
        assert executor.expert_counters()[1] == misses
    finally:
        server.stop()
