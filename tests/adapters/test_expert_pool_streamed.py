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
from tests.adapters.test_kernels_moe import FP32_BOUND, reference, rel_err
from tests.adapters.torch_exec_models import packed_expert_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, I, L, E, K = 64, 32, 3, 24, 6


@pytest.fixture(scope="module")
def bank_and_shared():
    gen = torch.Generator().manual_seed(5)
    layout = ExpertLayout(WeightFormat.MXFP4, H, I)
    rows, shared = packed_expert_rows(layout, L * E, gen), packed_expert_rows(layout, L, gen)
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
    # NOTE: small integers, so row bytes @ proj is exact in fp32 (< 2**24) whatever the matmul's blocking:
    # pools of different sizes compute the same expert outputs bit for bit
    proj = torch.randint(-3, 4, (_LAYOUT_BYTES[0], H), generator=torch.Generator().manual_seed(1)).float().to(DEVICE)
    assert _LAYOUT_BYTES[0] * 255 * 3 < 2**24

    def experts(self, pairs, x, slot_ids, weights, partials=None):
        out = torch.zeros((x.shape[0], slot_ids.shape[1], H), device=x.device) if partials is None else partials
        live = slot_ids >= 0  # [T, K]
        rows = (self.all_slots.float() @ proj)[slot_ids.clamp(min=0).long()]  # [T, K, H]
        y = weights[:, :, None] * rows * x[:, None, :]
        out[live] = y[live]
        if partials is not None:
            return out
        total = torch.zeros_like(x, dtype=torch.float32)
        for k in range(out.shape[1]):  # in top-k order, as moe_sum
            total += out[:, k]
        return total

    def grouped_round(self, x, align, weights, partials, h=None):
        """The grouped GEMMs' contract on an alignment: every row of a block whose slot is not -1 fills its
        pair's partial from that slot's row (the same expression as `experts` above)."""
        pairs, block_slots, block_m = align
        slot = block_slots.long().repeat_interleave(block_m)  # [R] slot of each padded row
        live = (pairs >= 0) & (slot >= 0)
        pair, slot = pairs[live].long(), slot[live]
        t, k = pair // weights.shape[1], pair % weights.shape[1]
        assert not torch.any(torch.bincount(pair, minlength=1) > 1), "a pair twice in one call"
        partials[t, k] = weights[t, k][:, None] * (self.all_slots.float() @ proj)[slot] * x[t]
        return h

    monkeypatch.setattr(DeviceExpertPool, "_experts", experts)
    monkeypatch.setattr(DeviceExpertPool, "grouped_round", grouped_round)


_LAYOUT_BYTES = [0]


