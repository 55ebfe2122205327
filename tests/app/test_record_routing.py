"""`ft serve --record-routing FILE` on the embedded demo model writes one routing line per computed token."""

from __future__ import annotations

import json

import httpx
import pytest

from app.demo_model import DEMO_MODEL_NAME
from tests.app.processes import FtServe

pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")


def test_serve_record_routing_writes_a_line_per_computed_token(tmp_path):
    trace = tmp_path / "routing.jsonl"
    # NOTE: --port 0, its URL read from its output: a free port picked here could be taken before it binds
    server = FtServe(["--port", "0", "--device", "cpu", "--record-routing", str(trace)])
    try:
        server.wait_ready(120)
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": DEMO_MODEL_NAME, "messages": [{"role": "user", "content": "What is 19 + 23?"}],
            "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
    finally:
        server.stop(30)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    # every prompt token and every generated one except the last (it was never fed back)
    assert len(lines) == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert len({x["stream"] for x in lines}) == 1
    assert [x["position"] for x in lines] == list(range(len(lines)))
    for x in lines:  # the demo model: 4 layers, top-2 of 8 experts
        assert len(x["layer_experts"]) == 4
        assert all(len(row) == 2 and len(set(row)) == 2 and all(0 <= e < 8 for e in row) for row in x["layer_experts"])
