"""Routing replay (`ft serve --routing-replay`) in both executors, on tiny random Qwen3.5 MoE models.

- the routing_replace kernel (Triton's interpreter on the CPU) against route(..., replace=ids);
- the reference TorchExecutor: a trace recorded from natural routing, replayed, gives exactly the recorded
  ids and reproduces the natural run bitwise (the replacement keeps the router's probabilities); a locality
  replay routes every token exactly as the simulator's stream for its key says; switched off, it is natural;
- the fast CudaGraphExecutor (eager decode over the static replay table on the CPU) honours the replacement
  as the reference does: same tokens, logits within 1e-4 of the logit scale, the same expert-cache decisions.

Shape legend: T tokens, E experts, K top-k, KO = K + 1 (the shared gate's column).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.routing_replay import KEEP, DeviceRoutingTable
from adapters.kernels.moe_router import moe_router
from adapters.kernels.routing_replace import routing_replace
from adapters.torch_exec.executor import TorchExecutor
from adapters.torch_exec.moe import route
from adapters.torch_exec.routing_replay import RoutingReplayer
from adapters.torch_exec.routing_trace import RoutingTraceRecorder
from domain.routing_streams import stream_key
from simulator.replay_source import replay_source
from tests.adapters.torch_exec_models import (
    QWEN3_5_CONFIGS,
    Sequence,
    build_hf_model,
    make_plan,
    pages_for,
    run_requests,
    save_and_load,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [2, 33, 71], [8, 1, 4, 4, 90, 12, 6, 7, 19, 23]]
NEW_TOKENS = 5
LOCALITY = "locality:p_prev=0.5,p_recent=0.3,seed=7"


# ---- the kernel ------------------------------------------------------------------------------------------
def _router_case(t=6, h=24, e=12, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w = torch.randn(e, h, generator=gen)
    g = torch.randn(1, h, generator=gen) * 0.1
    table = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)  # [T, K]
    return x, w, g, table


@pytest.mark.parametrize("renorm", [True, False])
def test_kernel_gives_the_router_probabilities_at_the_replayed_ids(renorm):
    x, w, g, table = _router_case()
    k = table.shape[1]
    x, w, g, table = (a.to(DEVICE) for a in (x, w, g, table))
    logits = x @ w.T  # [T, E]
    weights, ids = moe_router(x, w, k, renorm, g, logits=logits)  # [T, KO]
    gate = weights[:, k].clone()
    routing_replace(logits, table, weights, ids[:, :k], renorm)
    want_w, want_i = route(x, w, k, renorm, replace=table)
    assert torch.equal(ids[:, :k].cpu(), want_i.cpu()) and torch.equal(ids[:, k].cpu(), torch.full((6,), 12))
    assert torch.allclose(weights[:, :k], want_w, rtol=1e-5, atol=1e-7)
    assert torch.equal(weights[:, k], gate)  # the shared gate's column is not touched
    if renorm:
        assert torch.allclose(weights[:, :k].sum(1), torch.ones(6, device=DEVICE))


def test_kernel_keeps_rows_marked_keep_and_reads_a_layer_slice_of_a_table():
    x, w, g, table = _router_case(t=5, seed=1)
    k = table.shape[1]
    x, w, g = x.to(DEVICE), w.to(DEVICE), g.to(DEVICE)
    logits = x @ w.T
    weights, ids = moe_router(x, w, k, True, g, logits=logits)
    before_w, before_i = weights.clone(), ids.clone()
    full = torch.full((5, 2, k), KEEP, dtype=torch.int32)  # [T, L=2, K]; layer 1 is the one used
    full[:, 1] = table
    full[3, 1] = KEEP
    routing_replace(logits, full[:, 1].to(DEVICE), weights, ids[:, :k], True)
    assert torch.equal(weights[3], before_w[3]) and torch.equal(ids[3], before_i[3])
    changed = [r for r in range(5) if r != 3]
    assert torch.equal(ids[changed, :k].cpu(), table[changed].long())


def test_kernel_refuses_bad_shapes():
    logits = torch.zeros(2, 8, device=DEVICE)
    w, i = torch.zeros(2, 3, device=DEVICE), torch.zeros(2, 3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="table"):
        routing_replace(logits, torch.zeros(3, 2, dtype=torch.int32, device=DEVICE), w, i, True)
    with pytest.raises(ValueError, match="logits"):
        routing_replace(logits.double(), torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), w, i, True)
    with pytest.raises(ValueError, match="ids"):
        routing_replace(logits, torch.zeros(2, 3, dtype=torch.int32, device=DEVICE), w, i[:, :2].int(), True)


def test_the_device_table_stages_rows_and_keeps_the_rest():
    table = DeviceRoutingTable(4, 2, 3, DEVICE)
    ids = torch.arange(12, dtype=torch.int32).reshape(2, 2, 3).numpy()
    table.stage(ids, 2)
    assert torch.equal(table.view(2).cpu(), torch.from_numpy(ids))
    assert (table.table[2:] == KEEP).all()
    table.stage(None, 3)  # switched off: every row keeps the router's choice
    assert (table.table == KEEP).all()
    with pytest.raises(ValueError, match="exceed"):
        table.stage(None, 5)


# ---- the executors ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    model = build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"])
    path = tmp_path_factory.mktemp("replay") / "ckpt"
    save_and_load(model, path)
    return path


@pytest.fixture(scope="module")
def ckpt(ckpt_dir):
    from adapters.checkpoint.loader import load_checkpoint

    return load_checkpoint(ckpt_dir, progress=False)


def _replayer(ckpt, spec: str) -> RoutingReplayer:
    s = ckpt.spec
    return RoutingReplayer(replay_source(spec, s.num_layers, s.num_experts, s.top_k), s.num_layers, s.num_experts,
                           s.top_k)


def _seqs(prefix: str = "r"):
    return [Sequence(f"{prefix}{i}", p, pages_for(i, len(p) + NEW_TOKENS + 1), state_slot=i)
            for i, p in enumerate(PROMPTS)]


def _serve(executor, prefix="r", record=None):
    seqs = _seqs(prefix)
    run_requests(executor, seqs, NEW_TOKENS, chunk=4, record=record)
    return [s.output for s in seqs]


def _streams(path: Path) -> list[list[list[list[int]]]]:
    """[stream in order of first appearance][position][layer][k]."""
    by: dict[str, list] = {}
    for line in path.read_text().splitlines():
        x = json.loads(line)
        rows = by.setdefault(x["stream"], [])
        assert x["position"] == len(rows)
        rows.append(x["layer_experts"])
    return list(by.values())


def _reference(ckpt, slots, replay=None, recorder=None):
    return TorchExecutor(ckpt, make_plan(ckpt, expert_slots=slots), DEVICE, torch.float32, routing_recorder=recorder,
                         routing_replay=replay)


def test_a_replayed_natural_trace_gives_the_recorded_ids_and_the_natural_run(ckpt, tmp_path):
    slots = ckpt.spec.top_k * 4
    t1, t2 = tmp_path / "natural.jsonl", tmp_path / "replayed.jsonl"
    natural_logits, replay_logits = {}, {}
    rec1 = RoutingTraceRecorder(t1, ckpt.spec.num_layers)
    natural = _reference(ckpt, slots, recorder=rec1)
    out1 = _serve(natural, "a", natural_logits)
    rec1.close()
    rec2 = RoutingTraceRecorder(t2, ckpt.spec.num_layers)
    replayed = _reference(ckpt, slots, replay=_replayer(ckpt, f"trace:{t1}"), recorder=rec2)
    out2 = _serve(replayed, "b", replay_logits)
    rec2.close()
    assert _streams(t2) == _streams(t1)  # stream k in order of first use replays the file's stream k
    assert out2 == out1
    for (rid, rows), (_, rows2) in zip(natural_logits.items(), replay_logits.items(), strict=True):
        for a, b in zip(rows, rows2, strict=True):
            assert torch.equal(a, b), rid  # the same ids with the router's own weights: bitwise natural
    assert (replayed.expert_hits, replayed.expert_misses) == (natural.expert_hits, natural.expert_misses)
    assert replayed.routing_replay.tokens_replaced == sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)


def test_a_locality_replay_routes_every_token_as_the_simulator_stream_says(ckpt, tmp_path):
    trace = tmp_path / "locality.jsonl"
    recorder = RoutingTraceRecorder(trace, ckpt.spec.num_layers)
    replay = _replayer(ckpt, LOCALITY)
    executor = _reference(ckpt, ckpt.spec.top_k * 4, replay=replay, recorder=recorder)
    seqs = _seqs()
    run_requests(executor, seqs, NEW_TOKENS, chunk=4)
    recorder.close()
    # the simulator's own model, built afresh from the same spec: what python -m simulator would route
    oracle = replay_source(LOCALITY, ckpt.spec.num_layers, ckpt.spec.num_experts, ckpt.spec.top_k)
    recorded = _streams(trace)
    for s, got in zip(seqs, recorded, strict=True):
        first = Sequence(s.request_id, s.prompt, s.pages, s.state_slot).next_work(4)
        want = oracle.tokens(stream_key(first), 0, len(got))
        assert got == [[list(row) for row in token] for token in want], s.request_id
    natural_trace = tmp_path / "natural.jsonl"
    rec = RoutingTraceRecorder(natural_trace, ckpt.spec.num_layers)
    _serve(_reference(ckpt, ckpt.spec.top_k * 4, recorder=rec))
    rec.close()
    assert _streams(natural_trace) != recorded  # the replacement did replace
    executor.check_valid()


def test_switched_off_the_replay_routes_naturally(ckpt):
    slots = ckpt.spec.top_k * 4
    natural_logits, off_logits = {}, {}
    _serve(_reference(ckpt, slots), record=natural_logits)
    replay = _replayer(ckpt, LOCALITY)
    replay.set_active(False)
    executor = _reference(ckpt, slots, replay=replay)
    _serve(executor, record=off_logits)
    assert all(torch.equal(a, b) for rid in natural_logits for a, b in zip(natural_logits[rid], off_logits[rid],
                                                                             strict=True))
    assert replay.describe()["active"] is False and replay.tokens_replaced == 0


def test_a_replay_for_another_geometry_is_refused(ckpt):
    s = ckpt.spec
    source = replay_source("locality", s.num_layers + 1, s.num_experts, s.top_k)
    with pytest.raises(ValueError, match="does not fit the model"):
        RoutingReplayer(source, s.num_layers, s.num_experts, s.top_k)


@pytest.mark.parametrize("spec", [LOCALITY, "uniform:seed=3"])
def test_the_fast_executor_honours_the_replay_like_the_reference(ckpt, spec):
    slots = ckpt.spec.top_k * 4
    ref = _reference(ckpt, slots, replay=_replayer(ckpt, spec))
    fast = CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=slots), DEVICE, torch.float32, max_decode_rows=4,
                             prefill_kernels=True, routing_replay=_replayer(ckpt, spec))
    natural = CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=slots), DEVICE, torch.float32,
                                max_decode_rows=4, prefill_kernels=True)
    ref_logits, fast_logits = {}, {}
    assert _serve(fast, record=fast_logits) == _serve(ref, record=ref_logits)
    for rid, rows in ref_logits.items():
        for step, (ours, want) in enumerate(zip(fast_logits[rid], rows, strict=True)):
            err = (ours - want).abs().max().item()
            assert err <= 1e-4 * want.abs().max().item(), f"{rid} step {step}: {err}"
    # the same ids reached the device-side LRU: the same hits and misses, lookup for lookup
    assert (fast.expert_hits, fast.expert_misses) == (ref.expert_hits, ref.expert_misses)
    _serve(natural)
    assert (natural.expert_hits, natural.expert_misses) != (fast.expert_hits, fast.expert_misses)
    assert fast.routing_replay.tokens_replaced == ref.routing_replay.tokens_replaced > 0
    fast.check_valid()


def _switch_off_after(executor, steps: int):
    """The replay goes off (as `ft bench`'s natural pass turns it) after `steps` steps of this executor."""
    run = executor.compute_logits
    calls = [0]

    def counted(batch):
        calls[0] += 1
        if calls[0] > steps:
            executor.routing_replay.set_active(False)
        return run(batch)

    executor.compute_logits = counted
    return executor


def test_the_fast_executor_switched_off_mid_run_routes_naturally_from_then_on(ckpt):
    """The decode table is staged KEEP once the replay is off: one decode path (one graph) serves both modes."""
    slots = ckpt.spec.top_k * 4
    ref = _switch_off_after(_reference(ckpt, slots, replay=_replayer(ckpt, LOCALITY)), 4)
    fast = _switch_off_after(CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=slots), DEVICE, torch.float32,
                                               max_decode_rows=4, routing_replay=_replayer(ckpt, LOCALITY)), 4)
    a, b = {}, {}
    assert _serve(fast, record=a) == _serve(ref, record=b)
    for rid in a:
        for ours, want in zip(a[rid], b[rid], strict=True):
            assert (ours - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert (fast.expert_hits, fast.expert_misses) == (ref.expert_hits, ref.expert_misses)
    total = sum(len(p) + NEW_TOKENS - 1 for p in PROMPTS)
    assert 0 < fast.routing_replay.tokens_replaced == ref.routing_replay.tokens_replaced < total
    assert (fast.replay_table.table == KEEP).all()