# 40 tokens x 6 = 240 pairs >= 8 per expert: speculation; 100 tokens: 600 pairs, the grouped GEMMs (one
# alignment per layer, block slots mapped per round)
@pytest.mark.parametrize("tokens", [12, 40, 100])
def test_every_pool_and_staging_size_routes_each_pair_to_its_experts_row(bank_and_shared, monkeypatch, tokens):
    bank, shared = bank_and_shared
    _LAYOUT_BYTES[0] = bank.layout.row_bytes
    _fake_kernels(monkeypatch)
    x, ids, weights, valid = _chunk(tokens, seed=tokens + 1)
    legacy = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared)
    _warm(legacy, rounds=1)
    want = [legacy.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
    assert speculate_whole_layers(ids.numel(), E) == (tokens >= 40)
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


class _RecordingLane:
    """A copy lane that runs each copy inline (as the CPU lane) and records, in one log shared with the
    MoE compute and the layer calls, the order in which the host issues things: ("copy", round, engine,
    waits), ("mark", token), ("wait", copy event). Its events are unique tokens, so a test can follow which
    copy waits for which compute."""

    def __init__(self, log):
        self.log, self.count = log, 0

    def _token(self, kind):
        self.count += 1
        return (kind, self.count)

    def mark(self):
        token = self._token("mark")
        self.log.append(("mark", token))
        return token

    def copy(self, fn, waits, keep=()):
        done = self._token("copy")
        self.log.append(("copy", fn.round, fn.engine, tuple(waits), done))
        fn()
        return done

    def wait(self, event):
        self.log.append(("wait", event))

    def drain(self):
        self.log.append(("drain",))


def _recorded_step(pool, x, ids, weights, valid, monkeypatch):
    """One streamed step of every layer through a _RecordingLane; returns (outputs, log, opened token)."""
    log = []
    pool._lane = lane = _RecordingLane(log)
    real_experts = DeviceExpertPool._experts

    def experts(self, *args, **kwargs):
        log.append(("moe",))
        return real_experts(self, *args, **kwargs)

    monkeypatch.setattr(DeviceExpertPool, "_experts", experts)
    opened = []
    real_snapshot = pool._take_snapshot

    def snapshot():
        opened.append(lane.mark())  # the step's opening event: a token the first copies must wait for
        return real_snapshot()._replace(opened=opened[-1])

    monkeypatch.setattr(pool, "_take_snapshot", snapshot)
    outs = []
    with pool.streamed_step():
        for layer in range(L):
            log.append(("layer", layer))
            outs.append(pool.routed(layer, x, weights, ids, valid, shared=True))
            log.append(("end", layer))
    return outs, log, opened[0]


@pytest.mark.parametrize("tokens", [12, 40])  # 40 tokens: every round speculative; 12: later rounds masked
def test_the_next_rounds_copy_is_issued_before_this_rounds_compute_and_waits_only_for_its_half(
        bank_and_shared, monkeypatch, tokens):
    """The order the host issues a streamed step in (what lets copy and compute overlap on a GPU, where a
    CPU run cannot show it): round q's copy is issued before round q-1's MoE compute, also across a layer
    boundary; as soon as round q-2's compute has freed their half, the copy of round q is issued (before the
    layer call returns, so two rounds are in flight while the next layer's mixer runs) unless it needs
    routing that does not exist yet; each copy waits for the compute that last read its half (the first
    two for the step's opening) and for nothing later; copy-engine copies for rounds known on the host."""
    bank, shared = bank_and_shared
    _LAYOUT_BYTES[0] = bank.layout.row_bytes
    _fake_kernels(monkeypatch)
    x, ids, weights, valid = _chunk(tokens, seed=tokens + 7)
    legacy = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared)
    _warm(legacy, rounds=1)
    want = [legacy.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
    pool = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared, staging_slots=7)  # halves of 3 rows
    _warm(pool, rounds=1)
    got, log, opened = _recorded_step(pool, x, ids, weights, valid, monkeypatch)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    stream_rounds = plan_rounds([[e for e in range(E) if pool.residency.slot_of_key[layer * E + e] < 0]
                                 for layer in range(L)], 7)
    n = len(stream_rounds)
    assert n > L + 2 and max(sum(r.layer == i for r in stream_rounds) for i in range(L)) >= 3  # several per layer
    speculate = speculate_whole_layers(ids.numel(), E)
    assert speculate == (tokens == 40)
    computes = [i for i, e in enumerate(log) if e[0] == "moe"]
    assert len(computes) == n  # one MoE call per round
    copies = {e[1]: (i, e) for i, e in enumerate(log) if e[0] == "copy"}
    assert sorted(copies) == [r for r in range(n) if stream_rounds[r].experts]  # each round copied once
    ends = {e[1]: i for i, e in enumerate(log) if e[0] == "end"}
    for q, (at, (_, _, engine, waits, done)) in copies.items():
        rnd = stream_rounds[q]
        masked = not rnd.first and not speculate
        assert engine == (not masked), q  # the copy engine wherever the host knows the round's experts
        if q >= 1:
            assert at < computes[q - 1], f"round {q}'s copy after round {q - 1}'s compute"
        # the compute it must not overtake: the last one that read its half (round q - 2), or the opening
        if q >= 2:
            freed = next(e[1] for e in log[computes[q - 2]:] if e[0] == "mark")
            assert freed in waits and at > computes[q - 2], q
            if not masked or stream_rounds[q - 2].layer == rnd.layer:  # needs no routing that is not there yet
                assert at < ends[stream_rounds[q - 2].layer], f"round {q} waited for the next layer call"
        else:
            assert opened in waits, q
        later = {e[1] for e in log[at:] if e[0] == "mark"}
        assert not later & set(waits)  # waits only for what was issued before it
        # the compute of round q waits for this copy's event, after issuing it
        assert ("wait", done) in log[at:computes[q]]
    if speculate:  # at every layer boundary the lane holds the next layer's first two rounds
        for layer in range(L - 1):
            first = stream_rounds.index(next(r for r in stream_rounds if r.layer == layer + 1))
            ahead = [q for q in (first, first + 1) if q < n and stream_rounds[q].experts]
            assert all(copies[q][0] < ends[layer] for q in ahead), layer


