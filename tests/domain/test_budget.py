"""plan_pools: never over budget, monotone, exact refusals, explicit sizes honoured, SPEC example."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.budget import (
    GpuBudget,
    PlanRefusal,
    PoolPlan,
    PoolRequest,
    format_bytes,
    plan_pools,
    working_set_slots,
)
from domain.model_spec import LayerKind, ModelSpec, WeightFormat, qwen36_35b_a3b

GiB = 1024**3
QWEN_FP8 = qwen36_35b_a3b()
# tiny hybrid model: 4 layers x 4 experts, so "every expert resident" is reachable in a test
TINY = dataclasses.replace(
    qwen36_35b_a3b(WeightFormat.BF16), name="tiny", hidden_size=64, num_experts=4, top_k=2,
    expert_intermediate=32, layer_kinds=(LayerKind.LINEAR_ATTENTION, LayerKind.FULL_ATTENTION) * 2,
    num_attention_heads=4, num_kv_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=128)
QWEN3_MOE_LIKE = dataclasses.replace(TINY, name="full-attn", architecture="qwen3_moe",
                                     layer_kinds=(LayerKind.FULL_ATTENTION,) * 3,
                                     linear_num_key_heads=0, linear_num_value_heads=0,
                                     linear_key_head_dim=0, linear_value_head_dim=0, linear_conv_kernel=0)


def pool_budget(pool_bytes: int) -> GpuBudget:
    return GpuBudget(total_bytes=max(pool_bytes, 0), memory_ratio=1.0, fixed_bytes=max(-pool_bytes, 0))


def scale(spec: ModelSpec) -> int:
    """A byte range that spans refusals, MoE-first plans and all-experts-resident plans."""
    return (spec.total_experts * spec.expert_bytes() + 64 * spec.linear_state_bytes_per_sequence()
            + 40_000 * spec.kv_bytes_per_token())


@st.composite
def cases(draw):
    spec = draw(st.sampled_from([QWEN_FP8, TINY, QWEN3_MOE_LIKE]))
    page_size = draw(st.sampled_from([1, 16, 64]))
    request = PoolRequest(
        kv_tokens=draw(st.none() | st.integers(0, 40_000)),
        expert_slots=draw(st.none() | st.integers(spec.top_k, spec.total_experts)),
        state_slots=draw(st.none() | st.integers(1, 64)),
        kv_reserve_tokens=draw(st.integers(0, 10_000)),
        page_size=page_size,
    )
    pool = draw(st.integers(-1000, scale(spec)))
    return spec, request, pool


@given(cases())
def test_never_over_budget_and_explicit_sizes_honoured(case):
    spec, request, pool = case
    plan = plan_pools(spec, pool_budget(pool), request)
    if isinstance(plan, PlanRefusal):
        below_a_page = request.kv_tokens is not None and request.kv_tokens < request.page_size
        assert plan.shortfall_bytes > 0 or (below_a_page and plan.pool == "kv")
        return
    plan.check_valid()
    if request.kv_tokens is not None:
        assert plan.kv_pages >= 1, "an explicit KV size must leave at least one page"
    assert plan.pool_bytes == pool
    assert plan.used_bytes <= pool and plan.free_bytes >= 0
    assert plan.kv_bytes == plan.kv_tokens * spec.kv_bytes_per_token()
    assert plan.expert_bytes == plan.expert_slots * spec.expert_bytes()
    assert plan.state_bytes == plan.state_slots * spec.linear_state_bytes_per_sequence()
    assert spec.top_k <= plan.expert_slots <= spec.total_experts
    assert plan.residency == plan.expert_slots / spec.total_experts
    assert plan.state_slots == (4 if request.state_slots is None else request.state_slots)
    if request.expert_slots is not None:
        assert plan.expert_slots == request.expert_slots
    if request.kv_tokens is not None:
        assert plan.kv_tokens == request.kv_tokens // request.page_size * request.page_size
    else:
        assert plan.kv_tokens >= request.kv_reserve_tokens


@given(cases())
def test_leftover_memory_is_handed_out(case):
    """MoE first: unsized experts take all they can; unsized KV takes the rest once experts can't."""
    spec, request, pool = case
    plan = plan_pools(spec, pool_budget(pool), request)
    if isinstance(plan, PlanRefusal):
        return
    per_page = request.page_size * spec.kv_bytes_per_token()
    all_resident = plan.expert_slots == spec.total_experts
    if request.expert_slots is None and not all_resident:
        assert plan.free_bytes < spec.expert_bytes()
        if request.kv_tokens is None:  # KV stays at its floor while experts still want memory
            assert plan.kv_pages == -(-request.kv_reserve_tokens // request.page_size)
    if request.kv_tokens is None and per_page and (request.expert_slots is not None or all_resident):
        assert plan.free_bytes < per_page


@given(cases(), st.integers(0, 4 * GiB))
def test_more_memory_never_yields_fewer_slots_or_tokens(case, extra):
    spec, request, pool = case
    small = plan_pools(spec, pool_budget(pool), request)
    large = plan_pools(spec, pool_budget(pool + extra), request)
    if isinstance(small, PlanRefusal):
        return
    assert isinstance(large, PoolPlan)
    assert large.expert_slots >= small.expert_slots
    assert large.kv_tokens >= small.kv_tokens
    assert large.state_slots == small.state_slots


@given(cases())
def test_refusal_shortfall_is_exactly_what_is_missing(case):
    spec, request, pool = case
    refusal = plan_pools(spec, pool_budget(pool), request)
    if not isinstance(refusal, PlanRefusal):
        return
    if refusal.shortfall_bytes == 0:  # no memory helps: an explicit KV size below one page
        assert refusal.pool == "kv" and request.kv_tokens < request.page_size
        return
    assert refusal.pool in ("kv", "moe", "state", "budget")
    assert str(refusal.shortfall_bytes) in refusal.message or refusal.pool == "budget"
    assert isinstance(plan_pools(spec, pool_budget(pool + refusal.shortfall_bytes), request), PoolPlan)
    assert isinstance(plan_pools(spec, pool_budget(pool + refusal.shortfall_bytes - 1), request), PlanRefusal)
    state_bytes = plan_pools(spec, pool_budget(10**15), request).state_bytes
    if pool <= 0:
        assert refusal.pool == "budget"
    else:
        assert (refusal.pool == "state") == (state_bytes > pool)


def test_refusals_name_the_short_pool():
    spec = QWEN_FP8
    state = spec.linear_state_bytes_per_sequence()
    slot = spec.expert_bytes()
    refusal = plan_pools(spec, pool_budget(10 * state), PoolRequest(state_slots=11))
    assert refusal == PlanRefusal("state", refusal.shortfall_bytes, refusal.message)
    # shortfall covers the whole request: the state excess plus the floors after it
    assert refusal.shortfall_bytes == state + 320 * slot + 8192 * spec.kv_bytes_per_token()

    budget = pool_budget(10 * GiB)
    assert plan_pools(spec, budget, PoolRequest(kv_tokens=600_000)).pool == "kv"
    assert plan_pools(spec, budget, PoolRequest(expert_slots=4000)).pool == "moe"
    # explicit slots that crowd out the KV floor are blamed, not the floor
    crowded = plan_pools(spec, budget, PoolRequest(expert_slots=3300))
    assert crowded.pool == "moe"
    assert crowded.shortfall_bytes == 4 * state + 3300 * slot + 8192 * spec.kv_bytes_per_token() - 10 * GiB
    # the KV floor that does not fit after the working-set floor (top_k x layers) is blamed on KV
    tight = pool_budget(4 * state + 320 * slot + 100)
    assert plan_pools(spec, tight, PoolRequest()).pool == "kv"
    assert plan_pools(spec, pool_budget(4 * state + 100), PoolRequest()).pool == "moe"


def test_budget_and_top_k_refusals():
    spec = QWEN_FP8
    for pool in (0, -5):
        refusal = plan_pools(spec, pool_budget(pool), PoolRequest())
        assert refusal.pool == "budget" and refusal.shortfall_bytes > 0
    assert plan_pools(spec, GpuBudget(total_bytes=10 * GiB, weights_bytes=9 * GiB), PoolRequest()).pool == "budget"
    below = plan_pools(spec, pool_budget(20 * GiB), PoolRequest(expert_slots=7))
    assert below.pool == "moe" and below.shortfall_bytes == 0 and "top_k" in below.message
    above = plan_pools(spec, pool_budget(100 * GiB), PoolRequest(expert_slots=10_241))
    assert above.pool == "moe" and above.shortfall_bytes == 0


def test_spec_worked_example():
    """SPEC.md: Qwen3.6-35B-A3B FP8, ~17.6 GiB pool budget, 2048 slots / 453,005 tokens / 24 states."""
    budget = GpuBudget(total_bytes=int(17.6 * GiB), memory_ratio=1.0)
    plan = plan_pools(QWEN_FP8, budget, PoolRequest(kv_tokens=453_005, expert_slots=2048, state_slots=24))
    assert isinstance(plan, PoolPlan)
    assert plan.expert_slots == 2048 and plan.residency == pytest.approx(0.2)
    assert plan.kv_tokens == 452_992  # rounded down to 16-token pages
    assert plan.expert_bytes / GiB == pytest.approx(6.0, abs=0.01)
    assert plan.kv_bytes / GiB == pytest.approx(8.64, abs=0.01)
    assert plan.state_bytes / GiB == pytest.approx(1.44, abs=0.01)
    refusal = plan_pools(QWEN_FP8, budget, PoolRequest(kv_tokens=800_000, expert_slots=2048))
    assert isinstance(refusal, PlanRefusal) and refusal.pool == "kv"
    assert refusal.shortfall_bytes == (800_000 * 20 * 1024 + 2048 * QWEN_FP8.expert_bytes()
                                       + 4 * QWEN_FP8.linear_state_bytes_per_sequence() - budget.pool_bytes)
    # MoE-first at an 8k KV floor: SPEC's "~53 %" residency for 3 MiB slots
    moe_first = plan_pools(QWEN_FP8, budget, PoolRequest(state_slots=24))
    assert moe_first.kv_tokens == 8192
    assert moe_first.residency == pytest.approx(0.53, abs=0.01)


@pytest.mark.parametrize("kv_tokens", [0, 1, 15])
def test_an_explicit_kv_size_below_one_page_is_refused_not_planned_empty(kv_tokens):
    refusal = plan_pools(TINY, pool_budget(10**9), PoolRequest(kv_tokens=kv_tokens, page_size=16))
    assert isinstance(refusal, PlanRefusal) and refusal.pool == "kv" and refusal.shortfall_bytes == 0
    assert "one page" in refusal.message
    assert plan_pools(TINY, pool_budget(10**9), PoolRequest(kv_tokens=16, page_size=16)).kv_pages == 1


def test_a_refused_kv_size_that_is_not_whole_pages_says_it_was_rounded():
    """It once said "99999984 KV tokens" when 99999999 was asked, with no word on why."""
    refusal = plan_pools(QWEN_FP8, pool_budget(10 * GiB), PoolRequest(kv_tokens=99_999_999, page_size=16))
    assert isinstance(refusal, PlanRefusal) and refusal.pool == "kv"
    assert "99999984 KV tokens (99999999 rounded down to whole 16-token pages)" in refusal.message, refusal.message
    whole = plan_pools(QWEN_FP8, pool_budget(10 * GiB), PoolRequest(kv_tokens=99_999_984, page_size=16))
    assert "99999984 KV tokens" in whole.message and "rounded" not in whole.message, whole.message


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (38_361_498, "36.6 MiB"), (158_600_884, "151 MiB"),
    (512 * 2**20, "512 MiB"), (int(1.44 * GiB), "1.44 GiB"), (int(15.26 * GiB), "15.3 GiB"), (5 * 2**40, "5.00 TiB"),
    # rounding decides the unit and the digits: these printed "1024 KiB", "1024 MiB" and "100.0 KiB"
    (2**20 - 1, "1.00 MiB"), (GiB - 1, "1.00 GiB"), (102_348, "100 KiB"), (10_237, "10.0 KiB"),
])
def test_format_bytes_picks_a_unit_that_fits(n, text):
    assert format_bytes(n) == text


