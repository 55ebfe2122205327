"""Dense projections for prefill and mixed steps (any row count): the quantized weight is read by a Triton
kernel that dequantizes in registers, never materialised (qlinear, the reference, dequantizes whole K
blocks per call). With --prefill-kernels triton the decode step uses it too (tensor-core GEMM for
decode buckets of several rows); otherwise it keeps fast_decoder.fast_linear (GEMV only).

Shape legend: M rows (tokens), I in features, O out features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adapters.checkpoint.quant import QTensor, qlinear
from adapters.kernels import dense_gemm as gemm
from adapters.kernels import dense_gemv as gemv
from adapters.kernels.act_quant_fp8 import act_quant_fp8
from adapters.kernels.dequant_tile import A8_FORMATS
from adapters.kernels.packed_gemv import FORMAT_CODES

# Below these row counts the GEMV (one weight pass per row, re-read from L2) beats the tensor-core GEMM,
# whose tile is mostly padding (tl.dot needs 16 rows). Measured on the H200 at the Qwen3.6 block-FP8
# shapes (docs/bench/2026-12-01-bench-kernels-h200.json): K = 2048 (qkv/qkvz) GEMV 18.6 us vs GEMM 17.5 us
# at 4 rows; K = 4096 (o/out projections) GEMV 15.8 vs 23.9 us at 8 rows, 29.2 vs 25.3 us at 16.
GEMV_MAX_ROWS = 8  # K <= 2048: GEMV below 4 rows; wider K: GEMV up to 8 rows
GEMV_MAX_ROWS_NARROW_K = 3


def use_gemv(rows: int, in_features: int) -> bool:
    """True when the GEMV is the faster kernel for `rows` rows of a matrix with in_features columns."""
    return rows <= (GEMV_MAX_ROWS_NARROW_K if in_features <= 2048 else GEMV_MAX_ROWS)


def a8_weight(w: torch.Tensor | QTensor) -> bool:
    """True when w is a weight the W8A8 GEMM reads (FP8 block, tensor or channel scales; ADR 0018)."""
    return isinstance(w, QTensor) and gemm.supports(w) and FORMAT_CODES[w.fmt] in A8_FORMATS


def prefill_linear(x: torch.Tensor, w: torch.Tensor | QTensor, a8: bool = False) -> torch.Tensor:
    """x [..., I] @ w^T -> [..., O] in x.dtype, fp32 accumulation.

    Float weights (tensors or bf16-format QTensors): F.linear / qlinear. Quantized: dense_gemv for the few rows
    where it is faster (use_gemv) in a format it reads, else the tensor-core dense_gemm (every quantized format).
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
    else:
        out = gemm.dense_gemm(rows, w)  # [M, O]
    return out.reshape(*x.shape[:-1], w.shape[0])
