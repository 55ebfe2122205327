"""Routed experts, second half, expert-deduplicated (small-M decode): the weighted per-pair partials
y[t, k] = weights[t, k] * (h[t, k] @ down^T) in fp32, bitwise moe_down's partials mode, with each distinct
slot's down tile loaded and dequantized once for up to PAIRS of the pairs routed to it. moe_sum adds them
(k = 0..K-1 in order) afterwards, as after the per-pair kernel.

Shape legend: T tokens, K top-k, P pairs (T * K), H hidden, I expert intermediate, S slots, R row bytes,
M pairs per program (PAIRS).
  h [T, K, I] float; slot_ids int32 [T, K] (-1 = skip); weights fp32 [T, K]; slots uint8 [S, R];
  y [T, K, H] fp32.
Grid: (P, cdiv(H, BLOCK_N)), from shapes only; program (p, j) leads the chunk of p's segment starting at p
(dedup_gemv.segment_lead) or exits. A skipped pair's partial is left as it is (the caller's buffer: the
grouped path fills one over several calls) or, in a buffer this launcher allocates, zeroed by its own
program (ZERO_SKIPPED: no separate memset). No host sync, no sort, no atomics: graph-capturable.
NOTE: runs the per-pair kernel's tile (its autotuner's choice for the same key, read at every launch), so
every partial is bitwise moe_down's (dedup_gemv's NOTE says why that holds per member).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels import moe_down as per_pair
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
def _moe_down_dedup_kernel(h_ptr, slot_ids_ptr, weights_ptr, slots_ptr, y_ptr, work_ptr, S, P,
                           H: tl.constexpr, I: tl.constexpr, R: tl.constexpr,
                           D_DATA: tl.constexpr, D_SCALE: tl.constexpr, D_GSCALE: tl.constexpr,
                           W_DTYPE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                           PB: tl.constexpr, PAIRS: tl.constexpr, ZERO_SKIPPED: tl.constexpr, WORK: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)  # a pair t * K + k
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)  # [N] rows of down = columns of y
    n_ok = n < H
    slot, lead, count, rank = segment_lead(slot_ids_ptr, p, P, PB, PAIRS)
    tl.device_assert(slot < S, "slot id past the pool")
    if WORK:  # test hook: which programs stream weights
        tl.store(work_ptr + p * tl.num_programs(1) + tl.program_id(1), lead.to(tl.int32))
    if ZERO_SKIPPED:
        if slot < 0:
            tl.store(y_ptr + p.to(tl.int64) * H + n, tl.zeros([BLOCK_N], dtype=tl.float32), mask=n_ok)
    if lead:
        i0 = p
        i1, i2, i3 = chunk_members(slot_ids_ptr, p, slot, rank, count, P, PB)
        row = slots_ptr + slot.to(tl.int64) * R  # int64: S * R passes 2^31 at real pool sizes
        a0, a1, a2, a3 = packed_gemv_multi(row, h_ptr + i0.to(tl.int64) * I, h_ptr + i1.to(tl.int64) * I,
                                           h_ptr + i2.to(tl.int64) * I, h_ptr + i3.to(tl.int64) * I, count, n0,
                                           H, I, D_DATA, D_SCALE, D_GSCALE, W_DTYPE, FMT, GROUP, PAIRS,
                                           BLOCK_N, BLOCK_K)
        # the weight times the partial, rounded once and stored: moe_down's partials mode
        tl.store(y_ptr + i0.to(tl.int64) * H + n, tl.load(weights_ptr + i0) * a0, mask=n_ok)
        if count > 1:
            tl.store(y_ptr + i1.to(tl.int64) * H + n, tl.load(weights_ptr + i1) * a1, mask=n_ok)
        if count > 2:
            tl.store(y_ptr + i2.to(tl.int64) * H + n, tl.load(weights_ptr + i2) * a2, mask=n_ok)
        if count > 3:
            tl.store(y_ptr + i3.to(tl.int64) * H + n, tl.load(weights_ptr + i3) * a3, mask=n_ok)


def moe_down_dedup(h: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                   layout: ExpertLayout, partials: torch.Tensor | None = None, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int = 4, pairs: int | None = None,
                   work: torch.Tensor | None = None) -> torch.Tensor:
    """Partials y fp32 [T, K, H]: y[t, k] = weights[t, k] * (h[t, k] @ down^T), bitwise moe_down's partials
    mode, with each distinct slot's weights streamed once per PAIRS of its pairs. Sum them with moe_sum.

    h [T, K, I] bf16/fp16/fp32 (moe_gate_up's output); slot_ids int32 [T, K] (-1: that partial untouched;
    ids < S); weights fp32 [T, K]; slots uint8 [S, R] contiguous. partials: contiguous fp32 [T, K, H] to
    fill (only the pairs whose slot is not -1); None: a new buffer, skipped pairs zeroed.
    Tiles: block_n/block_k None on CUDA: the per-pair kernel's tuned tile for this key (tuning it once here,
    outside a graph capture, if it never ran); otherwise as moe_down (block_n 16, block_k 128/256).
    pairs: pairs per program (1..4; None: dedup_gemv.pairs_per_program). work (tests): int32
    [T*K, cdiv(H, block_n)], set to 1 where a program streamed weights.
    Raises ValueError on any shape, dtype, device or block-size mismatch, or more than MAX_DEDUP_PAIRS pairs.
    """
    if h.dim() != 3 or h.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"moe_down_dedup: h must be bf16/fp16/fp32 [T, K, I], got {h.dtype} {tuple(h.shape)}")
    tokens, k, inter = h.shape
    if inter != layout.intermediate:
        raise ValueError(f"moe_down_dedup: h has I={inter}, layout has I={layout.intermediate}")
    if check_pool(slot_ids, slots, layout, tokens, "moe_down_dedup") != k:
        raise ValueError(f"moe_down_dedup: slot_ids {tuple(slot_ids.shape)} and h {tuple(h.shape)} disagree on K")
    if weights.dtype != torch.float32 or weights.shape != (tokens, k):
        raise ValueError(f"moe_down_dedup: weights must be fp32 [{tokens}, {k}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if not h.device == weights.device == slots.device:
        raise ValueError(f"moe_down_dedup: h on {h.device}, weights on {weights.device}, slots on {slots.device}")
    if tokens * k > MAX_DEDUP_PAIRS:
        raise ValueError(f"moe_down_dedup: {tokens} x {k} pairs exceed MAX_DEDUP_PAIRS={MAX_DEDUP_PAIRS}")
    tuned, block_n, block_k = resolve_tiles(layout, block_n, block_k, slots.is_cuda, "moe_down_dedup")
    hidden = layout.hidden
    zero_skipped = partials is None
    if partials is None:
        partials = torch.empty((tokens, k, hidden), dtype=torch.float32, device=h.device)
    elif partials.shape != (tokens, k, hidden) or partials.dtype != torch.float32 or not partials.is_contiguous():
        raise ValueError(f"moe_down_dedup: partials must be contiguous fp32 [{tokens}, {k}, {hidden}], "
                         f"got {partials.dtype} {tuple(partials.shape)}")
    if tokens == 0:
        return partials
    c = layout_consts(layout)
    h, slot_ids, weights = h.contiguous(), slot_ids.contiguous(), weights.contiguous()
    key = dict(K=k, H=hidden, I=inter, R=c.row_bytes, FMT=c.fmt_code)
    tile_key = {**key, "PAIRS_BUCKET": pairs_bucket(tokens * k)}  # the per-pair autotuner's key
    stages = {}
    if tuned:
        def tune():  # the per-pair kernel on a scratch buffer: the caller's partials stay untouched
            scratch = torch.zeros((tokens, k, hidden), dtype=torch.float32, device=h.device)
            per_pair.moe_down(h, slot_ids, weights, slots, layout, partials=scratch)

        block_n, block_k, num_warps, num_stages = per_pair_tile(per_pair._TUNED, h.dtype, tile_key, tune)
        stages = {"num_stages": num_stages}
    tiles = triton.cdiv(hidden, block_n)
    if work is not None and (work.shape != (tokens * k, tiles) or work.dtype != torch.int32):
        raise ValueError(f"moe_down_dedup: work must be int32 [{tokens * k}, {tiles}], got {work.dtype} "
                         f"{tuple(work.shape)}")
    work_arg = work if work is not None else torch.empty(1, dtype=torch.int32, device=h.device)
    _moe_down_dedup_kernel[(tokens * k, tiles)](
        h, slot_ids, weights, slots, partials, work_arg, slots.shape[0], tokens * k,
        H=hidden, I=inter, R=c.row_bytes, D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale,
        W_DTYPE=c.down.w_dtype, FMT=c.fmt_code, GROUP=max(c.group, 1), PB=padded_pairs(tokens * k),
        PAIRS=pairs_per_program(block_n, block_k, num_warps, pairs), ZERO_SKIPPED=zero_skipped,
        WORK=work is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **stages)
    return partials
