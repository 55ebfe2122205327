"""A pool that holds every key routes a decode step without lookups (ADR 0027): moe_router reads each pair's slot
from the residency's table and marks the keys, and one settle launch after the step's last layer makes the
hits and stamps. Everything observable must equal the per-layer lookups it replaces: the weights and slot ids
bit for bit, and after the settle the tables (slot_of_key, key_of_slot, stamp, clock) and the counters
entry for entry, so the domain LRU's order and hit counts hold as before.

On the CPU the kernels run in Triton's interpreter; the same tests run on a GPU as they are (the last one
only there, at the Qwen3.6 geometry)."""

import random

import pytest
import torch

from adapters.cuda_exec.device_residency import DeviceResidency
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.kernels.moe_router import ResidentSlots, moe_router
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

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _resident(layers: int, experts: int, extra: int = 0) -> DeviceResidency:
    """A residency holding every key, filled as DeviceExpertPool.preload fills it, and marked."""
    r = DeviceResidency(layers * experts + extra, layers, experts, DEVICE)
    r.preload(torch.arange(layers * experts, device=DEVICE))
    r.mark_every_key_resident()
    return r


def _tables(r: DeviceResidency) -> list[torch.Tensor]:
    return [v.clone() for v in (r.slot_of_key, r.key_of_slot, r.stamp, r.clock, r._counters)]


@pytest.mark.parametrize("gate", ["none", "fp32", "bf16"])
@pytest.mark.parametrize("extra", [0, 5])
def test_resident_routing_then_one_settle_equals_the_router_then_a_lookup_per_layer(gate, extra):
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    layers, experts, top_k, rows, hidden = 4, 12, 3, 5, 40
    dtype = torch.bfloat16 if gate == "bf16" else torch.float32
    g = None if gate == "none" else (torch.randn(1, hidden, generator=gen) * 0.2).to(dtype).to(DEVICE)
    router = torch.zeros(experts, hidden, device=DEVICE)  # shapes only: the logits are given
    ours, twin = _resident(layers, experts, extra), _resident(layers, experts, extra)
    domain = ExpertResidency(layers * experts + extra)
    domain.lookup([(layer, e) for layer in range(layers) for e in range(experts)])
    domain.release()
    hits = 0
    for step in range(6):
        live = 0 if step == 0 else rng.randint(1, rows)  # step 0: every row padded (a capture's warm-up)
        valid = torch.tensor([r < live for r in range(rows)], device=DEVICE)
        for layer in range(layers):
            x = torch.randn(rows, hidden, generator=gen).to(dtype).to(DEVICE)
            logits = (torch.randn(rows, experts, generator=gen) * 2).to(DEVICE)
            logits[0, 5] = logits[0, 7] = logits[0].max() + 1  # an exact tie in the top-k: lowest id first
            logits[1] = logits[0]  # two rows routing alike: the same keys marked twice
            shared = layers * experts + extra + layer if g is not None else None
            weights, slot_ids = ours.route_resident(layer, logits, x, router, top_k, True, g, valid, shared)
            want_w, want_i = moe_router(x, router, top_k, True, g, logits=logits)
            _, _, want_slots = twin.lookup_layer(layer, want_i[:, :top_k], valid, shared)
            assert torch.equal(weights, want_w)  # the same kernel's arithmetic: the same bits
            assert torch.equal(slot_ids, want_slots)
            distinct = sorted({int(e) for e in want_i[:live, :top_k].flatten().tolist()})
            domain.lookup([(layer, e) for e in distinct])
            domain.release()
            hits += len(distinct)
        if step == 0:
            assert not bool(ours._presence.any())  # padded rows mark nothing
        ours.settle_resident()
        for mine, theirs in zip(_tables(ours), _tables(twin), strict=True):
            assert torch.equal(mine, theirs)
        assert not bool(ours._presence.any())
    # the domain counted its fill as misses; the device's preload is not counted
    assert ours.counters() == (hits, 0, 0) == (domain.hits, domain.misses - layers * experts, 0)
    assert ours.lru_order() == domain.lru_order()
    ours.check_valid()


def test_a_settle_with_nothing_routed_moves_nothing():
    r = _resident(2, 6)
    before = _tables(r)
    r.settle_resident()
    assert all(torch.equal(a, b) for a, b in zip(_tables(r), before, strict=True))


