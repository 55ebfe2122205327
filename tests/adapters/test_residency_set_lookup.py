"""DeviceResidency.lookup_set (the prefill chunk's set lookup: residency_set_hits + topk + residency_set_fills)
against lookup_flat over the same chunk's keys, which the domain contract already pins down: the same tables,
clock, counters, fill lists and slots after every layer, over random chunk sequences, with pins held, with
expert-parallel owners, and into a cold, a warm and a full pool."""

import random

import pytest
import torch

from adapters.cuda_exec.device_residency import DeviceResidency

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run in Triton's interpreter on the CPU


def _tables(r: DeviceResidency) -> dict[str, list]:
    """The tables without their sink entries (scratch that lookup_flat's scatters of padding write into)."""
    return {"slot_of_key": r.slot_of_key[:-1].tolist(), "key_of_slot": r.key_of_slot[:-1].tolist(),
            "stamp": r.stamp[:-1].tolist(), "clock": int(r.clock), "counters": r._counters.tolist(),
            "pinned": r.pinned[:-1].tolist()}


def _chunk_ids(rng: random.Random, tokens: int, top_k: int, experts: int, hot: int) -> torch.Tensor:
    """[T, K] distinct experts per row, drawn from `hot` of the layer's experts (so some are never routed)."""
    pool = rng.sample(range(experts), hot)
    return torch.tensor([rng.sample(pool, top_k) for _ in range(tokens)], dtype=torch.int64)


def _check_layer(flat_res, set_res, layer, ids, valid, shared_slot):
    experts = set_res.num_experts
    keys = torch.where(valid[:, None], ids + layer * experts, -1).reshape(-1)
    ordered = torch.sort(torch.where(keys < 0, 1 << 40, keys)).values
    ordered = torch.where(ordered == 1 << 40, -1, ordered)
    found = flat_res.lookup_flat(ordered.to(DEVICE), pin=False, presorted=True)
    present = torch.zeros(experts + 1, dtype=torch.bool)
    present[torch.where(valid[:, None], ids, experts).reshape(-1)] = True
    fill_keys, fill_slots, slot_map = set_res.lookup_set(layer, present[:experts].to(DEVICE), shared_slot)
    ts, tf = _tables(set_res), _tables(flat_res)
    for name in ts:
        assert ts[name] == tf[name], name
    n = int((found.fill_keys >= 0).sum())
    assert fill_keys[:n].tolist() == found.fill_keys[:n].tolist()  # the misses, ascending, as lookup_flat lists them
    assert fill_slots[:n].tolist() == found.fill_slots[:n].tolist()
    assert (fill_keys[n:] == -1).all() and (fill_slots[n:] == -1).all()
    # every routed pair's slot through the map equals lookup_flat's slot of its key
    expect = flat_res.slot_of_key[(ids + layer * experts).to(DEVICE)]
    got = slot_map[ids.to(DEVICE)].to(torch.int64)
    live = valid.to(DEVICE)[:, None].expand_as(got)
    if set_res.owner is not None:
        live = live & (set_res.owner[(ids + layer * experts).to(DEVICE)] == set_res.rank)
    assert torch.equal(torch.where(live, got, -2), torch.where(live, expect, -2))
    assert (slot_map[:experts][~present[:experts].to(DEVICE)] == -1).all()  # experts no valid row routes to
    assert slot_map[experts].item() == shared_slot and slot_map[experts + 1].item() == -1


@pytest.mark.parametrize("num_slots,hot", [(8, 6), (12, 8), (40, 8), (8, 8)])
def test_lookup_set_matches_lookup_flat(num_slots, hot):
    """Cold start, warm hits, evictions (a pool of as many slots as experts evicts every layer), padding rows."""
    rng = random.Random(num_slots * 31 + hot)
    layers, experts, top_k = 3, 8, 2
    flat_res = DeviceResidency(num_slots, layers, experts, DEVICE)
    set_res = DeviceResidency(num_slots, layers, experts, DEVICE)
    for step in range(4):
        for layer in range(layers):
            tokens = rng.randint(1, 24)
            ids = _chunk_ids(rng, tokens, top_k, experts, hot)
            valid = torch.tensor([rng.random() > 0.2 or t == 0 for t in range(tokens)])
            _check_layer(flat_res, set_res, layer, ids, valid, shared_slot=num_slots + layer if step % 2 else -1)
    set_res.check_valid()


