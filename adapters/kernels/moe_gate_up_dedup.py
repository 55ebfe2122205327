"""Routed experts, first half, expert-deduplicated (small-M decode): h[t, k] = silu(x[t] @ gate^T) * (x[t] @
up^T) as moe_gate_up computes it, bit for bit, but each distinct slot's gate/up tile is loaded and
dequantized once for up to PAIRS of the pairs routed to it, instead of once per pair.

Shape legend: T tokens, K top-k, P pairs (T * K), H hidden, I expert intermediate, S slots, R row bytes,
M pairs per program (PAIRS).
  x [T, H] float; slot_ids int32 [T, K] (-1 = skip); slots uint8 [S, R]; h [T, K, I] in x.dtype.
Grid: (P, cdiv(I, BLOCK_N)), from shapes only; program (p, j) leads the chunk of p's segment starting at p
(dedup_gemv.segment_lead) or exits; a skipped pair's program writes its zero row. No host sync, no sort,
no atomics: graph-capturable, deterministic.
NOTE: runs the per-pair kernel's tile (its autotuner's choice for the same key, read at every launch), so
every pair's h is bitwise moe_gate_up's (dedup_gemv's NOTE says why that holds per member).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels import moe_gate_up as per_pair
from adapters.kernels.dedup_gemv import (
    MAX_DEDUP_PAIRS,
    chunk_members,
    packed_gemv_multi,
    padded_pairs,
    pairs_per_program,
    per_pair_tile,
    segment_lead,
)
from adapters.kernels.packed_gemv import check_pool, layout_consts, pairs_bucket, resolve_tiles


# S only feeds the debug assert, P a mask: no recompiles on a pool resize or per decode bucket (PB is a power of 2)
@triton.jit(do_not_specialize=["S", "P"])
def _moe_gate_up_dedup_kernel(x_ptr, slot_ids_ptr, slots_ptr, h_ptr, work_ptr, S, P,
                              K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, R: tl.constexpr,
                              G_DATA: tl.constexpr, G_SCALE: tl.constexpr, G_GSCALE: tl.constexpr,
                              U_DATA: tl.constexpr, U_SCALE: tl.constexpr, U_GSCALE: tl.constexpr,
                              W_DTYPE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                              PB: tl.constexpr, PAIRS: tl.constexpr, WORK: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)  # a pair t * K + k
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)  # [N] rows of gate/up = columns of h
    n_ok = n < I
    slot, lead, count, rank = segment_lead(slot_ids_ptr, p, P, PB, PAIRS)
    tl.device_assert(slot < S, "slot id past the pool")
    if WORK:  # test hook: which programs stream weights
        tl.store(work_ptr + p * tl.num_programs(1) + tl.program_id(1), lead.to(tl.int32))
    if slot < 0:
        tl.store(h_ptr + p.to(tl.int64) * I + n, tl.zeros([BLOCK_N], dtype=h_ptr.dtype.element_ty), mask=n_ok)
    if lead:
        i0 = p
        i1, i2, i3 = chunk_members(slot_ids_ptr, p, slot, rank, count, P, PB)
        row = slots_ptr + slot.to(tl.int64) * R  # int64: S * R passes 2^31 at real pool sizes
        x0 = x_ptr + (i0 // K).to(tl.int64) * H
        x1 = x_ptr + (i1 // K).to(tl.int64) * H
        x2 = x_ptr + (i2 // K).to(tl.int64) * H
        x3 = x_ptr + (i3 // K).to(tl.int64) * H
        g0, g1, g2, g3 = packed_gemv_multi(row, x0, x1, x2, x3, count, n0, I, H, G_DATA, G_SCALE, G_GSCALE,
                                           W_DTYPE, FMT, GROUP, PAIRS, BLOCK_N, BLOCK_K)
        u0, u1, u2, u3 = packed_gemv_multi(row, x0, x1, x2, x3, count, n0, I, H, U_DATA, U_SCALE, U_GSCALE,
                                           W_DTYPE, FMT, GROUP, PAIRS, BLOCK_N, BLOCK_K)
        out_ty = h_ptr.dtype.element_ty
        tl.store(h_ptr + i0.to(tl.int64) * I + n, (g0 * tl.sigmoid(g0) * u0).to(out_ty), mask=n_ok)
        if count > 1:
            tl.store(h_ptr + i1.to(tl.int64) * I + n, (g1 * tl.sigmoid(g1) * u1).to(out_ty), mask=n_ok)
        if count > 2:
            tl.store(h_ptr + i2.to(tl.int64) * I + n, (g2 * tl.sigmoid(g2) * u2).to(out_ty), mask=n_ok)
        if count > 3:
            tl.store(h_ptr + i3.to(tl.int64) * I + n, (g3 * tl.sigmoid(g3) * u3).to(out_ty), mask=n_ok)


def moe_gate_up_dedup(x: torch.Tensor, slot_ids: torch.Tensor, slots: torch.Tensor, layout: ExpertLayout,
                      out: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
                      num_warps: int = 4, pairs: int | None = None, work: torch.Tensor | None = None) -> torch.Tensor:
    """h [T, K, I] in x.dtype, bitwise moe_gate_up's result for the same arguments (see there), with each
    distinct slot's weights streamed once per PAIRS of its pairs.

    x [T, H] bf16/fp16/fp32; slot_ids int32 [T, K] (-1 = skip: zeros; ids < S, checked on the device in
    debug builds only); slots uint8 [S, R] contiguous; out optional [T, K, I] x.dtype contiguous.
    Tiles: block_n/block_k None on CUDA: the per-pair kernel's tuned tile for this key (tuning it once here,
    outside a graph capture, if it never ran); otherwise as moe_gate_up (block_n 16, block_k 128/256).
    pairs: pairs per program (1..4; None: as many as fit the registers, dedup_gemv.pairs_per_program).
    work (tests): int32 [T*K, cdiv(I, block_n)], set to 1 where a program streamed weights, 0 elsewhere.
    Raises ValueError on any shape, dtype, device or block-size mismatch, or more than MAX_DEDUP_PAIRS pairs.
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"moe_gate_up_dedup: x must be bf16/fp16/fp32 [T, H], got {x.dtype} {tuple(x.shape)}")
    tokens, hidden = x.shape
    if hidden != layout.hidden:
        raise ValueError(f"moe_gate_up_dedup: x has H={hidden}, layout has H={layout.hidden}")
    k = check_pool(slot_ids, slots, layout, tokens, "moe_gate_up_dedup")
    if x.device != slots.device:
        raise ValueError(f"moe_gate_up_dedup: x on {x.device}, slots on {slots.device}")
    if tokens * k > MAX_DEDUP_PAIRS:
        raise ValueError(f"moe_gate_up_dedup: {tokens} x {k} pairs exceed MAX_DEDUP_PAIRS={MAX_DEDUP_PAIRS}")
    tuned, block_n, block_k = resolve_tiles(layout, block_n, block_k, slots.is_cuda, "moe_gate_up_dedup")
    inter = layout.intermediate
    if out is None:
        out = torch.empty((tokens, k, inter), dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, k, inter) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"moe_gate_up_dedup: out must be contiguous {x.dtype} [{tokens}, {k}, {inter}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    if tokens == 0:
        return out
    c = layout_consts(layout)
    x, slot_ids = x.contiguous(), slot_ids.contiguous()
    key = dict(K=k, H=hidden, I=inter, R=c.row_bytes, FMT=c.fmt_code)
    tile_key = {**key, "PAIRS_BUCKET": pairs_bucket(tokens * k)}  # the per-pair autotuner's key
    stages = {}
    if tuned:
        block_n, block_k, num_warps, num_stages = per_pair_tile(
            per_pair._TUNED, x.dtype, tile_key, lambda: per_pair.moe_gate_up(x, slot_ids, slots, layout, out=out))
        stages = {"num_stages": num_stages}
    tiles = triton.cdiv(inter, block_n)
    if work is not None and (work.shape != (tokens * k, tiles) or work.dtype != torch.int32):
        raise ValueError(f"moe_gate_up_dedup: work must be int32 [{tokens * k}, {tiles}], got {work.dtype} "
                         f"{tuple(work.shape)}")
    work_arg = work if work is not None else torch.empty(1, dtype=torch.int32, device=x.device)
    _moe_gate_up_dedup_kernel[(tokens * k, tiles)](
        x, slot_ids, slots, out, work_arg, slots.shape[0], tokens * k, **key,
        G_DATA=c.gate.data, G_SCALE=c.gate.scale, G_GSCALE=c.gate.global_scale,
        U_DATA=c.up.data, U_SCALE=c.up.scale, U_GSCALE=c.up.global_scale,
        W_DTYPE=c.gate.w_dtype, GROUP=max(c.group, 1), PB=padded_pairs(tokens * k),
        PAIRS=pairs_per_program(block_n, block_k, num_warps, pairs), WORK=work is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **stages)
    return out
