"""plan_resize: frees before allocations, peak within budget, steps reach the target, refusals."""

import copy
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.budget import GpuBudget, PlanRefusal, PoolPlan, PoolRequest, plan_pools
from domain.model_spec import qwen36_35b_a3b
from domain.resize import ResizePlan, ResizeStep, plan_resize
from tests.domain.test_budget import QWEN3_MOE_LIKE, QWEN_FP8, TINY, pool_budget, scale

GiB = 1024**3


def replay(current: PoolPlan, steps) -> tuple[dict[str, int], int, int]:
    """Apply steps to the current sizes the way an executor would; return sizes, held, peak."""
    sizes = {"kv": current.kv_tokens, "moe": current.expert_slots, "state": current.state_slots,
             "snapshot": current.snapshot_slots}
    held = peak = current.used_bytes
    for step in steps:
        if step.action == "free":
            assert sizes[step.pool] == step.size_from
            sizes[step.pool] = 0
            held -= step.bytes
        else:
            assert sizes[step.pool] == 0, "allocating over a live pool: old and new would coexist"
            sizes[step.pool] = step.size_to
            held += step.bytes
        peak = max(peak, held)
    return sizes, held, peak


@st.composite
def resize_cases(draw):
    spec = draw(st.sampled_from([QWEN_FP8, TINY, QWEN3_MOE_LIKE]))
    pool = draw(st.integers(1, scale(spec)))
    page_size = draw(st.sampled_from([1, 16]))
    current = plan_pools(spec, pool_budget(pool), PoolRequest(
        kv_reserve_tokens=draw(st.integers(0, 20_000)), state_slots=draw(st.integers(1, 32)),
        snapshot_slots=draw(st.integers(0, 16)), page_size=page_size))
    kv = draw(st.none() | st.integers(0, 60_000))
    slots = draw(st.none() | st.integers(0, spec.total_experts + 1))
    states = draw(st.none() | st.integers(1, 48))
    snaps = draw(st.none() | st.integers(0, 24))
    # the budget may also have changed since the current plan was made (never below its use)
    new_pool = pool if draw(st.booleans()) or isinstance(current, PlanRefusal) else \
        draw(st.integers(current.used_bytes, 2 * pool))
    return spec, pool_budget(new_pool), current, kv, slots, states, snaps


@given(resize_cases())
def test_resize_properties(case):
    spec, budget, current, kv, slots, states, snaps = case
    if isinstance(current, PlanRefusal):
        return
    before = copy.deepcopy(current)
    result = plan_resize(spec, budget, current, kv_tokens=kv, expert_slots=slots, state_slots=states,
                         snapshot_slots=snaps)
    assert current == before  # a refusal or a plan never touches the current plan
    direct = plan_pools(spec, budget, PoolRequest(
        kv_tokens=current.kv_tokens if kv is None else kv,
        expert_slots=current.expert_slots if slots is None else slots,
        state_slots=current.state_slots if states is None else states,
        snapshot_slots=current.snapshot_slots if snaps is None else snaps, page_size=current.page_size))
    assert isinstance(result, PlanRefusal) == isinstance(direct, PlanRefusal)
    if isinstance(result, PlanRefusal):
        assert result == direct
        return
    assert result.target == direct
    sizes, held, peak = replay(current, result.steps)
    assert sizes == {"kv": result.target.kv_tokens, "moe": result.target.expert_slots,
                     "state": result.target.state_slots, "snapshot": result.target.snapshot_slots}
    assert result.clears_prefix_cache == (sizes["kv"] != current.kv_tokens
                                          or sizes["snapshot"] != current.snapshot_slots)
    assert held == result.target.used_bytes
    assert result.peak_bytes == peak <= budget.pool_bytes
    actions = [step.action for step in result.steps]
    assert actions == sorted(actions, key=lambda a: a == "allocate")  # every free before any allocate
    assert result.experts_kept == (result.target.expert_slots == current.expert_slots)
    if slots is None or slots == current.expert_slots:
        assert result.experts_kept
    unchanged = {name for name, size in sizes.items()
                 if size == {"kv": current.kv_tokens, "moe": current.expert_slots,
                             "state": current.state_slots, "snapshot": current.snapshot_slots}[name]}
    assert not unchanged & {step.pool for step in result.steps}  # untouched pools stay put


def spec_plan() -> tuple[GpuBudget, PoolPlan]:
    budget = GpuBudget(total_bytes=int(17.6 * GiB), memory_ratio=1.0)
    plan = plan_pools(QWEN_FP8, budget, PoolRequest(kv_tokens=453_005, expert_slots=2048, state_slots=24))
    assert isinstance(plan, PoolPlan)
    return budget, plan


def test_shrink_kv_grow_moe_live_without_coexisting_pools():
    """The case the existing engine needed a restart for: growing MoE while shrinking KV."""
    budget, current = spec_plan()
    result = plan_resize(QWEN_FP8, budget, current, kv_tokens=100_000, expert_slots=4000)
    assert isinstance(result, ResizePlan)
    assert [(s.pool, s.action) for s in result.steps] == [
        ("kv", "free"), ("moe", "free"), ("kv", "allocate"), ("moe", "allocate")]
    assert result.steps[1] == ResizeStep("moe", "free", 2048, 0, current.expert_bytes)
    assert result.steps[3] == ResizeStep("moe", "allocate", 0, 4000, 4000 * QWEN_FP8.expert_bytes())
    assert not result.experts_kept and result.needs_idle
    assert result.peak_bytes == current.used_bytes <= budget.pool_bytes
    # allocating the new expert pool before freeing the old one would not have fitted
    assert current.used_bytes + result.target.expert_bytes > budget.pool_bytes


