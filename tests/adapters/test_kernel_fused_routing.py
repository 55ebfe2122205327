"""The fused MoE entry kernels against the unfused sequences they replace (Triton's interpreter on the CPU,
compiled on a GPU):
- rms_norm_router (norm + router GEMV) against rms_norm then F.linear on the norm's fp32 copy;
- moe_route_lookup (router from logits + the layer's LRU lookup; the decode step's path for small buckets,
  moe_route_lookup.pays) against moe_router then DeviceResidency.lookup_layer (the step's path above) on a
  twin residency: the same weights, slot ids, miss lists and, bit for bit, the same tables, stamps, clock
  and counters after every layer (lookup_layer itself is held to the domain LRU in
  test_device_residency.py; the hit/miss counts are checked against it here as well).
"""

import random

import pytest
import torch
import torch.nn.functional as F

from adapters.cuda_exec.device_residency import DeviceResidency
from adapters.kernels import residency_lookup
from adapters.kernels.moe_route_lookup import FUSED_MAX_TILE, MAX_TILE, fits, moe_route_lookup, pays
from adapters.kernels.moe_router import moe_router
from adapters.kernels.rms_norm import rms_norm
from adapters.kernels.rms_norm_router import TUNE_TILES, rms_norm_router
from domain.residency import ExpertResidency

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_router_matches_the_norm_then_the_router_gemv(unit_offset, dtype):
    gen = torch.Generator().manual_seed(3)
    t, d, e = 3, 80, 20  # D not a power of two (masked tail), E over several e-blocks with a ragged last one
    x = torch.randn(t, d, generator=gen).to(dtype).to(DEVICE)
    res = torch.randn(t, d, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(d, generator=gen) * 0.1).to(dtype).to(DEVICE)
    router = (torch.randn(e, d, generator=gen) * 0.2).to(DEVICE)
    total, out, logits = rms_norm_router(x, res, w, router, 1e-6, unit_offset=unit_offset, block_e=8, block_h=32)
    want_total, want_out, want32 = rms_norm(x, w, 1e-6, unit_offset=unit_offset, residual=res, fp32_copy=True)
    assert torch.equal(total, want_total)
    # the statistics are one full-row reduction in both kernels; compiled, its order may differ by a bit
    if DEVICE == "cpu":
        assert torch.equal(out, want_out)
    else:
        assert rel(out.float(), want_out.float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    want_logits = F.linear(out.float(), router)  # the router reads exactly the output it stored
    assert logits.dtype == torch.float32 and logits.shape == (t, e)
    assert rel(logits, want_logits) < 1e-5
    assert rel(F.linear(want32, router), want_logits) < (1e-5 if dtype == torch.float32 or DEVICE == "cpu" else 1e-2)


def test_norm_router_refuses_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="router"):
        rms_norm_router(x, x, torch.randn(8), torch.randn(4, 8).bfloat16(), 1e-6, unit_offset=True)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_router(x, torch.randn(2, 6), torch.randn(8), torch.randn(4, 8), 1e-6, unit_offset=True)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_router(x, x, torch.randn(6), torch.randn(4, 8), 1e-6, unit_offset=True)
    with pytest.raises(ValueError, match="block_e"):
        rms_norm_router(x, x, torch.randn(8), torch.randn(4, 8), 1e-6, unit_offset=True, block_e=3)
    with pytest.raises(ValueError, match="block_r"):
        rms_norm_router(x, x, torch.randn(8), torch.randn(4, 8), 1e-6, unit_offset=True, block_r=6)


