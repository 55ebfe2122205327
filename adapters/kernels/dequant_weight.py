"""Whole-matrix dequantization of a dense (non-expert) weight into a float buffer: out = dequant(W), for the
prefill's large chunks, whose dense projections then run on cuBLAS (prefill_linear.DEQUANT_MIN_ROWS says when).

Shape legend: N rows (out features), K columns (in features); W a QTensor [N, K] (adapters/checkpoint/quant.py),
out [N, K] bf16/fp16/fp32, written in place (a scratch buffer reused layer after layer).
Formats: every quantized format dense_gemm reads (packed_gemv.FORMAT_CODES 1-6). Values: the reference's
dequantization (quant.py `_dequant_cols`: the stored value times its scales in fp32, rounded once to out's
dtype); for FP8 (block, tensor, channel) and INT8 element for element, for NVFP4 the tile's group scale and the
global scale multiply in another order (fp32 rounding apart). Each program converts one [BLOCK_N, BLOCK_K] tile
through dequant_tile's device functions (the same tiles the GEMMs feed their tensor cores). Only experts must never
be materialised dequantized; a dense weight is copied into the scratch for one GEMM and overwritten by the next.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.quant import QTensor
from adapters.kernels.dense_gemm import check_weight, global_scale
from adapters.kernels.dequant_tile import block_scale, row_scale_t, w_tile_folded
from adapters.kernels.packed_gemv import FORMAT_CODES, SCALE_GROUP

BLOCK = 128  # one block-FP8 scale per tile; a whole number of 4-bit scale groups


@triton.jit
def _dequant_weight_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    kk = k0 + tl.arange(0, BLOCK_K)  # [BK]
    s = 1.0
    if FMT == 1:
        s = block_scale(s_ptr, pid_n * BLOCK_N, k0, K, GROUP)
    t = w_tile_folded(w_ptr, s_ptr, n, k0, s, N, K, FMT, GROUP, BLOCK_N, BLOCK_K, tl.float32)  # [BN, BK] fp32
    t = row_scale_t(t, s_ptr, g_ptr, n, N, FMT)  # tensor / channel / NVFP4 global scales
    tl.store(out_ptr + n[:, None].to(tl.int64) * K + kk[None, :], t.to(out_ptr.dtype.element_ty),
             mask=(n < N)[:, None] & (kk < K)[None, :])


def dequant_weight(q: QTensor, out: torch.Tensor) -> torch.Tensor:
    """Writes dequant(q) [N, K] into out (contiguous [N, K] bf16/fp16/fp32 on q's device) and returns it.

    Raises ValueError for float or unknown formats, a wrong out shape, dtype, layout or device."""
    check_weight(q, "dequant_weight")
    n, k = q.shape
    if out.shape != (n, k) or not out.is_contiguous() or out.dtype not in (torch.bfloat16, torch.float16,
                                                                            torch.float32):
        raise ValueError(f"dequant_weight: out must be contiguous bf16/fp16/fp32 [{n}, {k}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if not out.device == q.data.device == q.scale.device:
        raise ValueError(f"dequant_weight: out on {out.device}, weight on {q.data.device}, scale on {q.scale.device}")
    _dequant_weight_kernel[(triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))](
        q.data, q.scale, global_scale(q), out, N=n, K=k, FMT=FORMAT_CODES[q.fmt], GROUP=SCALE_GROUP.get(q.fmt, 1),
        BLOCK_N=BLOCK, BLOCK_K=BLOCK, num_warps=8)
    return out
