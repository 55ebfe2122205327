"""Dense quantized GEMM for prefill rows: y = x @ dequant(W)^T on tensor cores, W dequantized one
[BLOCK_N, BLOCK_K] tile at a time in registers (no dequantized copy of W is ever written to memory).

Shape legend: M rows of x (prefill tokens), K in features, N out features.
  x [M, K] bf16/fp16/fp32; W a QTensor [N, K] (adapters/checkpoint/quant.py); y [M, N] in x.dtype.
Formats: FP8_BLOCK (fp32 scale per 128x128 block), FP8_TENSOR, FP8_CHANNEL, INT8_CHANNEL, NVFP4, MXFP4
(dequant_tile.py says how each is split between the operand tile and fp32 scales); float weights belong
to F.linear. Each program owns a [BLOCK_M, BLOCK_N] tile of y and runs BLOCK_K = 128 columns per step
(one block-FP8 scale per step), fp32 accumulation, operands in x.dtype (weights converted in registers:
exactly, see dequant_tile.py). Programs are ordered in groups of GROUP_M row tiles so a weight tile is
reused from L2 by the row tiles that need it. Small M (decode) belongs to dense_gemv.

W_LHS (constexpr; bf16/fp16 activations only, never the A8 path): the program computes the transposed tile
acc_t [BLOCK_N, BLOCK_M] = w @ x^T with the converted weight tile as the dot's LEFT operand and stores it
transposed (the same y). Why: as the right operand, Triton writes the converted tile back to shared memory for
the sm_90 wgmma and waits for each wgmma at once (and block FP8's per-step `dot * scale` forces that wait too);
as the left operand the tile stays in registers (the wgmma A operand) and each wgmma is waited for one K step
later, so the tensor cores overlap the next step's loads and conversion (compile evidence:
docs/prefill-kernels.md, "Weight as the left operand"). It also gives small BLOCK_M a wgmma (BLOCK_N is its M).
Numerics: under W_LHS the block-FP8 scale is folded into the tile in fp32 before the cast to x.dtype, i.e. the
weight is rounded once to x.dtype exactly as the reference dequantizes it (quant.py `_dequant_cols`, what qlinear
multiplies by); the other formats' tiles and row scales are the same in both arrangements. The autotuner tries
W_LHS_TILES next to TUNE_TILES; fixed-tile launches (the interpreter) take w_lhs=False unless asked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.quant import QTensor
from adapters.kernels.act_quant_fp8 import GROUP as A8_GROUP
from adapters.kernels.act_quant_fp8 import Fp8Rows
from adapters.kernels.dequant_tile import (
    A8_FORMATS,
    W_LHS_TUNING,
    a8_dot_step,
    block_scale,
    check_w_lhs,
    dot_modes,
    fp8_rows,
    fp8_tile,
    prune_tiles,
    row_scale,
    row_scale_t,
    weight_step,
)
from adapters.kernels.packed_gemv import FORMAT_CODES, SCALE_GROUP
from domain.model_spec import WeightFormat

BLOCK_K = 128  # one 128x128 block-FP8 scale per K step; a whole number of 4-bit scale groups
SUPPORTED = tuple(f for f in FORMAT_CODES if f != WeightFormat.BF16)


# NOTE: M and M_BUCKET are not specialized (Triton would compile a variant for M == 1 and for M % 16 == 0):
# they only bound the row mask, so one binary serves every row count (the arithmetic is the same)
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _dense_gemm_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, g_ptr, y_ptr, M, M_BUCKET, stride_xm, stride_ym,
                       N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                       F32_DOT: tl.constexpr, PRECISION: tl.constexpr, A8: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, W_LHS: tl.constexpr):
    # M_BUCKET: only an autotune key (a power of two near M), so a new prompt length does not re-tune
    # W_LHS: the transposed tile acc [BN, BM] with the weight as the dot's left operand (module docstring)
    tl.static_assert(not (W_LHS and A8), "W_LHS is the bf16/fp16-activation path")
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    # NOTE: GROUP_M row tiles walk the N tiles together: their weight tiles are read once into L2
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok = m < M
    # the tile in the arrangement of its dot: [BM, BN], or transposed [BN, BM] under W_LHS
    if W_LHS:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        s = 1.0
        if FMT == 1:
            s = block_scale(s_ptr, pid_n * BLOCK_N, k0, K, GROUP)
        if A8:  # e4m3 x e4m3; each step's sum times the rows' group scale (BLOCK_K = 128 = the group)
            a = fp8_rows(x_ptr.to(tl.pointer_type(tl.uint8)) + m.to(tl.int64) * stride_xm, kk,
                         m_ok[:, None] & (kk < K)[None, :])  # [BM, BK]
            a_s = tl.load(xs_ptr + m.to(tl.int64) * ((K + BLOCK_K - 1) // BLOCK_K) + k0 // BLOCK_K, mask=m_ok,
                          other=0.0)[:, None]  # [BM, 1]
            acc = a8_dot_step(acc, a, fp8_tile(w_ptr, n, k0, N, K, BLOCK_N, BLOCK_K), a_s * s, F32_DOT)
        else:
            a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)  # [BM, BK]
            # W_LHS: block-FP8 scale folded into the tile, no per-step product on the dot's result
            acc = weight_step(acc, a, w_ptr, s_ptr, n, k0, s, N, K, FMT, GROUP, BLOCK_N, BLOCK_K,
                              x_ptr.dtype.element_ty, F32_DOT, PRECISION, W_LHS)
    if W_LHS:
        acc = row_scale_t(acc, s_ptr, g_ptr, n, N, FMT)  # [BN, BM]
        tl.store(y_ptr + m[None, :].to(tl.int64) * stride_ym + n[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[None, :] & (n < N)[:, None])
    else:
        acc = row_scale(acc, s_ptr, g_ptr, n, N, FMT)
        tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & (n < N)[None, :])


# (BLOCK_M, BLOCK_N, num_warps, num_stages), measured per (M bucket, N, K, format, x dtype) on CUDA before use;
# BLOCK_N <= 128 keeps a block-FP8 scale one scalar per step. The interpreter runs the launcher default.
# TUNE_TILES: tensor-core tiles (bf16/fp16 activations). FMA_TILES: fp32 activations, whose "ieee" dots are FMA
# loops unrolled over BLOCK_K = 128: at most 4 accumulators per thread (sm_90, Triton 3.6 ptxas: the tensor-core
# tiles spill 3-24 KB of stack per thread there, 100-300 B for these; scripts/compile_probe.py --act fp32).
TUNE_TILES = ((128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4), (64, 64, 4, 4), (32, 128, 4, 4),
              (16, 128, 4, 4), (16, 64, 4, 5), (16, 32, 4, 6), (16, 16, 4, 8))  # narrow N: more programs at small M
FMA_TILES = ((16, 16, 4, 3), (16, 32, 4, 3), (16, 64, 8, 3), (32, 32, 8, 3))
# W_LHS_TILES: tensor-core tiles computed transposed, the weight tile the wgmma A operand (module docstring):
# BLOCK_N >= 64 (the wgmma M), any BLOCK_M as its N. Tried next to TUNE_TILES (config kwarg W_LHS; a separate
# list because scripts unpack TUNE_TILES as 4-tuples); never for fp32 (FMA) or e4m3 (A8) activations.
W_LHS_TILES = ((128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 4, 3), (32, 128, 4, 4), (16, 128, 4, 4))


def tune_configs(w_lhs: bool = W_LHS_TUNING) -> list:
    """The autotuned configs: TUNE_TILES and FMA_TILES, and the W_LHS_TILES when w_lhs (by default, unless
    FLUXTIDE_PREFILL_W_LHS=0: dequant_tile.W_LHS_TUNING)."""
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": BLOCK_K, "GROUP_M": 8, "W_LHS": lhs},
                          num_warps=w, num_stages=st)
            for tiles, lhs in ((TUNE_TILES + FMA_TILES, False), (W_LHS_TILES if w_lhs else (), True))
            for bm, bn, w, st in tiles]


def _prune(configs, named_args, **kwargs):
    """early_config_prune: dequant_tile.prune_tiles for this call's shape (M bucket, N, K, format, dot mode)."""
    return prune_tiles(configs, set(FMA_TILES), fma=kwargs["PRECISION"] == "ieee", fmt=kwargs["FMT"],
                       block_m=None, n_cols=kwargs["N"], k_cols=kwargs["K"], m_cap=named_args["M_BUCKET"],
                       a8=bool(kwargs.get("A8", False)))


