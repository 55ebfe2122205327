"""Step 3 of 3 of the Triton pair alignment (moe_align): every pair's padded row, the padding, and the
slot of every row block, all in one launch.

Shape legend: P pairs, S slots, NB = MAX_SLOTS >= S (moe_align_count's), C = cdiv(P, CHUNK) chunks, BM rows
per block, B blocks (the host's bound), R = B*BM rows, BT blocks per padding program.
  slot_ids int32 [P], base int32 [C, S] (moe_align_scan's prefix), totals int32 [S]
  -> pairs int32 [R] (pair index, -1 for padding), block_slots int32 [B] (slot, -1 past the last used block).
Programs [0, C) place one chunk's pairs each: row = first_row[s] + base[c, s] + (earlier pairs of the chunk
with the same slot), a stable counting sort, so a slot's pairs keep ascending pair order (the torch
reference's stable sort). Programs [C, C + cdiv(B, BT)) own BT blocks each: their slot and the -1 of every
padding row. The two sets of rows are disjoint and cover [0, R), so no memset is needed. Pairs whose row
would be >= R (a max_groups bound that was too small) are dropped, as in the reference. Every program
rebuilds the slot layout (blocks per slot, their prefix) from totals: S values, cheaper than a launch.
Graph-capturable: no host sync.
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.moe_align_count import MAX_SLOTS

CHUNK = 256  # pairs per placing program (moe_align_count's chunk)
SUB = 32  # earlier pairs compared per step: a [SUB, CHUNK] tile instead of [CHUNK, CHUNK] in registers
# NOTE: built for sm_90 (cuobjdump, BM 16/64/128, NB 1024): 32 registers under 8 warps (83 under 4), no
# spill; the SUB loop must stay a runtime loop (range): unrolled (tl.static_range) it took 255 registers
NUM_WARPS = 8
ROWS_PER_PROGRAM = 2048  # padding rows per program (BT = ROWS_PER_PROGRAM // BM blocks, at least 32)


# NOTE: builds differ only by BM (16/32/64/128 in serving): the integers change with every prefill size
@triton.jit(do_not_specialize=["P", "S", "C", "B", "R"])
def _moe_align_place_kernel(slot_ids_ptr, base_ptr, totals_ptr, pairs_ptr, block_slots_ptr, P, S, C, B, R,
                            BM: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_S: tl.constexpr,
                            BT: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.arange(0, BLOCK_S)  # [NB] slots
    g_ok = g < S
    n = tl.load(totals_ptr + g, mask=g_ok, other=0)  # [NB] pairs per slot
    nblk = (n + BM - 1) // BM
    end = tl.cumsum(nblk, axis=0)  # [NB] block after each slot's last
    first = (end - nblk) * BM  # [NB] first padded row of each slot
    if pid < C:
        offs = pid * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] pair indices
        key = tl.load(slot_ids_ptr + offs, mask=offs < P, other=-1)
        live = (key >= 0) & (key < S)
        rank = tl.zeros((CHUNK,), dtype=tl.int32)  # earlier pairs of this chunk in the same slot
        for i0 in range(0, CHUNK, SUB):
            offs_i = pid * CHUNK + i0 + tl.arange(0, SUB)  # [SUB]
            key_i = tl.load(slot_ids_ptr + offs_i, mask=offs_i < P, other=-1)
            same = (key_i[:, None] == key[None, :]) & (offs_i[:, None] < offs[None, :])  # [SUB, CHUNK]
            rank += tl.sum(same.to(tl.int32), axis=0)
        k = tl.where(live, key, 0)
        before = tl.load(base_ptr + pid * S + k, mask=live, other=0)  # this slot's pairs in earlier chunks
        dest = tl.gather(first, k, 0) + before + rank
        tl.store(pairs_ptr + dest, offs, mask=live & (dest < R))
    else:
        b0 = (pid - C) * BT
        b = b0 + tl.arange(0, BT)  # [BT] blocks
        # owner(b) = slots whose blocks end at or before b (a searchsorted over the sorted `end`): the slots
        # ending before this tile, plus a running count of those ending inside it
        ended = tl.sum((g_ok & (end <= b0)).to(tl.int32), axis=0)
        inside = g_ok & (end > b0) & (end < b0 + BT)
        owner = ended + tl.cumsum(tl.histogram(end - b0, BT, mask=inside), axis=0)  # [BT]
        # NOTE: slot s owns the blocks b with end[s-1] <= b < end[s]; bin i counts the slots with end = b0 + i
        # (bin 0 stays empty: those are in `ended`), so the inclusive cumsum at i counts end <= b0 + i
        own = owner < S
        tl.store(block_slots_ptr + b, tl.where(own, owner, -1), mask=b < B)
        o = tl.where(own, owner, 0)
        limit = tl.where(own, tl.gather(first + n, o, 0), 0)  # [BT] first padding row of each block's slot
        rows = b[:, None] * BM + tl.arange(0, BM)[None, :]  # [BT, BM]
        pad = (b < B)[:, None] & (rows >= limit[:, None])
        tl.store(pairs_ptr + rows, tl.full((BT, BM), -1, tl.int32), mask=pad)


def blocks_per_program(block_m: int) -> int:
    """BT, the blocks of one padding program: ROWS_PER_PROGRAM rows, but at least 32 blocks. NOTE: BT is
    the bin count of that program's tl.histogram, whose CUDA lowering gives each lane of a warp
    bins / 32 bins: fewer than 32 bins would count nothing (an assert that release builds of the compiler
    drop; newer ones pad the bins)."""
    return max(32, ROWS_PER_PROGRAM // block_m)


def place_pairs(slot_ids: torch.Tensor, base: torch.Tensor, totals: torch.Tensor, block_m: int, chunk: int,
                pairs: torch.Tensor, block_slots: torch.Tensor) -> None:
    """Write pairs int32 [R] and block_slots int32 [B] (R = B*block_m, both contiguous, every element
    written) from slot_ids int32 [P], base int32 [C, S] (C = cdiv(P, chunk)) and totals int32 [S] (see the
    module docstring). block_m: a power of two; chunk: moe_align_count's, a power of two >= SUB.
    Raises ValueError on mismatched shapes."""
    num_pairs = slot_ids.numel()
    chunks = -(-num_pairs // chunk)
    blocks = block_slots.numel()
    if slot_ids.dim() != 1 or slot_ids.dtype != torch.int32 or not slot_ids.is_contiguous():
        raise ValueError(f"place_pairs: slot_ids must be contiguous int32 [P], got {slot_ids.dtype} "
                         f"{tuple(slot_ids.shape)}")
    if chunk < SUB or chunk & (chunk - 1):
        raise ValueError(f"place_pairs: chunk={chunk} must be a power of two >= {SUB}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"place_pairs: block_m={block_m} must be a power of two")
    num_slots = totals.numel()
    for name, t, shape in (("base", base, (chunks, num_slots)), ("totals", totals, (num_slots,)),
                           ("pairs", pairs, (blocks * block_m,)), ("block_slots", block_slots, (blocks,))):
        if t.shape != shape or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"place_pairs: {name} must be contiguous int32 {list(shape)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
        assert t.device == slot_ids.device
    if not 1 <= num_slots <= MAX_SLOTS:
        raise ValueError(f"place_pairs: {num_slots} slots outside [1, {MAX_SLOTS}]")
    assert base.numel() + chunk < 2**31 and pairs.numel() + num_pairs < 2**31, "int32 offsets"
    bt = blocks_per_program(block_m)
    grid = chunks + -(-blocks // bt)
    if grid:
        _moe_align_place_kernel[(grid,)](slot_ids, base, totals, pairs, block_slots, num_pairs, num_slots, chunks,
                                         blocks, pairs.numel(), BM=block_m, CHUNK=chunk, SUB=SUB,
                                         BLOCK_S=MAX_SLOTS, BT=bt, num_warps=NUM_WARPS)
