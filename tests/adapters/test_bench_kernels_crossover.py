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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_splitk_tile_study_runs_every_admitted_fixed_tile_and_names_the_fastest(monkeypatch, tmp_path):
    """--only splitk-tiles: each (tile, warps, stages) x split _prune would admit for the shape runs at every row
    count, its output checked against the default launch's (the interpreter computes them exactly alike
    up to the split's summation order), with bytes / time and the fastest named."""
    import bench_kernels

    import adapters.kernels.dense_gemm_splitk as sk

    tiles = ((16, 4, 3), (32, 4, 4), (128, 8, 3))
    # K = 512: four 128-column steps admit splits 1 and 2 (MIN_STEPS_PER_SPLIT = 2); N = 48 caps BLOCK_N at 64
    us = iter(range(1, 1000))

    def timer(fn):
        fn()
        return float(next(us))

    rows = bench_kernels.splitk_tile_points(dev="cpu", timer=timer, rows=(2, 5), shapes={"tiny": (48, 512)},
                                            tiles=tiles)
    assert [(r["matrix"], r["rows"]) for r in rows] == [("tiny", 2), ("tiny", 5)]
    for row in rows:
        got = [(t["block_n"], t["split_k"], t["num_warps"]) for t in row["tiles"]]
        assert got == [(16, 1, 4), (16, 2, 4), (32, 1, 4), (32, 2, 4)]  # 128 > the 64-column cap: not run
        assert [t["num_stages"] for t in row["tiles"]] == [3, 2, 4, 2]  # at most a split's K steps
        assert all(t["max_rel_diff"] < 1e-5 for t in row["tiles"])
        assert row["best"] == min(row["tiles"], key=lambda t: t["us"]) == row["tiles"][0]  # the timer counts up
        assert row["tuned_tile"] is None  # no autotuning off CUDA
        assert row["weight_bytes"] == 48 * 512 + 1 * 4 * 4  # fp8 weights + one fp32 scale per 128 x 128 block
        assert row["tiles"][0]["gb_s"] == round(row["weight_bytes"] / row["tiles"][0]["us"] / 1e3, 1)
    assert sk.SPLITS[:2] == (1, 2)
    # and the flag runs it alone into the record
    calls = []
    monkeypatch.setattr(bench_kernels, "splitk_tile_points", lambda **kw: calls.append(kw) or [{"rows": 4}])
    monkeypatch.setattr(bench_kernels, "hardware_profile", lambda dev: {})
    assert bench_kernels.main(["--out", str(tmp_path), "--only", "splitk-tiles"]) == 0
    record = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert calls == [{}] and record["splitk_tiles"] == [{"rows": 4}] and "crossover" not in record
