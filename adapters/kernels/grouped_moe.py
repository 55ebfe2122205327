"""Routed experts from the slot pool for prefill-sized batches: pairs grouped by slot (moe_align), then
the two tensor-core GEMMs (moe_grouped_gate_up, moe_grouped_down) and the ordered top-k sum (moe_sum).
No kernel of its own; the large-M counterpart of fused_moe, with the same arguments and results.

Shape legend: T tokens, K top-k columns, H hidden, I expert intermediate, S slots, R row bytes.
"""

from __future__ import annotations

import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels.act_quant_fp8 import act_quant_fp8
from adapters.kernels.dequant_tile import A8_FORMATS
from adapters.kernels.moe_align import Alignment, align_by_slot, choose_block_m
from adapters.kernels.moe_grouped_down import moe_grouped_down
from adapters.kernels.moe_grouped_gate_up import moe_grouped_gate_up
from adapters.kernels.moe_sum import moe_sum
from adapters.kernels.packed_gemv import layout_consts


def takes_a8(layout: ExpertLayout) -> bool:
    """Whether the grouped GEMMs can take e4m3 activations for this layout (FP8 block/tensor/channel)."""
    return layout_consts(layout).fmt_code in A8_FORMATS


def grouped_gemms(x: torch.Tensor, align: Alignment, weights: torch.Tensor, slots: torch.Tensor,
                  layout: ExpertLayout, partials: torch.Tensor, h: torch.Tensor | None = None,
                  a8: bool = False) -> torch.Tensor:
    """gate_up then down for the blocks of `align` (moe_grouped_gate_up / moe_grouped_down: shapes there) into
    partials fp32 [T, K, H]; h: an optional [P, I] x.dtype scratch for the gate_up output. Returns h.
    a8: x and h quantized to e4m3 per 128 columns (act_quant_fp8) for the FP8 tensor cores, when takes_a8(layout)
    (ADR 0018; h is still stored in x.dtype between the two). Raises ValueError as the launchers."""
    if a8 and takes_a8(layout):
        h = moe_grouped_gate_up(act_quant_fp8(x), align, weights.shape[1], slots, layout, out=h, out_dtype=x.dtype)
        moe_grouped_down(act_quant_fp8(h), align, weights.contiguous(), slots, layout, partials)
        return h
    h = moe_grouped_gate_up(x, align, weights.shape[1], slots, layout, out=h)
    moe_grouped_down(h, align, weights.contiguous(), slots, layout, partials)
    return h


def grouped_moe(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                layout: ExpertLayout, out: torch.Tensor | None = None, partials: torch.Tensor | None = None,
                max_groups: int | None = None, block_m: int | None = None, a8: bool = False) -> torch.Tensor:
    """out [T, H] in x.dtype = sum_k weights[t, k] * expert_{slot_ids[t, k]}(x[t]) (SwiGLU experts).

    x [T, H] bf16/fp16/fp32; slot_ids int32 [T, K] (-1 = skip; ids < S); weights fp32 [T, K]; slots uint8
    [S, R] packed by `layout`. As fused_moe: h [T, K, I] rounded to x.dtype between the GEMMs, fp32
    weighted partials per (t, k), summed in k order by moe_sum. partials (fp32 [T, K, H]): fill only the
    pairs whose slot is not -1 and return it unsummed. max_groups: a bound on the distinct slot ids that
    the caller guarantees (e.g. experts per layer + 1; default min(T*K, S)); it sizes the grid and, with
    T*K, picks BLOCK_M (block_m overrides), so calls that split one layer's experts into groups must pass
    the same bound to get bitwise-equal partials; a bound below the distinct ids drops pairs (unwritten:
    without `partials` their garbage would enter the sum). Memory: partials 4*T*K*H bytes, h about 2*T*K*I.
    a8: e4m3 activations into FP8 tensor cores for FP8 layouts (grouped_gemms).
    Raises ValueError on mismatched inputs (see the launchers).
    """
    if slot_ids.dim() != 2 or weights.shape != slot_ids.shape or weights.dtype != torch.float32:
        raise ValueError(f"grouped_moe: weights must be fp32 of slot_ids' shape [T, K], got {weights.dtype} "
                         f"{tuple(weights.shape)} and slot_ids {tuple(slot_ids.shape)}")
    if x.dim() != 2 or x.shape[0] != slot_ids.shape[0]:
        raise ValueError(f"grouped_moe: x must be [T={slot_ids.shape[0]}, H], got {tuple(x.shape)}")
    tokens, top_k = slot_ids.shape
    groups = min(tokens * top_k, slots.shape[0]) if max_groups is None else max_groups
    bm = choose_block_m(tokens * top_k, groups) if block_m is None else block_m
    # NOTE: our own partials are not zero-filled: every pair whose slot is >= 0 lands in a block of its slot
    # (ids < S, at most `groups` distinct: the caller's guarantee), so the GEMMs write exactly those pairs, and
    # moe_sum skips the others as the +0.0 a zeroed buffer held (the same bits, no 4*T*K*H-byte memset)
    if partials is None:
        y = torch.empty((tokens, top_k, layout.hidden), dtype=torch.float32, device=x.device)
    else:
        y = partials
    if tokens:
        align = align_by_slot(slot_ids, slots.shape[0], bm, groups)
        grouped_gemms(x, align, weights, slots, layout, y, a8=a8)
    if partials is not None:
        return partials
    if out is None:
        out = torch.empty_like(x)
    return moe_sum(y, out, slot_ids.contiguous())
