"""Dense projections for prefill and mixed steps (any row count): the quantized weight is read by a Triton
kernel that dequantizes in registers, never materialised (qlinear, the reference, dequantizes whole K
blocks per call). The decode buckets use it too on CUDA (the split-K GEMM for buckets of several rows).

Shape legend: M rows (tokens), I in features, O out features.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from adapters.checkpoint.quant import QTensor, qlinear
from adapters.kernels import dense_gemm as gemm
from adapters.kernels import dense_gemm_splitk as splitk
from adapters.kernels import dense_gemv as gemv
from adapters.kernels.act_quant_fp8 import act_quant_fp8
from adapters.kernels.dequant_tile import A8_FORMATS
from adapters.kernels.dequant_weight import dequant_weight
from adapters.kernels.packed_gemv import FORMAT_CODES

# Which kernel a quantized projection of M rows takes. Without the split-K GEMM: the GEMV (one weight pass per row,
# re-read from L2) for few rows, the tensor-core GEMM (dense_gemm, whose tile is mostly padding at decode M: tl.dot
# needs 16 rows) above. Measured on the H200 at the Qwen3.6 block-FP8 shapes (GEMV / GEMM in us,
# docs/bench/2026-12-04-bench-kernels-h200-splitk-crossover.json): K = 2048 (qkv/qkvz) 13.6 / 15.5 at 2 rows,
# 24.7 / 15.4 at 4; K = 4096 (o/out projections) 9.3 / 13.9 at 4 rows, 15.8 / 14.1 at 8.
GEMV_MAX_ROWS = 8  # K <= 2048: GEMV up to 3 rows; wider K: GEMV up to 8 rows
GEMV_MAX_ROWS_NARROW_K = 3
# The split-K GEMM (dense_gemm_splitk) takes SPLITK_GEMV_MAX_ROWS + 1 .. SPLITK_MAX_ROWS rows (0: none), the GEMV
# only up to SPLITK_GEMV_MAX_ROWS. Why: dense_gemm is bound by its serial K loop at decode M (~0.8-1.1 us a
# 128-column step whatever the rows), the GEMV's time grows with the rows, and the split-K GEMM reads the weight
# once on S times the programs: split-K / GEMV / GEMM in us at qkvz (12288 x 2048) 14.6 / 24.7 / 15.4 at 4 rows,
# 14.9 / 92.1 / 15.7 at 16, 25.6 / 182 / 24.7 at 32; at out (2048 x 4096) 7.7 / 9.3 / 13.9 at 4 rows, 8.3 / 29.3 /
# 14.2 at 16, 11.6 / 56.1 / 16.3 at 32; at 2 rows the GEMV is faster everywhere (the same record). The decode step
# with it (bench_decode, graph replay; docs/bench/2026-12-04-bench-decode-h200-splitk-pairs-ab.json): bs4
# 4.38 -> 4.10 ms, bs16 8.86 -> 8.61 ms, bs1 unchanged. Through HTTP it has not been measured alone: with the
# per-pair GEMVs' pair buckets also on, the resident ladder's c8/c16 TTFT doubled (docs/fast-decode.md, session 19),
# so those are off (packed_gemv.PAIRS_BUCKET_MAX) and this one is on, pending the A/B that separates the two.
SPLITK_MAX_ROWS = 32  # decode buckets and short prefill steps; a power of two, so an M bucket takes one kernel
SPLITK_GEMV_MAX_ROWS = 2


def _dequant_rows(value: str) -> int:
    """FLUXTIDE_PREFILL_DEQUANT_ROWS: a whole number of rows >= 0 (0: off); anything else is refused, as the other
    FLUXTIDE_PREFILL_* settings are (dequant_tile._w_lhs_tuning). ValueError."""
    if not value.isdigit():
        raise ValueError(f"FLUXTIDE_PREFILL_DEQUANT_ROWS must be a row count >= 0 (0: off), got {value!r}")
    return int(value)


# Chunks of at least this many rows (on CUDA, float activations) dequantize the weight into a scratch copy
# (dequant_weight: ~1 ms of HBM traffic for all of Qwen3.6's dense weights) and run cuBLAS on it: at prefill sizes
# dense_gemm reached ~35 % of the H100's bf16 peak (60.8 ms of the 8k chunk; docs/prefill-kernels.md). The copy
# rounds as the W_LHS tiles and the reference do (quant.py `_dequant_cols`). On from 1,024 rows since session 30
# (H100, 2026-12-06): cuBLAS took each projection in ~half dense_gemm's time at 1k-16k rows, the copy included
# (docs/bench/2026-12-06-s30-h100-bench-kernels-dense-prefill.json), and the resident prefill went 28.0k -> 31.6k
# tok/s at 8k, 23.9k -> 26.4k at 32k. FLUXTIDE_PREFILL_DEQUANT_ROWS=0 turns it off (the plan then holds no copy).
DEQUANT_MIN_ROWS = _dequant_rows(os.environ.get("FLUXTIDE_PREFILL_DEQUANT_ROWS", "1024"))


def use_gemv(rows: int, in_features: int) -> bool:
    """True when the GEMV is the faster kernel for `rows` rows of a matrix with in_features columns."""
    if SPLITK_MAX_ROWS > SPLITK_GEMV_MAX_ROWS:  # the split-K GEMM beats the GEMV from 3 rows at every shape
        return rows <= SPLITK_GEMV_MAX_ROWS
    return rows <= (GEMV_MAX_ROWS_NARROW_K if in_features <= 2048 else GEMV_MAX_ROWS)


def use_splitk(rows: int, w: QTensor) -> bool:
    """True when `rows` rows of w go to the split-K GEMM (bf16/fp16/fp32 activations; the FP8-activation GEMM
    keeps dense_gemm)."""
    return SPLITK_GEMV_MAX_ROWS < rows <= SPLITK_MAX_ROWS and splitk.supports(w, rows)


def use_dequant(rows: torch.Tensor) -> bool:
    """True when the rows [M, I] of a quantized projection go through a dequantized copy and cuBLAS
    (DEQUANT_MIN_ROWS; any format dense_gemm reads)."""
    return rows.is_cuda and 0 < DEQUANT_MIN_ROWS <= rows.shape[0]


def a8_weight(w: torch.Tensor | QTensor) -> bool:
    """True when w is a weight the W8A8 GEMM reads (FP8 block, tensor or channel scales; ADR 0018)."""
    return isinstance(w, QTensor) and gemm.supports(w) and FORMAT_CODES[w.fmt] in A8_FORMATS


def prefill_linear(x: torch.Tensor, w: torch.Tensor | QTensor, a8: bool = False) -> torch.Tensor:
    """x [..., I] @ w^T -> [..., O] in x.dtype, fp32 accumulation.

    Float weights (tensors or bf16-format QTensors): F.linear / qlinear. Quantized: dense_gemv for the few rows
    (use_gemv) in a format it reads, cuBLAS over a dequantized copy for chunks of DEQUANT_MIN_ROWS rows or more
    on CUDA (use_dequant), the split-K GEMM for decode row counts (use_splitk), else the tensor-core dense_gemm
    (every quantized format).
    a8: the GEMM's rows quantized to e4m3 per 128 columns first (act_quant_fp8) and multiplied on FP8 tensor
    cores, for FP8 weights (a8_weight; others ignore it): --prefill-fp8-activations, ADR 0018.
    Raises ValueError when x's last dimension is not I.
    """
    if not isinstance(w, QTensor):
        return F.linear(x, w)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"prefill_linear: x has {x.shape[-1]} features, weight expects {w.shape[1]}")
    if not gemm.supports(w):
        return qlinear(x, w)
    rows = x.reshape(-1, w.shape[1])  # [M, I]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if use_gemv(rows.shape[0], w.shape[1]) and gemv.supports(w):
        out = gemv.dense_gemv(rows, w)  # [M, O]
    elif a8 and a8_weight(w):
        out = gemm.dense_gemm(act_quant_fp8(rows), w, out_dtype=x.dtype)  # [M, O]
    elif use_dequant(rows):  # the scratch is the caching allocator's: one block reused layer after layer
        out = F.linear(rows, dequant_weight(w, torch.empty(w.shape, dtype=rows.dtype, device=rows.device)))
    elif use_splitk(rows.shape[0], w):
        out = splitk.dense_gemm_splitk(rows, w)  # [M, O]
    else:
        out = gemm.dense_gemm(rows, w)  # [M, O]
    return out.reshape(*x.shape[:-1], w.shape[0])
