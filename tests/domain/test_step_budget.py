"""Step budgets: the step cost line, the defaults ADR 0011 derives from it, and the activation reserve."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.budget import GpuBudget, PlanRefusal, PoolPlan, PoolRequest, plan_pools
from domain.model_spec import WeightFormat, qwen36_35b_a3b
from domain.step_budget import (
    DEFAULT_MAX_STEP_TOKENS,
    DEFAULT_MIXED_STEP_TOKENS,
    H200_DECODE_BS4_S,
    H200_QWEN36_FP8,
    MIXED_STEP_LIMIT_S,
    StepCost,
    activation_bytes_per_token,
    blame_step,
    dense_scratch_bytes,
    gdn_window_bytes,
    reserve_step,
    serve_step_reserve,
    step_activation_bytes,
)
from tests.domain.test_budget import QWEN3_MOE_LIKE, TINY

GIB = 2**30
MIB = 2**20


def test_the_line_through_two_steps():
    cost = StepCost.through(100, 0.3, 300, 0.7)
    assert cost.fixed_s == pytest.approx(0.1) and cost.per_token_s == pytest.approx(0.002)
    assert cost.step_s(200) == pytest.approx(0.5)
    assert cost.prefill_s(250, 100) == pytest.approx(3 * 0.1 + 250 * 0.002)  # three steps, three fixed costs
    assert cost.tokens_within(0.5) == 200
    assert cost.tokens_within(0.5, other_s=0.1) == 150
    assert cost.tokens_within(0.5, multiple=64) == 192
    assert cost.tokens_within(0.05) == 0  # the fixed cost alone is over the limit
    with pytest.raises(ValueError, match="distinct"):
        StepCost.through(100, 0.3, 100, 0.4)
    with pytest.raises(ValueError, match="fixed_s >= 0"):
        StepCost.through(100, 0.1, 200, 0.5)  # a negative intercept is no step cost
    with pytest.raises(ValueError, match="multiple"):
        cost.tokens_within(1.0, multiple=0)


def test_the_adr_arithmetic_from_the_h200_record():
    """docs/adr/0011-mixed-step-budget.md's numbers, reproduced from the two single-chunk measurements."""
    cost = H200_QWEN36_FP8
    assert cost.fixed_s == pytest.approx(0.0811, abs=5e-5)
    assert cost.per_token_s == pytest.approx(52.61e-6, rel=1e-3)
    # the mixed budget: the most tokens whose step, with the batch-4 decode, stays under 120 ms ...
    assert cost.tokens_within(MIXED_STEP_LIMIT_S, H200_DECODE_BS4_S) == 641
    # ... rounded down to a power of two: 512 fits with room, 1024 would not
    assert cost.step_s(DEFAULT_MIXED_STEP_TOKENS) + H200_DECODE_BS4_S == pytest.approx(0.1132, abs=5e-4)
    assert cost.step_s(2 * DEFAULT_MIXED_STEP_TOKENS) + H200_DECODE_BS4_S > MIXED_STEP_LIMIT_S
    # today's one budget of 2048 makes a 194 ms gap, over the 150 ms target
    gap_2048 = cost.step_s(2048) + H200_DECODE_BS4_S
    assert gap_2048 == pytest.approx(0.194, abs=1e-3) and gap_2048 > 0.150
    # a step alone: an 8k prompt in one step (the measured 0.512 s) against four 2048-token steps
    assert cost.prefill_s(8192, DEFAULT_MAX_STEP_TOKENS) == pytest.approx(0.5121, abs=1e-4)
    assert cost.prefill_s(8192, 2048) == pytest.approx(0.755, abs=1e-3)
    # doubling the step again saves one fixed cost per 16k only (32k: 2.05 s -> 1.89 s)
    assert cost.prefill_s(32768, 8192) - cost.prefill_s(32768, 16384) == pytest.approx(2 * cost.fixed_s)


