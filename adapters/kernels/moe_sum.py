"""The ordered top-k sum after moe_down's partials: out[t] = ((0 + y[t, 0]) + y[t, 1]) + ... in fp32,
cast once. One fixed order whatever produced the partials (one launch, or groups of experts when the
pool is smaller than a chunk's experts), so results are bitwise the same at any expert-slot count.

Shape legend: T tokens, K top-k (incl. a resident shared expert), H hidden.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(K):  # NOTE: k = 0..K-1 in order, the order moe_down's partials are defined in
        acc += tl.load(y_ptr + (t * K + k).to(tl.int64) * H + n, mask=mask, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] (any float dtype) = sum over k of y [T, K, H] fp32, in order. Raises ValueError on
    mismatched shapes."""
    if y.dim() != 3 or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"y must be contiguous fp32 [T, K, H], got {y.dtype} {tuple(y.shape)}")
    t, k, h = y.shape
    if out.shape != (t, h) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{t}, {h}], got {tuple(out.shape)}")
    if t:
        _moe_sum_kernel[(t, triton.cdiv(h, 1024))](y, out, h, K=k, BLOCK=1024)
    return out