def test_a_refusal_of_small_pools_names_their_sizes_not_zero_gib():
    """`ft ctl cache --kv 1m` on the demo model said "4 state slots (0.00 GiB) + 32 expert slots (0.00 GiB) + ...
    short by 158600884 (0.15 GiB)": every pool under 5 MiB read as nothing."""
    per_token = TINY.kv_bytes_per_token()
    refusal = plan_pools(TINY, pool_budget(1000 * per_token), PoolRequest(kv_tokens=4096, page_size=16))
    assert isinstance(refusal, PlanRefusal) and refusal.pool == "kv", refusal
    assert "0.00 GiB" not in refusal.message, refusal.message
    assert f"4096 KV tokens ({format_bytes(4096 * per_token)})" in refusal.message, refusal.message
    assert f"short by {refusal.shortfall_bytes} ({format_bytes(refusal.shortfall_bytes)})" in refusal.message
    assert "KiB)" in refusal.message, refusal.message


def test_gpu_budget_arithmetic_and_validation():
    assert GpuBudget(total_bytes=1000, memory_ratio=0.9, weights_bytes=100, fixed_bytes=50).pool_bytes == 750
    with pytest.raises(ValueError):
        GpuBudget(total_bytes=1000, memory_ratio=1.5)
    with pytest.raises(ValueError):
        GpuBudget(total_bytes=-1)
    with pytest.raises(ValueError):
        PoolRequest(kv_tokens=-1)
    with pytest.raises(ValueError):
        PoolRequest(state_slots=0)
    with pytest.raises(ValueError):
        PlanRefusal("disk", 1, "x")


