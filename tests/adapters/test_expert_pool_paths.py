"""DeviceExpertPool's three lookup paths give the same result and the domain LRU's decisions: the
one-launch kernel (decode), tensor ops (a prefill chunk whose keys fit the pool but are too many for
the kernel) and groups of experts (a chunk with more experts than slots)."""

import torch

from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.kernels.residency_lookup import MAX_KEYS
from domain.residency import ExpertResidency
from tests.adapters.torch_exec_models import random_fp8_bank

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E, K = 32, 16, 2, 160, 8


def _bank():
    return random_fp8_bank(H, I, L, E)


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


def test_an_eager_call_past_the_kernels_lanes_takes_the_set_lookup_with_the_kernels_decisions(monkeypatch):
    """Inside a streamed step (an eager prefill), a call of ONE_LAUNCH_EAGER_KEYS < T*K <= MAX_KEYS keys (a
    17..32-token prompt at top-8) is looked up as a set, not by the one-program kernel whose [n, n] tiles
    spill there; the same call outside a step (a decode bucket) keeps the kernel. Same rows, hits, misses
    and LRU order either way, and the domain's."""
    from adapters.cuda_exec.device_residency import DeviceResidency
    from adapters.cuda_exec.expert_pool import ONE_LAUNCH_EAGER_KEYS

    calls: list[str] = []
    for name in ("lookup_layer", "lookup_set"):
        real = getattr(DeviceResidency, name)
        monkeypatch.setattr(DeviceResidency, name,
                            lambda self, *a, _real=real, _name=name, **kw: calls.append(_name) or _real(self, *a, **kw))
    bank = _bank()
    gen = torch.Generator().manual_seed(5)
    tokens = ONE_LAUNCH_EAGER_KEYS // K + 4
    assert ONE_LAUNCH_EAGER_KEYS < tokens * K <= MAX_KEYS
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(DEVICE)
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1).to(DEVICE)
    valid = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    valid[-1] = False  # a padded row routes nowhere on both paths
    slots = E + E // 2  # some misses evict on the second layer
    outs, states = {}, {}
    for eager in (False, True):
        pool, ref = DeviceExpertPool(bank, slots, DEVICE), ExpertResidency(slots)
        calls.clear()
        for layer in range(L):
            if eager:
                with pool.streamed_step():
                    outs.setdefault(eager, []).append(pool.routed(layer, x, weights, ids, valid).cpu())
            else:
                outs.setdefault(eager, []).append(pool.routed(layer, x, weights, ids, valid).cpu())
            ref.lookup([(layer, e) for e in sorted({int(e) for e in ids[:-1].flatten().tolist()})])
            ref.release()
        assert calls == [("lookup_set" if eager else "lookup_layer")] * L
        assert (pool.hits, pool.misses) == (ref.hits, ref.misses)
        assert pool.residency.lru_order() == ref.lru_order()
        states[eager] = (pool.hits, pool.misses, pool.residency.lru_order())
        pool.check_valid()
    assert states[True] == states[False]
    for a, b in zip(outs[True], outs[False], strict=True):
        assert torch.equal(a, b) and not a[-1].any()
