"""DeviceExpertPool with the expert-deduplicated GEMVs switched on (dedup_min_pairs): bitwise the per-pair
path's layer outputs on the decode lookup and on the small pool's groups of experts (the shared expert's
column and padded rows included), and off by default (DEDUP_MIN_PAIRS is None until the H200 measures it)."""

import pytest
import torch

import adapters.kernels.fused_moe as fused_moe_mod
from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.host_bank import HostExpertBank
from adapters.cuda_exec import expert_pool
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.kernels.residency_lookup import MAX_KEYS
from domain.model_spec import WeightFormat
from tests.adapters.torch_exec_models import packed_expert_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E, K = 128, 32, 2, 12, 4


@pytest.fixture(scope="module")
def bank_and_shared():
    gen = torch.Generator().manual_seed(5)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, H, I)
    rows = packed_expert_rows(layout, L * E, gen)
    if DEVICE == "cuda":
        rows = rows.pin_memory()
    return HostExpertBank(layout, L, E, rows), packed_expert_rows(layout, L, gen)


def test_dedup_is_off_by_default(bank_and_shared):
    bank, shared = bank_and_shared
    assert expert_pool.DEDUP_MIN_PAIRS is None
    pool = DeviceExpertPool(bank, 8, DEVICE, shared_rows=shared)
    assert not any(pool.dedups(p) for p in (1, 8, 16 * 8, MAX_KEYS))
    on = DeviceExpertPool(bank, 8, DEVICE, dedup_min_pairs=8)
    assert [on.dedups(p) for p in (7, 8, MAX_KEYS, MAX_KEYS + 1)] == [False, True, True, False]
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="dedup_min_pairs"):
            DeviceExpertPool(bank, 8, DEVICE, dedup_min_pairs=bad)


def test_dedup_layers_are_bitwise_the_per_pair_layers(bank_and_shared, monkeypatch):
    bank, shared = bank_and_shared
    gen = torch.Generator().manual_seed(6)
    tokens = 6
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    # "local" routing: 6 tokens over 5 of the 12 experts, so most experts serve several tokens
    ids = torch.stack([torch.randperm(5, generator=gen)[:K] for _ in range(tokens)]).to(DEVICE)  # [T, K]
    weights = torch.rand(tokens, K + 1, generator=gen).to(DEVICE)  # column K: the shared expert's gate
    valid = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    valid[4] = False  # a padded row: routes nowhere
    calls = []
    real = fused_moe_mod.moe_gate_up_dedup
    monkeypatch.setattr(fused_moe_mod, "moe_gate_up_dedup", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    # the decode path (one-launch lookup) and a pool smaller than the layer's experts (groups of 10
    # experts, partials filled over several calls, one ordered sum), per-pair and dedup
    for slots in (L * E, 10):
        for dedup in (None, 1):
            pool = DeviceExpertPool(bank, slots, DEVICE, shared_rows=shared, dedup_min_pairs=dedup)
            before = len(calls)
            outs[slots, dedup] = [pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
            assert (len(calls) > before) == (dedup is not None)
            pool.check_valid()
    for slots in (L * E, 10):
        for a, b in zip(outs[slots, 1], outs[slots, None], strict=True):
            assert torch.equal(a, b), slots
    for a, b in zip(outs[10, 1], outs[L * E, None], strict=True):
        assert torch.equal(a[valid], b[valid])  # (padded rows: see test_expert_pool_grouped)
