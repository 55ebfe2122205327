"""RMSNorm of the Qwen3 family, optionally fused with the residual add before it, in one launch.

Shape legend: R rows (tokens, or tokens x heads for q/k norms), D normalised width.

Numerics follow adapters/torch_exec/norms.py exactly: the residual sum is rounded to the activations'
dtype (as a torch add is), statistics in fp32; unit_offset (Qwen3.5) scales by (1 + w) in fp32 before
the cast, the plain form (Qwen3) casts first and multiplies by w in the activations' dtype.
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.pdl import enabled as pdl_enabled
from adapters.kernels.pdl import let_next_start


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, sum_ptr, out_ptr, out32_ptr, D, eps, HAS_RES: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, FP32_COPY: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_GDC: tl.constexpr = False):
    if USE_GDC:  # pdl.py: a PDL-launched kernel after this one may start its pre-wait part
        let_next_start()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * D + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    xn = xf * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        y = xn * (1.0 + w)
    else:
        y = xn.to(out_ptr.dtype.element_ty).to(tl.float32) * w
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + offs, y, mask=mask)
    if FP32_COPY:  # the rounded output widened, as out.float() would give it
        tl.store(out32_ptr + row * D + offs, y.to(tl.float32), mask=mask)


def norm_warps(d: int) -> int:
    """Warps per program for a row of d columns (4 up to 2048, else 8). The row statistics reduce in an
    order set by the warp count, so kernels that must give this kernel's bits (rms_norm_router) use it too."""
    return 4 if d <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool,
             residual: torch.Tensor | None = None, fp32_copy: bool = False) -> tuple[torch.Tensor, ...]:
    """(x + residual, norm(x + residual)) for x [..., D] (residual None: (x, norm(x))), in x.dtype.

    weight [D] (any float dtype). fp32_copy: also return norm(...).float() as a third tensor, written by
    the same launch (an fp32 router reads it without a cast kernel of its own).
    Raises ValueError on mismatched shapes.
    """
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    x2 = x.reshape(-1, d).contiguous()
    rows = x2.shape[0]
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if residual is not None else x2
    out32 = torch.empty(x2.shape, dtype=torch.float32, device=x2.device) if fp32_copy else out
    if rows:
        res = residual.reshape(-1, d).contiguous() if residual is not None else x2
        _rms_norm_kernel[(rows,)](x2, res, weight, total, out, out32, d, eps, HAS_RES=residual is not None,
                                  UNIT_OFFSET=unit_offset, FP32_COPY=fp32_copy,
                                  BLOCK_D=triton.next_power_of_2(d), num_warps=norm_warps(d), USE_GDC=pdl_enabled(x2))
    if fp32_copy:
        return total.view(x.shape), out.view(x.shape), out32.view(x.shape)
    return total.view(x.shape), out.view(x.shape)