_TUNED = triton.autotune(
    configs=tune_configs(),
    key=["M_BUCKET", "N", "K", "FMT", "A8"],
    prune_configs_by={"early_config_prune": _prune},
    cache_results=True,  # a restart on this machine reads the tunings from Triton's cache dir
)(_dense_gemm_kernel)


def supports(q: QTensor) -> bool:
    """True when dense_gemm reads q's format (every quantized format; float weights go to F.linear)."""
    return q.fmt in SUPPORTED


def m_bucket(m: int) -> int:
    """Autotune key for M rows: the next power of two, at most 4096 (bigger M tunes alike)."""
    return min(triton.next_power_of_2(max(m, 1)), 4096)


def check_weight(q: QTensor, where: str) -> None:
    """Refuses a weight format the tensor-core GEMMs (dense_gemm, dense_gemm_splitk) do not read. ValueError."""
    if q.fmt not in SUPPORTED:
        raise ValueError(f"{where} does not read {q.fmt.value} weights (float weights: F.linear; "
                         f"supported: {sorted(f.value for f in SUPPORTED)})")


def global_scale(q: QTensor) -> torch.Tensor:
    """The kernels' global-scale argument: NVFP4's fp32 scalar, else q.scale (a valid pointer never read: only
    FMT 5 loads it)."""
    return q.global_scale if q.global_scale is not None else q.scale


