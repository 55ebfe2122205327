"""DeviceExpertPool's streamed prefill (docs/adr/0010-streamed-prefill.md): inside `streamed_step`, a
prefill-sized chunk reads resident experts in place and stages the others in rounds, bitwise the same as
the residency path at any pool and staging size, without touching the residency (the decode working set),
and counting what it needed and what it copied."""

import pytest
import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.host_bank import HostExpertBank
from adapters.cuda_exec.expert_pool import GEMV_MAX_PAIRS, DeviceExpertPool
from domain.model_spec import WeightFormat
from domain.streamed_prefill import plan_rounds, speculate_whole_layers
from tests.adapters.test_expert_pool_grouped import _rows
from tests.adapters.test_kernels_moe import FP32_BOUND, reference, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E, K = 64, 32, 3, 24, 6


@pytest.fixture(scope="module")
def bank_and_shared():
    gen = torch.Generator().manual_seed(5)
    layout = ExpertLayout(WeightFormat.MXFP4, H, I)
    rows, shared = _rows(layout, L * E, gen), _rows(layout, L, gen)
    if DEVICE == "cuda":
        rows = rows.pin_memory()
    return HostExpertBank(layout, L, E, rows), shared


def _chunk(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    # a skewed router: experts 0..E/2 take most pairs, so some experts stay unrouted in short chunks
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    ids = torch.where(torch.rand(tokens, K, generator=gen) < 0.5, ids % (E // 2), ids)
    ids = torch.stack([torch.tensor(list(dict.fromkeys(r.tolist() + list(range(E))))[:K]) for r in ids]).to(DEVICE)
    weights = torch.rand(tokens, K + 1, generator=gen).to(DEVICE)  # column K: the shared expert's gate
    valid = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    valid[[1, 4]] = False
    return x, ids, weights, valid


def _warm(pool, seed=9, rounds=2):
    """Decode-sized lookups through the residency (one launch), so some experts are resident."""
    gen = torch.Generator().manual_seed(seed)
    for layer in range(L):
        for _ in range(rounds):
            ids = torch.randperm(E, generator=gen)[:K].view(1, K).to(DEVICE)
            pool.routed(layer, torch.randn(1, H, generator=gen).to(DEVICE), torch.rand(1, K + 1, generator=gen)
                        .to(DEVICE), ids, shared=True)


def _residency_state(pool):
    res = pool.residency
    return (res.slot_of_key.clone(), res.key_of_slot.clone(), res.stamp.clone(), int(res.clock), res.counters(),
            res.lru_order())


def _same_state(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


# (slots, staging) with the real kernels in the interpreter (slow: a few launches per round); the fake-kernel
# test below sweeps many more sizes. grouped: > GEMV_MAX_PAIRS pairs, every round unmasked (speculation);
# gemv: a short chunk, rounds after a layer's first masked by its routing.
CASES = {"grouped": (GEMV_MAX_PAIRS // K + 5, ((10, 9),)), "gemv": (12, ((10, 5),))}


@pytest.mark.parametrize("path", sorted(CASES))
def test_streamed_prefill_is_bitwise_the_residency_path_and_leaves_the_lru_alone(bank_and_shared, path):
    tokens, cases = CASES[path]
    bank, shared = bank_and_shared
    x, ids, weights, valid = _chunk(tokens, seed=tokens)
    legacy = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared)  # fewer slots than a layer's experts
    _warm(legacy)
    want = [legacy.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
    for layer, got in enumerate(want):  # the residency path itself is right (the reference MoE)
        table = torch.cat((bank.rows[layer * E:(layer + 1) * E], shared[layer:layer + 1])).to(DEVICE)
        slot_ids = torch.cat((ids, torch.full_like(ids[:, :1], E)), 1).to(torch.int32)
        slot_ids[~valid, :K] = -1
        assert rel_err(got, reference(x, slot_ids, weights, table, bank.layout)[1]) < FP32_BOUND
    pairs = ids.numel()
    for slots, staging in cases:
        pool = DeviceExpertPool(bank, slots, DEVICE, shared_rows=shared, staging_slots=staging)
        _warm(pool)
        before = _residency_state(pool)
        resident = pool.residency.slot_of_key[:L * E].view(L, E).cpu()
        with pool.streamed_step():
            got = [pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (slots, staging)  # bitwise at any pool and staging size
        assert _same_state(_residency_state(pool), before), "a streamed prefill changed the residency"
        pool.check_valid()
        # what it needed: each routed (layer, expert) that was not resident, once per step
        routed = [{int(e) for e in ids[valid].flatten().tolist()} for _ in range(L)]
        needed = sum(1 for layer in range(L) for e in routed[layer] if resident[layer, e] < 0)
        missing = [[e for e in range(E) if resident[layer, e] < 0] for layer in range(L)]
        rounds = plan_rounds(missing, staging)
        if speculate_whole_layers(pairs, E):  # every non-resident expert copied, routed or not
            staged = sum(len(m) for m in missing)
        else:  # a layer's first round whole, later rounds only their routed experts
            staged = sum(len(r.experts) if r.first else sum(e in routed[r.layer] for e in r.experts) for r in rounds)
        stats = pool.streaming_stats()
        assert stats["experts_not_resident"] == needed and needed > (0 if slots < L * E else -1)
        assert stats["experts_staged"] == staged >= needed
        assert (stats["steps"], stats["layers"], stats["staging_experts"]) == (1, L, staging)
        assert stats["bytes_staged"] == staged * bank.layout.row_bytes


def test_outside_a_streamed_step_and_for_decode_sized_calls_the_residency_decides(bank_and_shared):
    bank, shared = bank_and_shared
    x, ids, weights, valid = _chunk(20, seed=3)
    pool = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared, staging_slots=4)
    pool.routed(0, x, weights, ids, valid, shared=True)  # no step open: the residency path
    assert pool.misses > 0 and pool.streaming_stats()["steps"] == 0
    misses = pool.misses
    with pool.streamed_step():  # a decode-sized call still takes the one-launch lookup
        pool.routed(1, x[:1], weights[:1], ids[:1], shared=True)
    assert pool.misses > misses and pool.streaming_stats()["steps"] == 0
    with pool.streamed_step():
        pool.routed(0, x, weights, ids, valid, shared=True)
        with pytest.raises(ValueError, match="same|pairs"):
            pool.routed(1, x[:-1], weights[:-1], ids[:-1], valid[:-1], shared=True)
        with pytest.raises(RuntimeError, match="already open"):
            with pool.streamed_step():
                pass
    pool.check_valid()
    with pytest.raises(ValueError, match="staging_slots"):
        DeviceExpertPool(bank, 10, DEVICE, staging_slots=-1)


class _LateLane:
    """A copy lane that runs each copy as late as a stream may: only when the compute stream waits for it
    (or at the end of the step). With the inline CPU lane (as early as possible) it brackets the schedules
    a side stream can produce, so a missing wait or a premature overwrite of a staging half shows."""

    def __init__(self):
        self.pending, self.ran = [], 0

    def mark(self):
        return None

    def copy(self, fn, waits, keep=()):
        event = object()
        self.pending.append((event, fn))
        return event

    def wait(self, event):
        while any(e is event for e, _ in self.pending):
            _, fn = self.pending.pop(0)
            fn()
            self.ran += 1

    def drain(self):
        while self.pending:
            self.pending.pop(0)[1]()
            self.ran += 1


def test_copies_run_as_late_as_a_side_stream_may_and_still_give_the_same_bits(bank_and_shared):
    bank, shared = bank_and_shared
    x, ids, weights, valid = _chunk(GEMV_MAX_PAIRS // K + 5, seed=20)  # the grouped GEMMs: cheaper here
    outs = []
    for late in (False, True):
        pool = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared, staging_slots=5)
        _warm(pool)
        if late:
            pool._lane = lane = _LateLane()
        with pool.streamed_step():
            outs.append([pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)])
    assert lane.ran > L and not lane.pending
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def _fake_kernels(monkeypatch):
    """Replace the MoE kernels by a cheap stand-in with their contract (fill the partials of pairs whose
    slot is not -1 from that slot's row, or return the ordered sum): expert(row)(x) = x * (row bytes @ P).
    Any pair read from the wrong row, twice, or not at all changes the result."""
    proj = torch.randn(_LAYOUT_BYTES[0], H, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def experts(self, pairs, x, slot_ids, weights, partials=None):
        out = torch.zeros((x.shape[0], slot_ids.shape[1], H), device=x.device) if partials is None else partials
        live = slot_ids >= 0  # [T, K]
        rows = self.all_slots[slot_ids.clamp(min=0).long()].float() @ proj  # [T, K, H]
        y = weights[:, :, None] * rows * x[:, None, :]
        out[live] = y[live]
        if partials is not None:
            return out
        total = torch.zeros_like(x, dtype=torch.float32)
        for k in range(out.shape[1]):  # in top-k order, as moe_sum
            total += out[:, k]
        return total

    monkeypatch.setattr(DeviceExpertPool, "_experts", experts)


_LAYOUT_BYTES = [0]


@pytest.mark.parametrize("tokens", [12, 40])  # 40 tokens x 6 = 240 pairs >= 8 per expert: speculation
def test_every_pool_and_staging_size_routes_each_pair_to_its_experts_row(bank_and_shared, monkeypatch, tokens):
    bank, shared = bank_and_shared
    _LAYOUT_BYTES[0] = bank.layout.row_bytes
    _fake_kernels(monkeypatch)
    x, ids, weights, valid = _chunk(tokens, seed=tokens + 1)
    legacy = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared)
    _warm(legacy, rounds=1)
    want = [legacy.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
    assert speculate_whole_layers(ids.numel(), E) == (tokens == 40)
    # slots: one token's experts, fewer than a layer's, all but one (a chunk of T*K <= S would take the
    # one-launch lookup instead); staging: one row (no double buffering), odd halves, more than a layer
    for slots in (K, 10, L * E - 1):
        for staging in (1, 3, 7, 2 * E + 1):
            pool = DeviceExpertPool(bank, slots, DEVICE, shared_rows=shared, staging_slots=staging)
            _warm(pool, rounds=1)
            before = _residency_state(pool)
            for late in (False, True):
                if late:
                    pool._lane = _LateLane()
                with pool.streamed_step():
                    got = [pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
                for a, b in zip(got, want, strict=True):
                    assert torch.equal(a, b), (slots, staging, late)
                assert _same_state(_residency_state(pool), before)
            pool.check_valid()
