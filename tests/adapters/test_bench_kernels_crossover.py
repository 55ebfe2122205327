"""scripts/bench_kernels.py's dense crossover at tiny shapes on the CPU (the H200 timing is the lead's): every
row times dense_gemv, the split-K GEMM (up to its row limit) and dense_gemm on the same inputs, names the
kernel prefill_linear picks and the fastest, and --only crossover runs the dense half alone."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

KERNELS = (("dense_gemv", "dense_gemv", "gemv"), ("dense_gemm_splitk", "dense_gemm_splitk", "splitk"),
           ("dense_gemm", "dense_gemm", "gemm"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_dense_crossover_times_three_kernels_and_names_the_chosen_and_best(monkeypatch):
    import importlib

    import bench_kernels

    import adapters.cuda_exec.prefill_linear as pl
    import adapters.kernels.dense_gemm_splitk as sk

    monkeypatch.setattr(bench_kernels, "DENSE", {"narrow": (48, 256), "wide": (32, 512)})
    monkeypatch.setattr(pl, "SPLITK_GEMV_MAX_ROWS", 1)  # prefill_linear's choice pinned: the GEMV at 1 row,
    monkeypatch.setattr(pl, "SPLITK_MAX_ROWS", 2)  # split-K at 2
    monkeypatch.setattr(sk, "MAX_ROWS", 4)  # the kernel's limit: 8 rows record None
    ran, outs = [], []
    for mod_name, fn_name, tag in KERNELS:  # each kernel says it ran (the timer tells them apart)
        mod = importlib.import_module(f"adapters.kernels.{mod_name}")
        real = getattr(mod, fn_name)
        monkeypatch.setattr(mod, fn_name, lambda *a, _r=real, _t=tag, **k: ran.append(_t) or _r(*a, **k))
    us = {"gemv": 3.0, "splitk": 1.0, "gemm": 2.0}

    def timer(fn):  # run once; an exception fails the test instead of being recorded
        outs.append(fn())
        return us[ran[-1]]

    got = bench_kernels.crossover_points(dev="cpu", timer=timer, moe=False)
    assert set(got) == {"dense"}
    rows = got["dense"]
    assert [(r["matrix"], r["rows"], r["chosen"]) for r in rows[:7]] == [
        ("narrow", 1, "gemv"), ("narrow", 2, "splitk"), ("narrow", 4, "gemm"), ("narrow", 8, "gemm"),
        ("narrow", 16, "gemm"), ("narrow", 32, "gemm"), ("narrow", 64, "gemm")]
    assert len(rows) == 2 * len(bench_kernels.CROSSOVER_ROWS)
    for row in rows:
        assert row["gemv_us"] == 3.0 and row["gemm_us"] == 2.0
        if row["rows"] <= 4:
            assert row["splitk_us"] == 1.0 and row["best"] == "splitk"
        else:
            assert row["splitk_us"] is None and "best" not in row
    # the three kernels, each on the same row's inputs, agree (bf16 outputs)
    i = 0
    for row in rows:
        n = 3 if row["splitk_us"] is not None else 2
        group = [o.float() for o in outs[i:i + n]]
        i += n
        assert all(o.shape == (row["rows"], bench_kernels.DENSE[row["matrix"]][0]) for o in group)
        scale = group[0].abs().max()
        assert all((o - group[0]).abs().max() <= 2e-2 * scale for o in group[1:])
    assert ran == [tag for r in rows for tag in ("gemv", "splitk", "gemm") if tag != "splitk" or r["rows"] <= 4]


def test_only_crossover_runs_the_dense_half_alone(monkeypatch, tmp_path):
    import bench_kernels

    calls = []
    monkeypatch.setattr(bench_kernels, "crossover_points", lambda **kw: calls.append(kw) or {"dense": []})
    monkeypatch.setattr(bench_kernels, "hardware_profile", lambda dev: {})
    for name in ("dedup_points", "grouped_decode_points", "pair_order_points", "fusion_points",
                 "route_lookup_points", "moe_points", "dense_points"):
        monkeypatch.setattr(bench_kernels, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran"))
    assert bench_kernels.main(["--out", str(tmp_path), "--only", "crossover"]) == 0
    assert calls == [{"moe": False}]
    record = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert record["crossover"] == {"dense": []} and record["args"]["only"] == "crossover"
