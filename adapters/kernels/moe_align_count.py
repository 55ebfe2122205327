"""Step 1 of 3 of the Triton pair alignment (moe_align): each chunk's pairs per slot.

Shape legend: P = T*K pairs (slot_ids flattened), S slots (<= MAX_SLOTS), C = cdiv(P, CHUNK) chunks, NB =
MAX_SLOTS (the histogram's bins).
  slot_ids int32 [P] (-1: skipped) -> counts int32 [C, S]: pairs of chunk c routed to slot s.
Ids outside [0, S) are counted nowhere (moe_align_place then drops them too), so a stray id cannot send a
later gather out of bounds. Graph-capturable: no host sync, every count written (no memset needed).
"""

import torch
import triton
import triton.language as tl

# NOTE: the alignment kernels' bound on S, also their fixed [NB] vector width: one build per kernel for every
# S (a pool resize or another model does not recompile on a request's path); 1024 bins cost a 4k prefill
# nothing measurable next to the launches they replace (S = 257 for Qwen3.6).
MAX_SLOTS = 1024


@triton.jit(do_not_specialize=["P", "S"])  # no recompiles across prefill sizes
def _moe_align_count_kernel(slot_ids_ptr, counts_ptr, P, S, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] pair indices
    key = tl.load(slot_ids_ptr + offs, mask=offs < P, other=-1)
    live = (key >= 0) & (key < S)
    hist = tl.histogram(key, BLOCK_S, mask=live)  # [NB] int32
    bins = tl.arange(0, BLOCK_S)
    tl.store(counts_ptr + pid * S + bins, hist, mask=bins < S)


def count_chunks(slot_ids: torch.Tensor, num_slots: int, chunk: int, counts: torch.Tensor) -> torch.Tensor:
    """Fill counts int32 [C, S] (C = cdiv(P, chunk)) with each chunk's pairs per slot of slot_ids int32 [P]
    (contiguous); 1 <= S <= MAX_SLOTS; chunk: a power of two >= 16. Returns counts. Raises ValueError on
    mismatched shapes or S out of range."""
    pairs = slot_ids.numel()
    chunks = -(-pairs // chunk)
    if slot_ids.dim() != 1 or slot_ids.dtype != torch.int32 or not slot_ids.is_contiguous():
        raise ValueError(f"count_chunks: slot_ids must be contiguous int32 [P], got {slot_ids.dtype} "
                         f"{tuple(slot_ids.shape)}")
    if not 1 <= num_slots <= MAX_SLOTS:
        raise ValueError(f"count_chunks: num_slots={num_slots} outside [1, {MAX_SLOTS}]")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"count_chunks: chunk={chunk} must be a power of two >= 16")
    if counts.shape != (chunks, num_slots) or counts.dtype != torch.int32 or not counts.is_contiguous():
        raise ValueError(f"count_chunks: counts must be contiguous int32 [{chunks}, {num_slots}], got "
                         f"{counts.dtype} {tuple(counts.shape)}")
    assert counts.device == slot_ids.device
    assert chunks * max(num_slots, chunk) < 2**31, "offsets are int32"
    if chunks:
        # NOTE: no more threads than keys: the histogram's CUDA lowering divides counts of replicated inputs
        # by a replication factor; one key per lane or more keeps that path out (chunk 32: one warp)
        _moe_align_count_kernel[(chunks,)](slot_ids, counts, pairs, num_slots, CHUNK=chunk,
                                           BLOCK_S=MAX_SLOTS, num_warps=max(1, min(4, chunk // 32)))
    return counts
