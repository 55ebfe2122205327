"""Dense projections for prefill and mixed steps (any row count): the quantized weight is read by a Triton
kernel that dequantizes in registers, never materialised (qlinear, the reference, dequantizes whole K
blocks per call). The decode step keeps fast_decoder.fast_linear.

Shape legend: M rows (tokens), I in features, O out features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adapters.checkpoint.quant import QTensor, qlinear
from adapters.kernels import dense_gemm as gemm
from adapters.kernels import dense_gemv as gemv

# Up to this many rows the GEMV (one weight pass per row, re-read from L2) beats a tensor-core tile that
# is mostly padding (tl.dot needs 16 rows); an estimate for the H200, not measured.
GEMV_MAX_ROWS = 8


def prefill_linear(x: torch.Tensor, w: torch.Tensor | QTensor) -> torch.Tensor:
    """x [..., I] @ w^T -> [..., O] in x.dtype, fp32 accumulation.

    Float weights (tensors or bf16-format QTensors): F.linear / qlinear. Quantized: dense_gemv for at most
    GEMV_MAX_ROWS rows of a format it reads, else the tensor-core dense_gemm (every quantized format).
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
    if rows.shape[0] <= GEMV_MAX_ROWS and gemv.supports(w):
        out = gemv.dense_gemv(rows, w)  # [M, O]
    else:
        out = gemm.dense_gemm(rows, w)  # [M, O]
    return out.reshape(*x.shape[:-1], w.shape[0])