def test_pool_plan_check_valid_catches_inconsistency():
    plan = plan_pools(TINY, pool_budget(10**8), PoolRequest())
    with pytest.raises(ValueError):
        dataclasses.replace(plan, kv_tokens=plan.kv_tokens + 1)
    with pytest.raises(ValueError):
        dataclasses.replace(plan, free_bytes=plan.free_bytes + 1)
    with pytest.raises(ValueError):
        dataclasses.replace(plan, used_bytes=plan.used_bytes - 1, free_bytes=plan.free_bytes + 1)


def test_automatic_expert_pool_holds_at_least_one_tokens_working_set():
    """Below top_k x layers slots the LRU keeps nothing from one token to the next, so an automatic
    split refuses rather than plan such a pool; an explicit size down to top_k is still honoured."""
    spec, GiB_ = QWEN_FP8, GiB
    assert working_set_slots(spec) == 8 * 40
    budget = GpuBudget(total_bytes=int(17.6 * GiB_), memory_ratio=1.0)
    # SPEC's reference box: 800k KV leaves ~307 slots, fewer than one token's 320 experts
    refusal = plan_pools(spec, budget, PoolRequest(kv_tokens=800_000, state_slots=24))
    assert isinstance(refusal, PlanRefusal) and refusal.pool == "kv"
    assert "working set" in refusal.message
    needed = (320 * spec.expert_bytes() + 800_000 * spec.kv_bytes_per_token()
              + 24 * spec.linear_state_bytes_per_sequence())
    assert refusal.shortfall_bytes == needed - budget.pool_bytes
    fits = plan_pools(spec, budget, PoolRequest(kv_tokens=700_000, state_slots=24))
    assert isinstance(fits, PlanRefusal) is False and fits.expert_slots >= 320
    explicit = plan_pools(spec, budget, PoolRequest(kv_tokens=800_000, expert_slots=8, state_slots=24))
    assert isinstance(explicit, PoolPlan) and explicit.expert_slots == 8


