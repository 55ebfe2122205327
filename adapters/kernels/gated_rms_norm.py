"""Gated DeltaNet output norm in one launch: w * rmsnorm(x) * silu(gate), per value head row, taking
the recurrence's fp32 output directly (the cast to the model dtype happens inside).

Shape legend: R rows (decode rows x value heads, B * Nv), D value head dim (128 in Qwen3.5), T tokens, Nv value
heads (R = T * Nv).

The gate is read through its strides where it is a [T, Nv, D] view with unit column stride (the z columns of the
stacked qkvz projection's output, whose rows are C + Nv*D wide): no copy into a contiguous [R, D] first (one
[T, Nv*D] copy a GDN layer: 2.5 ms of an 8k prefill's 30 layers on the H100, and a launch per layer of the decode
step).

Numerics equal adapters/torch_exec/norms.py `gated_rms_norm(x.to(dtype), gate, weight, eps)` rounding
point for rounding point: x rounded to dtype, statistics in fp32, the normalised row rounded to dtype,
times w (rounded to dtype when w is in dtype, as a torch product of two dtype tensors is), times
silu(gate) in fp32, one final cast. Only the sum of squares is reduced in the kernel's own order.
Graph-capturable: no host sync, grid (R,).
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.pdl import enabled as pdl_enabled
from adapters.kernels.pdl import let_next_start


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, D, eps, stride_gt, stride_gh, HEADS: tl.constexpr,
                           W_IN_DTYPE: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:  # pdl.py: a PDL-launched kernel after this one may start its pre-wait part
        let_next_start()
    row = tl.program_id(0).to(tl.int64)
    g_row = g_ptr + (row // HEADS) * stride_gt + (row % HEADS) * stride_gh  # token row // Nv, head row % Nv
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(dt).to(tl.float32)  # the caller's .to(dtype)
    xn = (x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)).to(dt).to(tl.float32)
    y = xn * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if W_IN_DTYPE:
        y = y.to(dt).to(tl.float32)
    g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
    y = y * (g / (1.0 + tl.exp(-g)))  # silu in fp32
    tl.store(out_ptr + row * D + offs, y.to(dt), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """w * rmsnorm(x.to(dtype)) * silu(gate) -> [..., D] in dtype (default x.dtype).

    x [..., D] (fp32 from the recurrence, or already in dtype); gate same shape (any float dtype; a [T, Nv, D]
    view with unit column stride is read in place, any other layout copied contiguous first);
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
    x2 = x.reshape(-1, d).contiguous()  # a no-op when contiguous
    if gate.dim() == 3 and gate.stride(2) == 1:  # [T, Nv, D] rows of any stride: read in place
        g2, heads, strides = gate, gate.shape[1], (gate.stride(0), gate.stride(1))
    else:
        g2 = gate.reshape(-1, d).contiguous()
        heads, strides = 1, (d, 0)
    rows = x2.shape[0]
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous(), "out must match x in dtype"
    if rows:
        _gated_rms_norm_kernel[(rows,)](x2, g2, weight, out, d, eps, *strides, HEADS=max(1, heads),
                                        W_IN_DTYPE=weight.dtype == dtype,
                                        BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 256 else 4,
                                        USE_GDC=pdl_enabled(x2))
    return out
