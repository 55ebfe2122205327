"""Grouping of (token, top-k) pairs by expert slot for the grouped (prefill) MoE GEMMs: the pairs sorted
by slot, each slot's group padded to a whole number of BLOCK_M rows, and the slot of every row block.
No host sync: the outputs are sized by a bound known on the host.

Two implementations with bitwise-equal results: three Triton launches (moe_align_count -> moe_align_scan ->
moe_align_place, a stable counting sort) for S <= MAX_TRITON_SLOTS on CUDA tensors or under Triton's
interpreter, else the torch reference `align_by_slot_torch` (~25 small launches: a 4k prefill is host-bound
on them, issue 9).

Shape legend: T tokens, K top-k columns (incl. a shared expert column), P = T*K pairs, S slots,
BM rows per block (BLOCK_M), B row blocks (bound), R = B*BM padded rows.
  slot_ids int32 [T, K] (-1: skipped pair) -> pairs int32 [R] (pair index t*K + k, -1 for padding),
  block_slots int32 [B] (slot of each block, -1 for blocks past the last used one).
Within a slot the pairs keep ascending pair order (a stable sort), so the layout and therefore every
result depend only on slot_ids, never on timing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from adapters.kernels.moe_align_count import MAX_SLOTS, count_chunks
from adapters.kernels.moe_align_place import CHUNK, place_pairs
from adapters.kernels.moe_align_scan import scan_chunks

# NOTE: the Triton path keeps [MAX_SLOTS] vectors per program and a [C, S] count table (C = P / 256 chunks);
# 1024 covers E + 1 groups up to E = 1023 experts (Qwen3.6: 257). Above it (a caller grouping by pool slot,
# thousands) the count table would grow with S, so the torch path runs.
MAX_TRITON_SLOTS = MAX_SLOTS


class Alignment(NamedTuple):
    pairs: torch.Tensor  # int32 [R]: pair index of each padded row, -1 for padding
    block_slots: torch.Tensor  # int32 [B]: slot of each block of BM rows, -1 for an unused block
    block_m: int


def max_blocks(num_pairs: int, groups: int, block_m: int) -> int:
    """Upper bound on the blocks of `num_pairs` pairs over at most `groups` distinct slots:
    sum_s ceil(n_s / BM) <= (P + groups * (BM - 1)) / BM."""
    groups = min(groups, num_pairs)
    return (num_pairs + groups * (block_m - 1)) // block_m


def narrow_keys(keys: torch.Tensor, bound: int) -> torch.Tensor:
    """keys (integers in [-1, bound]) in the narrowest of int16 / int32 / int64 that holds them, for sorting:
    a radix sort makes one pass per key byte, so int16 keys sort in 2 passes where int64 takes 8 (at a 4k
    prefill, three int64 sorts of 32,768 keys a MoE layer were ~60 launches and ~4 ms of a 187 ms step).
    Stable sorts of the narrowed keys give the same permutation. Raises ValueError on a negative bound."""
    if bound < 0:
        raise ValueError(f"narrow_keys: bound must be >= 0, got {bound}")
    for dtype in (torch.int16, torch.int32):
        if bound <= torch.iinfo(dtype).max:
            return keys.to(dtype)
    return keys.to(torch.int64)


def _check_args(slot_ids: torch.Tensor, num_slots: int, block_m: int, max_groups: int | None) -> int:
    """The arguments' checks of align_by_slot; returns the block bound B."""
    if slot_ids.dim() != 2 or slot_ids.dtype != torch.int32:
        raise ValueError(f"align_by_slot: slot_ids must be int32 [T, K], got {slot_ids.dtype} {tuple(slot_ids.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"align_by_slot: block_m={block_m} must be a power of two")
    if num_slots < 1:
        raise ValueError(f"align_by_slot: num_slots must be >= 1, got {num_slots}")
    pairs = slot_ids.numel()
    groups = min(pairs, num_slots) if max_groups is None else min(max_groups, pairs, num_slots)
    if groups < 0:
        raise ValueError(f"align_by_slot: max_groups must be >= 0, got {max_groups}")
    return max_blocks(pairs, groups, block_m)


def uses_triton(slot_ids: torch.Tensor, num_slots: int) -> bool:
    """Whether align_by_slot takes the Triton kernels: S <= MAX_TRITON_SLOTS and the ids on a CUDA device
    or Triton's interpreter on (TRITON_INTERPRET=1, the CPU test runs); else the torch reference."""
    return num_slots <= MAX_TRITON_SLOTS and (slot_ids.is_cuda or bool(triton.knobs.runtime.interpret))


def align_by_slot(slot_ids: torch.Tensor, num_slots: int, block_m: int, max_groups: int | None = None) -> Alignment:
    """Sort the pairs of slot_ids int32 [T, K] by slot and pad each slot's group to a multiple of block_m.

    num_slots: S, slot ids must lie in [-1, S) (not checked on the device: on the torch path an id >= S
    corrupts the grouping, the Triton path drops its pair). max_groups: bound on the distinct slot ids in
    slot_ids (default min(P, S)); a caller may pass a tighter one it can guarantee (e.g. experts per
    layer + 1), which shrinks the grid; a bound that is too small silently drops pairs (the same ones on
    both paths). Three Triton launches where `uses_triton`, else align_by_slot_torch; the results are
    bitwise equal. Raises ValueError on bad shapes or arguments.
    """
    if not uses_triton(slot_ids, num_slots):
        return align_by_slot_torch(slot_ids, num_slots, block_m, max_groups)
    return align_by_slot_triton(slot_ids, num_slots, block_m, max_groups)


def _up4(n: int) -> int:
    return (n + 3) & ~3


def align_by_slot_triton(slot_ids: torch.Tensor, num_slots: int, block_m: int, max_groups: int | None = None,
                         chunk: int = CHUNK) -> Alignment:
    """align_by_slot in three Triton launches (count per chunk, prefix over chunks, place + pad), for
    S <= MAX_TRITON_SLOTS; chunk: pairs per program (a power of two >= 32; tests shrink it to get many
    chunks at interpreter sizes). One int32 allocation, no fill kernel: pairs and block_slots are views of
    it, every element written by moe_align_place. Raises ValueError on bad shapes or arguments."""
    blocks = _check_args(slot_ids, num_slots, block_m, max_groups)
    if num_slots > MAX_TRITON_SLOTS:
        raise ValueError(f"align_by_slot_triton: num_slots={num_slots} > {MAX_TRITON_SLOTS}")
    rows = blocks * block_m
    flat = slot_ids.reshape(-1)  # [P] (a view when contiguous)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    chunks = -(-flat.numel() // chunk)  # NOTE: not triton.cdiv: a jit-callable, ~5 us of host time a call
    if rows == 0:  # no pairs, or a zero bound: nothing to place (and nothing to launch)
        empty = torch.empty(0, dtype=torch.int32, device=slot_ids.device)
        return Alignment(empty, empty, block_m)
    # NOTE: one buffer: [R] pairs | [B] block_slots | [C, S] per-chunk counts | [S] totals (the last two
    # are scratch the alignment keeps alive: C*S*4 bytes, 148 KB at a 4k prefill). Each part starts at a
    # multiple of 4 int32s: Triton specializes pointers on 16-byte alignment, and counts/totals at offsets
    # set by B and C (S = 257 by expert at Qwen3.6) compiled another binary per alignment on a request's path
    at_counts = _up4(rows + blocks)
    at_totals = at_counts + _up4(chunks * num_slots)
    work = torch.empty(at_totals + num_slots, dtype=torch.int32, device=slot_ids.device)
    pairs, block_slots = work[:rows], work[rows:rows + blocks]
    counts = work[at_counts:at_counts + chunks * num_slots].view(chunks, num_slots)
    totals = work[at_totals:]
    count_chunks(flat, num_slots, chunk, counts)
    scan_chunks(counts, totals)
    place_pairs(flat, counts, totals, block_m, chunk, pairs, block_slots)
    return Alignment(pairs, block_slots, block_m)


def align_by_slot_torch(slot_ids: torch.Tensor, num_slots: int, block_m: int,
                        max_groups: int | None = None) -> Alignment:
    """align_by_slot in torch ops (the reference, and the path for S > MAX_TRITON_SLOTS or CPU tensors
    without Triton's interpreter). Raises ValueError on bad shapes or arguments."""
    blocks = _check_args(slot_ids, num_slots, block_m, max_groups)
    device = slot_ids.device
    pairs = slot_ids.numel()
    rows = blocks * block_m
    flat = slot_ids.reshape(-1).to(torch.int64)  # [P]
    key = torch.where(flat >= 0, flat, num_slots)  # [P]; skipped pairs sort last, into the sink S
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_slots]  # [S] pairs per slot
    slot_blocks = (counts + block_m - 1) // block_m  # [S]
    block_end = torch.cumsum(slot_blocks, 0)  # [S] inclusive
    first_row = (block_end - slot_blocks) * block_m  # [S] first padded row of each slot's group
    first_sorted = torch.cumsum(counts, 0) - counts  # [S] first position of each slot in sorted order
    sorted_key, order = torch.sort(narrow_keys(key, num_slots), stable=True)  # [P], [P]
    sorted_key = sorted_key.to(torch.int64)
    live = sorted_key < num_slots
    slot = sorted_key.clamp(max=num_slots - 1)
    dest = first_row[slot] + torch.arange(pairs, device=device) - first_sorted[slot]  # [P]
    dest = torch.where(live & (dest < rows), dest, rows)  # skipped pairs land in a dump row, cut below
    out_pairs = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
    out_pairs.scatter_(0, dest, order.to(torch.int32))
    block = torch.arange(blocks, device=device)
    owner = torch.searchsorted(block_end, block, right=True)  # [B] first slot whose blocks end past b
    block_slots = torch.where(owner < num_slots, owner, -1).to(torch.int32)
    return Alignment(out_pairs[:rows], block_slots, block_m)


