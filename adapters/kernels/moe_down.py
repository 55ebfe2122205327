"""Routed experts, second half: out[t] = sum_k weights[t, k] * (h[t, k] @ down^T), with down read straight
from each expert's packed row in the slot pool and dequantized inside the K loop.

Shape legend: T tokens, K top-k, H hidden, I expert intermediate, S slots, R row bytes.
  h [T, K, I] float; slot_ids int32 [T, K] (-1 = skip); weights fp32 [T, K]; slots uint8 [S, R];
  out [T, H] in h.dtype.
Grid: (T*K, cdiv(H, BLOCK_N)): one program owns BLOCK_N columns of one (token, expert) pair and writes
its weighted partial y[t, k] in fp32 (every pair streams its expert at once: K times the parallelism of
one program per token); moe_sum then adds the K partials in order k = 0..K-1. The grouped and streamed
paths fill the same partials over several calls and sum them the same way, so outputs are bitwise the
same at any expert-slot count.
NOTE: a one-launch variant whose program walked a token's K pairs and summed them (grid (T, ...)) was
measured slower on the H200 at every decode batch (docs/fast-decode.md, run 6): K times fewer programs
(32 at bs1 on 132 SMs) outweigh the saved moe_sum launch.
Deterministic, no atomics, independent of which slot holds an expert (only the slot's bytes are read).
Graph-capturable: no host syncs, grid from shapes only.
NOTE: small-M (decode) path; the large-M (prefill) path grouped by expert is moe_grouped_down.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels.moe_sum import moe_sum
from adapters.kernels.packed_gemv import (
    check_pool,
    launch,
    layout_consts,
    packed_gemv,
    pairs_bucket,
    prune_tiles,
    resolve_tiles,
    tune_configs,
)
from adapters.kernels.pdl import enabled as pdl_enabled
from adapters.kernels.pdl import launch_args, wait_previous


# S only feeds the debug assert, PAIRS_BUCKET only the autotune key: neither is specialized on (no recompiles)
@triton.jit(do_not_specialize=["S", "PAIRS_BUCKET"])
def _moe_down_kernel(h_ptr, slot_ids_ptr, weights_ptr, slots_ptr, y_ptr, S, PAIRS_BUCKET,
                     K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, R: tl.constexpr,
                     D_DATA: tl.constexpr, D_SCALE: tl.constexpr, D_GSCALE: tl.constexpr,
                     W_DTYPE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, WRITE_SKIPPED: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:  # launched with PDL (pdl.py): h and the slots come from the kernels before
        wait_previous()
    tk = tl.program_id(0)  # t * K + k
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)  # [N] rows of down = columns of out
    slot = tl.load(slot_ids_ptr + tk)
    tl.device_assert(slot < S, "slot id past the pool")
    dst = y_ptr + tk.to(tl.int64) * H + n
    if slot >= 0:
        row = slots_ptr + slot.to(tl.int64) * R  # int64: S * R passes 2^31 at real pool sizes
        h_row = h_ptr + tk.to(tl.int64) * I
        part = packed_gemv(row, h_row, n0, H, I, D_DATA, D_SCALE, D_GSCALE, W_DTYPE, FMT, GROUP, BLOCK_N, BLOCK_K)
        tl.store(dst, tl.load(weights_ptr + tk) * part, mask=n < H)
    elif WRITE_SKIPPED:  # moe_down's own buffer: a skipped pair adds exact zeros in moe_sum
        tl.store(dst, tl.zeros([BLOCK_N], dtype=tl.float32), mask=n < H)


_TUNED = triton.autotune(configs=tune_configs(), key=["K", "H", "I", "R", "FMT", "PAIRS_BUCKET"],
                         prune_configs_by={"early_config_prune": prune_tiles},
                         cache_results=True)(_moe_down_kernel)


def moe_down(h: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
             layout: ExpertLayout, out: torch.Tensor | None = None, partials: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
             num_warps: int = 4) -> torch.Tensor:
    """out [T, H] in h.dtype: sum over k = 0..K-1 of weights[t, k] * (h[t, k] @ down^T), fp32 accumulation.

    h [T, K, I] bf16/fp16/fp32 (moe_gate_up's output); slot_ids int32 [T, K] (-1: adds nothing; ids must
    be < S); weights fp32 [T, K] router weights; slots uint8 [S, R] contiguous, rows packed by `layout`.
    `out` (optional, contiguous [T, H] h.dtype) is written in place, every element: the weighted partials
    go to a fresh fp32 [T, K, H] buffer (skipped pairs as zeros), then moe_sum adds them in k order.
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
    tuned, block_n, block_k = resolve_tiles(layout, block_n, block_k, slots.is_cuda, "moe_down", rows=layout.hidden)
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
    y = partials if partials is not None else torch.empty((tokens, k, hidden), dtype=torch.float32, device=h.device)
    c = layout_consts(layout)
    launch(_TUNED, _moe_down_kernel, tuned, tokens * k, hidden, block_n, block_k, num_warps,
           h.contiguous(), slot_ids.contiguous(), weights.contiguous(), slots, y, slots.shape[0],
           K=k, H=hidden, I=inter, R=c.row_bytes, PAIRS_BUCKET=pairs_bucket(tokens * k),
           D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale,
           W_DTYPE=c.down.w_dtype, FMT=c.fmt_code, GROUP=max(c.group, 1), WRITE_SKIPPED=partials is None,
           **launch_args(int(pdl_enabled(h))))
    return y if partials is not None else moe_sum(y, out)
