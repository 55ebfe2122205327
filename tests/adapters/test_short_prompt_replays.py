"""Short prompt chunks as replays of the decode step (adapters/cuda_exec/short_prompts.py, ADR 0026): which token
goes to which replay, and on the fast executor (CPU: Triton's interpreter, fp32 tiny model, no graph captured; the
same code a CUDA graph replays) the same logits, sampled tokens, KV, linear-attention state and prefix-cache
snapshots as the eager prefill step, with a cached prefix continued, a snapshot restored, snapshots taken inside
and at the end of a chunk, and decode rows in the step.

Bounds: 1e-5 of each tensor's scale on the CPU (the recurrent form of the delta rule against the chunked one: both
exact, fp32 rounding apart; ADR 0025 measured the GDN kernels alike), 1e-4 on a GPU; greedy tokens identical.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from adapters.cuda_exec import executor as executor_module
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.short_prompts import _max_tokens
from app.engine import Engine
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams
from domain.short_prompt_replays import DEFAULT_TOKENS, Row, unroll
from tests.adapters.test_prefill_spans import DEVICE, GREEDY, _fast, _plan, _pools, _work
from tests.adapters.torch_exec_models import (
    QWEN3_5_CONFIGS,
    build_hf_model,
    make_plan,
    pages_for,
    save_and_load,
)

# NOTE: on a GPU the Triton GEMMs take fp32 through TF32 in both paths, in different tilings: there the fast
# path's parity bound (1e-4 of the logit scale, tests/adapters/test_fast_executor.py)
TOL = 1e-5 if DEVICE == "cpu" else 1e-4


def _w(rid, tokens, start=0, snapshots=(), restore_from=None, layers=None, sample=True, slot=0):
    return SequenceWork(rid, tuple(tokens), start, pages_for(slot, start + len(tokens) + 1), slot, sample, GREEDY, 0,
                        restore_from=restore_from, snapshots=tuple(snapshots), layers=layers)


def test_each_replay_holds_one_token_of_every_chunk_longer_than_its_index():
    a = _w("a", [5, 6, 7], start=9, restore_from=1, snapshots=[(10, 0), (12, 1)], slot=0)
    d = _w("d", [8], start=20, slot=1)
    c = _w("c", [1, 2], slot=2, sample=False)
    replays = unroll([a, d, c], max_tokens=4, max_rows=4)
    assert [[r.work.request_id for r in rows] for rows in replays] == [["a", "d", "c"], ["a", "c"], ["a"]]
    rows_a = [rows[0] for rows in replays]
    assert [r.work.token_ids for r in rows_a] == [(5,), (6,), (7,)]
    assert [r.work.start_position for r in rows_a] == [9, 10, 11]
    assert [r.work.restore_from for r in rows_a] == [1, None, None]  # restored once, before its first token
    assert [r.work.snapshots for r in rows_a] == [((10, 0),), (), ((12, 1),)]  # each at the row that ends there
    assert [r.last for r in rows_a] == [False, False, True] and all(r.source is a for r in rows_a)
    assert all(r.work.sample and r.work.page_ids == a.page_ids and r.work.state_slot == 0 for r in rows_a)
    assert replays[0][1] == Row(d, d, True)  # a decode row is itself
    assert [r.last for r in (replays[0][2], replays[1][1])] == [False, True]


@pytest.mark.parametrize(("works", "max_tokens", "max_rows"), [
    ([_w("d", [1]), _w("e", [2], slot=1)], 4, 4),  # decodes only: the decode step as it is
    ([_w("a", [1, 2, 3, 4, 5])], 4, 4),  # a chunk past max_tokens: the eager step
    ([_w("a", [1, 2], layers=(0, 2))], 4, 4),  # a layer group
    ([_w("a", [1, 2])], 1, 4),  # off
    ([_w(f"r{i}", [1, 2], slot=i) for i in range(3)], 4, 2),  # more rows than the largest bucket
    ([], 4, 4),
])
def test_steps_that_are_not_for_replays(works, max_tokens, max_rows):
    assert unroll(works, max_tokens, max_rows) is None


@pytest.mark.parametrize("value", ["-1", "two", "1.5", ""])
def test_the_switch_refuses_anything_but_a_token_count(value):
    with pytest.raises(ValueError, match="FLUXTIDE_SHORT_PROMPT_REPLAYS"):
        _max_tokens(value)
    assert _max_tokens("0") == 0 and _max_tokens("8") == 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """3 Gated DeltaNet layers and 1 attention layer, as Qwen3.6 mixes them."""
    return save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path_factory.mktemp("h"))


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randint(0, 96, (n,), generator=gen).tolist() for name, n in
            (("a", 12), ("c", 2), ("s", 4), ("d", 6), ("r", 5))}


def _scenario(p):
    """(setup steps, step 1, step 2). Step 1: `a` 3 tokens after 9 cached; `c` a 2-token prompt; `s` a 4-token prompt
    taking a snapshot 2 tokens in (slot 0) and one at its end (slot 1); `d` one decode row. Step 2: `r`, whose first 4
    tokens are `s`'s (its first page is `s`'s, as a prefix-cache hit shares it), resumes from snapshot 1 with its 3
    other tokens."""
    setup = [[_work("a", 0, p["a"], 0, 9), _work("d", 3, p["d"], 0, 5)]]
    step1 = [_work("a", 0, p["a"], 9, 3), _work("c", 1, p["c"], 0, 2),
             _work("s", 2, p["s"], 0, 4, snapshots=((2, 0), (4, 1))), _work("d", 3, p["d"], 5, 1)]
    r = p["s"] + p["r"][:3]
    pages = (pages_for(2, 6)[0], pages_for(4, 8)[1])  # `s`'s first page (positions 0-3), then its own
    step2 = [dataclasses.replace(_work("r", 4, r, 4, 3, pages=pages), restore_from=1)]
    return setup, step1, step2


def _run(ckpt, monkeypatch, replays: int, graphs: bool = False):
    ex = (CudaGraphExecutor(ckpt, _plan(ckpt), DEVICE, torch.float32, max_decode_rows=4, prefill_kernels=True)
          if graphs else _fast(ckpt))
    monkeypatch.setattr(ex, "short_prompt_tokens", replays)
    ran = []
    rows = ex._replay_rows
    monkeypatch.setattr(ex, "_replay_rows", lambda r, *hook: ran.append(len(r)) or rows(r, *hook))
    setup, step1, step2 = _scenario(_prompts())
    for works in setup:
        ex.execute(StepBatch(tuple(works)))
    logits = {}
    for works in (step1, step2):
        logits.update(ex.compute_logits(StepBatch(tuple(works))))
    return ex, logits, ran


@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="needs a CUDA device"))], ids=["eager", "captured"])
def test_replays_give_the_eager_steps_logits_state_and_snapshots(ckpt, monkeypatch, graphs):
    """graphs: on CUDA the replays are the captured decode graphs (the eager prefill step stays the oracle)."""
    eager, want, ran_eager = _run(ckpt, monkeypatch, replays=0)
    fast, got, ran = _run(ckpt, monkeypatch, replays=4, graphs=graphs)
    assert bool(fast.graphs) == graphs
    assert ran_eager == [] and ran == [4, 3]  # step 1: `s` took 4 replays; step 2: `r` 3 (setup: 9 > 4, eager)
    assert sorted(got) == sorted(want) == ["a", "c", "d", "r", "s"]
    for rid in want:
        err = (got[rid] - want[rid]).abs().max() / want[rid].abs().max()
        assert err <= TOL, f"{rid}: {err:.3g}"
    for name, tensor in _pools(eager).items():
        err = (_pools(fast)[name] - tensor).abs().max() / tensor.abs().max().clamp_min(1e-30)
        assert err <= TOL, f"{name}: {err:.3g}"
    fast.check_valid()


def test_execute_samples_the_same_tokens_and_reads_them_back_once(ckpt, monkeypatch):
    tokens = {}
    for replays in (0, 4):
        ex = _fast(ckpt)
        monkeypatch.setattr(ex, "short_prompt_tokens", replays)
        setup, step1, step2 = _scenario(_prompts())
        ex.execute(StepBatch(tuple(setup[0])))
        hooks, reads, tolist = [], [], torch.Tensor.tolist
        ex.on_launched = lambda: hooks.append(1)  # noqa: B023
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))  # noqa: B023
            out = {**ex.execute(StepBatch(tuple(step1))), **ex.execute(StepBatch(tuple(step2)))}
        tokens[replays] = {rid: s.token_id for rid, s in out.items()}
        assert len(hooks) == 2  # the launch hook once a step, replays or not
        if replays:
            assert len(reads) == 2 and ex.expert_counters() == ex.experts.counters()  # tokens + counters: one read
    assert tokens[4] == tokens[0] and sorted(tokens[0]) == ["a", "c", "d", "r", "s"]


def test_the_launch_hook_runs_once_the_first_replay_is_launched(ckpt, monkeypatch):
    """The engine streams the step before's tokens while the replays run: its hook comes right after the first
    replay's launch, not after the last (restaging a row can wait for the replay before it)."""
    ex = _fast(ckpt)
    monkeypatch.setattr(ex, "short_prompt_tokens", 4)
    setup, step1, _ = _scenario(_prompts())
    ex.execute(StepBatch(tuple(setup[0])))
    events, decode = [], ex._decode
    monkeypatch.setattr(ex, "_decode", lambda works: events.append(len(works)) or decode(works))
    ex.on_launched = lambda: events.append("hook")
    ex.execute(StepBatch(tuple(step1)))
    assert events == [4, "hook", 3, 2, 1]  # replay 0: a, c, s, d; then a, c, s; a, s; s


