"""Combine step of flash-decoding: merge the per-split normalised outputs of paged_decode_attention by
their log-sum-exp weights.

Shape legend: B batch rows, N query heads, S splits, D head dim (BLOCK_D of it per program).
Optionally applies Qwen3.5's sigmoid output gate on the way out (HAS_GATE): out = round(y) * round(sigmoid(g)),
rounded, the reference's `out * torch.sigmoid(gate)` in the model dtype; it replaced three launches per
attention layer in the decode step (the gate's contiguous copy, the sigmoid, the product).
CUDA-graph safe: grid (B, N, D/BLOCK_D), static.
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.pdl import enabled as pdl_enabled
from adapters.kernels.pdl import let_next_start


@triton.jit
def _paged_decode_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, gate_ptr,
    stride_ob, stride_on, stride_os, stride_od,
    stride_lb, stride_ln, stride_ls,
    stride_yb, stride_yn, stride_yd,
    stride_gb, stride_gn, stride_gd,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_GATE: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    """Program (b, n, d-block): out[b, n, d] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max); zeros when every
    split is empty (lse all -inf: a padded row)."""
    if USE_GDC:  # pdl.py: a PDL-launched kernel after this one may start its pre-wait part
        let_next_start()
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * stride_lb + head * stride_ln + offs_s * stride_ls, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S], log2 domain
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all empty: weights become exactly 0, not NaN
    weight = tl.exp2(lse - top)  # [BLOCK_S]
    o = tl.load(part_o_ptr + row * stride_ob + head * stride_on + offs_s[:, None] * stride_os
                + offs_d[None, :] * stride_od, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    # NOTE: an empty split's o is 0 and its weight 0; where() keeps a stray NaN/inf out of the sum.
    contrib = tl.where((weight > 0.0)[:, None], o * weight[:, None], 0.0)
    total = tl.sum(weight, 0)
    y = (tl.sum(contrib, 0) / tl.where(total > 0.0, total, 1.0)).to(out_ptr.dtype.element_ty)  # [BLOCK_D]
    if HAS_GATE:  # NOTE: both factors rounded to the model dtype first, as the reference's torch ops are
        g = tl.load(gate_ptr + row * stride_gb + head * stride_gn + offs_d * stride_gd, mask=d_mask, other=0.0)
        sg = tl.sigmoid(g.to(tl.float32)).to(out_ptr.dtype.element_ty)
        y = (y.to(tl.float32) * sg.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_yb + head * stride_yn + offs_d * stride_yd, y, mask=d_mask)


def paged_decode_combine(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                         gate: torch.Tensor | None = None) -> torch.Tensor:
    """part_o fp32 [B, N, S, D] (each split's softmax-normalised output), part_lse fp32 [B, N, S] (each
    split's log2-sum-exp of scaled scores, -inf when the split saw no token) -> written into out [B, N, D]
    (any float dtype) and returned. gate (optional [B, N, D] in out's dtype, any strides): out becomes
    out * sigmoid(gate), each rounded to out's dtype. Raises ValueError on mismatched shapes or dtypes."""
    if part_o.dim() != 4 or part_lse.shape != part_o.shape[:3]:
        raise ValueError(f"part_o must be [B, N, S, D] and part_lse [B, N, S], got "
                         f"{tuple(part_o.shape)} and {tuple(part_lse.shape)}")
    batch, heads, splits, head_dim = part_o.shape
    if part_o.dtype != torch.float32 or part_lse.dtype != torch.float32:
        raise ValueError(f"partials must be fp32, got {part_o.dtype} and {part_lse.dtype}")
    if out.shape != (batch, heads, head_dim):
        raise ValueError(f"out must be [B, N, D] = {(batch, heads, head_dim)}, got {tuple(out.shape)}")
    if gate is not None and (gate.shape != out.shape or gate.dtype != out.dtype):
        raise ValueError(f"gate must be {out.dtype} {tuple(out.shape)}, got {gate.dtype} {tuple(gate.shape)}")
    if batch == 0 or heads == 0:
        return out
    g = out if gate is None else gate
    # NOTE: d-blocks keep the [S, BLOCK_D] fp32 tile small (64 splits x 64 = 32 registers a thread).
    block_d = min(64, triton.next_power_of_2(head_dim))
    _paged_decode_combine_kernel[(batch, heads, triton.cdiv(head_dim, block_d))](
        part_o, part_lse, out, g, *part_o.stride(), *part_lse.stride(), *out.stride(), *g.stride(),
        NUM_SPLITS=splits, HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        BLOCK_D=block_d, HAS_GATE=gate is not None, num_warps=4, USE_GDC=pdl_enabled(out),
    )
    return out