def test_lookup_set_leaves_pinned_slots_alone():
    """Slots pinned by an earlier pinned lookup are never victims (lookup_flat's rule)."""
    layers, experts = 2, 6
    flat_res, set_res = (DeviceResidency(9, layers, experts, DEVICE) for _ in range(2))
    for r in (flat_res, set_res):
        r.lookup_flat(torch.tensor([6, 7, 8], device=DEVICE), pin=True)  # layer 1's experts 0..2, pinned
    rng = random.Random(3)
    for _ in range(3):
        ids = _chunk_ids(rng, 10, 2, experts, 6)
        _check_layer(flat_res, set_res, 0, ids, torch.ones(10, dtype=torch.bool), -1)
    assert set_res.slot_of_key[6:9].min() >= 0  # still resident


def test_lookup_set_skips_other_ranks_keys():
    """Expert parallelism: keys another rank owns are not looked up and map to -1."""
    layers, experts = 2, 8
    owner = torch.tensor([(k // 2) % 2 for k in range(layers * experts)], dtype=torch.int32)
    flat_res, set_res = (DeviceResidency(8, layers, experts, DEVICE, owner=owner, rank=1) for _ in range(2))
    rng = random.Random(5)
    for layer in (0, 1, 0):
        ids = _chunk_ids(rng, 12, 2, experts, 8)
        _check_layer(flat_res, set_res, layer, ids, torch.ones(12, dtype=torch.bool), -1)
    assert set_res.hits + set_res.misses > 0


def test_lookup_set_rejects_bad_input():
    r = DeviceResidency(4, 2, 6, DEVICE)
    assert not r.can_lookup_set()
    with pytest.raises(ValueError, match="lookup_set needs"):
        r.lookup_set(0, torch.zeros(6, dtype=torch.bool, device=DEVICE))
    r = DeviceResidency(8, 2, 6, DEVICE)
    with pytest.raises(ValueError, match="present must be bool"):
        r.lookup_set(0, torch.zeros(5, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="layer 2 outside"):
        r.lookup_set(2, torch.zeros(6, dtype=torch.bool, device=DEVICE))


def test_a_chunk_whose_layer_fits_the_pool_takes_the_set_lookup(monkeypatch):
    """DeviceExpertPool.routed on a chunk of more pairs than slots, with E <= S: one set lookup (no per-key
    lookup), the misses counted once per distinct expert, and the output bitwise that of a pool smaller than
    the layer (the per-key path in groups of S)."""
    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.checkpoint.host_bank import HostExpertBank
    from adapters.cuda_exec.expert_pool import DeviceExpertPool
    from domain.model_spec import WeightFormat
    from tests.adapters.torch_exec_models import packed_expert_rows

    hidden, inter, layers, experts, top_k, tokens = 64, 32, 2, 12, 4, 9
    gen = torch.Generator().manual_seed(11)
    layout = ExpertLayout(WeightFormat.MXFP4, hidden, inter)
    rows, shared = packed_expert_rows(layout, layers * experts, gen), packed_expert_rows(layout, layers, gen)
    if DEVICE == "cuda":
        rows = rows.pin_memory()
    bank = HostExpertBank(layout, layers, experts, rows)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, top_k + 1, generator=gen).to(DEVICE)
    valid = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    valid[3] = False
    pool = DeviceExpertPool(bank, experts + 4, DEVICE, shared_rows=shared)
    calls = []
    for name in ("lookup_set", "lookup_flat"):
        original = getattr(pool.residency, name)
        monkeypatch.setattr(pool.residency, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    got = pool.routed(1, x, weights, ids, valid, shared=True)
    assert calls == ["lookup_set"]
    distinct = len(set(ids[valid].reshape(-1).tolist()))
    assert (pool.residency.hits, pool.residency.misses) == (0, distinct)  # cold: each routed expert missed once
    pool.check_valid()
    small = DeviceExpertPool(bank, experts - 4, DEVICE, shared_rows=shared)  # E > S: the per-key path
    assert torch.equal(got, small.routed(1, x, weights, ids, valid, shared=True))
