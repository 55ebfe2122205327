"""Dense quantized GEMV for decode batches: y = x @ dequant(W)^T, dequantizing one K block at a time
in registers (no dequantized copy of W is ever written to memory).

Shape legend: M rows of x (decode batch, small), K in features, N out features, G scale block (128).

Formats (adapters/checkpoint/quant.py canonical forms): FP8_BLOCK (e4m3 data, fp32 scale per 128x128
block), FP8_TENSOR (one fp32 scale), FP8_CHANNEL and INT8_CHANNEL (fp32 scale per output row). Decode
is memory-bound: each program streams a [BLOCK_N, BLOCK_K] tile of W per step and reduces it against
one row of x with fp32 accumulation; the weight is re-read per row of x, which stays in L2 for the
small M this kernel is for (prefill-sized M belongs to a tensor-core GEMM).
"""

import torch
import triton
import triton.language as tl

from adapters.checkpoint.quant import FP8_BLOCK, QTensor
from domain.model_spec import WeightFormat

# scale modes (tl.constexpr)
SCALE_BLOCK, SCALE_TENSOR, SCALE_ROW = 0, 1, 2
SUPPORTED = {WeightFormat.FP8_BLOCK: SCALE_BLOCK, WeightFormat.FP8_TENSOR: SCALE_TENSOR,
             WeightFormat.FP8_CHANNEL: SCALE_ROW, WeightFormat.INT8_CHANNEL: SCALE_ROW}


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_ym, scale_cols,
                       SCALE_MODE: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        mask_k = offs_k < K
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BK]
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)  # [BN, BK]
        if SCALE_MODE == 0:  # NOTE: BLOCK_K divides G, so one block's scale column per step
            s = tl.load(s_ptr + (offs_n // G) * scale_cols + k0 // G, mask=mask_n, other=0.0)  # [BN]
            acc += tl.sum(w * x[None, :], axis=1) * s
        else:
            acc += tl.sum(w * x[None, :], axis=1)
    if SCALE_MODE == 1:
        acc = acc * tl.load(s_ptr)
    if SCALE_MODE == 2:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def supports(q: QTensor) -> bool:
    return q.fmt in SUPPORTED


def dense_gemv(x: torch.Tensor, q: QTensor, out: torch.Tensor | None = None, block_n: int = 16,
               block_k: int = 128) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ q[N, K]^T -> [M, N] in x.dtype, fp32 accumulation.

    Raises ValueError for unsupported formats or mismatched shapes.
    """
    if q.fmt not in SUPPORTED:
        raise ValueError(f"dense_gemv does not read {q.fmt.value} weights (supported: "
                         f"{sorted(f.value for f in SUPPORTED)})")
    if x.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"x must be [M, {q.shape[1]}], got {tuple(x.shape)}")
    if x.stride(1) != 1 or not q.data.is_contiguous() or not q.scale.is_contiguous():
        raise ValueError("x rows, q.data and q.scale must be contiguous")
    mode = SUPPORTED[q.fmt]
    if mode == SCALE_BLOCK and FP8_BLOCK % block_k:
        raise ValueError(f"block_k {block_k} must divide the scale block {FP8_BLOCK}")
    m, (n, k) = x.shape[0], q.shape
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1, f"out must be [{m}, {n}] with unit column stride"
    if m == 0:
        return out
    grid = (triton.cdiv(n, block_n), m)
    _dense_gemv_kernel[grid](x, q.data, q.scale, out, n, k, x.stride(0), out.stride(0), q.scale.shape[1],
                             SCALE_MODE=mode, G=FP8_BLOCK, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
