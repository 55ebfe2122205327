"""scripts/soak.py, briefly, against the fake model: 0 x 5xx and nothing held afterwards."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from tests.app.conftest import make_container, start_server

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_brief_soak_with_disconnects_timeouts_and_live_resizes_leaves_nothing_held():
    srv = start_server(make_container(delay=0.001), kv_tokens=1024, max_running_requests=4)
    try:
        record = asyncio.run(load_soak().soak(srv.base_url, requests=120, concurrency=8, resizes=4, seed=3))
    finally:
        srv.stop()
    assert record["ok"], record
    outcomes = record["outcomes"]
    assert outcomes.get("200", 0) > 40 and outcomes.get("disconnected", 0) > 5, outcomes
    assert record["admitted"] == record["finished"] > 0
    assert record["resizes_applied"] >= 1, record
