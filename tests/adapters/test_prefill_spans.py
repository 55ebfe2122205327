"""The fast path's batched token mixers (adapters/cuda_exec/prefill_spans.py): one step holding several
sequences' prefill spans and the one-token rows of a mixed step gives every token the logits, and leaves in
the KV pages, the Gated DeltaNet states and the prefix cache's snapshot slots what the same spans give run
one per step on the reference executor; and the projections, norms, rope, the attention and the GDN conv
and WY of a step launch as often for 8 spans as for 1.

On the CPU the Triton kernels run in Triton's interpreter (fp32 tiny models; bound: 1e-4 of the logit scale).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adapters.cuda_exec import prefill, prefill_spans, step_plan
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.torch_exec.executor import TorchExecutor
from adapters.torch_exec.step_inputs import flatten
from domain.budget import GpuBudget, PoolRequest, plan_pools
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams
from tests.adapters.torch_exec_models import (
    PAGE_SIZE,
    QWEN3_5_CONFIGS,
    build_hf_model,
    pages_for,
    save_and_load,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TOL = 1e-4  # of the logit scale (max |logit| of the oracle)


@pytest.fixture(scope="module", params=["hybrid_3to1", "alternating_mqa"])
def ckpt(request, tmp_path_factory):
    """3 Gated DeltaNet layers and 1 attention layer (GQA, output gate, partial rotary), as Qwen3.6 mixes them;
    and alternating layers with one kv head, conv kernel 3."""
    model = build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS[request.param])
    return save_and_load(model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(autouse=True)
def grouped_moe(monkeypatch):
    """Steps of more than 16 routed pairs take the grouped MoE GEMMs: ~3x faster than the per-pair GEMVs in
    Triton's interpreter (the MoE is the same for both sides of every comparison here)."""
    from adapters.cuda_exec import expert_pool

    monkeypatch.setattr(expert_pool, "GEMV_MAX_PAIRS", 16)


def _plan(ckpt):
    return plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=256, expert_slots=ckpt.spec.total_experts, state_slots=8,
                                  snapshot_slots=2, page_size=PAGE_SIZE))


def _fast(ckpt):
    return CudaGraphExecutor(ckpt, _plan(ckpt), DEVICE, torch.float32, max_decode_rows=4, prefill_kernels=True,
                             use_graphs=False)


def _work(rid: str, index: int, prompt: list[int], start: int, length: int, snapshots=(), pages=None) -> SequenceWork:
    """Positions start..start+length-1 of sequence `index` (its own pages and state slot)."""
    end = start + length
    pages = pages_for(index, len(prompt) + 2) if pages is None else pages
    return SequenceWork(rid, tuple(prompt[start:end]), start, pages, index, end == len(prompt), GREEDY, 0,
                        snapshots=snapshots)


def _scenario():
    """(setup works, the step's works): `a` continues after 9 cached tokens; `b` (13 from 0) takes a prefix-cache
    snapshot 8 tokens in (a cut inside its span); `c` 7 from 0 (as long as `a`'s span); `e` a one-token prompt;
    d1 and d2 decode a token each, their rows between the spans (the step's order is not sorted by kind)."""
    gen = torch.Generator().manual_seed(5)
    p = {name: torch.randint(0, 96, (n,), generator=gen).tolist()
         for name, n in (("a", 16), ("d1", 6), ("b", 13), ("c", 7), ("d2", 7), ("e", 1))}
    setup = [_work("a", 0, p["a"], 0, 9), _work("d1", 1, p["d1"], 0, 5), _work("d2", 4, p["d2"], 0, 6)]
    step = [_work("a", 0, p["a"], 9, 7), _work("d1", 1, p["d1"], 5, 1), _work("b", 2, p["b"], 0, 13, ((8, 0),)),
            _work("c", 3, p["c"], 0, 7), _work("d2", 4, p["d2"], 6, 1), _work("e", 5, p["e"], 0, 1)]
    return setup, step


def _fast_step(ex, works, corrupt=None) -> dict[str, torch.Tensor]:
    """Every token's fp32 logits {rid: [n, V]} of one step on the fast executor (its compute_logits, for all
    positions); corrupt(inp) -> inp rewrites the flattened inputs first."""
    batch = StepBatch(tuple(works))
    assert ex.can_execute(batch) is None
    inp = flatten(batch, ex.device)
    if corrupt is not None:
        inp = corrupt(inp)
    ex._prepare_states(batch.works)
    with torch.inference_mode(), ex.experts.streamed_step():
        hidden = ex.model.forward(inp, ex.kv, ex.state, ex.experts, ex.snapshots)  # [T, H]
    ex._take_end_snapshots(batch.works)
    return {s.work.request_id: ex.model.logits(hidden[s.rows]) for s in inp.spans}


def _pools(ex) -> dict[str, torch.Tensor]:
    pages = ex.plan.kv_pages  # the fast executor's scratch pages past these are not compared
    return {"k": ex.kv.k[:, :pages], "v": ex.kv.v[:, :pages], "conv": ex.state.conv, "recurrent": ex.state.recurrent,
            "snap.conv": ex.snapshots.conv, "snap.recurrent": ex.snapshots.recurrent}


def _worst(got: dict, want: dict) -> float:
    """Largest logit error of any token, relative to its request's logit scale."""
    return max(((got[r] - want[r]).abs().max() / want[r].abs().max()).item() for r in want)


