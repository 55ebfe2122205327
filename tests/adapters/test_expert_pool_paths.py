"""DeviceExpertPool's three lookup paths give the same result and the domain LRU's decisions: the
one-launch kernel (decode), tensor ops (a prefill chunk whose keys fit the pool but are too many for
the kernel) and groups of experts (a chunk with more experts than slots)."""

import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.host_bank import HostExpertBank
from adapters.checkpoint.quantize import quantize
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.kernels.residency_lookup import MAX_KEYS
from domain.model_spec import WeightFormat
from domain.residency import ExpertResidency

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E, K = 32, 16, 2, 160, 8


def _bank():
    gen = torch.Generator().manual_seed(0)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, H, I)
    rows = torch.empty((L * E, layout.row_bytes), dtype=torch.uint8)
    for r in range(L * E):
        mats = [quantize(torch.randn(*shape, generator=gen) * 0.2, WeightFormat.FP8_BLOCK)
                for shape in ((I, H), (I, H), (H, I))]
        layout.pack(*mats, out=rows[r])
    if DEVICE == "cuda":
        rows = rows.pin_memory()
    return HostExpertBank(layout, L, E, rows)


def test_every_lookup_path_matches_the_domain_and_each_other():
    bank = _bank()
    gen = torch.Generator().manual_seed(1)
    tokens = MAX_KEYS // K + 6  # more keys than the one-launch kernel takes
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1).to(DEVICE)
    outs = {}
    for slots in (L * E, tokens * K // 2):  # tensor-op path (keys fit), grouped path (they do not)
        pool, ref = DeviceExpertPool(bank, slots, DEVICE), ExpertResidency(slots)
        for layer in range(L):
            outs.setdefault(slots, []).append(pool.routed(layer, x, weights, ids).cpu())
            distinct = sorted({int(e) for e in ids.flatten().tolist()})
            for start in range(0, len(distinct), slots):
                ref.lookup([(layer, e) for e in distinct[start:start + slots]])
                ref.release()
        assert (pool.hits, pool.misses) == (ref.hits, ref.misses)
        assert pool.residency.lru_order() == ref.lru_order()
        pool.check_valid()
    # one decode-sized lookup through the kernel on the same pool contents gives the same rows
    pool = DeviceExpertPool(bank, L * E, DEVICE)
    small = pool.routed(0, x[:2], weights[:2], ids[:2]).cpu()
    for a, b in zip(outs[L * E], outs[tokens * K // 2], strict=True):
        assert torch.equal(a, b)  # bitwise: the grouped path sums partials in the same order
    assert torch.allclose(small, outs[L * E][0][:2], rtol=1e-5, atol=1e-6)


def test_a_prefill_lookup_gathers_over_at_most_a_layers_experts_not_every_key(monkeypatch):
    """The sort-based lookup lists its fills first; a layer has at most E distinct keys, so the gather is
    launched over E entries, not T*K (whose 48 programs per entry cost ~1 ms a layer at 4k tokens on the
    H200), and still brings in every miss: the output is the one the pool gives when every expert is
    already resident."""
    import adapters.cuda_exec.expert_pool as expert_pool

    launched: list[int] = []
    real = expert_pool.gather_rows

    def spy(bank_rows, slots, keys, dst):
        launched.append(keys.shape[0])
        return real(bank_rows, slots, keys, dst)

    monkeypatch.setattr(expert_pool, "gather_rows", spy)
    bank = _bank()
    gen = torch.Generator().manual_seed(3)
    tokens = 2 * E // K + 3  # T*K > E keys, every expert of the layer routed at least once
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    ids[: E // K] = torch.arange(E).view(E // K, K)
    ids = ids.to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1).to(DEVICE)
    pool = DeviceExpertPool(bank, L * E, DEVICE)  # T*K > MAX_KEYS and a layer's E keys fit: the sort path
    got = pool.routed(1, x, weights, ids)
    assert launched == [E] and pool.misses == E  # every expert of the layer missed, gathered by one launch
    again = pool.routed(1, x, weights, ids)  # now all resident: no fill, the same experts
    assert pool.misses == E and torch.equal(got, again)
    pool.check_valid()
