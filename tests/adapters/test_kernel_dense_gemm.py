"""Tensor-core dense GEMM (prefill rows) against the reference dequantization and qlinear, every quantized
format (Triton's interpreter on the CPU, with fp32 dot operands; compiled on a GPU host).

Bounds: fp32 activations 1e-5 relative (exact fp32 products, reordered sums); bf16 activations 8e-3 (one
rounding of the output to bf16; the interpreter truncates instead of rounding, which doubles it).
Every check runs in both arrangements (w_lhs: the weight as the dot's left operand, the transposed tile).
"""

import os

import pytest
import torch

from adapters.checkpoint.quant import QTensor, dequantize, qlinear
from adapters.checkpoint.quantize import quantize
from adapters.kernels.dense_gemm import SUPPORTED, dense_gemm, m_bucket, supports
from domain.model_spec import WeightFormat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = sorted(SUPPORTED, key=lambda f: f.value)
W_LHS = pytest.mark.parametrize("w_lhs", [False, True], ids=["w_rhs", "w_lhs"])


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def _case(fmt, rows, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    q = quantize(torch.randn(n, k, generator=gen) * 0.05, fmt)
    x = torch.randn(rows, k, generator=gen)
    return x, q


@W_LHS
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_dense_gemm_matches_the_reference_in_fp32(fmt, w_lhs):
    # M=37 (three 16-row tiles, the last partial), N=200 (a partial 64-column tile), K=384 (three
    # 128-column steps, three scale blocks)
    x, q = _case(fmt, 37, 200, 384, seed=1)
    out = torch.full((37, 200), float("nan"), device=DEVICE)  # an unwritten element fails below
    dense_gemm(x.to(DEVICE), q.to(DEVICE), out=out, w_lhs=w_lhs)
    assert torch.isfinite(out).all()
    assert _err(out, x.double() @ dequantize(q, torch.float64).T) < 1e-5


@W_LHS
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_dense_gemm_ragged_k_and_small_tiles(fmt, w_lhs):
    # K=320: a partial last K step (and a partial 128-column scale block for block FP8); 32x32 tiles give
    # a 2 x 3 program grid that the GROUP_M ordering has to cover exactly once
    x, q = _case(fmt, 40, 96, 320, seed=2)
    out = dense_gemm(x.to(DEVICE), q.to(DEVICE), block_m=32, block_n=32, w_lhs=w_lhs)
    assert _err(out, x.double() @ dequantize(q, torch.float64).T) < 1e-5


@W_LHS
@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.INT8_CHANNEL, WeightFormat.NVFP4],
                         ids=lambda f: f.value)
def test_dense_gemm_bf16_activations_match_qlinear(fmt, w_lhs):
    x, q = _case(fmt, 24, 136, 256, seed=3)
    xb = x.bfloat16().to(DEVICE)
    out = dense_gemm(xb, q.to(DEVICE), w_lhs=w_lhs)
    assert out.dtype == torch.bfloat16
    exact = xb.double().cpu() @ dequantize(q, torch.float64).T
    assert _err(out, exact) < 8e-3
    assert _err(out, qlinear(xb, q.to(DEVICE))) < 8e-3


@W_LHS
def test_dense_gemm_writes_into_a_strided_out_and_handles_zero_rows(w_lhs):
    x, q = _case(WeightFormat.FP8_CHANNEL, 17, 64, 128, seed=4)
    wide = torch.full((17, 100), float("nan"), device=DEVICE)
    dense_gemm(x.to(DEVICE), q.to(DEVICE), out=wide[:, 10:74], w_lhs=w_lhs)
    assert torch.isnan(wide[:, :10]).all() and torch.isnan(wide[:, 74:]).all()
    assert _err(wide[:, 10:74], x.double() @ dequantize(q, torch.float64).T) < 1e-5
    assert dense_gemm(x[:0].to(DEVICE), q.to(DEVICE), w_lhs=w_lhs).shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_w_lhs_block_fp8_is_the_references_folded_dequantization(dtype):
    """Under W_LHS the block-FP8 scale is folded into the weight tile before its cast to the activations' dtype:
    (e4m3 * scale) rounded once, element for element what the reference dequantizes (dequantize(q, dtype)).
    With an fp32 output the product then matches that reference up to fp32 accumulation; the per-step scaled
    dot (w_rhs: exact e4m3 operands) is off it by the weights' rounding. fp16 on the CPU: the interpreter
    truncates fp32 -> bf16 where torch rounds (fp16 it rounds alike); bf16 where compiled."""
    from adapters.kernels.dense_gemm import BLOCK_K, _dense_gemm_kernel
    from adapters.kernels.dequant_tile import dot_modes
    from adapters.kernels.packed_gemv import FORMAT_CODES, SCALE_GROUP
    if dtype == torch.bfloat16 and DEVICE != "cuda":
        pytest.skip("the interpreter truncates fp32 -> bf16 casts")
    x, q = _case(WeightFormat.FP8_BLOCK, 40, 200, 320, seed=7)  # partial row, column and scale blocks
    xq, q = x.to(dtype).to(DEVICE), q.to(DEVICE)
    folded = xq.double().cpu() @ dequantize(q.to("cpu"), dtype).double().T  # [M, N]
    errs = {}
    for w_lhs in (False, True):
        y = torch.full((40, 200), float("nan"), device=DEVICE)  # fp32: no rounding of the output
        _dense_gemm_kernel[(3 * 4,)](xq, xq, q.data, q.scale, q.scale, y, 40, 64, xq.stride(0), y.stride(0),
                                    N=200, K=320, FMT=FORMAT_CODES[q.fmt], GROUP=SCALE_GROUP[q.fmt], A8=False,
                                    BLOCK_M=16, BLOCK_N=64, BLOCK_K=BLOCK_K, GROUP_M=8, W_LHS=w_lhs, **dot_modes(xq))
        errs[w_lhs] = _err(y, folded)
    assert errs[True] < 1e-6, errs
    assert errs[False] > 20 * errs[True], errs  # the check tells the two roundings apart


