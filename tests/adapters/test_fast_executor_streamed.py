"""The fast executor with staging rows (the streamed prefill, docs/adr/0010-streamed-prefill.md), Triton
prefill on (--prefill-kernels triton): bitwise the logits of the residency-path prefill, the reference
executor's tokens, a decode working set that a long prefill leaves where it was, the PCIe bound in its
stats, and live resizes that keep or rebuild the staging rows with the plan."""

import pytest
import torch

from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.torch_exec.executor import TorchExecutor
from domain.budget import GpuBudget, PoolRequest, plan_pools
from domain.ports import SequenceWork, StepBatch
from tests.adapters.torch_exec_models import (
    GREEDY,
    PAGE_SIZE,
    QWEN3_5_CONFIGS,
    Sequence,
    build_hf_model,
    pages_for,
    run_requests,
    save_and_load,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 8, 1], [2, 33, 71], [8, 1, 4, 4, 90, 12, 6, 7, 19, 23]]
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path_factory.mktemp("m"))


def _plan(ckpt, expert_slots, staging, kv_tokens=1024):
    plan = plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=kv_tokens, expert_slots=expert_slots, state_slots=4,
                                  page_size=PAGE_SIZE, staging_experts=staging))
    assert not hasattr(plan, "shortfall_bytes"), plan
    return plan


def _fast(ckpt, slots, staging, **kw):
    ex = CudaGraphExecutor(ckpt, _plan(ckpt, slots, staging), DEVICE, torch.float32, max_decode_rows=4,
                           prefill_kernels=True, **kw)
    # NOTE: replays off: this file streams the eager prefill steps' experts, and short chunks would run as decode
    # replays, equal within rounding only (ADR 0026; their own tests: test_short_prompt_replays.py)
    ex.short_prompt_tokens = 0
    return ex


def _run(executor, record):
    seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + NEW_TOKENS + 1), state_slot=i) for i, p in enumerate(PROMPTS)]
    run_requests(executor, seqs, NEW_TOKENS, chunk=6, record=record)
    return [s.output for s in seqs]


def test_streamed_prefill_gives_the_residency_paths_bits_and_the_references_tokens(ckpt):
    slots = ckpt.spec.top_k * 3  # fewer slots than one layer's experts
    plain, streamed = {}, {}
    # staging 3: fewer rows than a layer's misses (several rounds per layer, an odd half left over)
    fast = _fast(ckpt, slots, staging=3)
    tokens = _run(fast, streamed)
    assert tokens == _run(_fast(ckpt, slots, staging=0), plain)
    assert tokens == _run(TorchExecutor(ckpt, _plan(ckpt, slots, 0), DEVICE, torch.float32), {})
    for rid in plain:
        for a, b in zip(streamed[rid], plain[rid], strict=True):
            assert torch.equal(a, b)  # bitwise: prefill and mixed steps, and the decodes after them
    stats = fast.prefill_stats()
    assert stats["steps"] > 0 and stats["experts_staged"] >= stats["experts_not_resident"] > 0
    assert stats["pcie_bound_s"] == stats["bytes_not_resident"] / stats["link_bytes_per_s"] > 0
    fast.check_valid()


def test_a_long_prefill_leaves_the_decode_working_set_alone(ckpt):
    slots = ckpt.spec.top_k * 3
    fast = _fast(ckpt, slots, staging=2, use_graphs=False)
    decoding = [Sequence("d0", PROMPTS[1], pages_for(0, 16), state_slot=0)]
    run_requests(fast, decoding, 2, chunk=1)  # one token per step: every step goes through the residency
    res = fast.experts.residency
    before = (res.slot_of_key.clone(), res.stamp.clone(), res.lru_order(), fast.expert_counters())
    assert len(before[2]) == slots  # the decode working set fills the pool
    stats = fast.prefill_stats()
    prompt = [(7 * i + 3) % 96 for i in range(24)]
    work = SequenceWork("long", tuple(prompt), 0, pages_for(1, 32), 1, True, GREEDY, 0)
    fast.execute(StepBatch((work,)))
    after = (res.slot_of_key, res.stamp, res.lru_order(), fast.expert_counters())
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert before[2:] == after[2:]  # same keys, same LRU order, no hit or miss counted
    now = fast.prefill_stats()
    assert now["steps"] == stats["steps"] + 1 and now["bytes_not_resident"] > stats["bytes_not_resident"]
    # the next decode step still finds its experts: the LRU decides as if the prefill had not happened
    run_requests(fast, decoding, 3, chunk=1)
    fast.check_valid()


def test_resizes_keep_or_rebuild_the_staging_rows_with_the_plan(ckpt):
    fast = _fast(ckpt, ckpt.spec.top_k * 3, staging=4, use_graphs=False)
    assert fast.experts.staging_slots == 4 and fast.pool_bytes()["moe"] >= (6 + 4) * fast.bank.layout.row_bytes
    pool = fast.experts
    fast.resize_pools(_plan(ckpt, ckpt.spec.top_k * 3, 4, kv_tokens=512))  # KV only: the pool stays warm
    assert fast.experts is pool
    fast.resize_pools(_plan(ckpt, ckpt.spec.top_k * 4, 4))  # more slots: rebuilt, staging kept
    assert fast.experts is not pool and fast.experts.staging_slots == 4
    fast.check_valid()
    fast.resize_pools(_plan(ckpt, ckpt.spec.top_k * 4, 0))  # staging dropped: rebuilt without it
    assert fast.experts.staging_slots == 0
    fast.check_valid()
    seqs = [Sequence("r", PROMPTS[0], pages_for(0, 20), state_slot=0)]
    run_requests(fast, seqs, 2, chunk=6)  # serves after each resize
    assert len(seqs[0].output) == 2 and fast.prefill_stats()["steps"] == 0
