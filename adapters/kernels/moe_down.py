"""Routed experts, second half: out[t] = sum_k weights[t, k] * (h[t, k] @ down^T), with down read straight
from each expert's packed row in the slot pool and dequantized inside the K loop.

Shape legend: T tokens, K top-k, H hidden, I expert intermediate, S slots, R row bytes.
  h [T, K, I] float; slot_ids int32 [T, K] (-1 = skip); weights fp32 [T, K]; slots uint8 [S, R];
  out [T, H] in h.dtype.
Two modes of the one kernel (SUM_PAIRS), sharing one tile choice:
- summed (the decode step, `out`): grid (T, cdiv(H, BLOCK_N)); a program owns BLOCK_N columns of one
  token, walks its K pairs in order k = 0..K-1 and writes out[t] = ((0 + y[t, 0]) + y[t, 1]) + ... cast
  once, with y[t, k] = weights[t, k] * part rounded to fp32 before the add (PTX mul.rn on the GPU: no FMA
  contraction), so it is bitwise moe_sum over the per-pair partials, in one launch instead of two.
- per pair (`partials`): grid (T*K, cdiv(H, BLOCK_N)); one program per (pair, column tile) writes the
  weighted partial y[t, k] in fp32; the grouped and streamed paths fill them over several calls and
  moe_sum adds them in the same order.
NOTE: both modes go through one autotuner and present it the same key (its shape keys, and the dtypes of
all tensor arguments: each mode passes both `out` and `y`, a one-element stand-in for the one it does not
write), so they run the same tile and so the same per-pair dot-product order: the summed result is
bitwise the per-pair partials summed, which keeps outputs identical at any slot count (small pools take
the partials path for prefill chunks).
Deterministic, no atomics, independent of which slot holds an expert (only the slot's bytes are read).
Graph-capturable: no host syncs, grid from shapes only.
NOTE: small-M (decode) path; the large-M (prefill) path grouped by expert is moe_grouped_down.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels.packed_gemv import (
    check_pool,
    launch,
    layout_consts,
    packed_gemv,
    prune_tiles,
    resolve_tiles,
    tune_configs,
)


@triton.jit
def _mul_rn(a, b):
    """a * b rounded to fp32 on its own: PTX's mul.rn is never contracted into an FMA with a later add
    (libdevice's mul_rn lowers to mul.rn.ftz, which would flush denormal products the per-pair mode keeps).
    CUDA only; the interpreter multiplies in numpy, which never contracts."""
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit(do_not_specialize=["S"])  # S only feeds the debug assert: no recompiles on a pool resize
def _moe_down_kernel(h_ptr, slot_ids_ptr, weights_ptr, slots_ptr, out_ptr, y_ptr, S,
                     K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, R: tl.constexpr,
                     D_DATA: tl.constexpr, D_SCALE: tl.constexpr, D_GSCALE: tl.constexpr,
                     W_DTYPE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, SUM_PAIRS: tl.constexpr,
                     MUL_RN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)  # [N] rows of down = columns of out
    if SUM_PAIRS:
        t = tl.program_id(0)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(K):  # NOTE: k = 0..K-1 in order, moe_sum's order
            tk = t * K + k
            slot = tl.load(slot_ids_ptr + tk)
            tl.device_assert(slot < S, "slot id past the pool")
            if slot >= 0:
                row = slots_ptr + slot.to(tl.int64) * R  # int64: S * R passes 2^31 at real pool sizes
                part = packed_gemv(row, h_ptr + tk.to(tl.int64) * I, n0, H, I, D_DATA, D_SCALE, D_GSCALE, W_DTYPE,
                                   FMT, GROUP, BLOCK_N, BLOCK_K)
                wk = tl.load(weights_ptr + tk)
                if MUL_RN:  # the product rounded on its own, as the per-pair mode stores it
                    acc = acc + _mul_rn(tl.full([BLOCK_N], 0.0, tl.float32) + wk, part)
                else:
                    acc = acc + wk * part
        tl.store(out_ptr + t.to(tl.int64) * H + n, acc.to(out_ptr.dtype.element_ty), mask=n < H)
    else:
        tk = tl.program_id(0)  # t * K + k
        slot = tl.load(slot_ids_ptr + tk)
        tl.device_assert(slot < S, "slot id past the pool")
        if slot >= 0:
            row = slots_ptr + slot.to(tl.int64) * R
            part = packed_gemv(row, h_ptr + tk.to(tl.int64) * I, n0, H, I, D_DATA, D_SCALE, D_GSCALE, W_DTYPE,
                               FMT, GROUP, BLOCK_N, BLOCK_K)
            tl.store(y_ptr + tk.to(tl.int64) * H + n, tl.load(weights_ptr + tk) * part, mask=n < H)


_TUNED = triton.autotune(configs=tune_configs(), key=["K", "H", "I", "R", "FMT"],
                         prune_configs_by={"early_config_prune": prune_tiles},
                         cache_results=True)(_moe_down_kernel)


def moe_down(h: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
             layout: ExpertLayout, out: torch.Tensor | None = None, partials: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
             num_warps: int = 4) -> torch.Tensor:
    """out [T, H] in h.dtype: sum over k = 0..K-1 of weights[t, k] * (h[t, k] @ down^T), fp32 accumulation.

    h [T, K, I] bf16/fp16/fp32 (moe_gate_up's output); slot_ids int32 [T, K] (-1: adds nothing; ids must
    be < S); weights fp32 [T, K] router weights; slots uint8 [S, R] contiguous, rows packed by `layout`.
    `out` (optional, contiguous [T, H] h.dtype) is written in place, every element, by the summing mode
    (one launch, bitwise moe_sum of the partials below).
    partials (optional fp32 [T, K, H]): write only the weighted partials of the pairs whose slot is not
    -1 there and return it, with no sum (the grouped path fills it over several calls, then moe_sum).
    Given both, partials wins and out is not written.
    block_k (None: 128, 256 for 4-bit formats): a power of two and a multiple of the scale group (128 for
    block FP8).
    Raises ValueError on any shape, dtype, device or block-size mismatch.
    """
    if h.dim() != 3 or h.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"moe_down: h must be bf16/fp16/fp32 [T, K, I], got {h.dtype} {tuple(h.shape)}")
    tokens, k, inter = h.shape
    if inter != layout.intermediate:
        raise ValueError(f"moe_down: h has I={inter}, layout has I={layout.intermediate}")
    if check_pool(slot_ids, slots, layout, tokens, "moe_down") != k:
        raise ValueError(f"moe_down: slot_ids {tuple(slot_ids.shape)} and h {tuple(h.shape)} disagree on K")
    if weights.dtype != torch.float32 or weights.shape != (tokens, k):
        raise ValueError(f"moe_down: weights must be fp32 [{tokens}, {k}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if not h.device == weights.device == slots.device:
        raise ValueError(f"moe_down: h on {h.device}, weights on {weights.device}, slots on {slots.device}")
    tuned, block_n, block_k = resolve_tiles(layout, block_n, block_k, slots.is_cuda, "moe_down")
    hidden = layout.hidden
    if partials is None and out is None:
        out = torch.empty((tokens, hidden), dtype=h.dtype, device=h.device)
    elif out is not None and (out.shape != (tokens, hidden) or out.dtype != h.dtype or not out.is_contiguous()):
        raise ValueError(f"moe_down: out must be contiguous {h.dtype} [{tokens}, {hidden}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    if partials is not None and (partials.shape != (tokens, k, hidden) or partials.dtype != torch.float32
                                 or not partials.is_contiguous()):
        raise ValueError(f"moe_down: partials must be contiguous fp32 [{tokens}, {k}, {hidden}], "
                         f"got {partials.dtype} {tuple(partials.shape)}")
    if tokens == 0:
        return out if partials is None else partials
    c = layout_consts(layout)
    summed = partials is None
    # one-element stand-ins for the output a mode does not write (same argument dtypes: see the NOTE above)
    out_arg = out if summed else torch.empty(1, dtype=h.dtype, device=h.device)
    y_arg = torch.empty(1, dtype=torch.float32, device=h.device) if summed else partials
    launch(_TUNED, _moe_down_kernel, tuned, tokens if summed else tokens * k, hidden, block_n, block_k, num_warps,
           h.contiguous(), slot_ids.contiguous(), weights.contiguous(), slots, out_arg, y_arg,
           slots.shape[0], K=k, H=hidden, I=inter, R=c.row_bytes,
           D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale,
           W_DTYPE=c.down.w_dtype, FMT=c.fmt_code, GROUP=max(c.group, 1), SUM_PAIRS=summed, MUL_RN=slots.is_cuda)
    return out if summed else partials