def test_supports_and_refusals():
    q = quantize(torch.randn(32, 128) * 0.05, WeightFormat.FP8_BLOCK).to(DEVICE)
    bf16 = QTensor(WeightFormat.BF16, (32, 128), torch.randn(32, 128, dtype=torch.bfloat16))
    assert supports(q) and not supports(bf16)
    x = torch.randn(4, 128, device=DEVICE)
    cases = [
        ((x, bf16), {}, "does not read bf16"),
        ((x[:, :64], q), {}, r"\[M, 128\]"),
        ((x.to(torch.int32), q), {}, "bf16/fp16/fp32"),
        ((x, q), {"block_m": 8}, "block_m=8"),
        ((x, q), {"block_n": 48}, "block_n=48"),
        ((x, q), {"block_n": 256}, "<= 128"),
        ((x, q), {"out": torch.empty(4, 16, device=DEVICE)}, "out must be"),
        ((x, q), {"out": torch.empty(4, 32, dtype=torch.bfloat16, device=DEVICE)}, "out must be"),
        ((torch.randn(128, 4, device=DEVICE).T, q), {}, "contiguous"),
    ]
    from adapters.kernels.act_quant_fp8 import act_quant_fp8_reference
    cases += [
        ((act_quant_fp8_reference(x), q), {"w_lhs": True}, "w_lhs does not apply to FP8 activations"),
        ((x, q), {"w_lhs": 1}, "w_lhs must be a bool"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            dense_gemm(*args, **kwargs)
    with pytest.raises(ValueError, match="block_n=8 must be a power of two >= 16"):  # W_LHS: the wgmma's M side
        dense_gemm(x, q, block_n=8, w_lhs=True)


def test_m_bucket_keeps_tuning_keys_few():
    assert [m_bucket(m) for m in (1, 16, 17, 1000, 4096, 70000)] == [1, 16, 32, 1024, 4096, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.FP8_CHANNEL, WeightFormat.MXFP4],
                         ids=lambda f: f.value)
@pytest.mark.parametrize("rows", [40, 1000])
def test_dense_gemm_real_shapes_on_gpu(fmt, rows):
    """Autotuned tiles at a Qwen3.6 projection shape (N=4096, K=2048)."""
    x, q = _case(fmt, rows, 4096, 2048, seed=5)
    x, q = x.cuda(), q.to("cuda")
    exact = x.double() @ dequantize(q, torch.float64).T
    assert _err(dense_gemm(x, q), exact) < 1e-5  # fp32 activations: exact products ("ieee" dots)
    xb = x.bfloat16()
    assert _err(dense_gemm(xb, q), xb.double() @ dequantize(q, torch.float64).T) < 8e-3
    assert _err(dense_gemm(xb, q), qlinear(xb, q)) < 8e-3


# ---- every tile the autotuner may pick is correct, and the autotuner only tries tiles that fit -------------

@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.NVFP4, WeightFormat.MXFP4], ids=lambda f: f.value)
def test_every_tuned_tile_is_exact_on_tail_shapes(fmt, act):
    """The autotuner may pick any tile of the activation dtype's family (FMA_TILES for fp32, TUNE_TILES for
    bf16), so each must be right where the masks work: N=48 narrower than most tiles (prefill_linear's test
    shape), K=320 a partial last step and scale block, M=40 a partial row tile. The interpreter ignores
    warps and stages; on a GPU each tile is launched as tuned, so a tile the compiler gets wrong is named.
    bf16 also takes the W_LHS tiles (W_LHS_TILES, the transposed arrangement)."""
    from adapters.kernels.dense_gemm import FMA_TILES, TUNE_TILES, W_LHS_TILES
    x, q = _case(fmt, 40, 48, 320, seed=6)
    x, q = x.to(act).to(DEVICE), q.to(DEVICE)
    exact = x.double().cpu() @ dequantize(q.to("cpu"), torch.float64).T
    tiles = ([(*t, False) for t in FMA_TILES] if act == torch.float32
             else [(*t, False) for t in TUNE_TILES] + [(*t, True) for t in W_LHS_TILES])
    if DEVICE != "cuda":
        tiles = sorted({(bm, bn, 4, None, lhs) for bm, bn, _, _, lhs in tiles})
    bad = {}
    for bm, bn, warps, stages, w_lhs in tiles:
        out = torch.full((40, 48), float("nan"), dtype=act, device=DEVICE)
        dense_gemm(x, q, out=out, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, w_lhs=w_lhs)
        err = _err(out, exact)
        if not err < (1e-5 if act == torch.float32 else 8e-3):
            bad[(bm, bn, warps, stages, w_lhs)] = err
    assert not bad, f"tiles off the reference: {bad}"