# ---- the prefix cache's snapshot pool --------------------------------------------------------------------


def test_snapshot_slots_are_claimed_after_the_state_slots_and_counted():
    request = PoolRequest(kv_tokens=2048, expert_slots=8, state_slots=2, snapshot_slots=5)
    plan = plan_pools(TINY, pool_budget(scale(TINY)), request)
    assert plan.snapshot_slots == 5 and plan.snapshot_bytes == 5 * TINY.linear_state_bytes_per_sequence()
    assert plan.used_bytes == plan.kv_bytes + plan.expert_bytes + plan.state_bytes + plan.snapshot_bytes
    # exactly the snapshot claim short: refused by name, with the exact shortfall
    without = plan_pools(TINY, pool_budget(scale(TINY)), dataclasses.replace(request, snapshot_slots=0))
    tight = pool_budget(without.used_bytes + 4 * TINY.linear_state_bytes_per_sequence())
    refusal = plan_pools(TINY, tight, request)
    assert isinstance(refusal, PlanRefusal) and refusal.shortfall_bytes == TINY.linear_state_bytes_per_sequence()
    assert refusal.pool == "snapshot" and "state snapshot slots" in refusal.message
    assert isinstance(plan_pools(TINY, pool_budget(tight.pool_bytes + refusal.shortfall_bytes), request), PoolPlan)
    with pytest.raises(ValueError, match="snapshot_slots"):
        PoolRequest(snapshot_slots=-1)


def test_a_model_without_linear_attention_has_no_snapshot_pool():
    plan = plan_pools(QWEN3_MOE_LIKE, pool_budget(scale(QWEN3_MOE_LIKE)),
                      PoolRequest(kv_tokens=2048, expert_slots=8, snapshot_slots=7))
    assert (plan.snapshot_slots, plan.snapshot_bytes) == (0, 0)