def _norm_router_inputs(t, d=80, e=21, seed=5, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed + t)
    x, res = (torch.randn(t, d, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    w = (torch.randn(d, generator=gen) * 0.1).to(dtype).to(DEVICE)
    router = (torch.randn(e, d, generator=gen) * 0.2).to(DEVICE)
    return x, res, w, router


@pytest.mark.parametrize("t", [1, 2, 5])
def test_norm_router_small_tiles_give_the_default_launchs_results(t):
    """The tiles the autotuner may pick for few rows (1 or 2 router rows per program, several column steps,
    E=21 leaving a ragged last e-block, D=80 a masked tail) against the launch without a tile (the default
    tile here, the autotuned one on a GPU): the same sum and normalised row, bit for bit (every tile runs
    the same warp count, so the same statistics), and logits equal up to the summation order."""
    x, res, w, router = _norm_router_inputs(t)
    want_total, want_out, want_logits = rms_norm_router(x, res, w, router, 1e-6, unit_offset=True)
    assert want_logits.abs().min() > 0
    for block_e in (1, 2):
        for block_h in (16, 32, 64, 128):
            total, out, logits = rms_norm_router(x, res, w, router, 1e-6, unit_offset=True, block_e=block_e,
                                                 block_h=block_h)
            assert torch.equal(total, want_total) and torch.equal(out, want_out), (block_e, block_h)
            assert rel(logits, want_logits) < 1e-6, (block_e, block_h)
            assert rel(logits, F.linear(out.float(), router)) < 1e-5


ROW_BLOCK_TILES = [tile for tile in TUNE_TILES if tile[0] > 1]


@pytest.mark.parametrize(("t", "unit_offset"), [(3, True), (5, False), (19, True)])
def test_norm_router_row_blocks_match_the_norm_then_the_router_gemv(t, unit_offset):
    """Every row-block tile of TUNE_TILES (BLOCK_R 4-16 rows a program, each router tile applied to all of
    them) against rms_norm + F.linear: the sum and the normalised row bit for bit (each row's statistics are
    still one rms_norm reduction), logits within the one-row tiles' tolerance. T 3 and 5 leave rows past T
    in the only or last block, 19 is a multiple of no BLOCK_R; E 21 a ragged e-block, D 80 a masked tail
    (the tile's BH, capped at the padded row: one column step; BH 32: three, the last one masked)."""
    assert {br for br, _, _ in ROW_BLOCK_TILES} == {4, 8, 16}
    x, res, w, router = _norm_router_inputs(t)
    want_total, want_out = rms_norm(x, w, 1e-6, unit_offset=unit_offset, residual=res)
    want_logits = F.linear(want_out.float(), router)
    for br, be, bh in ROW_BLOCK_TILES:
        for block_h in (bh, 32):
            total, out, logits = rms_norm_router(x, res, w, router, 1e-6, unit_offset=unit_offset, block_r=br,
                                                 block_e=be, block_h=block_h)
            assert torch.equal(total, want_total) and torch.equal(out, want_out), (br, be, block_h)
            assert logits.shape == (t, 21) and rel(logits, want_logits) < 1e-5, (br, be, block_h)


def test_norm_router_row_blocks_store_no_row_past_t():
    """The last row block's rows past T (they repeat row T-1 in the statistics and the GEMV) store nothing:
    the kernel launched on outputs with spare rows leaves those rows as they were."""
    import adapters.kernels.rms_norm_router as nr

    t, d, e, br = 5, 48, 6, 4
    x, res, w, router = _norm_router_inputs(t, d=d, e=e)
    total, out = (torch.full((2 * br, d), float("nan"), dtype=x.dtype, device=DEVICE) for _ in range(2))
    logits = torch.full((2 * br, e), float("nan"), device=DEVICE)
    nr._rms_norm_router_kernel[(2, 2)](x, res, w, router, total, out, logits, t, d, e, 1e-6, UNIT_OFFSET=True,
                                       BLOCK_D=64, BLOCK_E=4, BLOCK_H=16, BLOCK_R=br, num_warps=nr.tune_warps(d))
    assert not total[:t].isnan().any() and not out[:t].isnan().any() and not logits[:t].isnan().any()
    assert total[t:].isnan().all() and out[t:].isnan().all() and logits[t:].isnan().all()


def test_norm_router_tile_candidates_keep_enough_programs_and_one_warp_count():
    """The autotuner's candidates at the Qwen3.6 shape (D 2048, E 256): at least one fills >= 128 programs at
    one row (the bs1 grid of the old 4 x 512 tile was 64 for 132 SMs), the old tile stays a candidate, all
    run rms_norm's warp count (4 to 2048 columns, 8 above); row blocks only where BLOCK_R <= T (a larger
    block only repeats row T-1); a row narrower than every BH keeps the narrowest."""
    import adapters.kernels.rms_norm_router as nr

    def tiles(t, d=2048):
        kept = nr._prune(nr._TUNED.configs, {"T": t, "D": d}, BLOCK_D=d)  # d a power of two here
        return {(c.kwargs["BLOCK_R"], c.kwargs["BLOCK_E"], c.kwargs["BLOCK_H"]) for c in kept}, kept

    at16, kept = tiles(16)
    assert at16 == set(nr.TUNE_TILES) and {c.num_warps for c in kept} == {4}
    assert tiles(1)[0] == {tile for tile in nr.TUNE_TILES if tile[0] == 1}
    assert max(-(-256 // be) for _, be, _ in tiles(1)[0]) >= 256 and (1, 4, 512) in tiles(1)[0]
    assert tiles(5)[0] == {tile for tile in nr.TUNE_TILES if tile[0] <= 4} != tiles(1)[0]
    assert {br for br, _, _ in at16} == {1, 4, 8, 16}
    assert {c.num_warps for c in tiles(16, 4096)[1]} == {8}
    narrow = nr._prune(nr._TUNED.configs, {"T": 16, "D": 80}, BLOCK_D=128)
    assert narrow and {c.kwargs["BLOCK_H"] for c in narrow} == {min(bh for _, _, bh in nr.TUNE_TILES)}


def test_norm_router_tunes_per_row_count_and_never_inside_a_capture(monkeypatch):
    """The autotuned launch (forced here, with a fake timer, so the CPU runs it): one key per row count T
    (the bs1 and bs16 buckets get their own tiles), the fastest candidate chosen and its results those of
    an explicit launch of that tile; inside a CUDA graph capture a tuned T launches without measuring and
    an untuned T runs the default tile instead of benchmarking in the capture."""
    import adapters.kernels.rms_norm_router as nr

    monkeypatch.setattr(nr, "_tunes", lambda x: True)
    monkeypatch.setattr(nr._TUNED, "cache", {})
    monkeypatch.setattr(nr._TUNED, "cache_results", False)  # no disk cache: this test's fake timings only
    measured = []
    fastest = {1: (1, 2, 16), 2: (2, 1, 32)}  # per T: the tile the fake timer makes fastest

    def tile(config):
        return config.kwargs["BLOCK_R"], config.kwargs["BLOCK_E"], config.kwargs["BLOCK_H"]

    def fake_bench(*args, config, **meta):
        t, d = args[7], args[8]
        assert config.num_warps == nr.tune_warps(d)
        measured.append((t, *tile(config)))
        ms = 1.0 if tile(config) == fastest[t] else 2.0
        return [ms, ms, ms]

    monkeypatch.setattr(nr._TUNED, "_bench", fake_bench)
    # a 2-row block: measured (and picked) at T 2, pruned at T 1
    configs = [triton_config(*tile) for tile in ((1, 1, 16), (1, 2, 16), (1, 1, 32), (1, 4, 32), (2, 1, 32))]
    monkeypatch.setattr(nr._TUNED, "configs", configs)
    for t in (1, 2):
        x, res, w, router = _norm_router_inputs(t, d=48, e=6)
        got = nr.rms_norm_router(x, res, w, router, 1e-6, unit_offset=False)
        assert sorted(m[1:] for m in measured if m[0] == t) == sorted(
            tile(c) for c in configs if c.kwargs["BLOCK_R"] <= t)
        br, be, bh = fastest[t]
        assert nr.tuned_tile(x, w, router) == {"block_r": br, "block_e": be, "block_h": bh, "num_warps": 4}
        want = nr.rms_norm_router(x, res, w, router, 1e-6, unit_offset=False, block_r=br, block_e=be,
                                  block_h=bh)
        for ours, theirs in zip(got, want, strict=True):
            assert torch.equal(ours, theirs)
    assert len(nr._TUNED.cache) == 2
    monkeypatch.setattr(nr, "_capturing", lambda: True)
    before = len(measured)
    x, res, w, router = _norm_router_inputs(1, d=48, e=6)
    nr.rms_norm_router(x, res, w, router, 1e-6, unit_offset=False)  # tuned: no measuring in the capture
    assert len(measured) == before
    x, res, w, router = _norm_router_inputs(4, d=48, e=6)
    got = nr.rms_norm_router(x, res, w, router, 1e-6, unit_offset=False)  # untuned: the default tile, unmeasured
    want = nr.rms_norm_router(x, res, w, router, 1e-6, unit_offset=False, block_r=nr.DEFAULT_BLOCK_R,
                              block_e=nr.DEFAULT_BLOCK_E, block_h=nr.DEFAULT_BLOCK_H)
    for ours, theirs in zip(got, want, strict=True):
        assert torch.equal(ours, theirs)
    assert len(measured) == before and len(nr._TUNED.cache) == 2


def triton_config(block_r: int, block_e: int, block_h: int):
    import triton

    return triton.Config({"BLOCK_R": block_r, "BLOCK_E": block_e, "BLOCK_H": block_h}, num_warps=4)


def _tables(r: DeviceResidency):
    return [v.clone() for v in (r.slot_of_key, r.key_of_slot, r.stamp, r.clock, r._counters)]


@pytest.mark.parametrize(("renorm", "block"), [(True, 4096), (False, 4096), (True, 4)])
@pytest.mark.parametrize("gate", ["none", "fp32", "bf16"])
def test_route_lookup_matches_the_router_then_the_lookup(renorm, gate, block, monkeypatch):
    # block: the victim scan's lanes (VICTIM_BLOCK); 4 scans the 14 slots in four blocks, both kernels alike
    monkeypatch.setattr(residency_lookup, "VICTIM_BLOCK", block)
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    layers, experts, top_k, rows, hidden, num_slots = 3, 12, 3, 4, 40, 14
    dtype = torch.bfloat16 if gate == "bf16" else torch.float32
    g = None if gate == "none" else (torch.randn(1, hidden, generator=gen) * 0.2).to(dtype).to(DEVICE)
    fused = DeviceResidency(num_slots, layers, experts, DEVICE)
    twin = DeviceResidency(num_slots, layers, experts, DEVICE)
    domain = ExpertResidency(num_slots)
    for _step in range(5):
        live = rng.randint(1, rows)
        valid = torch.tensor([r < live for r in range(rows)], device=DEVICE)
        for layer in range(layers):
            x = torch.randn(rows, hidden, generator=gen).to(dtype).to(DEVICE)
            logits = (torch.randn(rows, experts, generator=gen) * 2).to(DEVICE)
            logits[0, 5] = logits[0, 7] = logits[0].max() + 1  # an exact tie in the top-k: lowest id first
            shared = num_slots + layer if layer % 2 else None
            weights, slot_ids, fill_keys, fill_slots = moe_route_lookup(
                logits, x, top_k, renorm, g, valid, layer * experts, fused.slot_of_key, fused.key_of_slot,
                fused.stamp, fused.clock, fused._counters, num_slots, shared)
            want_w, want_i = moe_router(x, torch.zeros(experts, hidden, device=DEVICE), top_k, renorm, g,
                                        logits=logits)
            want_fk, want_fs, want_slots = twin.lookup_layer(layer, want_i[:, :top_k], valid, shared)
            assert rel(weights, want_w) < 1e-6
            assert torch.equal(slot_ids, want_slots)
            assert torch.equal(fill_keys, want_fk) and torch.equal(fill_slots, want_fs)
            for ours, theirs in zip(_tables(fused), _tables(twin), strict=True):
                assert torch.equal(ours, theirs)
            distinct = sorted({int(e) for e in want_i[:live, :top_k].flatten().tolist()})
            domain.lookup([(layer, e) for e in distinct])
            domain.release()
    assert fused.counters()[:2] == (domain.hits, domain.misses) and domain.misses > 0 and domain.hits > 0
    assert fused.lru_order() == domain.lru_order()
    fused.check_valid()


def test_route_lookup_bounds_and_bad_input():
    assert fits(16, 256, 8, 2048) and not fits(16, 512, 8, 2048)  # 16 x 512 > MAX_TILE
    assert fits(8, 512, 8, 2048) and fits(1, 1024, 8, 2048) and not fits(1, 1025, 8, 2048)
    assert not fits(4, 8, 2, 7)  # 8 keys cannot all be resident in 7 slots
    assert 16 * 256 <= MAX_TILE
    # where the decode step takes the kernel (measured crossover, run 6): up to 4 rows at E = 256
    assert FUSED_MAX_TILE <= MAX_TILE  # the step never asks for a tile the kernel cannot hold
    assert pays(1, 256) and pays(3, 256) and pays(4, 256) and not pays(5, 256) and not pays(16, 256)
    assert pays(2, 512) and not pays(4, 512) and pays(8, 128) and not pays(1, 2048)
    r = DeviceResidency(8, 1, 6, DEVICE)
    args = (r.slot_of_key, r.key_of_slot, r.stamp, r.clock, r._counters, 8)
    x, valid = torch.randn(2, 8, device=DEVICE), torch.ones(2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="logits"):
        moe_route_lookup(torch.randn(2, 6, device=DEVICE).double(), x, 2, True, None, valid, 0, *args)
    with pytest.raises(ValueError, match="do not fit"):
        moe_route_lookup(torch.randn(2, 6, device=DEVICE), x, 5, True, None, valid, 0, *args)
    with pytest.raises(ValueError, match="valid"):
        moe_route_lookup(torch.randn(2, 6, device=DEVICE), x, 2, True, None, valid[:1], 0, *args)
    with pytest.raises(ValueError, match="gate_weight"):
        moe_route_lookup(torch.randn(2, 6, device=DEVICE), x, 2, True, torch.randn(1, 5, device=DEVICE), valid,
                         0, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 8, 16])
def test_norm_router_every_tile_keeps_rms_norms_bits_on_gpu(rows):
    """Compiled, at the Qwen3.6 shape (D 2048, E 256, bf16, unit offset): every tile of TUNE_TILES (row
    blocks included, also those the autotuner prunes at this T) gives rms_norm's sum and normalised row bit
    for bit (the engine's bitwise-identical output across pool sizes rests on it: other paths run rms_norm),
    and logits within F.linear's tolerance."""
    gen = torch.Generator(device="cuda").manual_seed(100 + rows)
    h, e = 2048, 256
    x, res = (torch.randn(rows, h, device="cuda", generator=gen).bfloat16() for _ in range(2))
    norm_w = torch.randn(h, device="cuda", generator=gen).bfloat16()
    router = torch.randn(e, h, device="cuda", generator=gen) * 0.02
    want_total, want_out = rms_norm(x, norm_w, 1e-6, unit_offset=True, residual=res)
    for br, be, bh in TUNE_TILES:
        total, out, logits = rms_norm_router(x, res, norm_w, router, 1e-6, unit_offset=True, block_r=br,
                                             block_e=be, block_h=bh)
        assert torch.equal(total, want_total) and torch.equal(out, want_out), (br, be, bh)
        assert rel(logits, F.linear(out.float(), router)) < 1e-5, (br, be, bh)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_fused_routing_at_the_qwen3_6_geometry_on_gpu(rows):
    """H 2048, 256 experts, top-8 + a resident shared expert, 2,048 slots, bf16 activations: the norm's
    logits against F.linear on its output, the routing and lookup against the unfused pair."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    h, e, k, slots = 2048, 256, 8, 2048
    x, res = (torch.randn(rows, h, device="cuda", generator=gen).bfloat16() for _ in range(2))
    norm_w = torch.randn(h, device="cuda", generator=gen).bfloat16()
    router = torch.randn(e, h, device="cuda", generator=gen) * 0.02
    g = (torch.randn(1, h, device="cuda", generator=gen) * 0.02).bfloat16()
    total, out, logits = rms_norm_router(x, res, norm_w, router, 1e-6, unit_offset=True)
    assert torch.equal(total, rms_norm(x, norm_w, 1e-6, unit_offset=True, residual=res)[0])
    assert rel(logits, F.linear(out.float(), router)) < 1e-5
    fused, twin = (DeviceResidency(slots, 40, e, "cuda") for _ in range(2))
    valid = torch.ones(rows, dtype=torch.bool, device="cuda")
    for layer in (3, 3, 7):  # misses, then all hits, then another layer
        weights, slot_ids, fk, fs = fused.route_layer(layer, logits, out, k, True, g, valid, slots + layer)
        want_w, want_i = moe_router(out, router, k, True, g, logits=logits)
        want_fk, want_fs, want_slots = twin.lookup_layer(layer, want_i[:, :k], valid, slots + layer)
        assert rel(weights, want_w) < 1e-6
        assert torch.equal(slot_ids, want_slots) and torch.equal(fk, want_fk) and torch.equal(fs, want_fs)
        for ours, theirs in zip(_tables(fused), _tables(twin), strict=True):
            assert torch.equal(ours, theirs)
