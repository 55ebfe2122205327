"""Routed experts, first half: h[t, k] = silu(x[t] @ gate^T) * (x[t] @ up^T), with gate and up read
straight from the expert's packed row in the slot pool and dequantized inside the K loop.

Shape legend: T tokens, K top-k, H hidden, I expert intermediate, S slots, R row bytes.
  x [T, H] float; slot_ids int32 [T, K] (-1 = skip); slots uint8 [S, R]; h [T, K, I] in x.dtype.
Grid: (T * K, cdiv(I, BLOCK_N)); one program streams BLOCK_N rows of gate and of up for one (t, k).
Graph-capturable: shapes and grid depend only on T, K and the layout; no host syncs.
NOTE: this is the small-M (decode, T <= ~16) path: a tl.sum GEMV per (t, k) that re-reads an expert
shared by several tokens from L2. The large-M (prefill) path grouped by expert is moe_grouped_gate_up.
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
    pairs_bucket,
    prune_tiles,
    resolve_tiles,
    tune_configs,
)
from adapters.kernels.pdl import enabled as pdl_enabled
from adapters.kernels.pdl import launch_args, let_next_start, wait_previous


# S only feeds the debug assert, PAIRS_BUCKET only the autotune key: neither is specialized on (no recompiles)
@triton.jit(do_not_specialize=["S", "PAIRS_BUCKET"])
def _moe_gate_up_kernel(x_ptr, slot_ids_ptr, slots_ptr, h_ptr, S, PAIRS_BUCKET,
                        K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, R: tl.constexpr,
                        G_DATA: tl.constexpr, G_SCALE: tl.constexpr, G_GSCALE: tl.constexpr,
                        U_DATA: tl.constexpr, U_SCALE: tl.constexpr, U_GSCALE: tl.constexpr,
                        W_DTYPE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:  # launched with PDL (pdl.py): the slots come from the kernel before, nothing to do before them
        let_next_start()  # moe_down's programs may take SMs as this grid's programs finish
        wait_previous()
    tk = tl.program_id(0)  # t * K + k
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)  # [N] rows of gate/up = columns of h
    slot = tl.load(slot_ids_ptr + tk)
    tl.device_assert(slot < S, "slot id past the pool")
    h = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        row = slots_ptr + slot.to(tl.int64) * R  # int64: S * R passes 2^31 at real pool sizes
        x_row = x_ptr + (tk // K).to(tl.int64) * H
        g = packed_gemv(row, x_row, n0, I, H, G_DATA, G_SCALE, G_GSCALE, W_DTYPE, FMT, GROUP, BLOCK_N, BLOCK_K)
        u = packed_gemv(row, x_row, n0, I, H, U_DATA, U_SCALE, U_GSCALE, W_DTYPE, FMT, GROUP, BLOCK_N, BLOCK_K)
        h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + tk.to(tl.int64) * I + n, h.to(h_ptr.dtype.element_ty), mask=n < I)


_TUNED = triton.autotune(configs=tune_configs(), key=["K", "H", "I", "R", "FMT", "PAIRS_BUCKET"],
                         prune_configs_by={"early_config_prune": prune_tiles},
                         cache_results=True)(_moe_gate_up_kernel)


def moe_gate_up(x: torch.Tensor, slot_ids: torch.Tensor, slots: torch.Tensor, layout: ExpertLayout,
                out: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
                num_warps: int = 4) -> torch.Tensor:
    """h [T, K, I] in x.dtype: silu(x @ gate^T) * (x @ up^T) per (token, top-k), fp32 accumulation.

    x [T, H] bf16/fp16/fp32; slot_ids int32 [T, K]: the pool slot holding each token's k-th expert, -1 to
    skip (that row of h is zeros); ids must be < S (checked on the device only in debug builds).
    slots uint8 [S, R] contiguous, rows packed by `layout`. `out` (optional, [T, K, I] x.dtype contiguous)
    is written in place. block_k (None: 128, 256 for 4-bit formats): a power of two and a multiple of the
    scale group (128 for block FP8).
    Raises ValueError on any shape, dtype, device or block-size mismatch.
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"moe_gate_up: x must be bf16/fp16/fp32 [T, H], got {x.dtype} {tuple(x.shape)}")
    tokens, hidden = x.shape
    if hidden != layout.hidden:
        raise ValueError(f"moe_gate_up: x has H={hidden}, layout has H={layout.hidden}")
    k = check_pool(slot_ids, slots, layout, tokens, "moe_gate_up")
    if x.device != slots.device:
        raise ValueError(f"moe_gate_up: x on {x.device}, slots on {slots.device}")
    tuned, block_n, block_k = resolve_tiles(layout, block_n, block_k, slots.is_cuda, "moe_gate_up", rows=layout.intermediate)
    inter = layout.intermediate
    if out is None:
        out = torch.empty((tokens, k, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, k, inter) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"moe_gate_up: out must be contiguous {x.dtype} [{tokens}, {k}, {inter}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    if tokens == 0:
        return out
    c = layout_consts(layout)
    launch(_TUNED, _moe_gate_up_kernel, tuned, tokens * k, inter, block_n, block_k, num_warps,
           x.contiguous(), slot_ids.contiguous(), slots, out, slots.shape[0],
           K=k, H=hidden, I=inter, R=c.row_bytes, PAIRS_BUCKET=pairs_bucket(tokens * k),
           G_DATA=c.gate.data, G_SCALE=c.gate.scale, G_GSCALE=c.gate.global_scale,
           U_DATA=c.up.data, U_SCALE=c.up.scale, U_GSCALE=c.up.global_scale,
           W_DTYPE=c.gate.w_dtype, FMT=c.fmt_code, GROUP=max(c.group, 1),
           **launch_args(int(pdl_enabled(x))))
    return out
