"""Dense quantized GEMV for decode batches: y = x @ dequant(W)^T, dequantizing one K block at a time
in registers (no dequantized copy of W is ever written to memory).

Shape legend: M rows of x (decode batch, small), K in features, N out features, G scale block (128).

Formats (adapters/checkpoint/quant.py canonical forms): FP8_BLOCK (e4m3 data, fp32 scale per 128x128
block), FP8_TENSOR (one fp32 scale), FP8_CHANNEL and INT8_CHANNEL (fp32 scale per output row); the launcher
hands NVFP4 and MXFP4 to dense_gemv_fp4's kernel. Decode
is memory-bound: each program streams a [BLOCK_N, BLOCK_K] tile of W per step and reduces it against
one row of x with fp32 accumulation; the weight is re-read per row of x, which stays in L2 for the
small M this kernel is for (prefill-sized M belongs to a tensor-core GEMM).
"""

import torch
import triton
import triton.language as tl

from adapters.checkpoint.quant import FP8_BLOCK, QTensor
from adapters.kernels import dense_gemv_fp4
from adapters.kernels.packed_gemv import check_dense_operands, untuned_block_n
from adapters.kernels.pdl import launch_args, prefetch_rows, wait_previous, weight_mode
from domain.model_spec import WeightFormat

# scale modes (tl.constexpr)
SCALE_BLOCK, SCALE_TENSOR, SCALE_ROW = 0, 1, 2
SUPPORTED = {WeightFormat.FP8_BLOCK: SCALE_BLOCK, WeightFormat.FP8_TENSOR: SCALE_TENSOR,
             WeightFormat.FP8_CHANNEL: SCALE_ROW, WeightFormat.INT8_CHANNEL: SCALE_ROW}


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, stride_xm, stride_ym,
                       scale_cols: tl.constexpr, SCALE_MODE: tl.constexpr, G: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = 0):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < N
    if USE_GDC:  # launched with PDL (pdl.py): the weight slice is static, ask L2 for it before x is ready
        if USE_GDC == 2 and row == 0:  # the other rows' programs read the same slice
            prefetch_rows(w_ptr, tl.minimum(offs_n, N - 1), K, 0, K)
        wait_previous()
    # NOTE: a tile that divides the matrix needs no masks, and a block-FP8 tile inside one scale row folds
    # its scales into x: the loop is one convert and one FMA per weight byte (see packed_gemv's note)
    EVEN: tl.constexpr = (N % BLOCK_N == 0) and (K % BLOCK_K == 0)
    # NOTE: a [BN, BK] fp32 accumulator, reduced once after the loop: each step is loads and FMAs only,
    # so several weight tiles can be in flight (decode GEMVs are bound by HBM latency x bytes in flight)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        mask_k = offs_k < K
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        if EVEN:
            x = tl.load(x_ptr + row * stride_xm + offs_k).to(tl.float32)  # [BK]
            w = tl.load(w_ptrs).to(tl.float32)  # [BN, BK]
        else:
            x = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BK]
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BN, BK]
        if SCALE_MODE == 0:  # block scales: BLOCK_K is a multiple of G, one scale per G columns
            if EVEN and BLOCK_N <= G:  # the tile lies in one scale row
                acc += w * (x * tl.load(s_ptr + (n0 // G) * scale_cols + offs_k // G))[None, :]
            else:
                s = tl.load(s_ptr + (offs_n // G)[:, None] * scale_cols + (k0 // G + tl.arange(0, BLOCK_K // G))[None, :],
                            mask=mask_n[:, None] & ((k0 // G + tl.arange(0, BLOCK_K // G)) < scale_cols)[None, :],
                            other=0.0)  # [BN, BK/G]
                prod = tl.reshape(w * x[None, :], (BLOCK_N, BLOCK_K // G, G)) * s[:, :, None]
                acc += tl.reshape(prod, (BLOCK_N, BLOCK_K))
        else:
            acc += w * x[None, :]
    out = tl.sum(acc, axis=1)  # [BN]
    if SCALE_MODE == 1:
        out = out * tl.load(s_ptr)
    if SCALE_MODE == 2:
        out = out * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(y_ptr + row * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=mask_n)


# On CUDA the tile is chosen per shape by measurement (once, in the warm-up before graph capture);
# the interpreter runs the one default tile.
_TUNED = triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
             for bn, bk, w, st in ((16, 128, 4, 1), (16, 256, 4, 3), (8, 512, 4, 3), (16, 512, 8, 3),
                                   (4, 1024, 4, 3), (8, 1024, 8, 2), (32, 256, 8, 3))],
    key=["N", "K", "SCALE_MODE"],
    cache_results=True,  # a restart on this machine reads the tunings from Triton's cache dir
)(_dense_gemv_kernel)


def supports(q: QTensor) -> bool:
    """True for the formats dense_gemv reads: the 8-bit ones here, NVFP4 and MXFP4 through dense_gemv_fp4."""
    return q.fmt in SUPPORTED or q.fmt in dense_gemv_fp4.GROUPS


def dense_gemv(x: torch.Tensor, q: QTensor, out: torch.Tensor | None = None, block_n: int | None = None,
               block_k: int | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ q[N, K]^T -> [M, N] in x.dtype, fp32 accumulation.

    block_n/block_k: a fixed tile (block_k a multiple of the 128-column scale block); None: on CUDA the
    measured best tile for this shape (triton.autotune), elsewhere 16 x 128.
    NVFP4/MXFP4 weights go to dense_gemv_fp4 (its own kernel; block_k a multiple of the format's group there).
    Raises ValueError for unsupported formats or mismatched shapes.
    """
    if q.fmt in dense_gemv_fp4.GROUPS:
        return dense_gemv_fp4.dense_gemv_fp4(x, q, out=out, block_n=block_n, block_k=block_k)
    if q.fmt not in SUPPORTED:
        raise ValueError(f"dense_gemv does not read {q.fmt.value} weights (supported: "
                         f"{sorted(f.value for f in SUPPORTED)})")
    check_dense_operands(x, q)
    mode = SUPPORTED[q.fmt]
    if block_k is not None and mode == SCALE_BLOCK and block_k % FP8_BLOCK:
        raise ValueError(f"block_k {block_k} must be a multiple of the scale block {FP8_BLOCK}")
    m, (n, k) = x.shape[0], q.shape
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1, f"out must be [{m}, {n}] with unit column stride"
    if m == 0:
        return out
    args = (x, q.data, q.scale, out, n, k, x.stride(0), out.stride(0), q.scale.shape[1])
    consts = dict(SCALE_MODE=mode, G=FP8_BLOCK, **launch_args(weight_mode(x)))
    if x.is_cuda and block_n is None and block_k is None:
        _TUNED[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), m)](*args, **consts)
    else:
        bn, bk = block_n or untuned_block_n(n, x.is_cuda), block_k or 128
        _dense_gemv_kernel[(triton.cdiv(n, bn), m)](*args, **consts, BLOCK_N=bn, BLOCK_K=bk)
    return out