def test_copy_engine_and_gather_kernel_give_the_same_bits(bank_and_shared, monkeypatch):
    bank, shared = bank_and_shared
    _LAYOUT_BYTES[0] = bank.layout.row_bytes
    _fake_kernels(monkeypatch)
    for tokens in (12, 40):
        x, ids, weights, valid = _chunk(tokens, seed=tokens + 3)
        outs = {}
        for how in ("engine", "kernel"):
            pool = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared, staging_slots=5, staging_copy=how)
            _warm(pool, rounds=1)
            with pool.streamed_step():
                outs[how] = [pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
            pool.check_valid()
        for a, b in zip(outs["engine"], outs["kernel"], strict=True):
            assert torch.equal(a, b), tokens
    with pytest.raises(ValueError, match="staging_copy"):
        DeviceExpertPool(bank, 10, DEVICE, staging_copy="dma")


def test_a_lookup_inside_the_step_makes_the_streamed_calls_snapshot_again(bank_and_shared, monkeypatch):
    """The residency table is snapshotted when the step opens; a decode-sized call inside the step changes
    the residency, so the streamed call after it must read the table as it is then, not as it was."""
    bank, shared = bank_and_shared
    _LAYOUT_BYTES[0] = bank.layout.row_bytes
    _fake_kernels(monkeypatch)
    x, ids, weights, valid = _chunk(40, seed=44)
    legacy = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared)
    want = legacy.routed(2, x, weights, ids, valid, shared=True)
    pool = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared, staging_slots=5)
    _warm(pool, rounds=2)  # the 10 slots full, some of layer 2's experts among them
    before = pool.residency.slot_of_key.clone()
    resident = {e for e in range(E) if before[2 * E + e] >= 0}
    fresh = [e for e in range(E) if e not in resident][:K]  # a token whose experts all miss: K evictions
    with pool.streamed_step():
        pool.routed(2, x[:1], weights[:1], torch.tensor([fresh], device=DEVICE), shared=True)
        evicted = [k for k in range(L * E) if before[k] >= 0 and pool.residency.slot_of_key[k] < 0]
        assert evicted  # slots the opening snapshot says hold an expert now hold another one
        got = pool.routed(2, x, weights, ids, valid, shared=True)
    assert torch.equal(got, want)


@pytest.mark.skipif(DEVICE != "cuda", reason="streams and the copy engine exist on CUDA only")
def test_on_cuda_staging_copies_are_copy_engine_memcpys_on_a_side_stream(bank_and_shared, tmp_path):
    """On a GPU: a long chunk's staging copies are host-to-device memcpys (no gather kernel), all on one
    stream that runs none of the MoE kernels; the bits stay those of the residency path."""
    import json

    from torch.profiler import ProfilerActivity, profile

    bank, shared = bank_and_shared
    x, ids, weights, valid = _chunk(GEMV_MAX_PAIRS // K + 5, seed=31)
    legacy = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared)
    want = [legacy.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
    pool = DeviceExpertPool(bank, 10, DEVICE, shared_rows=shared, staging_slots=5)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with pool.streamed_step():
            got = [pool.routed(layer, x, weights, ids, valid, shared=True) for layer in range(L)]
        torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    compute = {e["args"]["stream"] for e in events if e["cat"] == "kernel" and "moe" in e["name"]}
    side = [e for e in events if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]
            and e["args"]["stream"] not in compute]
    assert compute and side and not any("gather_rows" in e["name"] for e in events)
    # every staged byte crossed on the side stream's memcpys (the compute stream's HtoD are the step's tables)
    staged = pool.streaming_stats()["bytes_staged"]
    assert staged > 0 and sum(e["args"]["bytes"] for e in side) == staged