def _pruned(prec, fmt, m_bucket, n, k, a8=False, w_lhs=False):
    """The admitted (BLOCK_M, BLOCK_N, warps, stages) of one arrangement (w_lhs: the W_LHS tiles)."""
    from adapters.kernels import dense_gemm as dg
    kept = dg._prune(dg.tune_configs(w_lhs=True), {"M_BUCKET": m_bucket}, PRECISION=prec, FMT=fmt, N=n, K=k, A8=a8)
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept
            if c.kwargs["W_LHS"] == w_lhs]


def test_w_lhs_tiles_are_tuned_unless_turned_off():
    """The W_LHS tiles join the autotuner unless FLUXTIDE_PREFILL_W_LHS=0 (dequant_tile.W_LHS_TUNING; on by default
    since session 25 timed them); with it off the served configs are the right-operand ones only."""
    from adapters.kernels import dense_gemm as dg
    from adapters.kernels.dequant_tile import W_LHS_TUNING, grouped_configs
    assert not any(c.kwargs["W_LHS"] for c in dg.tune_configs(w_lhs=False) + grouped_configs(w_lhs=False))
    assert sum(c.kwargs["W_LHS"] for c in dg.tune_configs(w_lhs=True)) == len(dg.W_LHS_TILES)
    assert any(c.kwargs["W_LHS"] for c in dg._TUNED.configs) == W_LHS_TUNING
    assert W_LHS_TUNING == (os.environ.get("FLUXTIDE_PREFILL_W_LHS", "1") == "1")  # unset: on
    from adapters.kernels.dequant_tile import _w_lhs_tuning
    assert (_w_lhs_tuning("0"), _w_lhs_tuning("1")) == (False, True)
    for bad in ("true", "yes", ""):
        with pytest.raises(ValueError, match="FLUXTIDE_PREFILL_W_LHS must be 0 or 1"):
            _w_lhs_tuning(bad)


def test_autotune_tries_only_tiles_that_fit_the_shape_and_the_registers():
    from adapters.kernels.dense_gemm import FMA_TILES, TUNE_TILES, W_LHS_TILES
    # served shape, bf16: every tensor-core tile in both arrangements (none spills at sm_90)
    assert _pruned("tf32", 1, 4096, 4096, 2048) == list(TUNE_TILES)
    assert _pruned("tf32", 1, 4096, 4096, 2048, w_lhs=True) == list(W_LHS_TILES)
    assert all(bn >= 64 for _, bn, _, _ in W_LHS_TILES)  # the weight tile is the wgmma's M side
    # e4m3 activations (W8A8): the activations stay the left operand, no W_LHS tile
    assert _pruned("tf32", 1, 4096, 4096, 2048, a8=True) == list(TUNE_TILES)
    assert _pruned("tf32", 1, 4096, 4096, 2048, a8=True, w_lhs=True) == []
    # fp32 activations: FMA loops, only the small FMA tiles (the tensor-core ones spill 3-24 KB per thread)
    assert _pruned("ieee", 1, 4096, 4096, 2048) == list(FMA_TILES)
    assert _pruned("ieee", 1, 4096, 4096, 2048, w_lhs=True) == []
    # 4-bit weights: no 128-column tile on 4 warps (128 dequantized elements per thread spill)
    for lhs in (False, True):
        fp4 = _pruned("tf32", 6, 4096, 4096, 2048, w_lhs=lhs)
        assert (128, 128, 8, 3) in fp4 and not [t for t in fp4 if t[1] == 128 and t[2] == 4]
    # a few rows, narrow N, two K steps: no tile taller than 16 rows or wider than 64 columns, <= 2 stages
    for lhs in (False, True):
        small = _pruned("tf32", 1, 8, 48, 256, w_lhs=lhs)
        assert all(bm == 16 and bn <= 64 and st <= 2 for bm, bn, _, st in small)
        assert len(set(small)) == len(small) and (small or lhs)
    # nothing fits (K of one step, N of 16): one tile is still kept
    assert _pruned("ieee", 6, 1, 16, 64) == [(16, 16, 4, 1)]
