"""Step 2 of 3 of the Triton pair alignment (moe_align): per slot, an exclusive prefix over the chunks.

Shape legend: C chunks, S slots, BG slots per program.
  counts int32 [C, S] (moe_align_count's) -> in place: pairs of slot s in chunks before c;
  totals int32 [S]: pairs per slot.
Grid cdiv(S, BG): the chunk loop runs over BLOCK_C chunks at a time, so a 4k prefill (C = 144 at CHUNK 256)
is three steps per program. Graph-capturable: no host sync.
"""

import torch
import triton
import triton.language as tl

BLOCK_G = 32  # slots per program: a 128-byte row segment per chunk
# NOTE: built for sm_90 (cuobjdump): a [64, 32] step takes 86 registers under 4 warps, no spill; [256, 32]
# spilled 464 bytes under 4 warps and took 252 registers under 8
BLOCK_C = 64  # chunks per step of a program's loop (a 4k prefill: 144 chunks, 3 steps)


@triton.jit(do_not_specialize=["C", "S"])  # no recompiles across prefill sizes
def _moe_align_scan_kernel(counts_ptr, totals_ptr, C, S, BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BG] slots
    g_ok = g < S
    carry = tl.zeros((BLOCK_G,), dtype=tl.int32)  # pairs of each slot in the chunks done so far
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)  # [BC]
        ok = (c < C)[:, None] & g_ok[None, :]
        ptrs = counts_ptr + c[:, None] * S + g[None, :]  # [BC, BG]
        tile = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + carry[None, :], mask=ok)  # same program, same cells
        carry += tl.sum(tile, axis=0)
    tl.store(totals_ptr + g, carry, mask=g_ok)


def scan_chunks(counts: torch.Tensor, totals: torch.Tensor) -> None:
    """Turn counts int32 [C, S] (contiguous) in place into each slot's exclusive prefix over the chunks and
    write totals int32 [S] (pairs per slot). Raises ValueError on mismatched shapes."""
    if counts.dim() != 2 or counts.dtype != torch.int32 or not counts.is_contiguous():
        raise ValueError(f"scan_chunks: counts must be contiguous int32 [C, S], got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    chunks, num_slots = counts.shape
    if totals.shape != (num_slots,) or totals.dtype != torch.int32 or not totals.is_contiguous():
        raise ValueError(f"scan_chunks: totals must be contiguous int32 [{num_slots}], got {totals.dtype} "
                         f"{tuple(totals.shape)}")
    assert totals.device == counts.device
    assert counts.numel() + BLOCK_C * num_slots < 2**31, "offsets are int32"
    if num_slots:
        _moe_align_scan_kernel[(-(-num_slots // BLOCK_G),)](counts, totals, chunks, num_slots,
                                                                   BLOCK_C=BLOCK_C, BLOCK_G=BLOCK_G, num_warps=4)