def test_grow_kv_only_keeps_experts_and_refuses_overcommit():
    budget, current = spec_plan()
    grown = plan_resize(QWEN_FP8, budget, current, kv_tokens=500_000)
    assert isinstance(grown, ResizePlan) and grown.experts_kept
    assert [s.pool for s in grown.steps] == ["kv", "kv"] and grown.target.expert_slots == 2048
    assert grown.peak_bytes == grown.target.used_bytes
    refused = plan_resize(QWEN_FP8, budget, current, kv_tokens=800_000)
    assert isinstance(refused, PlanRefusal) and refused.pool == "kv" and refused.shortfall_bytes > 0
    moe_only = plan_resize(QWEN_FP8, budget, current, expert_slots=1024)
    assert not moe_only.experts_kept and not moe_only.needs_idle
    same = plan_resize(QWEN_FP8, budget, current)
    assert same.steps == () and same.experts_kept and same.peak_bytes == current.used_bytes


@pytest.mark.parametrize(("sizes", "pool"), [
    ({"kv_tokens": 1}, "kv"), ({"kv_tokens": -5}, "kv"), ({"state_slots": 0}, "state"),
    ({"state_slots": -1}, "state"), ({"expert_slots": -3}, "moe"), ({"expert_slots": 0}, "moe"),
])
def test_sizes_that_cannot_work_are_refused_never_raised(sizes, pool):
    budget, current = spec_plan()
    refusal = plan_resize(QWEN_FP8, budget, current, **sizes)
    assert isinstance(refusal, PlanRefusal) and refusal.pool == pool and refusal.shortfall_bytes == 0


def test_bad_current_plan_is_rejected():
    budget, current = spec_plan()
    with pytest.raises(ValueError, match="another budget"):
        plan_resize(QWEN_FP8, GpuBudget(total_bytes=8 * GiB, memory_ratio=1.0), current)
    with pytest.raises(ValueError, match="not sized"):
        plan_resize(qwen36_35b_a3b(), budget, dataclasses.replace(
            current, expert_slots=current.expert_slots - 1, used_bytes=current.used_bytes,
            free_bytes=current.free_bytes))


def test_resize_plan_check_valid_rejects_bad_orders():
    budget, current = spec_plan()
    plan = plan_resize(QWEN_FP8, budget, current, kv_tokens=100_000, expert_slots=4000)
    reordered = (plan.steps[0], plan.steps[2], plan.steps[1], plan.steps[3])
    with pytest.raises(ValueError):
        dataclasses.replace(plan, steps=reordered)
    with pytest.raises(ValueError):
        dataclasses.replace(plan, experts_kept=True)
    with pytest.raises(ValueError):
        dataclasses.replace(plan, peak_bytes=plan.peak_bytes - 1)
    with pytest.raises(ValueError):
        dataclasses.replace(plan, steps=plan.steps[:-1])


# ---- the prefix cache's snapshot pool --------------------------------------------------------------------


def test_the_snapshot_pool_is_kept_across_resizes_and_rebuilt_when_asked():
    budget = pool_budget(scale(TINY))
    current = plan_pools(TINY, budget, PoolRequest(kv_tokens=4096, expert_slots=8, state_slots=2, snapshot_slots=6))
    per = TINY.linear_state_bytes_per_sequence()
    assert current.snapshot_bytes == 6 * per and current.used_bytes == (
        current.kv_bytes + current.expert_bytes + current.state_bytes + 6 * per)
    kv = plan_resize(TINY, budget, current, kv_tokens=8192)
    assert kv.target.snapshot_slots == 6 and kv.clears_prefix_cache and kv.needs_idle
    moe = plan_resize(TINY, budget, current, expert_slots=6)
    assert not moe.clears_prefix_cache and not moe.needs_idle
    state = plan_resize(TINY, budget, current, state_slots=3)
    assert not state.clears_prefix_cache and state.needs_idle
    snap = plan_resize(TINY, budget, current, snapshot_slots=10)
    assert [(s.pool, s.action) for s in snap.steps] == [("snapshot", "free"), ("snapshot", "allocate")]
    assert snap.clears_prefix_cache and snap.target.snapshot_bytes == 10 * per
    assert snap.peak_bytes == max(current.used_bytes, snap.target.used_bytes)
    sizes, held, peak = replay(current, snap.steps)
    assert sizes["snapshot"] == 10 and held == snap.target.used_bytes and peak == snap.peak_bytes


def test_a_snapshot_pool_that_does_not_fit_is_refused_by_name_and_a_negative_one_never_fits():
    current = plan_pools(TINY, pool_budget(scale(TINY)), PoolRequest(kv_tokens=4096, expert_slots=8))
    tight = pool_budget(current.used_bytes + 3 * TINY.linear_state_bytes_per_sequence())
    refusal = plan_resize(TINY, tight, current, snapshot_slots=5)
    assert isinstance(refusal, PlanRefusal) and refusal.pool == "snapshot"
    assert refusal.shortfall_bytes == 2 * TINY.linear_state_bytes_per_sequence()
    assert isinstance(plan_resize(TINY, tight, current, snapshot_slots=3), ResizePlan)
    bad = plan_resize(TINY, tight, current, snapshot_slots=-1)
    assert isinstance(bad, PlanRefusal) and bad.pool == "snapshot" and bad.shortfall_bytes == 0
