"""The MoE block's entry in one launch: residual add + RMSNorm (rms_norm.py's numerics) and the fp32 router
GEMV on the normalised row, logits = norm(x + residual).float() @ router^T.

Shape legend: T rows, D hidden (normalised width), E experts, BE experts per program, BH columns per step.

Why: the decode step ran the norm (one launch), then the router as a cuBLAS fp32 GEMV (`gemvx`, ~3 us
for a 2 MiB [256, 2048] matrix on the H200, launch-bound), 40 times a step. Here program (t, e-block)
computes row t's statistics over the whole row, then streams BE router rows against the normalised row,
rebuilt chunk by chunk from x and residual (L1/L2 hits) with the very operations that produced the stored
output, so the logits read exactly the values `out` holds, widened to fp32 (what the router read before:
the norm's fp32 copy). Program (t, 0) stores the sum and the normalised row.
NOTE: each row's programs read the whole router: T reads of it per step, from L2 after the first
(2 MiB at the Qwen3.6 shape); one program per e-block for all rows would serialise the rows instead.
Graph-capturable: grid (T, cdiv(E, BE)) from shapes only.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _normed(x_ptr, res_ptr, w_ptr, row_off, offs, mask, rstd, SUM_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
            UNIT_OFFSET: tl.constexpr):
    """(x + res rounded to SUM_DTYPE, its normalised value rounded to OUT_DTYPE) at columns offs: the same
    element-wise operations as _rms_norm_kernel, so every call gives the same bits for a column."""
    s = (tl.load(x_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)).to(SUM_DTYPE)
    xn = s.to(tl.float32) * rstd
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        y = xn * (1.0 + w)
    else:
        y = xn.to(OUT_DTYPE).to(tl.float32) * w
    return s, y.to(OUT_DTYPE)


@triton.jit
def _rms_norm_router_kernel(x_ptr, res_ptr, w_ptr, r_ptr, sum_ptr, out_ptr, logits_ptr, D, E, eps,
                            UNIT_OFFSET: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    eb = tl.program_id(1)
    row_off = row.to(tl.int64) * D
    SUM_DTYPE: tl.constexpr = sum_ptr.dtype.element_ty
    OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    s = (tl.load(x_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)).to(SUM_DTYPE)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / D + eps)
    if eb == 0:
        total, y = _normed(x_ptr, res_ptr, w_ptr, row_off, offs, mask, rstd, SUM_DTYPE, OUT_DTYPE, UNIT_OFFSET)
        tl.store(sum_ptr + row_off + offs, total, mask=mask)
        tl.store(out_ptr + row_off + offs, y, mask=mask)
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
    e_ok = offs_e < E
    acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, D, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)  # [BH]
        h_ok = offs_h < D
        _, y = _normed(x_ptr, res_ptr, w_ptr, row_off, offs_h, h_ok, rstd, SUM_DTYPE, OUT_DTYPE, UNIT_OFFSET)
        r = tl.load(r_ptr + offs_e[:, None].to(tl.int64) * D + offs_h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                    other=0.0)  # [BE, BH] fp32
        acc += r * y.to(tl.float32)[None, :]
    tl.store(logits_ptr + row.to(tl.int64) * E + offs_e, tl.sum(acc, axis=1), mask=e_ok)


def rms_norm_router(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, router: torch.Tensor,
                    eps: float, *, unit_offset: bool, block_e: int = 4, block_h: int = 512
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + residual, norm(x + residual), logits fp32 [T, E]) for x, residual [T, D] (same dtype).

    The first two are rms_norm(x, weight, eps, unit_offset=..., residual=residual)'s, in x.dtype; logits =
    norm(...).float() @ router^T with fp32 accumulation (order the kernel's own: within ~1e-6 relative of
    torch's F.linear). weight [D] (any float dtype); router fp32 [E, D] contiguous. block_e: router rows
    per program, block_h: columns per step (powers of two).
    Raises ValueError on mismatched shapes or dtypes.
    """
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"x and residual must be [T, D] of one dtype, got {x.dtype} {tuple(x.shape)} and "
                         f"{residual.dtype} {tuple(residual.shape)}")
    t, d = x.shape
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    if router.dim() != 2 or router.shape[1] != d or router.dtype != torch.float32 or not router.is_contiguous():
        raise ValueError(f"router must be a contiguous fp32 [E, {d}], got {router.dtype} {tuple(router.shape)}")
    for name, v in (("block_e", block_e), ("block_h", block_h)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    e = router.shape[0]
    x, residual = x.contiguous(), residual.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    if t:
        _rms_norm_router_kernel[(t, triton.cdiv(e, block_e))](
            x, residual, weight, router, total, out, logits, d, e, eps, UNIT_OFFSET=unit_offset,
            BLOCK_D=triton.next_power_of_2(d), BLOCK_E=block_e, BLOCK_H=min(block_h, triton.next_power_of_2(d)),
            num_warps=4 if d <= 2048 else 8)
    return total, out, logits
