"""scripts/bench_prefix_cache.py at tiny scale on the CPU: against the fake model and the demo model
(the real wiring), it measures both turns, sees turn 2 hit the cache and writes its JSON record."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from app.containers import Container
from app.serving import RunningServer
from app.settings import ServeSettings
from tests.app.conftest import start_server

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_prefix_cache.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_prefix_cache"] = module
    spec.loader.exec_module(module)
    return module


def run_bench(url: str, out: Path, *extra: str) -> tuple[int, dict]:
    code = load_bench().main(["--url", url, "--out", str(out), "--repeats", "2", "--max-tokens", "4", *extra])
    return code, json.loads(out.read_text())


def test_bench_against_the_fake_model_records_both_turns_and_the_cache_hit(tmp_path):
    server = start_server(kv_tokens=4096)
    try:
        code, record = run_bench(server.base_url, tmp_path / "fake.json", "--prefix-tokens", "600",
                                 "--max-ratio", "100")
        strict, _ = run_bench(server.base_url, tmp_path / "strict.json", "--prefix-tokens", "600",
                              "--max-ratio", "0")
    finally:
        server.stop()
    assert code == 0 and record["ok"] and record["every_turn2_hit_the_cache"], record
    assert strict == 1  # a ratio no run can meet fails with exit 1
    for r in record["repeats"]:
        assert 500 <= r["turn1"]["prompt_tokens"] <= 800, r  # calibrated to the asked prefix length
        assert r["turn2"]["cached_tokens"] >= r["turn1"]["prompt_tokens"] - 16 - 4  # all but < 1 page + answer
        assert r["turn1"]["cached_tokens"] == 0  # a fresh prefix per repeat
    assert record["server_after"]["prefix_cache"]["hits"] >= 2


def test_bench_against_the_demo_model(tmp_path):
    pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")
    server = RunningServer(Container(), ServeSettings(port=0, device="cpu", max_running_requests=2))
    server.start(wait_ready=120)
    try:
        code, record = run_bench(server.base_url, tmp_path / "demo.json", "--prefix-tokens", "500",
                                 "--max-ratio", "100")
    finally:
        server.stop()
    assert code == 0 and record["every_turn2_hit_the_cache"], record
    assert all(r["turn2"]["cached_tokens"] >= 400 for r in record["repeats"]), record["repeats"]
