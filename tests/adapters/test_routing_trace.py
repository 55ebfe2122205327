"""The routing-trace recorder: TorchExecutor serving batched, chunked requests records, per token, the
experts transformers' router selects for the same tokens, in the file format the simulator replays.

Shape legend: T tokens, K top-k.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapters.torch_exec.executor import TorchExecutor
from adapters.torch_exec.routing_trace import RoutingTraceRecorder
from simulator.routing import load_trace
from tests.adapters.torch_exec_models import (
    QWEN3_5_CONFIGS,
    Sequence,
    build_hf_model,
    make_plan,
    pages_for,
    run_requests,
    save_and_load,
)

NEW_TOKENS = 5
PROMPT_LENGTHS = {"long": 11, "short": 2, "mid": 7}


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def hf_router_choices(model, tokens: list[int]) -> list[list[list[int]]]:
    """[T][L][K] expert ids transformers' routers select for `tokens` in one forward pass."""
    picks: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _in, out, i=i: picks.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    per_layer = torch.stack([picks[i] for i in range(len(picks))], dim=1)  # [T, L, K]
    return per_layer.tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Three requests of different lengths batched with chunked prefill through a recording executor."""
    tmp = tmp_path_factory.mktemp("routing")
    model = build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"])
    ckpt = save_and_load(model, tmp / "ckpt")
    trace = tmp / "trace.jsonl"
    recorder = RoutingTraceRecorder(trace, ckpt.spec.num_layers)
    executor = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=ckpt.spec.top_k + 1), "cpu", torch.float32,
                             routing_recorder=recorder)
    gen = torch.Generator().manual_seed(3)
    seqs = [Sequence(name, torch.randint(0, 96, (n,), generator=gen).tolist(), pages_for(i, n + NEW_TOKENS + 1), i)
            for i, (name, n) in enumerate(PROMPT_LENGTHS.items())]
    run_requests(executor, seqs, NEW_TOKENS, chunk=3)
    recorder.close()
    return model, tmp / "ckpt", trace, seqs, recorder


def test_recorded_experts_equal_transformers_router(served):
    model, _, trace, seqs, recorder = served
    lines = read_lines(trace)
    assert set(lines[0]) == {"stream", "position", "layer_experts"}
    by_stream: dict[str, list[dict]] = {}
    for line in lines:
        by_stream.setdefault(line["stream"], []).append(line)
    assert set(by_stream) == set(PROMPT_LENGTHS)
    for s in seqs:
        computed = s.tokens[:-1]  # the last sampled token was never fed back
        records = by_stream[s.request_id]
        assert [r["position"] for r in records] == list(range(len(computed)))
        ours = [[sorted(row) for row in r["layer_experts"]] for r in records]
        ref = [[sorted(row) for row in token] for token in hf_router_choices(model, computed)]
        assert ours == ref, s.request_id
    assert recorder.tokens_written == len(lines) == sum(len(s.tokens) - 1 for s in seqs)
    assert recorder.dropped_tokens == 0


def test_simulator_loads_the_trace(served):
    _, _, trace, seqs, _ = served
    streams = load_trace(trace)
    assert {name: len(tokens) for name, tokens in streams.items()} == {s.request_id: len(s.tokens) - 1 for s in seqs}
    assert all(len(token) == 4 and all(len(row) == 2 for row in token) for t in streams.values() for token in t)


def test_simulator_predict_replays_the_trace(served):
    _, ckpt_dir, trace, _, _ = served
    out = subprocess.run([sys.executable, "-m", "simulator", "predict", "--hardware", "rtx3090", "--model",
                          str(ckpt_dir), "--routing", f"trace:{trace}", "--kv", "8192", "--batch", "1",
                          "--workers", "1", "--json"], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    points = json.loads(out.stdout)
    assert len(points) == 1 and points[0]["decode_tok_s"] > 0, points


# ---- the recorder on its own -------------------------------------------------------------------------
def ids(*rows) -> torch.Tensor:
    return torch.tensor(rows)  # [T, K]


def test_recompute_after_preemption_is_not_written_twice_and_gaps_drop(tmp_path):
    rec = RoutingTraceRecorder(tmp_path / "t.jsonl", num_layers=2)
    for spans, layer0, layer1 in [
        ([("a", 0, 2)], ids([0, 1], [2, 3]), ids([4, 5], [6, 7])),
        ([("a", 0, 3)], ids([9, 9], [9, 9], [1, 2]), ids([9, 9], [9, 9], [3, 4])),  # re-prefill after preemption
        ([("b", 1, 1), ("a", 3, 1)], ids([5, 6], [7, 0]), ids([1, 1], [2, 2])),  # b starts past a gap
    ]:
        rec.begin_pass(spans)
        rec.record_layer(0, layer0)
        rec.record_layer(1, layer1)
        rec.end_pass()
        rec.check_valid()
    rec.close()
    lines = read_lines(tmp_path / "t.jsonl")
    assert [(x["stream"], x["position"]) for x in lines] == [("a", 0), ("a", 1), ("a", 2), ("a", 3)]
    assert lines[1]["layer_experts"] == [[2, 3], [6, 7]]  # the first recording wins
    assert lines[2]["layer_experts"] == [[1, 2], [3, 4]]
    assert lines[3]["layer_experts"] == [[7, 0], [2, 2]]
    assert rec.dropped_tokens == 1 and rec.tokens_written == 4
    assert set(load_trace(tmp_path / "t.jsonl")) == {"a"}


def test_misuse_is_refused(tmp_path):
    rec = RoutingTraceRecorder(tmp_path / "t.jsonl", num_layers=2)
    with pytest.raises(RuntimeError, match="outside a pass"):
        rec.record_layer(0, ids([1, 2]))
    rec.begin_pass([("a", 0, 1)])
    assert rec.can_begin_pass() == "the previous pass has not ended"
    with pytest.raises(ValueError, match="pass has 1 tokens"):
        rec.record_layer(0, ids([1, 2], [3, 4]))
    with pytest.raises(ValueError, match="outside"):
        rec.record_layer(2, ids([1, 2]))
    rec.record_layer(0, ids([1, 2]))
    with pytest.raises(RuntimeError, match=r"layers \[1\] did not route"):
        rec.end_pass()
    assert rec.can_begin_pass() is None
    rec.close()
    assert rec.can_begin_pass() == "the recorder is closed"
    assert (tmp_path / "t.jsonl").read_text() == ""
    with pytest.raises(ValueError, match=">= 1 routed layer"):
        RoutingTraceRecorder(tmp_path / "u.jsonl", num_layers=0)
