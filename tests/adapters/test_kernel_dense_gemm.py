"""Tensor-core dense GEMM (prefill rows) against the reference dequantization and qlinear, every quantized
format (Triton's interpreter on the CPU, with fp32 dot operands; compiled on a GPU host).

Bounds: fp32 activations 1e-5 relative (exact fp32 products, reordered sums); bf16 activations 8e-3 (one
rounding of the output to bf16; the interpreter truncates instead of rounding, which doubles it).
"""

import pytest
import torch

from adapters.checkpoint.quant import QTensor, dequantize, qlinear
from adapters.checkpoint.quantize import quantize
from adapters.kernels.dense_gemm import SUPPORTED, dense_gemm, m_bucket, supports
from domain.model_spec import WeightFormat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = sorted(SUPPORTED, key=lambda f: f.value)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def _case(fmt, rows, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    q = quantize(torch.randn(n, k, generator=gen) * 0.05, fmt)
    x = torch.randn(rows, k, generator=gen)
    return x, q


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_dense_gemm_matches_the_reference_in_fp32(fmt):
    # M=37 (three 16-row tiles, the last partial), N=200 (a partial 64-column tile), K=384 (three
    # 128-column steps, three scale blocks)
    x, q = _case(fmt, 37, 200, 384, seed=1)
    out = torch.full((37, 200), float("nan"), device=DEVICE)  # an unwritten element fails below
    dense_gemm(x.to(DEVICE), q.to(DEVICE), out=out)
    assert torch.isfinite(out).all()
    assert _err(out, x.double() @ dequantize(q, torch.float64).T) < 1e-5


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_dense_gemm_ragged_k_and_small_tiles(fmt):
    # K=320: a partial last K step (and a partial 128-column scale block for block FP8); 32x32 tiles give
    # a 2 x 3 program grid that the GROUP_M ordering has to cover exactly once
    x, q = _case(fmt, 40, 96, 320, seed=2)
    out = dense_gemm(x.to(DEVICE), q.to(DEVICE), block_m=32, block_n=32)
    assert _err(out, x.double() @ dequantize(q, torch.float64).T) < 1e-5


@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.INT8_CHANNEL, WeightFormat.NVFP4],
                         ids=lambda f: f.value)
def test_dense_gemm_bf16_activations_match_qlinear(fmt):
    x, q = _case(fmt, 24, 136, 256, seed=3)
    xb = x.bfloat16().to(DEVICE)
    out = dense_gemm(xb, q.to(DEVICE))
    assert out.dtype == torch.bfloat16
    exact = xb.double().cpu() @ dequantize(q, torch.float64).T
    assert _err(out, exact) < 8e-3
    assert _err(out, qlinear(xb, q.to(DEVICE))) < 8e-3


def test_dense_gemm_writes_into_a_strided_out_and_handles_zero_rows():
    x, q = _case(WeightFormat.FP8_CHANNEL, 17, 64, 128, seed=4)
    wide = torch.full((17, 100), float("nan"), device=DEVICE)
    dense_gemm(x.to(DEVICE), q.to(DEVICE), out=wide[:, 10:74])
    assert torch.isnan(wide[:, :10]).all() and torch.isnan(wide[:, 74:]).all()
    assert _err(wide[:, 10:74], x.double() @ dequantize(q, torch.float64).T) < 1e-5
    assert dense_gemm(x[:0].to(DEVICE), q.to(DEVICE)).shape == (0, 64)


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
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            dense_gemm(*args, **kwargs)


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
    warps and stages; on a GPU each tile is launched as tuned, so a tile the compiler gets wrong is named."""
    from adapters.kernels.dense_gemm import FMA_TILES, TUNE_TILES
    x, q = _case(fmt, 40, 48, 320, seed=6)
    x, q = x.to(act).to(DEVICE), q.to(DEVICE)
    exact = x.double().cpu() @ dequantize(q.to("cpu"), torch.float64).T
    tiles = FMA_TILES if act == torch.float32 else TUNE_TILES
    if DEVICE != "cuda":
        tiles = sorted({(bm, bn, 4, None) for bm, bn, _, _ in tiles})
    bad = {}
    for bm, bn, warps, stages in tiles:
        out = torch.full((40, 48), float("nan"), dtype=act, device=DEVICE)
        dense_gemm(x, q, out=out, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        err = _err(out, exact)
        if not err < (1e-5 if act == torch.float32 else 8e-3):
            bad[(bm, bn, warps, stages)] = err
    assert not bad, f"tiles off the reference: {bad}"


def _pruned(prec, fmt, m_bucket, n, k):
    from adapters.kernels import dense_gemm as dg
    kept = dg._prune(dg._TUNED.configs, {"M_BUCKET": m_bucket}, PRECISION=prec, FMT=fmt, N=n, K=k)
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]


def test_autotune_tries_only_tiles_that_fit_the_shape_and_the_registers():
    from adapters.kernels.dense_gemm import FMA_TILES, TUNE_TILES
    # served shape, bf16: every tensor-core tile (none spills at sm_90)
    assert _pruned("tf32", 1, 4096, 4096, 2048) == list(TUNE_TILES)
    # fp32 activations: FMA loops, only the small FMA tiles (the tensor-core ones spill 3-24 KB per thread)
    assert _pruned("ieee", 1, 4096, 4096, 2048) == list(FMA_TILES)
    # 4-bit weights: no 128-column tile on 4 warps (128 dequantized elements per thread spill)
    fp4 = _pruned("tf32", 6, 4096, 4096, 2048)
    assert (128, 128, 8, 3) in fp4 and not [t for t in fp4 if t[1] == 128 and t[2] == 4]
    # a few rows, narrow N, two K steps: no tile taller than 16 rows or wider than 64 columns, <= 2 stages
    small = _pruned("tf32", 1, 8, 48, 256)
    assert small and all(bm == 16 and bn <= 64 and st <= 2 for bm, bn, _, st in small)
    assert len(set(small)) == len(small)
    # nothing fits (K of one step, N of 16): one tile is still kept
    assert _pruned("ieee", 6, 1, 16, 64) == [(16, 16, 4, 1)]
