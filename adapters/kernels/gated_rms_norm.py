"""Gated DeltaNet output norm in one launch: w * rmsnorm(x) * silu(gate), per value head row, taking
the recurrence's fp32 output directly (the cast to the model dtype happens inside).

Shape legend: R rows (decode rows x value heads, B * Nv), D value head dim (128 in Qwen3.5).

Numerics equal adapters/torch_exec/norms.py `gated_rms_norm(x.to(dtype), gate, weight, eps)` rounding
point for rounding point: x rounded to dtype, statistics in fp32, the normalised row rounded to dtype,
times w (rounded to dtype when w is in dtype, as a torch product of two dtype tensors is), times
silu(gate) in fp32, one final cast. Only the sum of squares is reduced in the kernel's own order.
Graph-capturable: no host sync, grid (R,).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, D, eps, W_IN_DTYPE: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(dt).to(tl.float32)  # the caller's .to(dtype)
    xn = (x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)).to(dt).to(tl.float32)
    y = xn * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if W_IN_DTYPE:
        y = y.to(dt).to(tl.float32)
    g = tl.load(g_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    y = y * (g / (1.0 + tl.exp(-g)))  # silu in fp32
    tl.store(out_ptr + row * D + offs, y.to(dt), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """w * rmsnorm(x.to(dtype)) * silu(gate) -> [..., D] in dtype (default x.dtype).

    x [..., D] (fp32 from the recurrence, or already in dtype); gate same shape (any float dtype);
    weight [D] in dtype or fp32. out: optional contiguous preallocated result.
    Raises ValueError on mismatched shapes or dtypes.
    """
    dtype = x.dtype if dtype is None else dtype
    d = x.shape[-1]
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    if weight.shape != (d,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{d}], got {tuple(weight.shape)}")
    if weight.dtype not in (dtype, torch.float32):
        raise ValueError(f"weight must be {dtype} or fp32, got {weight.dtype}")
    x2, g2 = x.reshape(-1, d).contiguous(), gate.reshape(-1, d).contiguous()  # no-ops when contiguous
    rows = x2.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous(), "out must match x in dtype"
    if rows:
        _gated_rms_norm_kernel[(rows,)](x2, g2, weight, out, d, eps, W_IN_DTYPE=weight.dtype == dtype,
                                        BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4)
    return out
