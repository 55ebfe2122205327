"""Expert parallelism in the domain: the partition of (layer, expert) keys over N ranks and every rank's
pools checked against its own budget, with live resize all-or-nothing."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.budget import GpuBudget, PlanRefusal, PoolRequest, plan_pools
from domain.expert_parallel import (
    ExpertParallelPlan,
    ExpertParallelResize,
    ExpertPartition,
    plan_expert_parallel,
    plan_resize_expert_parallel,
)
from domain.model_spec import qwen36_35b_a3b
from tests.domain.test_budget import QWEN_FP8, TINY, pool_budget

GiB = 1024**3


# ---- the partition ---------------------------------------------------------------------------------
@given(st.integers(1, 6), st.integers(1, 40), st.integers(1, 8))
def test_modulo_partition_gives_every_key_one_owner_and_equal_shares(layers, experts, ranks):
    if ranks > experts:
        with pytest.raises(ValueError, match="would own none"):
            ExpertPartition.modulo(layers, experts, ranks)
        return
    p = ExpertPartition.modulo(layers, experts, ranks)
    owned = [p.keys_of(r) for r in range(ranks)]
    assert sum(owned) == layers * experts
    assert max(owned) - min(owned) <= layers  # at most one expert per layer apart
    for layer in range(layers):
        mine = [p.experts_of(r, layer) for r in range(ranks)]
        assert sorted(e for m in mine for e in m) == list(range(experts))
        for r, m in enumerate(mine):
            assert all(p.owner_of((layer, e)) == r for e in m)
    # the layer rotation spreads the remainder experts: over N layers every rank owns the same count
    if layers % ranks == 0:
        assert len(set(owned)) == 1


def test_modulo_partition_is_expert_plus_layer_mod_n():
    p = ExpertPartition.modulo(2, 5, 2)
    assert p.owner == ((0, 1, 0, 1, 0), (1, 0, 1, 0, 1))
    assert p.split([(0, 4), (1, 4), (0, 1), (1, 1)]) == [[(0, 4), (1, 1)], [(1, 4), (0, 1)]]
    with pytest.raises(ValueError, match="outside"):
        p.owner_of((2, 0))
    with pytest.raises(ValueError, match="rank 2 outside"):
        p.keys_of(2)


@given(st.lists(st.lists(st.integers(0, 1000), min_size=6, max_size=6), min_size=1, max_size=4),
       st.integers(1, 6))
def test_balanced_partition_keeps_equal_shares_and_bounds_the_worst_rank_load(counts, ranks):
    p = ExpertPartition.balanced(counts, ranks)
    m = ExpertPartition.modulo(len(counts), 6, ranks)
    for layer, row in enumerate(counts):
        def worst(part, row=row, layer=layer):
            return max(sum(row[e] for e in part.experts_of(r, layer)) for r in range(ranks))
        # LPT is a 4/3-approximation, not optimal; but with equal shares it never loses to a fixed rule by
        # more than the largest single count (each rank gets at most one more expert than another)
        assert worst(p) <= worst(m) + max(row)
        assert worst(p) <= sum(row) / ranks + max(row)
    assert ExpertPartition.balanced(counts, ranks) == p  # deterministic


def test_balanced_partition_splits_the_hot_experts():
    counts = [[100, 1, 90, 1, 1, 1]]  # modulo (e % 2) puts both hot experts on rank 0
    assert ExpertPartition.modulo(1, 6, 2).owner_of((0, 0)) == ExpertPartition.modulo(1, 6, 2).owner_of((0, 2))
    p = ExpertPartition.balanced(counts, 2)
    assert p.owner_of((0, 0)) != p.owner_of((0, 2))


@pytest.mark.parametrize("bad, match", [
    ([[1, -1]], ">= 0"), ([[1, float("nan")]], ">= 0"), ([[1, 2], [1]], "layer 1 has 1"), ([], "non-empty"),
])
def test_balanced_partition_refuses_bad_counts(bad, match):
    with pytest.raises(ValueError, match=match):
        ExpertPartition.balanced(bad, 2)


def test_a_hand_made_partition_is_checked():
    with pytest.raises(ValueError, match="unbalanced"):
        ExpertPartition(2, ((0, 0, 0, 1),))
    with pytest.raises(ValueError, match="outside"):
        ExpertPartition(2, ((0, 1, 2, 1),))
    with pytest.raises(ValueError, match="int >= 1"):
        ExpertPartition.modulo(1, 4, 0)
    with pytest.raises(ValueError, match="needs routing counts"):
        ExpertPartition.build("balanced", TINY, 2)
    with pytest.raises(ValueError, match="one of"):
        ExpertPartition.build("random", TINY, 2)


# ---- the budget of every rank -------------------------------------------------------------------------
def test_qwen36_at_24_gib_per_gpu_holds_every_expert_on_two_ranks_but_not_on_one():
    spec = qwen36_35b_a3b()
    budget = GpuBudget(24 * GiB, 0.9, spec.dense_weight_bytes(), 1 * GiB)
    request = PoolRequest(state_slots=16)
    one = plan_pools(spec, budget, request)
    assert isinstance(one, type(plan_pools(spec, budget, request))) and one.residency < 1
    for n in (2, 4):
        ep = plan_expert_parallel(spec, budget, request, ExpertPartition.modulo(spec.num_layers, spec.num_experts, n))
        assert isinstance(ep, ExpertParallelPlan), ep
        assert ep.residency == 1.0
        assert [p.expert_slots for p in ep.ranks] == [spec.total_experts // n] * n
        # every rank: the same shared pools, each within its own budget with the dense weights counted
        assert len({(p.kv_tokens, p.state_slots) for p in ep.ranks}) == 1
        assert all(p.used_bytes <= budget.pool_bytes for p in ep.ranks)
        assert ep.shared.kv_tokens >= one.kv_tokens  # the leftover goes to KV once experts are resident


@given(st.integers(0, 12 * 5 * 2**20), st.integers(1, 4), st.one_of(st.none(), st.integers(1, 12)),
       st.one_of(st.none(), st.integers(0, 64)))
def test_every_rank_fits_its_budget_owns_its_slots_and_shares_the_scheduler_pools(pool, ranks, slots, kv):
    spec = TINY
    partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, ranks)
    request = PoolRequest(kv_tokens=kv, expert_slots=slots, state_slots=2, page_size=4)
    ep = plan_expert_parallel(spec, pool_budget(pool), request, partition)
    if isinstance(ep, PlanRefusal):
        assert ep.message.startswith("rank ")
        rank = int(ep.message.split()[1].rstrip(":"))
        # the refusing rank's own plan_pools refuses the same way: a plan that does not fit one rank
        alone = plan_pools(spec, pool_budget(pool), request, expert_keys=partition.keys_of(rank))
        assert isinstance(alone, PlanRefusal) and (alone.pool, alone.shortfall_bytes) == (ep.pool, ep.shortfall_bytes)
        return
    for r, plan in enumerate(ep.ranks):
        assert plan.used_bytes <= pool
        assert plan.expert_slots <= partition.keys_of(r)
        if slots is not None:
            assert plan.expert_slots == slots
    assert len({(p.kv_tokens, p.state_slots, p.page_size) for p in ep.ranks}) == 1
    if kv is not None:
        assert ep.shared.kv_tokens == kv // 4 * 4


def test_uneven_shares_pin_the_kv_pool_to_the_smallest_rank():
    spec = dataclasses.replace(TINY, num_experts=5)  # 4 layers x 5 experts over 3 ranks: 7, 7, 6 keys
    partition = ExpertPartition.modulo(spec.num_layers, spec.num_experts, 3)
    assert sorted(partition.keys_of(r) for r in range(3)) == [6, 7, 7]
    pool = 7 * spec.expert_bytes() + 2 * spec.linear_state_bytes_per_sequence() + 56 * spec.kv_bytes_per_token()
    request = PoolRequest(state_slots=2, page_size=4, kv_reserve_tokens=16)
    alone = [plan_pools(spec, pool_budget(pool), request, expert_keys=partition.keys_of(r)).kv_tokens
             for r in range(3)]
    assert len(set(alone)) == 2  # planned alone, the rank owning 6 keys would get more KV than the others
    ep = plan_expert_parallel(spec, pool_budget(pool), request, partition)
    assert isinstance(ep, ExpertParallelPlan)
    assert [p.expert_slots for p in ep.ranks] == [partition.keys_of(r) for r in range(3)]
    assert {p.kv_tokens for p in ep.ranks} == {min(alone)}


def test_explicit_slots_beyond_a_ranks_keys_are_refused_by_rank():
    partition = ExpertPartition.modulo(TINY.num_layers, TINY.num_experts, 2)  # 8 keys each
    ep = plan_expert_parallel(TINY, pool_budget(1 << 30), PoolRequest(expert_slots=9, state_slots=2), partition)
    assert isinstance(ep, PlanRefusal) and ep.pool == "moe" and "rank 0" in ep.message and "owns 8" in ep.message
    with pytest.raises(ValueError, match="partition is"):
        plan_expert_parallel(QWEN_FP8, pool_budget(1 << 30), PoolRequest(), partition)


# ---- live resize -------------------------------------------------------------------------------------
def make_ep(pool: int, ranks: int = 2, **request):
    partition = ExpertPartition.modulo(TINY.num_layers, TINY.num_experts, ranks)
    ep = plan_expert_parallel(TINY, pool_budget(pool), PoolRequest(state_slots=2, page_size=4, **request), partition)
    assert isinstance(ep, ExpertParallelPlan), ep
    return ep


def test_resize_changes_every_rank_alike_or_none():
    pool = 1 << 24
    ep = make_ep(pool, kv_tokens=64, expert_slots=4)
    grow = plan_resize_expert_parallel(TINY, pool_budget(pool), ep, expert_slots=8, kv_tokens=128)
    assert isinstance(grow, ExpertParallelResize)
    assert [t.expert_slots for t in grow.target] == [8, 8] and {t.kv_tokens for t in grow.target} == {128}
    assert grow.needs_idle and not grow.experts_kept
    for step in grow.ranks:
        step.check_valid()  # frees before allocations, peak within the budget, per rank
    moe_only = plan_resize_expert_parallel(TINY, pool_budget(pool), ep, expert_slots=6)
    assert not moe_only.needs_idle and [t.kv_tokens for t in moe_only.target] == [64, 64]
    too_many = plan_resize_expert_parallel(TINY, pool_budget(pool), ep, expert_slots=9)
    assert isinstance(too_many, PlanRefusal) and "rank 0" in too_many.message
    short = plan_resize_expert_parallel(TINY, pool_budget(pool), ep, kv_tokens=10**9)
    assert isinstance(short, PlanRefusal) and short.pool == "kv" and short.message.startswith("rank 0")
    typo = plan_resize_expert_parallel(TINY, pool_budget(pool), ep, state_slots=0)
    assert isinstance(typo, PlanRefusal) and typo.shortfall_bytes == 0


def test_plan_check_refuses_mismatched_shared_pools():
    a, b = make_ep(1 << 24, kv_tokens=64).ranks[0], make_ep(1 << 24, kv_tokens=128).ranks[1]
    with pytest.raises(ValueError, match="differ from rank 0"):
        ExpertParallelPlan(ExpertPartition.modulo(4, 4, 2), (a, b))
    with pytest.raises(ValueError, match="rank plans"):
        ExpertParallelPlan(ExpertPartition.modulo(4, 4, 2), (a,))
