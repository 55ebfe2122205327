"""domain/serve_plan.py: `ft serve`'s flags -> budget and pools, the defaults dropped (and said) when they do
not fit, explicit sizes never dropped, unsized KV capped at what the running requests can use."""

import dataclasses

import pytest

from domain.budget import GpuBudget, PlanRefusal, PoolPlan, plan_pools
from domain.model_spec import LayerKind, ModelSpec
from domain.serve_plan import (
    GIB,
    ServePlan,
    ServePools,
    cap_bytes,
    embedding_on_host,
    plan_serve_pools,
    serve_budget,
)
from domain.streamed_prefill import default_staging_experts

SPEC = ModelSpec(
    name="tiny", architecture="qwen3_5_moe", hidden_size=64,
    layer_kinds=(LayerKind.LINEAR_ATTENTION, LayerKind.FULL_ATTENTION) * 2, num_experts=16, top_k=2,
    expert_intermediate=32, shared_expert_intermediate=32, num_attention_heads=4, num_kv_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel=4, vocab_size=1000, max_context=4096)
E, S = SPEC.expert_bytes(), SPEC.linear_state_bytes_per_sequence()
KV = 1024 * SPEC.kv_bytes_per_token()
STAGING = default_staging_experts(E, SPEC.num_experts)
FLOOR = SPEC.top_k * SPEC.num_layers  # one token's working set of expert slots


def _plan(pool: int, **flags) -> ServePlan | PlanRefusal:
    return plan_serve_pools(SPEC, GpuBudget(total_bytes=pool, memory_ratio=1.0), ServePools(**flags))


def test_the_budget_is_the_capped_card_times_the_ratio_less_the_dense_weights():
    budget = serve_budget(SPEC, 100 * GIB, 0.9, cap_bytes(24))
    assert budget.total_bytes == 24 * GIB and budget.weights_bytes == SPEC.dense_weight_bytes()
    assert budget.pool_bytes == int(24 * GIB * 0.9) - SPEC.dense_weight_bytes()
    assert serve_budget(SPEC, 8 * GIB, 0.9, cap_bytes(24)).total_bytes == 8 * GIB  # a cap above the card
    assert serve_budget(SPEC, 8 * GIB).total_bytes == 8 * GIB
    with pytest.raises(ValueError, match="gpu-budget-gib"):
        cap_bytes(0)
    with pytest.raises(ValueError, match="device_total_bytes"):
        serve_budget(SPEC, 0)


def test_a_gpu_deployment_leaves_the_input_embedding_out_of_the_budget():
    # the loader and decoder keep the table in pinned host memory on a GPU: its VRAM goes to the pools
    assert SPEC.embedding_bytes() == SPEC.vocab_size * SPEC.hidden_size * 2
    hosted = serve_budget(SPEC, 100 * GIB, 0.9, cap_bytes(24), host_embedding=embedding_on_host(SPEC, gpu=True))
    on_gpu = serve_budget(SPEC, 100 * GIB, 0.9, cap_bytes(24))
    assert hosted.weights_bytes == SPEC.dense_weight_bytes() - SPEC.embedding_bytes()
    assert hosted.pool_bytes - on_gpu.pool_bytes == SPEC.embedding_bytes()
    assert not embedding_on_host(SPEC, gpu=False)  # a CPU deployment: everything is host memory already
    assert not embedding_on_host(dataclasses.replace(SPEC, hidden_size=2044), gpu=True)  # rows the gather cannot copy


def test_defaults_are_ft_serves_and_bad_flags_are_refused():
    request = ServePools(kv_tokens=1024).request()
    assert (request.state_slots, request.snapshot_slots, request.staging_experts) == (4, 16, 0)
    assert ServePools(kv_tokens=1024, streams_prefill=True).request().staging_experts is None  # auto
    assert ServePools(cache_type="none", snapshot_slots=9).request().snapshot_slots == 0
    assert ServePools(max_running_requests=3).request().snapshot_slots == 12
    with pytest.raises(ValueError, match="cache-type"):
        ServePools(cache_type="lru")
    with pytest.raises(ValueError, match="max-running-requests"):
        ServePools(max_running_requests=0)
    with pytest.raises(ValueError, match="staging_experts"):
        ServePools(staging_experts=-1)


def test_a_roomy_budget_plans_every_default_and_says_nothing():
    planned = _plan(1 << 30, kv_tokens=1024, streams_prefill=True)
    assert isinstance(planned, ServePlan) and planned.notes == ()
    assert planned.plan.snapshot_slots == 16 and planned.plan.state_slots == 4
    # every expert resident: nothing would stream, so auto staging plans none
    assert planned.plan.expert_slots == SPEC.total_experts and planned.plan.staging_experts == 0
    assert planned.plan == plan_pools(SPEC, GpuBudget(1 << 30, 1.0), planned.request)


def test_when_both_defaults_do_not_fit_both_are_dropped_in_turn():
    # room for the state slots, the floor of expert slots, the KV and a few more slots: neither the 16
    # snapshots nor the staging rows fit. The planner refuses the snapshots first (auto staging tries the
    # plan without staging first), then the staging rows; the server starts without either.
    pool = 4 * S + (FLOOR + 4) * E + KV
    assert 16 * S > 4 * E and STAGING > 4
    planned = _plan(pool, kv_tokens=1024, streams_prefill=True)
    assert isinstance(planned, ServePlan)
    assert (planned.plan.snapshot_slots, planned.plan.staging_experts) == (0, 0)
    assert planned.plan.expert_slots == FLOOR + 4
    assert [n.split(" do not fit")[0] for n in planned.notes] == ["the default 16 state snapshot slots",
                                                                   "the default prefill staging rows"]


def test_explicit_sizes_are_never_dropped():
    pool = 4 * S + (FLOOR + 4) * E + KV
    refused = _plan(pool, kv_tokens=1024, snapshot_slots=16)
    assert isinstance(refused, PlanRefusal) and refused.pool == "snapshot"
    refused = _plan(pool, kv_tokens=1024, staging_experts=STAGING, cache_type="none")
    assert isinstance(refused, PlanRefusal) and refused.pool == "staging"
    refused = _plan(4 * S + FLOOR * E, kv_tokens=1024)  # the KV itself does not fit
    assert isinstance(refused, PlanRefusal) and refused.pool == "kv"


def test_unsized_kv_is_capped_at_the_running_requests_full_context():
    planned = _plan(1 << 30, max_running_requests=2)
    assert isinstance(planned.plan, PoolPlan)
    assert planned.plan.kv_tokens == 2 * SPEC.max_context and planned.request.kv_tokens == 2 * SPEC.max_context
    sized = _plan(1 << 30, kv_tokens=64 * SPEC.max_context)  # asked for: kept
    assert sized.plan.kv_tokens == 64 * SPEC.max_context