@pytest.mark.parametrize("sdpa_past", [step_plan.PAGED_PREFILL_MAX_PAIRS, 60], ids=["paged", "paged+sdpa"])
def test_one_step_of_many_spans_matches_the_spans_one_per_step(ckpt, sdpa_past, monkeypatch):
    """Against the reference executor running each work as a step of its own (its setup too). sdpa_past: the
    query-context pairs (span tokens x context) beyond which a span attends through SDPA instead of
    paged_prefill_attention (60: `a` (7 x 16) and `b` (13 x 13) through SDPA, `c` (7 x 7) through the paged
    kernel, in one step)."""
    monkeypatch.setattr(step_plan, "PAGED_PREFILL_MAX_PAIRS", sdpa_past)
    setup, step = _scenario()
    fast, ref = _fast(ckpt), TorchExecutor(ckpt, _plan(ckpt), DEVICE, torch.float32)
    _fast_step(fast, setup)
    for w in setup:
        ref.compute_logits(StepBatch((w,)))
    before = {ex: {k: v.clone() for k, v in _pools(ex).items()} for ex in (fast, ref)}

    # the check can fail: `a` and `c` (7 tokens each) at each other's positions (rotary; pages stay right)
    def swap(inp):
        pos = inp.positions.clone()
        a, c = inp.spans[0].rows, inp.spans[3].rows
        pos[a], pos[c] = inp.positions[c], inp.positions[a]
        return dataclasses.replace(inp, positions=pos)

    swapped = _fast_step(fast, step, corrupt=swap)
    for name, t in _pools(fast).items():  # undo the swapped step
        t.copy_(before[fast][name])
    got = _fast_step(fast, step)
    want = {}
    for w in step:
        want |= ref.compute_logits(StepBatch((w,)), all_positions=True)
    assert {r: g.shape for r, g in got.items()} == {w.request_id: (len(w.token_ids), 96) for w in step}
    assert _worst(got, want) <= TOL
    assert _worst(swapped, want) > 100 * TOL
    # the pools: the same places written (the step's K/V, its slots' states, b's snapshot at 8), same values
    for name, mine in _pools(fast).items():
        theirs = _pools(ref)[name]
        assert torch.equal(mine != before[fast][name], theirs != before[ref][name]), name
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5), name
    assert (_pools(fast)["snap.recurrent"][:, 0] != 0).any()  # the cut inside b's span was taken
    fast.check_valid()


def _counts(ex, works, monkeypatch) -> dict[str, int]:
    """Calls per kernel entry point (and of the step's projection matmul) for one step."""
    calls: dict[str, int] = {}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapped

    with monkeypatch.context() as m:
        for name in ("qk_norm_rope", "gated_rms_norm", "paged_decode_attention", "paged_prefill_attention",
                     "gdn_decode_step", "gdn_conv_prefill_spans", "gdn_chunk_wy", "delta_rule"):
            m.setattr(prefill_spans, name, count(name, getattr(prefill_spans, name)))
        for name in ("gdn_chunk_state", "gdn_chunk_out"):  # the state walk's launches
            m.setattr(prefill, name, count(name, getattr(prefill, name)))
        # one lower-right causal mask per SDPA call (patching SDPA itself defeats the mask's dispatch)
        m.setattr(prefill_spans, "causal_lower_right", count("sdpa", prefill_spans.causal_lower_right))
        for name in ("gdn_conv_prefill", "gdn_chunk_wy"):  # the one-span launchers: not on this path
            m.setattr(prefill, name, count("per-span " + name, getattr(prefill, name)))
        m.setattr(ex.model, "_linear", count("linear", ex.model._linear))
        _fast_step(ex, works)
    return calls


def test_a_step_projects_norms_and_ropes_once_whatever_its_span_count(ckpt, monkeypatch):
    """The projections (and o_proj/out_proj, the MoE's shared expert), qk_norm_rope, the attention, the gated
    RMSNorm and the Gated DeltaNet conv, WY form and state walk (gdn_chunk_state + gdn_chunk_out) launch as
    often for 8 prefill spans as for 1: nothing goes once per span (but the attention's gather + SDPA of a
    span over a long context: none here)."""
    gen = torch.Generator().manual_seed(3)
    layers = ckpt.spec.num_layers
    counts = {}
    for spans in (1, 8):
        ex = _fast(ckpt)
        prompts = [torch.randint(0, 96, (3,), generator=gen).tolist() for _ in range(spans)]
        works = [_work(f"r{i}", i, p, 0, 3, pages=(i,)) for i, p in enumerate(prompts)]
        counts[spans] = _counts(ex, works, monkeypatch)
    one, eight = counts[1], counts[8]
    attn = len(ex.model.full_layers)
    assert one["qk_norm_rope"] == eight["qk_norm_rope"] == attn
    assert one["gated_rms_norm"] == eight["gated_rms_norm"] == layers - attn
    assert one["linear"] == eight["linear"] > 0
    gdn = layers - attn
    assert one["gdn_conv_prefill_spans"] == eight["gdn_conv_prefill_spans"] == gdn
    assert one["gdn_chunk_wy"] == eight["gdn_chunk_wy"] == gdn
    assert one["gdn_chunk_state"] == eight["gdn_chunk_state"] == gdn
    assert one["gdn_chunk_out"] == eight["gdn_chunk_out"] == gdn
    assert one["paged_prefill_attention"] == eight["paged_prefill_attention"] == attn
    assert not {"sdpa", "delta_rule", "paged_decode_attention", "gdn_decode_step", "per-span gdn_conv_prefill",
                "per-span gdn_chunk_wy"} & (one.keys() | eight.keys())
