"""Building blocks of the expert-deduplicated decode GEMVs (moe_gate_up_dedup, moe_down_dedup; no kernel of
its own): the in-kernel segment logic that lets one program stream an expert's weight tile once for every
pair routed to that slot, the multi-pair packed GEMV that applies one dequantized tile to up to 4 input
vectors, and the host lookup of the per-pair kernels' tuned tile (the dedup kernels must run that tile to
give the per-pair path's bits).

Shape legend: P pairs (T * K, the flattened slot_ids), PB pairs padded to a power of two, N output rows of
a tile (BLOCK_N), C input columns, BK columns per K step (BLOCK_K), G columns per scale group, M pairs per
program (PAIRS, 1..4).

Segments: the pairs with one slot id form a segment, its members in pair order; a segment holds at most T
pairs (an expert appears once per token). Member r's program is the chunk leader when r % M == 0 and then
computes members r .. r + M - 1; every other program (and a pair whose slot is -1) does no GEMV, so the
working programs per row tile are sum over slots of ceil(pairs / M), whatever the routing.

NOTE (bit-equality with packed_gemv): for each member, `packed_gemv_multi` performs packed_gemv's
operations in packed_gemv's order on the same [BLOCK_N, BLOCK_K] tile: the same dequantization, the same
elementwise fp32 accumulation over K steps (the same FMA contraction pattern: acc + product), one tl.sum
over the tile's columns after the loop, the row-constant scale last. Only the weight loads are shared
between members. The tl.sum's order depends on the accumulator's layout, which Triton derives from the
weight-tile loads (identical pointers); tests/adapters/test_kernels_moe_dedup.py compares the reduce
layouts of both kernels in the sm_90 build, and the GPU test compares the bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.kernels.packed_gemv import acc_cols, autotune_key, load_tile, load_x, row_scale, term

MAX_PAIRS = 4  # accumulators per program (registers: PAIRS x BLOCK_N x BLOCK_K fp32)
MAX_DEDUP_PAIRS = 1024  # pairs of one call: the segment logic holds every slot id in one program's registers


@triton.jit
def segment_lead(slot_ids_ptr, p, P, PB: tl.constexpr, PAIRS: tl.constexpr):
    """For pair p: (slot, lead, count, rank). lead: p starts a chunk of its segment (slot >= 0 and p's rank
    among its segment's members, `rank`, a multiple of PAIRS); count: members of that chunk (1..PAIRS)."""
    q = tl.arange(0, PB)  # [PB]
    slot = tl.load(slot_ids_ptr + p)
    ids = tl.load(slot_ids_ptr + q, mask=q < P, other=-1)  # [PB]
    member = ((ids == slot) & (q < P)).to(tl.int32)  # [PB] 1 for the members of p's segment
    rank = tl.sum(tl.where(q < p, member, 0), axis=0)  # members before p
    total = tl.sum(member, axis=0)
    lead = (slot >= 0) & (rank % PAIRS == 0)
    return slot, lead, tl.minimum(total - rank, PAIRS), rank


@triton.jit
def chunk_members(slot_ids_ptr, p, slot, rank, count, P, PB: tl.constexpr):
    """(i1, i2, i3): the pair indices of members rank + 1 .. rank + 3 of p's segment (pair order); those past
    `count` repeat p. Only a chunk leader calls it (the segment's slot ids come from L1/L2 again)."""
    q = tl.arange(0, PB)  # [PB]
    ids = tl.load(slot_ids_ptr + q, mask=q < P, other=-1)  # [PB]
    same = (ids == slot) & (q < P)
    order = tl.cumsum(same.to(tl.int32), axis=0) - 1  # [PB] a member's rank in its segment
    i1 = tl.sum(tl.where(same & (order == rank + 1), q, 0), axis=0)
    i2 = tl.sum(tl.where(same & (order == rank + 2), q, 0), axis=0)
    i3 = tl.sum(tl.where(same & (order == rank + 3), q, 0), axis=0)
    return tl.where(count > 1, i1, p), tl.where(count > 2, i2, p), tl.where(count > 3, i3, p)


@triton.jit
def packed_gemv_multi(row_ptr, x0_ptr, x1_ptr, x2_ptr, x3_ptr, count, n0,
                      ROWS: tl.constexpr, COLS: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr,
                      GSCALE: tl.constexpr, W_DTYPE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                      PAIRS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(a0, a1, a2, a3) fp32 [N]: a_m = W[n0 : n0 + BLOCK_N, :] @ x_m for the first `count` (1..PAIRS) of the
    four input vectors (x_m [COLS] float; the others' results are undefined), each bitwise packed_gemv's
    result for that vector, with each weight tile loaded and dequantized once for all of them."""
    n = n0 + tl.arange(0, BLOCK_N)  # [N]
    n_ok = n < ROWS  # [N]
    EVEN: tl.constexpr = (ROWS % BLOCK_N == 0) and (COLS % BLOCK_K == 0)
    FOLD: tl.constexpr = FMT == 1 and EVEN and BLOCK_N <= GROUP
    kk = tl.arange(0, BLOCK_K)
    gi = tl.arange(0, BLOCK_K // GROUP)
    acc0 = tl.zeros([BLOCK_N, acc_cols(FMT, BLOCK_K, GROUP)], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, acc_cols(FMT, BLOCK_K, GROUP)], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, acc_cols(FMT, BLOCK_K, GROUP)], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, acc_cols(FMT, BLOCK_K, GROUP)], dtype=tl.float32)
    for k0 in range(0, COLS, BLOCK_K):
        w, s = load_tile(row_ptr, n, n_ok, n0, k0, kk, gi, DATA, SCALE, COLS, W_DTYPE, FMT, GROUP, EVEN, FOLD,
                         BLOCK_N, BLOCK_K)  # [N, BK] fp32 and the step's scales, as packed_gemv loads them
        acc0 += term(w, load_x(x0_ptr, k0, kk, COLS, EVEN), s, FMT, FOLD, BLOCK_N, BLOCK_K, GROUP)
        # NOTE: uniform branches: a chunk of one pair (most routed experts at random routing) pays one FMA
        # per weight, as the per-pair kernel
        if PAIRS > 1:
            if count > 1:
                acc1 += term(w, load_x(x1_ptr, k0, kk, COLS, EVEN), s, FMT, FOLD, BLOCK_N, BLOCK_K, GROUP)
        if PAIRS > 2:
            if count > 2:
                acc2 += term(w, load_x(x2_ptr, k0, kk, COLS, EVEN), s, FMT, FOLD, BLOCK_N, BLOCK_K, GROUP)
        if PAIRS > 3:
            if count > 3:
                acc3 += term(w, load_x(x3_ptr, k0, kk, COLS, EVEN), s, FMT, FOLD, BLOCK_N, BLOCK_K, GROUP)
    a0 = row_scale(tl.sum(acc0, axis=1), row_ptr, n, n_ok, SCALE, GSCALE, FMT)  # [N]
    a1 = a0
    a2 = a0
    a3 = a0
    if PAIRS > 1:
        a1 = row_scale(tl.sum(acc1, axis=1), row_ptr, n, n_ok, SCALE, GSCALE, FMT)
    if PAIRS > 2:
        a2 = row_scale(tl.sum(acc2, axis=1), row_ptr, n, n_ok, SCALE, GSCALE, FMT)
    if PAIRS > 3:
        a3 = row_scale(tl.sum(acc3, axis=1), row_ptr, n, n_ok, SCALE, GSCALE, FMT)
    return a0, a1, a2, a3


# ---- host side --------------------------------------------------------------------------------------

def pairs_per_program(block_n: int, block_k: int, num_warps: int, pairs: int | None = None) -> int:
    """Accumulators per program: as many as fit 64 fp32 registers per thread (4 at a 16x128 tile on 4 warps,
    2 at 32 registers per accumulator), at most MAX_PAIRS; `pairs` overrides (1..MAX_PAIRS).
    Raises ValueError for a pairs outside 1..MAX_PAIRS."""
    if pairs is not None:
        if not 1 <= pairs <= MAX_PAIRS:
            raise ValueError(f"pairs={pairs} must be 1..{MAX_PAIRS}")
        return pairs
    per_acc = max(1, block_n * block_k // (32 * num_warps))
    return max(1, min(MAX_PAIRS, 64 // per_acc))


def padded_pairs(pairs: int) -> int:
    """PB: the pair count rounded up to a power of two (the segment logic loads every slot id at once)."""
    return triton.next_power_of_2(max(pairs, 1))


def per_pair_tile(tuner, act: torch.dtype, values: dict, tune) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) the per-pair kernel's autotuner chose for this key, read
    from its cache at every call (the expert-parallel path may replace it with rank 0's choice). Not tuned
    yet: `tune()` runs the per-pair launcher once on the caller's inputs (it measures its tiles there, as
    the per-pair path would have) — refused inside a CUDA graph capture (tune before capturing, as
    DeviceExpertPool.tune does). Raises RuntimeError when the choice cannot be found."""
    key = autotune_key(tuner, act, values)
    cfg = tuner.cache.get(key)
    if cfg is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"dedup GEMV: the per-pair kernel is not tuned for {key}; tune before capture")
        tune()
        cfg = tuner.cache.get(key)
        if cfg is None:
            raise RuntimeError(f"dedup GEMV: the per-pair autotuner filed its choice under another key than "
                               f"{key} (Triton's key format changed?): the tiles, and so the bits, could differ")
    return cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_K"], cfg.num_warps, cfg.num_stages