def check_placement(xq: torch.Tensor, q: QTensor, where: str) -> None:
    """Activation rows with unit column stride, the weight's data and scales contiguous, all on one device.
    ValueError."""
    if xq.stride(1) != 1 or not q.data.is_contiguous() or not q.scale.is_contiguous():
        raise ValueError(f"{where}: x rows, q.data and q.scale must be contiguous")
    if not xq.device == q.data.device == q.scale.device:
        raise ValueError(f"{where}: x on {xq.device}, weight on {q.data.device}, scale on {q.scale.device}")


def out_buffer(out: torch.Tensor | None, m: int, n: int, dtype: torch.dtype, device: torch.device,
               where: str) -> torch.Tensor:
    """The [M, N] output: `out` when it is `dtype` with unit column stride on `device`, a new one when None.
    ValueError otherwise."""
    if out is None:
        return torch.empty((m, n), dtype=dtype, device=device)
    if out.shape != (m, n) or out.dtype != dtype or out.stride(1) != 1 or out.device != device:
        raise ValueError(f"{where}: out must be {dtype} [{m}, {n}] with unit column stride on {device}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out


def dense_gemm(x: torch.Tensor | Fp8Rows, q: QTensor, out: torch.Tensor | None = None, block_m: int | None = None,
               block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None,
               out_dtype: torch.dtype = torch.bfloat16, w_lhs: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(q)[N, K]^T -> [M, N] in x.dtype, fp32 accumulation.

    x may be Fp8Rows (act_quant_fp8) for an FP8 block/tensor/channel weight: the W8A8 path, e4m3 x e4m3
    products, the result in out_dtype (ADR 0018).

    The weight is dequantized to x.dtype tile by tile (exact for bf16 activations); block/tensor/channel
    scales multiply fp32 partial sums. out: optional [M, N] x.dtype with unit column stride, written in
    place. block_m/block_n: a fixed tile (powers of two, 16 <= block_m, 16 <= block_n <= 128); None: on
    CUDA the measured best tile for this shape (triton.autotune), elsewhere 16 x 64. num_warps/num_stages:
    the fixed tile's launch options (num_stages None: Triton's default); ignored when autotuned.
    w_lhs: compute the tile transposed, the weight as the dot's left operand (module docstring; not with
    Fp8Rows); True always launches a fixed tile (the defaults above when block_m/block_n are None); the
    autotuner (w_lhs False, no tile given) measures both arrangements itself.
    Raises ValueError for float or unknown formats, mismatched shapes, dtypes or devices, bad tiles.
    """
    check_weight(q, "dense_gemm")
    a8 = isinstance(x, Fp8Rows)
    if a8:
        if FORMAT_CODES[q.fmt] not in A8_FORMATS:
            raise ValueError(f"dense_gemm: FP8 activations need an FP8 weight, got {q.fmt.value}")
        if x.q.shape[1] != q.shape[1] or x.scales.shape != (x.q.shape[0], -(-q.shape[1] // A8_GROUP)):
            raise ValueError(f"dense_gemm: Fp8Rows with q {tuple(x.q.shape)} and scales {tuple(x.scales.shape)} "
                             f"for a weight of {q.shape[1]} columns")
    elif x.dim() != 2 or x.shape[1] != q.shape[1] or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dense_gemm: x must be bf16/fp16/fp32 [M, {q.shape[1]}], got {x.dtype} {tuple(x.shape)}")
    xq, xs = (x.q, x.scales) if a8 else (x, x)  # without A8 the scale pointer is never read
    check_placement(xq, q, "dense_gemm")
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if block is not None and (block < 16 or block & (block - 1)):
            raise ValueError(f"dense_gemm: {name}={block} must be a power of two >= 16")
    if block_n is not None and block_n > 128:
        raise ValueError(f"dense_gemm: block_n={block_n} must be <= 128 (one block-FP8 scale per tile)")
    check_w_lhs(w_lhs, a8, "dense_gemm")
    m, (n, k) = x.shape[0], q.shape
    out = out_buffer(out, m, n, out_dtype if a8 else x.dtype, xq.device, "dense_gemm")
    if m == 0:
        return out
    args = (xq, xs, q.data, q.scale, global_scale(q), out, m, m_bucket(m), xq.stride(0), out.stride(0))
    consts = dict(N=n, K=k, FMT=FORMAT_CODES[q.fmt], GROUP=SCALE_GROUP.get(q.fmt, 1), A8=a8, **dot_modes(xq))
    if x.is_cuda and block_m is None and block_n is None and not w_lhs:
        _TUNED[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)](*args, **consts)
    else:
        bm, bn = block_m or 16, block_n or 64
        _dense_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
            *args, **consts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=8, W_LHS=w_lhs, num_warps=num_warps,
            **({} if num_stages is None else {"num_stages": num_stages}))
    return out
