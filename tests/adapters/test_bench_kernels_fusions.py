"""scripts/bench_kernels.py's fused-vs-unfused A/B at tiny shapes on the CPU (the H200 timing is the lead's):
every pair of the four decode fusions runs both sides on the same inputs without error."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_fusion_points_run_both_sides_of_every_fusion(monkeypatch):
    import bench_kernels

    from adapters.torch_exec.gated_deltanet import GdnGeometry

    monkeypatch.setattr(bench_kernels, "HIDDEN", 256)
    monkeypatch.setattr(bench_kernels, "INTER", 128)
    monkeypatch.setattr(bench_kernels, "SLOTS", 40)
    calls = []

    def timer(fn):  # run once; an exception fails the test instead of being recorded as a string
        calls.append(fn())
        return 1.0

    rows = bench_kernels.fusion_points([1, 2], dev="cpu", experts=16, geo=GdnGeometry(2, 4, 16, 16, 4), timer=timer)
    pairs = ("norm_router", "route_lookup", "down_sum", "gdn_ab", "attn_gate")
    assert [r["tokens"] for r in rows] == [1, 2]
    for row in rows:
        assert set(row) == {"tokens"} | {f"{p}_{side}_us" for p in pairs for side in ("fused", "unfused")}
    assert len(calls) == 2 * 2 * len(pairs)
    # down + sum: the two sides wrote the same bits (calls 4 and 5 of a token: fused first, then unfused)
    per_token = 2 * len(pairs)
    for fused, unfused in ((calls[4], calls[5]), (calls[per_token + 4], calls[per_token + 5])):
        assert fused is not unfused and torch.equal(fused, unfused)
