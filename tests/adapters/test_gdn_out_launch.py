"""The Gated DeltaNet output kernel's launch configuration (gdn_chunk_out's block_v, num_warps, num_stages): other
launches give today's values, a bad launch is refused before anything is written, and scripts/bench_kernels.py's
gdn-out A/B (scripts/gdn_launch_ab.gdn_out_points) runs at tiny shapes on the CPU (the H100 timing is the device
session's; docs/prefill-kernels.md, "The output's launch configuration").

Without CUDA the kernels run in Triton's interpreter (fp32), where num_warps and num_stages change nothing but the
launch's arguments and block_v changes the tiling across programs.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

import adapters.kernels.gdn_chunk_out as out_mod
from adapters.kernels.gdn_chunk_out import gdn_chunk_out
from adapters.kernels.gdn_chunk_state import gdn_chunk_state
from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy
from adapters.torch_exec.gated_deltanet import GdnGeometry
from tests.adapters.test_kernels_attention_gdn import DEVICE, rel_err
from tests.adapters.test_kernels_prefill import random_wy_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

# Dk = 80: the state tile in two halves (the second part-masked); Dv = 40: 3 programs of 16 columns, 2 of 32, 1 of 64
GEO = GdnGeometry(1, 2, 80, 40, 4)
DEFAULT = (out_mod.BLOCK_V, out_mod.LAUNCH["num_warps"], out_mod.LAUNCH["num_stages"])


def _walked(tokens: int, seed: int):
    """(mixed, v', gc, hs) of one sequence after today's state walk: what gdn_chunk_out reads."""
    mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(GEO, tokens, seed=seed)
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, GEO.num_k_heads, GEO.k_head_dim, GEO.v_head_dim)
    hs = gdn_chunk_state(mixed, w, u, gc, ks, state, GEO.num_k_heads)
    return mixed, u, gc, hs


@pytest.mark.parametrize("cfg", [(64, 8, 1), (16, 4, 1), (64, 4, 2), (128, 16, 1), (16, 8, 1)])
def test_output_with_another_launch_gives_the_default_values(cfg):
    """One sequence of 130 tokens (2 chunks and a 2-token tail) from a non-zero state: the core output as the
    default launch gives it (bitwise in the interpreter at the default's block_v, else within 1e-6 relative)."""
    mixed, u, gc, hs = _walked(130, seed=51)
    want = gdn_chunk_out(mixed, u, gc, hs, GEO.num_k_heads)
    got = gdn_chunk_out(mixed, u, gc, hs, GEO.num_k_heads, block_v=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
    assert want.abs().max() > 0
    if cfg[0] == DEFAULT[0] and DEVICE.type != "cuda":
        assert torch.equal(got, want), cfg
    else:
        assert rel_err(got, want) <= 1e-6, (cfg, rel_err(got, want))


def test_output_refuses_a_bad_launch_before_writing_anything():
    """gdn_chunk_out checks the launch first: `out` keeps its contents; None takes LAUNCH's and BLOCK_V's values."""
    mixed, u, gc, hs = _walked(70, seed=52)
    out = torch.full((70, GEO.num_v_heads, GEO.v_head_dim), 7.0, device=DEVICE)
    for launch in [dict(num_warps=6), dict(num_stages=0), dict(num_stages=5), dict(num_warps=True),
                   dict(num_stages=2.0), dict(num_warps=4, num_stages=9)]:
        with pytest.raises(ValueError, match="num_warps|num_stages"):
            gdn_chunk_out(mixed, u, gc, hs, GEO.num_k_heads, out=out, **launch)
    assert bool((out == 7.0).all())
    got = gdn_chunk_out(mixed, u, gc, hs, GEO.num_k_heads, out=out, block_v=None, num_warps=None, num_stages=None)
    assert torch.equal(got, gdn_chunk_out(mixed, u, gc, hs, GEO.num_k_heads))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_gdn_out_points_run_every_config_and_agree_with_the_default():
    """gdn_launch_ab.gdn_out_points in the interpreter: Dk 32, Dv 40, prompts of 130 and 64 tokens walked in windows
    of 64 (3 windows and 1): one row per (prompt, config), today's first, each within fp32 rounding of it; the
    timer's figure is one window's, times the prompt's windows."""
    import gdn_launch_ab

    configs = [(64, 8, 1), DEFAULT, (16, 4, 1)]
    timed = []

    def timer(fn):  # run once; an exception fails the test instead of being recorded
        fn()
        timed.append(1)
        return 10.0 if len(timed) % 2 else 5.0

    rows = gdn_launch_ab.gdn_out_points(timer, tokens=(130, 64), configs=configs, dev="cpu",
                                        geometry=(1, 2, 32, 40), window=64)
    want = [DEFAULT, (64, 8, 1), (16, 4, 1)]
    assert [(r["tokens"], (r["block_v"], r["num_warps"], r["num_stages"])) for r in rows] == [
        (t, c) for t in (130, 64) for c in want]
    assert len(timed) == len(rows)
    for r in rows:
        assert "error" not in r, r
        assert r["default"] == ((r["block_v"], r["num_warps"], r["num_stages"]) == DEFAULT)
        assert r["windows"] == (3 if r["tokens"] == 130 else 1) and r["chunks"] == -(-r["tokens"] // 64)
        assert r["programs_per_chunk"] == 2 * {16: 3, 32: 2, 64: 1}[r["block_v"]]
        assert r["max_rel_diff"] <= 1e-6, r
        if r["block_v"] == DEFAULT[0]:
            assert r["max_rel_diff"] == 0, r
        assert r["compiled"] is None  # the interpreter compiles nothing
        assert r["out_us"] in (10.0 * r["windows"], 5.0 * r["windows"])
        assert r["us_per_chunk"] == round(r["out_us"] / r["chunks"], 3)
    default_130 = rows[0]["out_us"]
    assert rows[1]["speedup_vs_default"] == round(default_130 / rows[1]["out_us"], 3)


def test_only_gdn_out_runs_the_output_alone_with_its_configs(monkeypatch, tmp_path):
    import bench_kernels
    import gdn_launch_ab

    calls = []
    monkeypatch.setattr(bench_kernels, "gdn_out_points", lambda *a, **k: calls.append((a, k)) or [{"tokens": 1}])
    monkeypatch.setattr(bench_kernels, "hardware_profile", lambda dev: {})
    for name in ("dedup_points", "grouped_decode_points", "pair_order_points", "fusion_points", "crossover_points",
                 "route_lookup_points", "moe_points", "dense_points", "splitk_tile_points", "gdn_walk_points"):
        monkeypatch.setattr(bench_kernels, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran"))
    assert bench_kernels.main(["--out", str(tmp_path), "--only", "gdn-out", "--out-configs", "64x8x1,128X16x1",
                               "--walk-tokens", "128,256"]) == 0
    assert calls == [((bench_kernels._timed, [128, 256], [(64, 8, 1), (128, 16, 1)]), {})]
    record = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert record["gdn_out"] == [{"tokens": 1}] and record["args"]["only"] == "gdn-out"
    calls.clear()
    assert bench_kernels.main(["--out", str(tmp_path), "--only", "gdn-out"]) == 0
    assert calls == [((bench_kernels._timed, [*bench_kernels.GDN_WALK_TOKENS], [*gdn_launch_ab.GDN_OUT_CONFIGS]),
                      {})]
    assert gdn_launch_ab.GDN_OUT_CONFIGS[0] == DEFAULT  # today's launch leads, as the rows do
    with pytest.raises(SystemExit):
        bench_kernels.main(["--out", str(tmp_path), "--only", "gdn-out", "--out-configs", "64x8"])
