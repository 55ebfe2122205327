"""The Gated DeltaNet state walk's launch configuration (gdn_chunk_state's block_v, num_warps, num_stages):
other launches give today's values, the launcher refuses launches outside its ranges, every candidate of
scripts/bench_kernels.py's GDN_WALK_CONFIGS builds for sm_90 within the spill bound, and the bench's
gdn-walk A/B runs at tiny shapes on the CPU (the H100 timing is the device session's; docs/prefill-kernels.md,
"The state walk's launch configuration").

Without CUDA the kernels run in Triton's interpreter (fp32: its bf16 dots are not the GPU's), where num_warps
and num_stages change nothing but the launch's arguments and block_v changes the tiling across programs.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

import adapters.kernels.gdn_chunk_state as walk_mod
from adapters.kernels.gdn_chunk_state import SpanWalk, check_launch, gdn_chunk_state
from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy
from adapters.torch_exec.gated_deltanet import GdnGeometry
from tests.adapters.test_kernels_attention_gdn import DEVICE, rel_err
from tests.adapters.test_kernels_prefill import random_wy_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

# Dk = 80: the state tile in two halves (the second part-masked); Dv = 40: 3 programs of 16 columns or 2 of 32
GEO = GdnGeometry(1, 2, 80, 40, 4)
DEFAULT = (walk_mod.BLOCK_V, walk_mod.LAUNCH["num_warps"], walk_mod.LAUNCH["num_stages"])
# NOTE: no 32-column launch past 2 stages: (32, 4, 4) needs 238,348 B of shared memory on sm_90, above its 232,448
# (Triton's OutOfResources on the H100, 2026-12-05), so no GPU can run it; (32, 4, 2) keeps 4 warps at 32 columns.
OTHERS = [(32, 8, 2), (16, 4, 1), (16, 8, 3), (32, 4, 2), (16, 8, 1)]


def _same(got: torch.Tensor, want: torch.Tensor, same_tiles: bool) -> bool:
    """Bitwise in the interpreter where the tiles are the default's (warps and stages change nothing there);
    otherwise (another block_v, or a GPU) within 1e-6 relative: the same operations per element."""
    if same_tiles and DEVICE.type != "cuda":
        return torch.equal(got, want)
    return rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("cfg", OTHERS)
def test_walk_with_another_launch_gives_the_default_values(cfg):
    """One sequence of 130 tokens (2 chunks and a 2-token tail) from a non-zero state: hs, v' (written over u)
    and the final state as the default launch gives them."""
    block_v, warps, stages = cfg
    mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(GEO, 130, seed=41)
    nk = GEO.num_k_heads
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, nk, GEO.k_head_dim, GEO.v_head_dim)
    runs = {}
    for launch in (DEFAULT, cfg):
        s, v = state.clone(), u.clone()
        hs = gdn_chunk_state(mixed, w, v, gc, ks, s, nk, block_v=launch[0], num_warps=launch[1],
                             num_stages=launch[2])
        runs[launch] = (hs, v, s)
    assert not torch.equal(runs[DEFAULT][1], u)  # v' was written
    for name, got, want in zip(("hs", "v_new", "state"), runs[cfg], runs[DEFAULT], strict=True):
        assert _same(got, want, block_v == DEFAULT[0]), (cfg, name, rel_err(got, want))


@pytest.mark.parametrize("cfg", [(32, 8, 2), (16, 4, 3)])
def test_span_walk_with_another_launch_gives_the_default_values(cfg):
    """Over a span table (what the prefill launches): spans of 70 and 130 tokens with gaps, in slots 2 and 0 of a
    3-slot pool, in one launch; slot 1 untouched."""
    from adapters.cuda_exec.step_plan import plan_walks

    block_v, warps, stages = cfg
    nk, nv, dk, dv = GEO.num_k_heads, GEO.num_v_heads, GEO.k_head_dim, GEO.v_head_dim
    spans = [(slice(3, 73), 2), (slice(76, 206), 0)]
    mixed, a, b, neg_a, dt_bias, _ = random_wy_inputs(GEO, 209, seed=42)
    gen = torch.Generator().manual_seed(43)
    pool = (torch.randn(3, nv, dk, dv, generator=gen) * 0.3).to(DEVICE)  # [S, Nv, Dk, Dv]
    chunks = [(r.start + c, r.stop) for r, _ in spans for c in range(0, r.stop - r.start, 64)]
    table = tuple(torch.tensor(v, dtype=torch.int64, device=DEVICE) for v in zip(*chunks, strict=True))
    entries, launches = plan_walks(spans, 4096)
    assert len(launches) == 1
    walk_table = torch.tensor(entries, dtype=torch.int64, device=DEVICE).t().contiguous()  # [4, E]
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, nk, dk, dv, chunks=table)
    (first, count, chunk0, n_chunks), = launches
    runs = {}
    for launch in (DEFAULT, cfg):
        s, v = pool.clone(), u.clone()
        hs = gdn_chunk_state(mixed, w, v, gc, ks, s, nk, walk=SpanWalk(walk_table, first, count, chunk0, n_chunks),
                             block_v=launch[0], num_warps=launch[1], num_stages=launch[2])
        assert hs.shape == (nv, n_chunks, dk, dv)
        assert torch.equal(s[1], pool[1])
        runs[launch] = (hs, v, s)
    # v' over the spans' rows only: the gaps' rows of u are gdn_chunk_wy's uninitialised memory (no chunk covers
    # them), which the walk never reads or writes; compared, their garbage (NaN at times) failed the test at random
    rows = torch.cat([torch.arange(r.start, r.stop) for r, _ in spans]).to(DEVICE)
    for name, got, want in zip(("hs", "v_new", "state"), runs[cfg], runs[DEFAULT], strict=True):
        if name == "v_new":
            got, want = got[:, rows], want[:, rows]
        assert _same(got, want, block_v == DEFAULT[0]), (cfg, name, rel_err(got, want))


def test_check_launch_accepts_the_ranges_and_refuses_the_rest():
    assert check_launch(8, 1) == (8, 1)
    assert [check_launch(w, walk_mod.MAX_STAGES) for w in walk_mod.WARPS] == [
        (w, walk_mod.MAX_STAGES) for w in walk_mod.WARPS]
    for warps, stages in [(3, 1), (0, 1), (32, 1), (-8, 1), (True, 1), (8.0, 1), ("8", 1), (None, 1),
                          (8, 0), (8, walk_mod.MAX_STAGES + 1), (8, -1), (8, True), (8, False), (8, 2.0), (8, None)]:
        with pytest.raises(ValueError, match="num_warps" if stages == 1 and type(stages) is int else "num_stages"):
            check_launch(warps, stages)


def test_walk_refuses_a_bad_launch_before_touching_anything():
    """gdn_chunk_state checks the launch first: u and the state stay as they were; None takes LAUNCH's value."""
    nv = GEO.num_v_heads
    mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(GEO, 70, seed=44)
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, GEO.num_k_heads, GEO.k_head_dim, GEO.v_head_dim)
    s, v = state.clone(), u.clone()
    for launch in [dict(num_warps=6), dict(num_stages=0), dict(num_stages=5), dict(num_warps=True),
                   dict(num_stages=True), dict(num_warps=4, num_stages=5)]:
        with pytest.raises(ValueError, match="num_warps|num_stages"):
            gdn_chunk_state(mixed, w, v, gc, ks, s, GEO.num_k_heads, **launch)
    assert torch.equal(s, state) and torch.equal(v, u)
    hs = gdn_chunk_state(mixed, w, v, gc, ks, s, GEO.num_k_heads, num_warps=None, num_stages=None)
    assert hs.shape == (nv, 2, GEO.k_head_dim, GEO.v_head_dim)


