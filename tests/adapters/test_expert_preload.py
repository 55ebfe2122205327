"""Every expert resident from the start: a pool whose slots hold every key it may hold is filled from the host
bank while the executor builds it (ExecutorPools._preload_experts), through the machinery of a miss (the
residency lookup, the gather from the bank), so that the device residency is what the domain LRU holds after
accessing every key once in ascending order; a partial pool is left to fill by use. The fill is not counted as
misses or copied bytes (those are the workload's: /v1/stats' hit rate, a benchmark's PCIe bytes).

On the CPU the fast path's kernels run in Triton's interpreter; the same tests run on a GPU as they are."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.cuda_exec.device_residency import DeviceResidency
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.cuda_exec.expert_shard import ExpertShard
from adapters.torch_exec.executor import TorchExecutor
from adapters.torch_exec.expert_cache import ExpertSlotCache
from adapters.torch_exec.expert_parallel import PartitionedSlotCache
from domain.expert_parallel import ExpertPartition
from domain.residency import ExpertResidency
from tests.adapters.torch_exec_models import (
    QWEN3_5_CONFIGS,
    Sequence,
    build_hf_model,
    make_plan,
    pages_for,
    random_fp8_bank,
    run_requests,
    save_and_load,
)
from tests.contracts.residency_contract import lookup_decisions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E, K = 32, 16, 3, 12, 4
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [2, 33, 71]]


def _bank():
    return random_fp8_bank(H, I, L, E)


def _all_keys(owns=lambda key: True) -> list[tuple[int, int]]:
    return [(layer, e) for layer in range(L) for e in range(E) if owns((layer, e))]


def _assert_rows_resident(pool, keys) -> None:
    """Every key has a slot and the slot's bytes are the bank's row, bit for bit."""
    slots = pool.slots.cpu()
    for key in keys:
        slot = pool.residency.slot_of(key)
        assert slot is not None, f"{key} is not resident"
        assert torch.equal(slots[slot], pool.bank.rows[key[0] * E + key[1]].cpu()), f"{key}'s slot differs"


@settings(max_examples=40, deadline=None)
@given(num_slots=st.integers(4, 12), seed=st.integers(0, 2**31 - 1))
def test_the_device_fill_is_a_lookup_the_counters_do_not_see(num_slots, seed):
    """DeviceResidency.preload from any state: the domain LRU's decisions for lookup + release of the same keys,
    while hits, misses and evictions stay as they were."""
    rng = random.Random(seed)
    keys = _all_keys()
    ref, dev = ExpertResidency(num_slots), DeviceResidency(num_slots, L, E)
    for _ in range(rng.randint(0, 4)):  # some history first
        ask = [rng.choice(keys) for _ in range(rng.randint(1, num_slots))]
        assert lookup_decisions(dev.lookup(ask)) == lookup_decisions(ref.lookup(ask))
        dev.release()
        ref.release()
    counted = dev.counters()
    fill = sorted(set(rng.sample(keys, num_slots)))
    expected = ref.lookup(fill)
    ref.release()
    found = dev.preload(torch.tensor([layer * E + e for layer, e in fill]))
    assert [(divmod(k, E), s) for k, s in zip(found.fill_keys.tolist(), found.fill_slots.tolist(), strict=True)
            if k >= 0] == list(expected.fills)
    assert [divmod(k, E) for k in found.evicted.tolist() if k >= 0] == list(expected.evicted)
    assert dev.lru_order() == ref.lru_order() and dev.counters() == counted
    assert not bool(dev.pinned.any())
    dev.check_valid()


@pytest.mark.parametrize("extra", [0, 3])
def test_a_pool_holding_every_key_is_filled_as_the_domain_lru_fed_every_key_once(extra):
    """extra: slots past the keys (the domain keeps them free, lowest first, after the fill)."""
    bank = _bank()
    pool = DeviceExpertPool(bank, L * E + extra, DEVICE)
    assert pool.holds_every_key() and pool.num_keys == L * E
    report = pool.preload()
    assert (report.copied, report.resident, report.keys) == (L * E, L * E, L * E)
    assert report.bytes == L * E * bank.layout.row_bytes and report.seconds >= 0
    assert "experts resident: 36/36" in report.describe()
    # not counted as the workload's lookups: no hit, no miss, no copied byte
    assert pool.counters() == (0, 0) and pool.bytes_copied == 0 and pool.residency.evictions == 0
    pool.check_valid()
    keys = _all_keys()
    _assert_rows_resident(pool, keys)
    ref = ExpertResidency(L * E + extra)
    ref.lookup(keys)
    ref.release()
    assert pool.residency.lru_order() == ref.lru_order() == tuple(keys)
    assert all(pool.residency.slot_of(k) == ref.slot_of(k) for k in keys)
    # afterwards, decision for decision: the host-facing lookup (every LRU rule) and the decode lookups
    rng = random.Random(7)
    for _ in range(20):
        ask = [rng.choice(keys) for _ in range(rng.randint(1, 8))]
        assert lookup_decisions(pool.residency.lookup(ask)) == lookup_decisions(ref.lookup(ask))
        pool.residency.release()
        ref.release()
    assert pool.residency.lru_order() == ref.lru_order()
    assert pool.misses == 0 and ref.misses == L * E  # the reference counted the fill; the pool reports it apart


def test_after_the_fill_a_forward_over_random_routing_copies_nothing():
    bank = _bank()
    pool = DeviceExpertPool(bank, L * E, DEVICE)
    pool.preload()
    before = pool.slots.clone()
    gen = torch.Generator().manual_seed(2)
    for tokens in (1, 3, 2 * E):  # decode-sized (one-launch lookup) and prefill-sized (set / tensor lookups)
        x = torch.randn(tokens, H, generator=gen).to(DEVICE)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(DEVICE)
        weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1).to(DEVICE)
        for layer in range(L):
            hits = pool.hits
            out = pool.routed(layer, x, weights, ids)
            assert torch.isfinite(out).all()
            assert pool.hits - hits == len({int(e) for e in ids.flatten().tolist()})  # every key hits
    assert pool.misses == 0 and pool.bytes_copied == 0 and pool.residency.evictions == 0
    assert torch.equal(pool.slots, before)  # nothing was copied in
    pool.check_valid()


def test_a_partial_pool_is_not_filled():
    pool = DeviceExpertPool(_bank(), L * E - 1, DEVICE)
    assert not pool.holds_every_key() and pool.preload() is None
    assert pool.residency.lru_order() == () and pool.counters() == (0, 0)


def test_a_shard_fills_only_the_keys_its_rank_owns():
    partition = ExpertPartition.modulo(L, E, 2)
    shard = ExpertShard(partition, 1, None, DEVICE)
    pool = DeviceExpertPool(_bank(), partition.keys_of(1), DEVICE, shard=shard)
    report = pool.preload()
    mine = _all_keys(lambda key: partition.owns(1, key))
    assert report.copied == report.resident == report.keys == len(mine) < L * E
    _assert_rows_resident(pool, mine)
    ref = ExpertResidency(len(mine))
    ref.lookup(mine)
    assert pool.residency.lru_order() == ref.lru_order() and pool.counters() == (0, 0)
    pool.check_valid()  # every resident key is the rank's


def test_the_reference_cache_fills_the_same_way():
    bank = _bank()
    cache = ExpertSlotCache(bank, L * E, "cpu")
    report = cache.preload()
    keys = _all_keys()
    assert (report.copied, report.resident, report.keys, report.bytes) == (
        L * E, L * E, L * E, L * E * bank.layout.row_bytes)
    assert cache.counters() == (0, 0) and cache.bytes_copied == 0 and cache.residency.num_pinned == 0
    _assert_rows_resident(cache, keys)
    assert cache.residency.lru_order() == tuple(keys)
    groups = list(cache.resident_groups(1, [3, 0, 7]))  # hits only
    assert cache.counters() == (3, 0) and cache.bytes_copied == 0 and len(groups) == 1
    assert ExpertSlotCache(bank, L * E - 1, "cpu").preload() is None
    partition = ExpertPartition.modulo(L, E, 2)
    ranked = PartitionedSlotCache(bank, partition.keys_of(0), "cpu", partition, 0)
    assert ranked.preload().resident == partition.keys_of(0)
    ranked.check_valid()


# ---- the executors: filled while they build their pools, before any capture and before serving ----------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path_factory.mktemp("m"))


def _run(executor, record=None) -> list[list[int]]:
    seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + 5), state_slot=i) for i, p in enumerate(PROMPTS)]
    run_requests(executor, seqs, 3, chunk=4, record=record)
    return [s.output for s in seqs]


def _fast(ckpt, slots, **kw):
    return CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=slots), DEVICE, torch.float32, max_decode_rows=4,
                             prefill_kernels=True, **kw)


def test_both_executors_start_with_every_expert_resident_and_serve_from_hits(ckpt):
    total = ckpt.spec.num_layers * ckpt.spec.num_experts
    phases: list[str] = []
    fast = _fast(ckpt, total, on_phase=phases.append)
    ref_phases: list[str] = []
    ref = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=total), DEVICE, torch.float32, on_phase=ref_phases.append)
    for executor, said in ((fast, phases), (ref, ref_phases)):
        report = executor.expert_preload
        assert report is not None and report.copied == report.resident == report.keys == total
        start = said.index(f"making experts resident: {total} experts from the host bank")
        assert said[start + 1] == report.describe() and report.describe().startswith(f"experts resident: {total}/")
        assert executor.expert_counters() == (0, 0) and executor.experts.bytes_copied == 0
    # the fill comes before the graphs are captured (on CUDA; none are captured on the CPU)
    captures = [i for i, p in enumerate(phases) if p.startswith("capturing decode graphs")]
    assert all(i > phases.index(fast.expert_preload.describe()) for i in captures)
    ref_logits, fast_logits = {}, {}
    assert _run(fast, fast_logits) == _run(ref, ref_logits)
    # NOTE: >=: the fast path runs these 4-token chunks as decode replays (ADR 0026), one lookup per token, where the
    # reference path looks a chunk's distinct experts up once
    assert fast.expert_misses == ref.expert_misses == 0 and fast.expert_hits >= ref.expert_hits > 0
    assert fast.experts.bytes_copied == 0
    fast.check_valid()
    ref.check_valid()


def test_a_partial_plan_fills_by_use_and_a_resize_to_every_expert_fills_again(ckpt):
    total = ckpt.spec.num_layers * ckpt.spec.num_experts
    phases: list[str] = []
    fast = _fast(ckpt, total - 1, on_phase=phases.append)
    assert fast.expert_preload is None and not any("resident" in p for p in phases)
    assert fast.experts.residency.lru_order() == ()
    _run(fast)
    assert fast.expert_misses > 0
    # a live resize that ends fully resident: rebuilt (freed first), then filled before the graphs are recaptured
    fast.resize_pools(make_plan(ckpt, expert_slots=total, kv_tokens=512))
    assert fast.expert_preload.resident == total and fast.experts.counters() == (0, 0)
    assert len(fast.experts.residency.lru_order()) == total
    assert not any("resident" in p for p in phases)  # after start-up: logged, not a start-up milestone
    _run(fast)
    assert fast.expert_counters()[1] == 0
    # the same pool size kept (KV resized only): no second fill, the warm cache stays as it is
    pool, report = fast.experts, fast.expert_preload
    fast.resize_pools(make_plan(ckpt, expert_slots=total, kv_tokens=256))
    assert fast.experts is pool and fast.expert_preload is report
    # back to a partial plan: nothing filled
    fast.resize_pools(make_plan(ckpt, expert_slots=total // 2))
    assert fast.expert_preload is None and fast.experts.residency.lru_order() == ()
    fast.check_valid()


def test_after_the_fill_the_set_lookup_skips_its_victim_choice_with_the_same_decisions(monkeypatch):
    """DeviceExpertPool.preload marks a residency that now holds every key: its prefill set lookups (lookup_set)
    then make no victim choice (no torch.topk: nothing can miss) and decide exactly as an unmarked twin does;
    a resize (empty slots again) clears the mark, and marking refuses a residency with a key left out."""
    import adapters.cuda_exec.device_residency as dr

    pool = DeviceExpertPool(_bank(), L * E, DEVICE)
    pool.preload()
    marked = pool.residency
    assert marked.every_key_resident
    twin = DeviceResidency(L * E, L, E, DEVICE)  # the same tables, not marked
    for name in ("slot_of_key", "key_of_slot", "stamp", "pinned", "clock"):
        getattr(twin, name).copy_(getattr(marked, name))
    assert not twin.every_key_resident
    gen = torch.Generator().manual_seed(3)
    topk_calls = []
    real_topk = torch.topk
    monkeypatch.setattr(dr.torch, "topk", lambda *a, **k: topk_calls.append(1) or real_topk(*a, **k))
    for _ in range(6):
        layer = int(torch.randint(0, L, (1,), generator=gen))
        present = (torch.rand(E, generator=gen) < 0.6).to(DEVICE)
        calls = len(topk_calls)
        got = marked.lookup_set(layer, present, shared_slot=5)
        assert len(topk_calls) == calls  # no victim choice
        want = twin.lookup_set(layer, present, shared_slot=5)
        assert len(topk_calls) == calls + 1  # the twin chose its (unused) victims
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        assert bool((got[0] == -1).all())  # nothing to copy
        for name in ("slot_of_key", "key_of_slot", "stamp", "clock"):
            assert torch.equal(getattr(marked, name), getattr(twin, name)), name
        assert marked.counters() == twin.counters() and marked.misses == 0
    marked.resize(L * E)
    assert not marked.every_key_resident
    with pytest.raises(ValueError, match="not every key"):
        marked.mark_every_key_resident()
    partial = DeviceExpertPool(_bank(), L * E - 1, DEVICE)
    assert partial.preload() is None and not partial.residency.every_key_resident
    partition = ExpertPartition.modulo(L, E, 2)
    shard_pool = DeviceExpertPool(_bank(), partition.keys_of(1), DEVICE, shard=ExpertShard(partition, 1, None, DEVICE))
    shard_pool.preload()
    assert not shard_pool.residency.every_key_resident  # a rank holds only its own keys: no mark
    with pytest.raises(ValueError, match="owner"):
        shard_pool.residency.mark_every_key_resident()
