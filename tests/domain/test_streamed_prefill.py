"""domain.streamed_prefill: rounds, buffers, the speculation rule, the default staging size and the PCIe
bound; and the staging rows in the budget (claimed, refused by name, kept across live resizes)."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.budget import PlanRefusal, PoolRequest, plan_pools
from domain.model_spec import qwen36_35b_a3b
from domain.resize import ResizePlan, plan_resize
from domain.streamed_prefill import (
    LINK_BYTES_PER_S,
    copy_runs,
    default_staging_experts,
    pcie_bound_s,
    plan_rounds,
    speculate_whole_layers,
    staging_buffers,
)
from tests.domain.test_budget import QWEN_FP8, TINY, cases, pool_budget

GiB = 1024**3


@given(st.lists(st.sets(st.integers(0, 40), max_size=30), min_size=1, max_size=5), st.integers(1, 70))
def test_rounds_cover_every_missing_expert_once_in_alternating_halves(missing, staging):
    rounds = plan_rounds([sorted(m, reverse=True) for m in missing], staging)
    buffers, per_round = staging_buffers(staging)
    assert buffers * per_round <= staging and per_round >= 1
    for layer, want in enumerate(missing):
        mine = [r for r in rounds if r.layer == layer]
        assert mine and mine[0].first and not any(r.first for r in mine[1:])
        got = [e for r in mine for e in r.experts]
        assert got == sorted(want)  # ascending, each once
        assert all(0 < len(r.experts) <= per_round for r in mine) or (not want and len(mine) == 1)
    assert [r.layer for r in rounds] == sorted(r.layer for r in rounds)
    assert [r.buffer for r in rounds] == [i % buffers for i in range(len(rounds))]


def test_bad_rounds_and_buffers_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        staging_buffers(0)
    with pytest.raises(ValueError, match="distinct"):
        plan_rounds([[1, 1]], 4)
    with pytest.raises(ValueError, match="distinct"):
        plan_rounds([[-1]], 4)
    assert staging_buffers(1) == (1, 1) and staging_buffers(7) == (2, 3)


def test_speculation_and_the_pcie_bound():
    spec = qwen36_35b_a3b()
    assert speculate_whole_layers(256 * spec.top_k, spec.num_experts)  # a 256-token chunk: whole layers
    assert not speculate_whole_layers(255 * spec.top_k, spec.num_experts)
    # the scenario: 4,096 tokens at 20 % residency touch ~every expert; 80 % are not resident
    missing = int(0.8 * spec.total_experts) * spec.expert_bytes()
    assert pcie_bound_s(missing) == pytest.approx(missing / 51e9) == pytest.approx(0.506, abs=0.001)
    assert pcie_bound_s(10, 5.0) == 2.0 and LINK_BYTES_PER_S == 51e9
    with pytest.raises(ValueError):
        pcie_bound_s(-1)
    with pytest.raises(ValueError):
        pcie_bound_s(1, 0)


def test_default_staging_size_from_the_geometry():
    spec = qwen36_35b_a3b()
    rows = default_staging_experts(spec.expert_bytes(), spec.num_experts)
    assert rows == 130 and rows * spec.expert_bytes() < 400 * 1024**2  # 390 MiB, not 1.5 GiB
    assert default_staging_experts(10, 4) == 8  # tiny experts: two whole layers at most
    assert default_staging_experts(10**12, 4) == 2  # huge ones: at least one per half
    with pytest.raises(ValueError):
        default_staging_experts(0, 4)


def test_staging_is_claimed_counted_and_refused_by_name():
    spec, per = QWEN_FP8, QWEN_FP8.expert_bytes()
    request = PoolRequest(kv_tokens=8192, expert_slots=2048, state_slots=4, staging_experts=66)
    plan = plan_pools(spec, pool_budget(24 * GiB), request)
    assert (plan.staging_experts, plan.staging_bytes) == (66, 66 * per)
    assert plan.used_bytes == plan.kv_bytes + plan.expert_bytes + plan.state_bytes + plan.staging_bytes
    # exactly the staging rows short: refused by name, shortfall exact
    tight = plan.used_bytes - 1
    refused = plan_pools(spec, pool_budget(tight), request)
    assert isinstance(refused, PlanRefusal) and refused.pool == "staging" and refused.shortfall_bytes == 1
    assert not isinstance(plan_pools(spec, pool_budget(tight + 1), request), PlanRefusal)
    with pytest.raises(ValueError, match="staging"):
        PoolRequest(staging_experts=-1)
    with pytest.raises(ValueError, match="used_bytes"):
        dataclasses.replace(plan, staging_bytes=plan.staging_bytes + 1)


def test_automatic_staging_comes_from_the_geometry_unless_every_expert_is_resident():
    auto = PoolRequest(kv_tokens=8192, state_slots=4, staging_experts=None)
    plan = plan_pools(QWEN_FP8, pool_budget(24 * GiB), auto)
    assert plan.staging_experts == 130 and plan.expert_slots < QWEN_FP8.total_experts
    without = plan_pools(QWEN_FP8, pool_budget(24 * GiB), dataclasses.replace(auto, staging_experts=0))
    assert without.expert_slots == plan.expert_slots + 130  # the rows come out of the residency
    big = plan_pools(TINY, pool_budget(1 << 40), dataclasses.replace(auto, kv_tokens=64))
    assert big.expert_slots == TINY.total_experts and big.staging_experts == 0  # nothing would stream
    assert plan_pools(TINY, pool_budget(1), auto).pool == "state"  # the bare plan's refusal stands


def test_a_live_resize_keeps_the_staging_rows():
    spec, budget = QWEN_FP8, pool_budget(24 * GiB)
    current = plan_pools(spec, budget, PoolRequest(kv_tokens=8192, expert_slots=2048, staging_experts=66))
    resized = plan_resize(spec, budget, current, kv_tokens=65536, expert_slots=1024)
    assert isinstance(resized, ResizePlan)
    assert resized.target.staging_experts == 66 and resized.target.expert_slots == 1024
    assert resized.peak_bytes <= budget.pool_bytes
    # growing the experts into the staging rows' bytes is refused (naming the staging rows, claimed after
    # the pools the model needs), not planned over budget
    room = (budget.pool_bytes - current.used_bytes) // spec.expert_bytes()
    assert isinstance(plan_resize(spec, budget, current, expert_slots=2048 + room), ResizePlan)
    refused = plan_resize(spec, budget, current, expert_slots=2048 + room + 1)
    assert isinstance(refused, PlanRefusal) and refused.pool == "staging"
    with pytest.raises(ValueError, match="staging"):
        ResizePlan(current, dataclasses.replace(resized.target, staging_experts=0, staging_bytes=0,
                                                used_bytes=resized.target.used_bytes - resized.target.staging_bytes,
                                                free_bytes=resized.target.free_bytes + resized.target.staging_bytes),
                   resized.steps, resized.peak_bytes, resized.experts_kept)
    with pytest.raises(ValueError, match="staging rows were not sized"):
        plan_resize(spec, budget, dataclasses.replace(current, staging_bytes=1, used_bytes=current.used_bytes
                                                      - current.staging_bytes + 1,
                                                      free_bytes=current.free_bytes + current.staging_bytes - 1))


@given(cases(), st.integers(0, 600))
def test_staging_rows_are_honoured_exactly_and_never_over_budget(case, staging):
    spec, request, pool = case
    request = dataclasses.replace(request, staging_experts=staging)
    plan = plan_pools(spec, pool_budget(pool), request)
    if isinstance(plan, PlanRefusal):
        if plan.shortfall_bytes:  # a budget that many bytes larger fits the same request
            assert not isinstance(plan_pools(spec, pool_budget(pool + plan.shortfall_bytes), request), PlanRefusal)
        return
    assert (plan.staging_experts, plan.staging_bytes) == (staging, staging * spec.expert_bytes())
    assert plan.used_bytes <= pool
    bare = plan_pools(spec, pool_budget(pool), dataclasses.replace(request, staging_experts=0))
    assert plan.expert_slots <= bare.expert_slots and plan.kv_tokens <= bare.kv_tokens


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=20))
def test_copy_runs_move_exactly_the_pairs_in_order_and_merge_only_consecutive_rows(pairs):
    runs = copy_runs([s for s, _ in pairs], [d for _, d in pairs])
    assert [(s + i, d + i) for s, d, n in runs for i in range(n)] == pairs  # every pair, in order, once
    assert all(n >= 1 for _, _, n in runs)
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:], strict=False):  # maximal: breaks only where it must
        assert (s1, d1) != (s0 + n0, d0 + n0)


def test_copy_runs_of_a_layers_consecutive_missing_experts_are_one_copy():
    # a warm cache holding each layer's first experts: the rest are consecutive bank rows -> one memcpy
    assert copy_runs(range(51 + 256, 84 + 256), range(2100, 2133)) == ((307, 2100, 33),)
    assert copy_runs([5, 6, 9], [0, 1, 2]) == ((5, 0, 2), (9, 2, 1))
    with pytest.raises(ValueError, match="source rows"):
        copy_runs([1], [])
    with pytest.raises(ValueError, match=">= 0"):
        copy_runs([-1], [0])
