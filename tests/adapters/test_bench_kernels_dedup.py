"""scripts/bench_kernels.py's per-pair vs expert-deduplicated MoE A/B at tiny shapes on the CPU (the H200
timing is the lead's): every variant runs on the same inputs, the record says the outputs are bitwise equal,
and local routing repeats experts (fewer distinct slots than pairs)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_dedup_points_run_every_variant_and_check_the_bits(monkeypatch):
    import bench_kernels

    monkeypatch.setattr(bench_kernels, "SLOTS", 40)
    calls = []

    def timer(fn):  # run once; an exception fails the test instead of being recorded
        calls.append(fn())
        return 1.0

    rows = bench_kernels.dedup_points([2], dev="cpu", timer=timer, hidden=128, inter=32, experts=16, hot=9)
    assert [(r["routing"], r["tokens"]) for r in rows] == [("random", 2), ("local", 2)]
    assert all(r["bitwise_equal"] is True for r in rows)
    assert len(calls) == len(rows) * (3 + 2 * 5 + 2)
    local = rows[-1]
    assert local["pairs"] == 18 and local["distinct_slots"] <= 10 and local["weight_bytes_ratio"] < 0.6
    assert {"gate_up_dedup_p4_us", "down_dedup_p1_us", "layer_dedup_us", "layer_us"} <= set(local)
