"""DeviceExpertPool with the decode calls on the grouped GEMMs (grouped_decode_min_pairs): the one-launch lookup's
pairs aligned by expert key and multiplied on the tensor-core kernels give the per-pair GEMVs' layer outputs (within
the fp32 accumulators' rounding; padded rows zero, the shared expert's column included), make the same residency
decisions, and are off by default (GROUPED_DECODE_MIN_PAIRS is None until the H200 measures them)."""

import pytest
import torch

import adapters.cuda_exec.expert_pool as expert_pool_mod
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.kernels.moe_align import choose_block_m
from adapters.kernels.residency_lookup import MAX_KEYS

# NOTE: the dedup tests' bank (the same shapes, FP8 block, a packed shared expert per layer)
from tests.adapters.test_expert_pool_dedup import DEVICE, E, H, K, L, bank_and_shared  # noqa: E402, F401


def test_grouped_decode_is_off_by_default(bank_and_shared):  # noqa: F811
    bank, shared = bank_and_shared
    assert expert_pool_mod.GROUPED_DECODE_MIN_PAIRS is None
    pool = DeviceExpertPool(bank, 8, DEVICE, shared_rows=shared)
    assert not any(pool.groups_decode(p) for p in (1, 8, 16 * 8, MAX_KEYS))
    on = DeviceExpertPool(bank, 8, DEVICE, grouped_decode_min_pairs=8)
    assert [on.groups_decode(p) for p in (7, 8, MAX_KEYS, MAX_KEYS + 1)] == [False, True, True, False]
    # a bucket on the grouped GEMMs takes the unfused routing: _grouped_by_expert needs the router's ids
    assert pool.fuses_routing(1, K) == pool.can_route(1, K) and not on.fuses_routing(2, K)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="grouped_decode_min_pairs"):
            DeviceExpertPool(bank, 8, DEVICE, grouped_decode_min_pairs=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_layers_match_the_per_pair_layers(bank_and_shared, monkeypatch, dtype):  # noqa: F811
    bank, shared = bank_and_shared
    gen = torch.Generator().manual_seed(8)
    tokens = 4
    x = torch.randn(tokens, H, generator=gen).to(DEVICE, dtype)
    # "local" routing: 4 tokens over 5 of the 12 experts, so most experts serve several tokens (several rows
    # of one block), and one expert that only one token routes to
    ids = torch.stack([torch.randperm(5, generator=gen)[:K] for _ in range(tokens)])
    ids[0, 0] = 11
    ids = ids.to(DEVICE)  # [T, K]
    weights = torch.rand(tokens, K + 1, generator=gen).to(DEVICE)  # column K: the shared expert's gate
    valid = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    valid[2] = False  # a padded row: routes nowhere, computes nothing
    grouped_calls = []
    real = expert_pool_mod.grouped_gemms
    monkeypatch.setattr(expert_pool_mod, "grouped_gemms", lambda *a, **k: grouped_calls.append(1) or real(*a, **k))
    outs, tables = {}, {}
    # a pool holding every expert, and one of tokens * K slots (the most a one-launch lookup takes), fed steps
    # on disjoint experts and then the first ones again: the small pool evicts and misses them a second time
    steps = (ids, (ids + 6) % E, ids)
    for slots in (L * E, tokens * K):
        for grouped in (None, 1):
            pool = DeviceExpertPool(bank, slots, DEVICE, shared_rows=shared, grouped_decode_min_pairs=grouped)
            before = len(grouped_calls)
            outs[slots, grouped] = [pool.routed(layer, x, weights, step, valid, shared=True)
                                    for step in steps for layer in range(L)]
            assert len(grouped_calls) - before == (len(steps) * L if grouped else 0)
            pool.check_valid()
            tables[slots, grouped] = (pool.residency.slot_of_key.clone(), pool.counters())
    assert tables[tokens * K, None][1][1] > tables[L * E, None][1][1]  # the small pool missed more (it evicted)
    bound = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: h rounded between the GEMMs on both sides
    for slots in (L * E, tokens * K):
        assert torch.equal(tables[slots, 1][0], tables[slots, None][0])  # the same residency decisions
        assert tables[slots, 1][1] == tables[slots, None][1]  # the same hits and misses
        for got, want in zip(outs[slots, 1], outs[slots, None], strict=True):
            assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
            assert torch.equal(want[~valid], torch.zeros_like(want[~valid]))
            scale = want.float().abs().max()
            assert scale > 0 and float((got.float() - want.float()).abs().max() / scale) < bound
    for got, want in zip(outs[tokens * K, 1], outs[L * E, 1], strict=True):
        assert torch.equal(got, want)  # grouped by expert: the same bits at any pool size


def test_tune_runs_the_grouped_gemms_on_real_slots_when_on(bank_and_shared, monkeypatch):  # noqa: F811
    """The graph capture tunes before it captures (an autotune inside a capture is fatal): with grouped decode on,
    tune() also runs the grouped GEMMs once over real slots, at the BLOCK_M of the largest one-launch call (at the
    Qwen3.6 shapes every decode bucket's: 16)."""
    import adapters.kernels.grouped_moe as grouped_moe_mod

    bank, shared = bank_and_shared
    seen = []
    real = grouped_moe_mod.grouped_gemms
    monkeypatch.setattr(grouped_moe_mod, "grouped_gemms", lambda x, align, *a, **k: seen.append(
        (x.shape[0], align.block_m, int((align.block_slots >= 0).sum()))) or real(x, align, *a, **k))
    x = torch.randn(1, H).to(DEVICE)
    DeviceExpertPool(bank, L * E, DEVICE, shared_rows=shared).tune(x, K)
    assert seen == []
    DeviceExpertPool(bank, L * E, DEVICE, shared_rows=shared, grouped_decode_min_pairs=1).tune(x, K)
    rows = MAX_KEYS // K  # the most rows a one-launch lookup takes
    assert seen == [(rows, choose_block_m(rows * (K + 1), E + 1), seen[0][2])] and seen[0][2] > 1


def test_tune_measures_every_pair_bucket_with_the_decode_counts_first(bank_and_shared, monkeypatch):  # noqa: F811
    """The per-pair GEMVs' tiles are tuned per pair bucket (packed_gemv.pairs_bucket), and a capture cannot tune:
    tune() runs each decode bucket's own row count first (largest first: the first call of a bucket decides its
    tile), then every pair bucket no decode count reached, at the most tokens it holds; a count past the largest
    bucket (it shares bs1's key) tunes nothing."""
    import adapters.cuda_exec.expert_pool as pool_mod
    from adapters.kernels import packed_gemv
    from adapters.kernels.packed_gemv import PAIRS_BUCKETS, pairs_bucket

    bank, shared = bank_and_shared
    monkeypatch.setattr(packed_gemv, "PAIRS_BUCKET_MAX", 256)  # the buckets on (off by default)
    calls = []
    real = pool_mod.fused_moe
    monkeypatch.setattr(pool_mod, "fused_moe", lambda x, ids, *a, **k: calls.append(
        (x.shape[0], pairs_bucket(ids.numel()))) or real(x, ids, *a, **k))
    DeviceExpertPool(bank, L * E, DEVICE, shared_rows=shared).tune(torch.randn(1, H).to(DEVICE), K,
                                                                    rows=(1, 2, 4, 64))
    # K + 1 = 5 columns: 64 rows (320 pairs) are past the largest bucket (bs1's key, which they must not tune);
    # 4 rows (20 pairs) and 2 rows (10) open buckets 64 and 16; 1 row (5) falls in 16, tuned
    assert [rows for rows, _ in calls[:2]] == [4, 2] and not {1, 64} & {rows for rows, _ in calls}
    assert sorted(bucket for _, bucket in calls) == sorted(PAIRS_BUCKETS)  # every key, once, before any capture
    calls.clear()
    monkeypatch.setattr(packed_gemv, "PAIRS_BUCKET_MAX", 1)  # one key for all: bs1 tunes it, as before
    DeviceExpertPool(bank, L * E, DEVICE, shared_rows=shared).tune(torch.randn(1, H).to(DEVICE), K, rows=(1, 2, 4))
    assert calls == [(1, 1)]