def choose_block_m(num_pairs: int, groups: int) -> int:
    """Rows per block for P pairs over about `groups` experts: the smallest of 16/32/64/128 that is not
    much below the mean group size (padding wastes at most one block per expert; bigger blocks reuse
    each weight tile over more rows). Depends only on its arguments, so the grouping (and the bits of
    the result) do not depend on how the caller splits a layer's experts into calls."""
    mean = num_pairs / max(1, min(groups, num_pairs))
    for block_m, up_to in ((16, 24), (32, 48), (64, 384)):
        if mean < up_to:
            return block_m
    return 128


def check_alignment(align: Alignment, slots: torch.Tensor, where: str) -> int:
    """Shape/dtype/device checks of an Alignment against the slot pool (host metadata only); returns the
    padded row count R."""
    pairs, block_slots, block_m = align
    if pairs.dtype != torch.int32 or block_slots.dtype != torch.int32 or pairs.dim() != 1 or block_slots.dim() != 1:
        raise ValueError(f"{where}: alignment tensors must be 1-D int32, got {pairs.dtype} {tuple(pairs.shape)} "
                         f"and {block_slots.dtype} {tuple(block_slots.shape)}")
    if block_m < 16 or block_m & (block_m - 1) or pairs.numel() != block_slots.numel() * block_m:
        raise ValueError(f"{where}: {pairs.numel()} rows are not {block_slots.numel()} blocks of {block_m} "
                         f"(a power of two >= 16)")
    if not (pairs.is_contiguous() and block_slots.is_contiguous()):
        raise ValueError(f"{where}: alignment tensors must be contiguous")
    if not pairs.device == block_slots.device == slots.device:
        raise ValueError(f"{where}: alignment on {pairs.device}, slots on {slots.device}")
    return pairs.numel()