# ---------------------------------------------------------------- CPU: compiled for sm_90 by ptxas

_SM90_WALK = r"""
import json

from adapters.kernels import gdn_chunk_state as walk, gdn_chunk_wy as wy
from tests.adapters.sm90_usage import resource_usage

heads = dict(KEY_HEADS=16, VALUE_HEADS=32, DK=128, DV=128, CHUNK=64)
f32 = "*fp32"
out = {}
for block_v, warps, stages in json.loads(CONFIGS):
    # the bf16 model's walk over a span table: what the fast path's prefill launches
    out[f"{block_v}x{warps}x{stages}"] = resource_usage(walk._gdn_chunk_state_kernel, dict(
        mixed_ptr=f32, w_ptr=f32, u_ptr=f32, gc_ptr=f32, ks_ptr=f32, state_ptr=f32, hs_ptr=f32, walk_ptr="*i64"),
        dict(**heads, BLOCK_KB=64, SPLIT=True, BLOCK_V=block_v, DOT_PRECISION=wy.dot_precision(False), SPANS=True,
             NUM_STAGES=stages), dict(num_warps=warps, num_stages=stages))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_walk_config_builds_for_sm90_within_the_spill_bound():
    """Each GDN_WALK_CONFIGS launch (today's first) builds for sm_90 at Qwen3.6 geometry (bf16 model, span table)
    in a fresh process, fits an SM's 227 KiB of shared memory and spills at most GDN_WALK_SPILL_BOUND bytes a
    thread, today's launch included (measured 2026-12-05 in GDN_WALK_CONFIGS' order: 160 / 0 / 160 / 80 B under
    Triton 3.6, FT_SM90_TRITON; 168 / 24 / 96 / 152 B under 3.9)."""
    import bench_kernels

    from tests.adapters.sm90 import build_for_sm90

    configs = [list(c) for c in bench_kernels.GDN_WALK_CONFIGS]
    assert tuple(configs[0]) == DEFAULT
    assert len({tuple(c) for c in configs}) == len(configs)
    script = f"CONFIGS = {json.dumps(json.dumps(configs))}\n" + _SM90_WALK
    usage = json.loads(build_for_sm90(script).strip().splitlines()[-1])
    assert list(usage) == [f"{b}x{w}x{s}" for b, w, s in configs]
    for name, found in usage.items():
        assert found["SMEM"] <= 227 * 1024, (name, found)
        assert found["STACK"] <= bench_kernels.GDN_WALK_SPILL_BOUND, (name, found)


# ---------------------------------------------------------------- the bench's A/B at tiny shapes

@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is scripts/bench_kernels.py itself")
def test_gdn_walk_points_run_every_config_and_agree_with_the_default():
    """bench_kernels.gdn_walk_points in the interpreter: Dk 32, Dv 40, prompts of 130 and 64 tokens walked in
    windows of 64 (3 launches and 1): one row per (prompt, config), today's first, each within fp32 rounding of
    it (v', the last window's entry states, the final state); the timer's numbers land in the rows."""
    import bench_kernels

    configs = [(32, 8, 2), (16, 4, 1), DEFAULT, (32, 4, 3)]
    calls = []

    def timer(fn):  # run once; an exception fails the test instead of being recorded
        fn()
        calls.append(1)
        return 10.0 if len(calls) % 3 else 4.0

    rows = bench_kernels.gdn_walk_points(tokens=(130, 64), configs=configs, dev="cpu", timer=timer,
                                         geometry=(1, 2, 32, 40), window=64)
    want = [DEFAULT, (32, 8, 2), (16, 4, 1), (32, 4, 3)]
    assert [(r["tokens"], (r["block_v"], r["num_warps"], r["num_stages"])) for r in rows] == [
        (t, c) for t in (130, 64) for c in want]
    for r in rows:
        assert "error" not in r, r
        assert r["default"] == ((r["block_v"], r["num_warps"], r["num_stages"]) == DEFAULT)
        assert r["launches"] == (3 if r["tokens"] == 130 else 1) and r["chunks"] == -(-r["tokens"] // 64)
        assert r["programs"] == 2 * (3 if r["block_v"] == 16 else 2)
        assert set(r["max_rel_diff"]) == {"v_new", "hs", "state"}
        assert all(d <= 1e-6 for d in r["max_rel_diff"].values()), r
        if r["block_v"] == DEFAULT[0]:
            assert all(d == 0 for d in r["max_rel_diff"].values()), r
        assert r["compiled"] is None  # the interpreter compiles nothing
        assert {"wy_us", "out_us", "reset_us", "walk_us"} <= set(r)
        assert isinstance(r["walk_us"], float) and r["walk_us"] == round(r["walk_us"], 2)
        assert r["us_per_chunk_step"] == round(r["walk_us"] / r["chunks"], 3)


def test_only_gdn_walk_runs_the_walk_alone_with_its_configs(monkeypatch, tmp_path):
    import bench_kernels

    calls = []
    monkeypatch.setattr(bench_kernels, "gdn_walk_points", lambda *a, **k: calls.append((a, k)) or [{"tokens": 1}])
    monkeypatch.setattr(bench_kernels, "hardware_profile", lambda dev: {})
    for name in ("dedup_points", "grouped_decode_points", "pair_order_points", "fusion_points", "crossover_points",
                 "route_lookup_points", "moe_points", "dense_points", "splitk_tile_points"):
        monkeypatch.setattr(bench_kernels, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} ran"))
    assert bench_kernels.main(["--out", str(tmp_path), "--only", "gdn-walk", "--walk-configs", "32x8x2,16X4x1",
                               "--walk-tokens", "128,256"]) == 0
    assert calls == [(([128, 256], [(32, 8, 2), (16, 4, 1)]), {})]
    record = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert record["gdn_walk"] == [{"tokens": 1}] and record["args"]["only"] == "gdn-walk"
    calls.clear()
    assert bench_kernels.main(["--out", str(tmp_path), "--only", "gdn-walk"]) == 0
    assert calls == [(([*bench_kernels.GDN_WALK_TOKENS], [*bench_kernels.GDN_WALK_CONFIGS]), {})]
    with pytest.raises(SystemExit):
        bench_kernels.main(["--out", str(tmp_path), "--only", "gdn-walk", "--walk-configs", "32x8"])
