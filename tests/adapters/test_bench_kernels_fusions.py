"""scripts/bench_kernels.py's fused-vs-unfused A/B at tiny shapes on the CPU (the H200 timing is the lead's):
every decode fusion runs both sides on the same inputs without error, and the router + lookup A/B runs
both sides at each row count, with the same slot decisions, naming the side the decode step takes."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.fixture
def tiny(monkeypatch):
    import bench_kernels

    monkeypatch.setattr(bench_kernels, "HIDDEN", 256)
    monkeypatch.setattr(bench_kernels, "INTER", 128)
    monkeypatch.setattr(bench_kernels, "SLOTS", 40)
    calls = []

    def timer(fn):  # run once; an exception fails the test instead of being recorded as a string
        calls.append(fn())
        return 1.0

    return bench_kernels, timer, calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_fusion_points_run_both_sides_of_every_fusion(tiny):
    from adapters.kernels.rms_norm_router import TUNE_TILES
    from adapters.torch_exec.gated_deltanet import GdnGeometry

    bench_kernels, timer, calls = tiny
    rows = bench_kernels.fusion_points([1, 2], dev="cpu", experts=16, geo=GdnGeometry(2, 4, 16, 16, 4), timer=timer)
    pairs = ("norm_router", "gdn_ab", "attn_gate")
    tiles = {f"{br}x{be}x{bh}" for br, be, bh in TUNE_TILES if br == 1}  # the candidates at T 1-2 (BR <= T)
    assert [r["tokens"] for r in rows] == [1, 2]
    for row in rows:
        assert set(row) == {"tokens", "norm_router_tile", "norm_router_tiles_us"} | {
            f"{p}_{side}_us" for p in pairs for side in ("fused", "unfused")}
        assert row["norm_router_tile"] is None  # no autotuning off CUDA
        assert set(row["norm_router_tiles_us"]) == tiles and set(row["norm_router_tiles_us"].values()) == {1.0}
    assert len(calls) == 2 * (2 * len(pairs) + len(tiles))
    # every candidate tile's run gives the default tile's logits (calls: per row, fused first, then the tiles)
    per_row = 2 * len(pairs) + len(tiles)
    for r in range(2):
        fused = calls[r * per_row + 1]
        for total, out, logits in calls[r * per_row + 2:r * per_row + 2 + len(tiles)]:
            assert torch.equal(total, fused[0]) and torch.equal(out, fused[1])
            assert torch.allclose(logits, fused[2], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_route_lookup_points_time_both_sides_and_name_the_steps_side(tiny, monkeypatch):
    import adapters.kernels.moe_route_lookup as mrl

    bench_kernels, timer, calls = tiny
    monkeypatch.setattr(mrl, "FUSED_MAX_TILE", 32)  # 2 rows of 16 experts: the crossover inside the rows
    rows = bench_kernels.route_lookup_points([1, 2, 4], dev="cpu", experts=16, timer=timer)
    assert [(r["rows"], r["tile"], r["step_takes"]) for r in rows] == [(1, 16, "fused"), (2, 32, "fused"),
                                                                         (4, 64, "unfused")]
    for row in rows:
        assert row["fused_max_tile"] == 32 and row["fused_us"] == row["unfused_us"] == 1.0
        assert row["same_slots"] is True
    assert len(calls) == 2 * 3
    for (w_unfused, ids_unfused), (w_fused, ids_fused) in zip(calls[::2], calls[1::2], strict=True):
        assert torch.equal(ids_unfused, ids_fused) and (ids_fused[:, :-1] >= 0).all()  # routed pairs resident
        assert torch.allclose(w_unfused, w_fused, rtol=1e-6, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_grouped_decode_points_time_both_sides_on_the_same_layer(tiny):
    """Both sides of the decode-sized MoE layer run on the same inputs and agree (the grouped side aligned by
    expert key over E + 1 groups, through the Triton alignment), every part timed."""
    bench_kernels, timer, calls = tiny
    rows = bench_kernels.grouped_decode_points([1, 4], dev="cpu", experts=16, timer=timer)
    assert [r["tokens"] for r in rows] == [1, 4]
    for row in rows:
        assert row["pairs"] == row["tokens"] * bench_kernels.TOP_K
        assert 1 + bench_kernels.TOP_K - 1 <= row["distinct_experts"] <= row["pairs"]
        assert row["block_m"] == 16 and row["triton_align"] is True
        for part in ("per_pair_gate_up", "per_pair_down", "per_pair_sum", "per_pair_layer", "grouped_align",
                     "grouped_gemms", "grouped_layer"):
            assert row[f"{part}_us"] == 1.0
        assert row["max_rel_diff"] < 2e-2  # bf16 between the GEMMs on both sides; fp32 accumulators
    assert len(calls) == 2 * 7
    # the whole layers the timer ran: per-pair and grouped give the same output for each token count
    for per_pair, grouped in ((calls[3], calls[6]), (calls[10], calls[13])):
        scale = per_pair.float().abs().max()
        assert scale > 0 and ((grouped.float() - per_pair.float()).abs().max() / scale) < 2e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_pair_order_points_time_the_same_pairs_in_three_orders(tiny):
    """The per-pair GEMVs over one layer's pairs as launched, sorted by expert and shuffled: every side timed, and
    the sorted side's partials, put back in pair order, are the launched side's."""
    bench_kernels, timer, calls = tiny
    rows = bench_kernels.pair_order_points([1, 4], dev="cpu", experts=16, timer=timer)
    assert [r["tokens"] for r in rows] == [1, 4]
    for row in rows:
        assert row["pairs"] == row["tokens"] * bench_kernels.TOP_K
        for side in ("launched", "sorted", "shuffled"):
            assert row[f"{side}_gate_up_us"] == row[f"{side}_down_us"] == 1.0 and row[f"{side}_us"] == 2.0
        assert row["max_rel_diff"] < 1e-6  # the same pair's products, the same kernels
    assert len(calls) == 2 * 6