def test_activations_of_qwen36_per_token_and_per_step():
    spec = qwen36_35b_a3b()
    assert activation_bytes_per_token(spec) == 131_456  # the Gated DeltaNet layer's, in bf16
    # the split recurrence's entry states: 32 value heads x 128 x 128 fp32 per 64 tokens, one 2,048-token window
    assert gdn_window_bytes(spec, 1) == 2 * MIB and gdn_window_bytes(spec, 65) == 4 * MIB
    assert gdn_window_bytes(spec, 2048) == gdn_window_bytes(spec, 32768) == 64 * MIB
    # the dequantized copy of the widest dense projection (GDN qkv + z: 12,288 x 2,048 in bf16)
    assert dense_scratch_bytes(spec) == 12288 * 2048 * 2 == 48 * MIB
    assert dense_scratch_bytes(replace(spec, dense_format=WeightFormat.BF16)) == 0  # nothing to dequantize
    assert step_activation_bytes(spec, 8192, 4) == 8192 * 131_456 + 64 * MIB + 4 * spec.vocab_size * 6
    assert step_activation_bytes(spec, 8192, 4) / GIB == pytest.approx(1.0710, abs=1e-3)
    # the server reserves the copy only where its prefill makes one (FLUXTIDE_PREFILL_DEQUANT_ROWS > 0 on CUDA)
    assert serve_step_reserve(spec, 8192, 4, dense_copy=True) == serve_step_reserve(spec, 8192, 4) + 48 * MIB
    assert gdn_window_bytes(QWEN3_MOE_LIKE, 8192) == 0  # no Gated DeltaNet layers
    with pytest.raises(ValueError, match="step_tokens"):
        gdn_window_bytes(spec, -1)
    assert activation_bytes_per_token(spec, dtype_bytes=4) > activation_bytes_per_token(spec)
    with pytest.raises(ValueError, match="step_tokens"):
        step_activation_bytes(spec, -1, 0)


@settings(max_examples=50, deadline=None)
@given(spec=st.sampled_from([TINY, QWEN3_MOE_LIKE]), a=st.integers(0, 65536), b=st.integers(0, 65536),
       rows=st.integers(0, 16))
def test_activations_grow_with_the_step(spec, a, b, rows):
    lo, hi = sorted((a, b))
    assert step_activation_bytes(spec, lo, rows) <= step_activation_bytes(spec, hi, rows)
    # a model without Gated DeltaNet layers (QWEN3_MOE_LIKE) is sized by its MoE or attention layer
    assert activation_bytes_per_token(spec) > 4 * spec.hidden_size * 2


def test_a_step_the_budget_cannot_hold_is_refused_and_named():
    spec = qwen36_35b_a3b()
    request = PoolRequest(kv_tokens=8192, state_slots=4)
    bare = GpuBudget(total_bytes=20 * GIB, memory_ratio=1.0, weights_bytes=spec.dense_weight_bytes())
    fits = plan_pools(spec, bare, request)
    assert isinstance(fits, PoolPlan)
    # every GiB the step takes is a GiB the pools lose
    act = step_activation_bytes(spec, 8192, 4)
    reserved = plan_pools(spec, reserve_step(bare, act), request)
    assert reserved.pool_bytes == fits.pool_bytes - act
    # a budget that holds the pools' floor but not the floor plus the reserve of a 32k step
    floor = plan_pools(spec, bare, replace(request, expert_slots=spec.total_experts // 4))
    tight = replace(bare, total_bytes=bare.total_bytes - floor.free_bytes + GIB)
    act32 = step_activation_bytes(spec, 32768, 4)
    explicit = replace(request, expert_slots=spec.total_experts // 4)
    refused = plan_pools(spec, reserve_step(tight, act32), explicit)
    assert isinstance(refused, PlanRefusal) and refused.pool == "moe"
    named = blame_step(refused, plan_pools(spec, tight, explicit), 32768, act32)
    assert named.pool == "activation" and named.shortfall_bytes == refused.shortfall_bytes
    assert "a prefill step of 32768 tokens (--max-prefill-length) needs 4.08 GiB" in named.message
    assert "lower --max-prefill-length" in named.message
    # the shortfall is exact: that many bytes more and the pools fit beside the reserve
    more = replace(tight, total_bytes=tight.total_bytes + named.shortfall_bytes)
    assert isinstance(plan_pools(spec, reserve_step(more, act32), explicit), PoolPlan)
    # a refusal the reserve did not cause keeps its own name
    hopeless = replace(bare, total_bytes=spec.dense_weight_bytes() + GIB)
    alone = plan_pools(spec, hopeless, explicit)
    assert isinstance(alone, PlanRefusal)
    assert blame_step(alone, alone, 8192, act) is alone
    with pytest.raises(ValueError, match="activation_bytes"):
        reserve_step(bare, -1)