def test_a_seeded_draw_is_the_eager_steps(ckpt, monkeypatch):
    """The chunk's last row draws with the chunk's seed and output index; the rows before it draw nothing."""
    drawn = {}
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=4)
    for replays in (0, 4):
        ex = _fast(ckpt)
        monkeypatch.setattr(ex, "short_prompt_tokens", replays)
        prompt = _prompts()["s"]
        work = dataclasses.replace(_work("s", 2, prompt, 0, 4), sampling=params)
        drawn[replays] = ex.execute(StepBatch((work,)))["s"].token_id
    assert drawn[4] == drawn[0]


def test_the_executor_reads_the_switch(monkeypatch, ckpt):
    monkeypatch.setattr(executor_module.short_prompts, "MAX_TOKENS", 6)
    assert _fast(ckpt).short_prompt_tokens == 6


def test_the_stats_say_what_runs(ckpt, monkeypatch):
    """/v1/stats' executor section (Engine.executor_info) states the chunk length, the default unless set, so every
    `ft bench` record says whether its short prompts ran as replays; a live resize does not change it (the same
    tokens at any expert-slot count)."""
    spec = ckpt.spec
    ex = CudaGraphExecutor(ckpt, make_plan(ckpt, spec.top_k * 2, state_slots=8), DEVICE, torch.float32,
                           max_decode_rows=4, prefill_kernels=True, use_graphs=False)
    assert Engine.executor_info(SimpleNamespace(executor=ex))["short_prompt_replays"] == DEFAULT_TOKENS == 8
    ex.resize_pools(make_plan(ckpt, spec.total_experts, state_slots=8))
    assert Engine.executor_info(SimpleNamespace(executor=ex))["short_prompt_replays"] == DEFAULT_TOKENS
    monkeypatch.setattr(ex, "short_prompt_tokens", 0)
    assert Engine.executor_info(SimpleNamespace(executor=ex))["short_prompt_replays"] == 0
