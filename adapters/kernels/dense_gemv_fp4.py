"""Dense 4-bit GEMV for decode batches (NVFP4, MXFP4): y = x @ dequant(W)^T, each K step's nibbles decoded
in registers (packed_gemv.load_fp4_tile) and never written back.

Shape legend: M rows of x (decode batch, small), K in features, N out features, G scale group (16 for NVFP4,
32 for MXFP4).
Formats (canonical forms of adapters/checkpoint/quant.py): data uint8 [N, K/2], low nibble = even column;
NVFP4: scale e4m3 [N, K/16] and global_scale fp32 [1] (ModelOpt's weight_scale_2); MXFP4: scale uint8 e8m0
[N, K/32].
Why: without it the decode step ran the 4-bit attention and Gated DeltaNet projections through the tensor-core
dense_gemm at M = 1, 2,982 us of a 6.07 ms NVFP4 step (H200, docs/bench/2026-12-04-bench-decode-h200-nvfp4-
modelopt.json) where the 8-bit GEMVs of block FP8 took 586 us for twice the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.quant import MXFP4_GROUP, NVFP4_GROUP, QTensor
from adapters.kernels.packed_gemv import (
    FORMAT_CODES,
    check_dense_operands,
    load_fp4_tile,
    load_x,
    term,
    untuned_block_n,
)
from domain.model_spec import WeightFormat

GROUPS = {WeightFormat.NVFP4: NVFP4_GROUP, WeightFormat.MXFP4: MXFP4_GROUP}


@triton.jit
def _dense_gemv_fp4_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, stride_xm,
                           stride_ym, FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < N
    EVEN: tl.constexpr = (N % BLOCK_N == 0) and (K % BLOCK_K == 0)
    kk = tl.arange(0, BLOCK_K)
    gi = tl.arange(0, BLOCK_K // GROUP)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    # NOTE: a [BN, BK/G] accumulator of scaled group sums, reduced once after the loop (packed_gemv's term)
    acc = tl.zeros((BLOCK_N, BLOCK_K // GROUP), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, s = load_fp4_tile(w_ptr, s_ptr, n, n_ok, k0, gi, K, FMT, GROUP, EVEN, BLOCK_N, BLOCK_K)
        acc += term(w, load_x(x_row, k0, kk, K, EVEN), s, FMT, False, BLOCK_N, BLOCK_K, GROUP)
    out = tl.sum(acc, axis=1)  # [BN]
    if FMT == 5:  # NVFP4's global scale
        out = out * tl.load(gs_ptr)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + n, out.to(y_ptr.dtype.element_ty), mask=n_ok)


# On CUDA the tile is chosen per shape by measurement (in the warm-up before graph capture); BLOCK_K >= 256
# keeps a tile row at 128 bytes or more (16-byte loads). The interpreter runs the launcher's default tile.
_TUNED = triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
             for bn, bk, w, st in ((16, 256, 4, 3), (8, 512, 4, 3), (16, 512, 8, 3), (4, 1024, 4, 3),
                                   (32, 256, 8, 3), (8, 1024, 8, 2), (16, 256, 4, 1))],
    key=["N", "K", "FMT"],
    cache_results=True,
)(_dense_gemv_fp4_kernel)


def dense_gemv_fp4(x: torch.Tensor, q: QTensor, out: torch.Tensor | None = None, block_n: int | None = None,
                   block_k: int | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ q[N, K]^T -> [M, N] in x.dtype, fp32 accumulation, for NVFP4/MXFP4 q.

    block_n/block_k: a fixed tile (block_k a power of two and a multiple of the scale group); None: on CUDA
    the measured best tile for this shape (triton.autotune), elsewhere untuned_block_n x 256.
    Raises ValueError for other formats, mismatched shapes or a block_k the format cannot use.
    """
    if q.fmt not in GROUPS:
        raise ValueError(f"dense_gemv_fp4 reads nvfp4 and mxfp4 weights, not {q.fmt.value}")
    check_dense_operands(x, q)
    n, k = q.shape
    group = GROUPS[q.fmt]
    if block_k is not None and (block_k < group or block_k & (block_k - 1)):
        raise ValueError(f"block_k {block_k} must be a power of two and a multiple of the scale group {group}")
    gs = q.global_scale if q.fmt == WeightFormat.NVFP4 else q.scale  # MXFP4: an unread placeholder
    if q.fmt == WeightFormat.NVFP4 and gs.numel() != 1:
        raise ValueError(f"an nvfp4 global_scale holds one value, got {tuple(gs.shape)}")
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1, f"out must be [{m}, {n}] with unit column stride"
    if m == 0:
        return out
    args = (x, q.data, q.scale, gs.contiguous(), out, n, k, x.stride(0), out.stride(0))
    consts = dict(FMT=FORMAT_CODES[q.fmt], GROUP=group)
    if x.is_cuda and block_n is None and block_k is None:
        _TUNED[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), m)](*args, **consts)
    else:
        bn, bk = block_n or untuned_block_n(n, x.is_cuda), block_k or 256
        _dense_gemv_fp4_kernel[(triton.cdiv(n, bn), m)](*args, **consts, BLOCK_N=bn, BLOCK_K=bk)
    return out