def test_resident_routing_refuses_a_partial_residency_and_bad_slot_tensors():
    partial = DeviceResidency(5, 2, 6, DEVICE)
    x, logits = torch.randn(2, 8, device=DEVICE), torch.randn(2, 6, device=DEVICE)
    router, valid = torch.zeros(6, 8, device=DEVICE), torch.ones(2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="holds every key"):
        partial.route_resident(0, logits, x, router, 2, True, None, valid)
    with pytest.raises(ValueError, match="holds every key"):
        partial.settle_resident()
    r = _resident(2, 6)
    presence = r._presence
    good = ResidentSlots(r.slot_of_key, 6, valid, presence, torch.empty(2, 2, dtype=torch.int32, device=DEVICE), None)
    moe_router(x, router, 2, True, logits=logits, slots=good)  # accepted
    r.settle_resident()
    bad = {
        "slot_of_key": good._replace(slot_of_key=r.slot_of_key.int()),
        "base": good._replace(base=7),  # 7 + 6 keys run past the 12 of the table
        "presence": good._replace(presence=presence.bool()),
        "valid": good._replace(valid=valid[:1]),
        "out": good._replace(out=torch.empty(2, 3, dtype=torch.int32, device=DEVICE)),  # no shared slot: K columns
    }
    for name, slots in bad.items():
        with pytest.raises(ValueError, match=f"slots.{name}"):
            moe_router(x, router, 2, True, logits=logits, slots=slots)


def test_a_pool_routes_resident_only_when_it_holds_every_key():
    bank = random_fp8_bank(32, 16, 3, 12)
    full, partial = DeviceExpertPool(bank, 36, DEVICE), DeviceExpertPool(bank, 35, DEVICE)
    assert not full.routes_resident(8)  # not filled yet
    full.preload()
    partial.preload()
    assert full.routes_resident(8) and not partial.routes_resident(8)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="holds every key"):
        partial.routed_resident(0, x, torch.randn(2, 12, device=DEVICE), torch.zeros(12, 32, device=DEVICE), 4, True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path_factory.mktemp("m"))


def _serve(ckpt, monkeypatch, resident_routing: bool):
    total = ckpt.spec.num_layers * ckpt.spec.num_experts
    import adapters.kernels.moe_route_lookup as mrl

    with monkeypatch.context() as m:
        # every bucket past the fused router + lookup (the resident route is for those: decode_step)
        m.setattr(mrl, "FUSED_MAX_TILE", 0)
        if not resident_routing:  # the per-layer lookups, as before ADR 0027
            m.setattr(DeviceExpertPool, "routes_resident", lambda self, pairs: False)
        # NOTE: counted from the start: on CUDA the steps replay graphs captured in the constructor, whose
        # warm-up steps are the Python calls the spy sees
        calls = []
        m.setattr(DeviceExpertPool, "settle_step", lambda self, f=DeviceExpertPool.settle_step: (calls.append(1), f(self)))
        fast = CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=total), DEVICE, torch.float32,
                                 max_decode_rows=4, prefill_kernels=True)
        prompts = [[5, 17, 3, 88, 41, 9, 60, 12, 30, 2, 7], [2, 33, 71], [9] * 10]
        seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + 6), state_slot=i) for i, p in enumerate(prompts)]
        record: dict = {}
        run_requests(fast, seqs, 6, chunk=4, record=record)
    return fast, record, [s.output for s in seqs], len(calls)


def test_a_resident_executor_serves_the_same_bits_and_leaves_the_same_tables(ckpt, monkeypatch):
    ours, our_logits, our_tokens, settles = _serve(ckpt, monkeypatch, True)
    twin, twin_logits, twin_tokens, twin_settles = _serve(ckpt, monkeypatch, False)
    assert settles > 0 and twin_settles == 0  # the decode steps took the resident route (or, the twin, not)
    assert our_tokens == twin_tokens
    for rid in twin_logits:
        for a, b in zip(our_logits[rid], twin_logits[rid], strict=True):
            assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(_tables(ours.experts.residency), _tables(twin.experts.residency),
                                                 strict=True))
    assert ours.expert_counters() == twin.expert_counters() and ours.expert_counters()[0] > 0
    ours.check_valid()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_resident_routing_at_the_qwen3_6_geometry_on_gpu(rows):
    """E 256, top-8 + the resident shared expert's bf16 gate, two layers of the 40: the same checks at the
    real tile sizes, compiled for the GPU (its reductions and stores, not the interpreter's)."""
    gen = torch.Generator().manual_seed(11)
    layers, experts, top_k, hidden = 2, 256, 8, 2048
    g = (torch.randn(1, hidden, generator=gen) * 0.02).to(torch.bfloat16).to(DEVICE)
    router = torch.zeros(experts, hidden, device=DEVICE)
    ours, twin = _resident(layers, experts), _resident(layers, experts)
    valid = torch.arange(rows, device=DEVICE) < max(1, rows - 1)
    for _step in range(3):
        for layer in range(layers):
            x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(DEVICE)
            logits = torch.randn(rows, experts, generator=gen).to(DEVICE)
            shared = layers * experts + layer
            weights, slot_ids = ours.route_resident(layer, logits, x, router, top_k, True, g, valid, shared)
            want_w, want_i = moe_router(x, router, top_k, True, g, logits=logits)
            _, _, want_slots = twin.lookup_layer(layer, want_i[:, :top_k], valid, shared)
            assert torch.equal(weights, want_w) and torch.equal(slot_ids, want_slots)
        ours.settle_resident()
        assert all(torch.equal(a, b) for a, b in zip(_tables(ours), _tables(twin), strict=True))
    ours.check_valid()
