"""Proof of the prefix cache on the reference executor: multi-turn conversations through the domain
scheduler give the same greedy tokens, and fp32 logits within 1e-5, with the radix cache as without it
(on the trained demo model and the tiny hybrid parity configs), with prefixes ending mid-page and
mid-snapshot-interval, concurrent conversations sharing a system prompt, and seeded sampling unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapters.checkpoint.loader import load_checkpoint
from adapters.torch_exec.executor import TorchExecutor
from domain.budget import GpuBudget, PoolRequest, plan_pools
from domain.kv_pages import PageAllocator
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from tests.adapters.torch_exec_models import PAGE_SIZE, QWEN3_5_CONFIGS, build_hf_model, save_and_load

DEMO_DIR = Path(__file__).resolve().parents[2] / "app" / "demo_model" / "checkpoint"
# NOTE: 1e-5 of the logit scale (max |logit|, at least 1). Absolute 1e-5 is below the engine's own noise:
# the demo model without any cache gives logits 2.6e-5 apart (scale 15.7) for prefill chunks of 5 vs 7
# tokens, while cache vs no cache differ by 1.9e-5 at the same chunk size (docs/adr/0004-prefix-cache.md).
LOGIT_TOL = 1e-5
INTERVAL = 2 * PAGE_SIZE  # a snapshot every 8 tokens: prefixes of any length end mid-interval often


def make_engine(ckpt, cache: bool, *, kv_tokens=1024, snapshot_slots=48, max_running=3, max_step_tokens=7,
                fast: bool = False):
    plan = plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=kv_tokens, expert_slots=ckpt.spec.total_experts, state_slots=max_running,
                                  snapshot_slots=snapshot_slots if cache else 0, page_size=PAGE_SIZE))
    if fast:  # the fast path's executor: Triton's interpreter on the CPU, no graphs
        from adapters.cuda_exec.executor import CudaGraphExecutor

        executor = CudaGraphExecutor(ckpt, plan, "cuda" if torch.cuda.is_available() else "cpu", torch.float32,
                                     max_decode_rows=max_running)
    else:
        executor = TorchExecutor(ckpt, plan, "cpu", torch.float32)
    config = SchedulerConfig(max_running=max_running, max_step_tokens=max_step_tokens, page_size=PAGE_SIZE,
                             max_context=kv_tokens, prefix_cache=cache, snapshot_interval=INTERVAL,
                             linear_state=bool(executor.model.linear_layers))
    scheduler = Scheduler(config, PageAllocator(plan.kv_pages), plan.state_slots, plan.snapshot_slots)
    return scheduler, executor


def drive(scheduler, executor, requests: list[Request]):
    """Run requests to the end; returns ({id: tokens}, {id: [fp32 logits row per sample]}, works seen)."""
    for r in requests:
        scheduler.add(r)
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    works = []
    while (batch := scheduler.schedule()) is not None:
        works += batch.works
        rows = executor.compute_logits(batch)
        by_id = {w.request_id: w for w in batch.works}
        sampled = {}
        for rid, row in rows.items():
            logits.setdefault(rid, []).append(row[0].clone())
            sampled[rid] = executor.sampler.sample(rid, row[0], by_id[rid].sampling, by_id[rid].output_index)
        for ev in scheduler.complete(batch, sampled):
            tokens.setdefault(ev.request_id, []).append(ev.token_id)
        scheduler.check_valid()
        executor.check_valid()
    return tokens, logits, works


def conversation(scheduler, executor, turns: list[list[int]], sampling: SamplingParams, tag: str):
    """Each turn's prompt = everything so far + that turn's new tokens (a client resending history)."""
    history: list[int] = []
    out_tokens, out_logits, all_works = [], [], []
    for i, new in enumerate(turns):
        prompt = history + new
        rid = f"{tag}-turn{i}"
        tokens, logits, works = drive(scheduler, executor, [Request(rid, prompt, sampling)])
        out_tokens.append(tokens[rid])
        out_logits.append(torch.stack(logits[rid]))
        all_works += works
        history = prompt + tokens[rid]
    return out_tokens, out_logits, all_works


def assert_same(cached, plain, what: str):
    (c_tokens, c_logits), (p_tokens, p_logits) = cached, plain
    assert c_tokens == p_tokens, f"{what}: greedy tokens differ with the cache"
    for i, (c, p) in enumerate(zip(c_logits, p_logits, strict=True)):
        err, scale = (c - p).abs().max().item(), max(1.0, p.abs().max().item())
        assert err <= LOGIT_TOL * scale, f"{what} turn {i}: fp32 logits differ by {err:.3g} > {LOGIT_TOL} x {scale:.3g}"


def hits(works) -> list[int]:
    """Start positions of works that resumed from a snapshot (prefix-cache hits)."""
    return [w.start_position for w in works if w.restore_from is not None]


@pytest.fixture(scope="module")
def demo():
    if not (DEMO_DIR / "model.safetensors").exists():
        pytest.skip("demo checkpoint absent")
    from tokenizers import Tokenizer

    return load_checkpoint(DEMO_DIR, progress=False), Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids


def test_demo_model_multi_turn_same_tokens_and_logits_with_and_without_cache(demo):
    ckpt, tokenizer = demo
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    turns = [chat(tokenizer, "What is 62 + 17?"), chat(tokenizer, "What is 7 - 30?"), chat(tokenizer, "What is 9 + 9?")]
    scheduler, executor = make_engine(ckpt, cache=True)
    c_tokens, c_logits, works = conversation(scheduler, executor, turns, sampling, "c")
    plain = conversation(*make_engine(ckpt, cache=False), turns, sampling, "p")
    assert_same((c_tokens, c_logits), plain[:2], "demo model")
    resumed = hits(works)
    assert len(resumed) == 2, f"turns 2 and 3 should resume from the cache, resumed at {resumed}"
    # turn 1 computed prompt + 5 outputs; turn 2 resumes at the deepest snapshot page boundary of it
    turn1 = len(turns[0]) + 5
    assert resumed[0] == turn1 // PAGE_SIZE * PAGE_SIZE
    assert all(p % PAGE_SIZE == 0 for p in resumed)


def test_demo_model_prefix_ending_mid_page_and_mid_interval(demo):
    """Two conversations share a system prompt whose end is neither a page nor an interval boundary."""
    ckpt, tokenizer = demo
    system = tokenizer.encode("<|im_start|>system\nYou add and subtract.<|im_end|>\n").ids
    assert len(system) % PAGE_SIZE and len(system) % INTERVAL, "pick a system prompt ending mid-page"
    prompts = [system + chat(tokenizer, q) for q in ("What is 1 + 2?", "What is 40 - 3?", "What is 5 + 5?")]
    sampling = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    results = {}
    for cache in (True, False):
        scheduler, executor = make_engine(ckpt, cache)
        first = drive(scheduler, executor, [Request("a", prompts[0], sampling)])
        rest = drive(scheduler, executor, [Request("b", prompts[1], sampling), Request("c", prompts[2], sampling)])
        results[cache] = (first, rest)
        if cache:
            starts = hits(rest[2])
            # cut back to the deepest snapshot at or before the shared part: an interval boundary
            assert starts and all(s == (len(system) + 4) // INTERVAL * INTERVAL or s % INTERVAL == 0 for s in starts)
            assert all(s <= len(system) + 4 for s in starts), starts
    for (c, p) in zip(results[True], results[False], strict=True):
        for rid in c[0]:
            assert c[0][rid] == p[0][rid], f"{rid}: tokens differ"
            ref = torch.stack(p[1][rid])
            err, scale = (torch.stack(c[1][rid]) - ref).abs().max().item(), max(1.0, ref.abs().max().item())
            assert err <= LOGIT_TOL * scale, f"{rid}: logits differ by {err:.3g} > {LOGIT_TOL} x {scale:.3g}"


def test_seeded_sampling_is_unchanged_by_the_cache(demo):
    ckpt, tokenizer = demo
    sampling = SamplingParams(temperature=1.0, top_k=8, seed=1234, max_tokens=6, ignore_eos=True)
    turns = [chat(tokenizer, "What is 3 + 4?"), chat(tokenizer, "And 8 - 1?")]
    cached = conversation(*make_engine(ckpt, cache=True), turns, sampling, "c")
    plain = conversation(*make_engine(ckpt, cache=False), turns, sampling, "p")
    assert cached[0] == plain[0]
    assert hits(cached[2])


@pytest.mark.parametrize("name", sorted(QWEN3_5_CONFIGS))
def test_tiny_hybrid_configs_multi_turn_parity(name, tmp_path):
    ckpt = save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS[name]), tmp_path)
    gen = torch.Generator().manual_seed(3)
    turns = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (13, 6, 9)]
    sampling = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    scheduler, executor = make_engine(ckpt, cache=True)
    c_tokens, c_logits, works = conversation(scheduler, executor, turns, sampling, "c")
    plain = conversation(*make_engine(ckpt, cache=False), turns, sampling, "p")
    assert_same((c_tokens, c_logits), plain[:2], name)
    assert len(hits(works)) == 2


def test_fast_path_executor_resumes_from_the_cache_like_it_computes_without(tmp_path):
    """CudaGraphExecutor through the same ExecutorPools hooks: restores before a (graph-shaped) decode or a
    prefill, snapshots after; on the CPU its Triton kernels run in the interpreter."""
    ckpt = save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path)
    gen = torch.Generator().manual_seed(5)
    # turn 1: 5 + 4 tokens, 8 computed, the last decode ends on the page boundary 8 (a snapshot); turn 2
    # resends those 9 tokens (a regenerate): resumed at 8, one token left
    turns = [torch.randint(0, 96, (5,), generator=gen).tolist(), []]
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    scheduler, executor = make_engine(ckpt, cache=True, fast=True)
    c_tokens, c_logits, works = conversation(scheduler, executor, turns, sampling, "c")
    plain = conversation(*make_engine(ckpt, cache=False, fast=True), turns, sampling, "p")
    assert_same((c_tokens, c_logits), plain[:2], "fast path")
    (resumed,) = [w for w in works if w.restore_from is not None]
    assert (resumed.start_position, len(resumed.token_ids), resumed.sample) == (8, 1, True)
    assert any(w.snapshots for w in works if len(w.token_ids) == 1)  # an end snapshot after a decode


def test_executor_pools_build_keep_and_check_the_snapshot_pool(tmp_path):
    ckpt = save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["wide_router"]), tmp_path)
    scheduler, executor = make_engine(ckpt, cache=True, snapshot_slots=5)
    assert executor.snapshots.num_slots == 5 and executor.pool_bytes()["snapshot"] == executor.snapshots.nbytes()
    state = executor.state
    state.recurrent[:, 1].normal_()
    state.conv[:, 1].normal_()
    state.copy_slot(1, executor.snapshots, 4)  # a snapshot, then its restore into another slot: exact copies
    executor.snapshots.copy_slot(4, state, 2)
    assert torch.equal(state.recurrent[:, 2], state.recurrent[:, 1]) and torch.equal(state.conv[:, 2], state.conv[:, 1])
    with pytest.raises(ValueError, match="outside"):
        state.copy_slot(1, executor.snapshots, 5)
    kept = executor.snapshots
    plan = executor.plan
    executor.resize_pools(plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40), PoolRequest(
        kv_tokens=plan.kv_tokens * 2, expert_slots=plan.expert_slots, state_slots=plan.state_slots,
        snapshot_slots=5, page_size=PAGE_SIZE)))
    assert executor.snapshots is kept  # unchanged size: kept with its contents (the cache may survive)
    executor.resize_pools(plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40), PoolRequest(
        kv_tokens=plan.kv_tokens, expert_slots=plan.expert_slots, state_slots=plan.state_slots,
        snapshot_slots=0, page_size=PAGE_SIZE)))
    assert executor.snapshots is None
    executor.check_valid()


def test_a_batch_naming_bad_snapshot_slots_is_refused_before_it_runs(tmp_path):
    from domain.ports import SequenceWork, StepBatch

    ckpt = save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["wide_router"]), tmp_path)
    _, executor = make_engine(ckpt, cache=True, snapshot_slots=2)
    greedy = SamplingParams(temperature=0.0)

    def work(rid, slot, **kw):
        return SequenceWork(rid, (1, 2, 3, 4), kw.pop("start", 0), (slot, slot + 4), slot, True, greedy, 0, **kw)

    assert executor.can_execute(StepBatch((work("a", 0, snapshots=((4, 1),)),))) is None
    assert "outside" in executor.can_execute(StepBatch((work("a", 0, snapshots=((5, 1),)),)))
    assert "out of the pool" in executor.can_execute(StepBatch((work("a", 0, snapshots=((4, 2),)),)))
    two = StepBatch((work("a", 0, snapshots=((4, 1),)), work("b", 1, snapshots=((4, 1),))))
    assert "twice" in executor.can_execute(two)
    clash = StepBatch((work("a", 0, start=4, restore_from=1), work("b", 1, snapshots=((4, 1),))))
    assert "restored from" in executor.can_execute(clash)
    assert "restore" in executor.can_execute(StepBatch((work("a", 0, restore_from=0),)))  # at position 0
    with pytest.raises(ValueError, match="cannot execute"):
        executor.compute_logits(two)
