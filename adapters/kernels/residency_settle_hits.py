"""A decode step's residency bookkeeping for a pool that holds every key, once per step instead of once per
layer: the keys the step's routers marked in a presence map (moe_router's ResidentSlots) become most recently
used, in ascending flat-key order, and count as hits; the map is cleared for the next step.

Shape legend: N flat keys (L*E), P = N + 1 (the table's sink entry), S slots.

Why this equals the per-layer lookups (residency_lookup.py) it replaces, stamp for stamp: with every key
resident no lookup misses, so layer l's lookup only stamps its distinct keys clock_l + rank (rank among them,
ascending) and advances the clock by their count. Layer l's keys are l*E + id, all above layer l-1's, so
clock_l + rank is clock_0 + (the number of the step's distinct keys below the key): one exclusive prefix sum
over the presence map gives every stamp, and the clock ends at clock_0 + the step's distinct keys, as after
the L lookups. Tables: slot_of_key int64 [P], stamp int64 [S + 1], clock int64 [], counters int64 [3]
(hits, misses, evictions). Graph-capturable: grid (1,), no host sync.
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _settle_hits_kernel(presence_ptr, slot_of_ptr, stamp_ptr, clock_ptr, counters_ptr, N,
                        BLOCK_N: tl.constexpr):
    clock = tl.load(clock_ptr)
    below = clock * 0  # distinct keys of the step below the current block
    for k0 in range(0, N, BLOCK_N):
        offs = k0 + tl.arange(0, BLOCK_N)
        marked = tl.load(presence_ptr + offs, mask=offs < N, other=0).to(tl.int32)  # [BN] 0/1
        present = marked != 0
        rank = below + tl.cumsum(marked, axis=0) - marked  # [BN] exclusive: distinct keys below each
        slot = tl.load(slot_of_ptr + offs, mask=present, other=0)
        tl.store(stamp_ptr + slot, clock + rank, mask=present)
        tl.store(presence_ptr + offs, tl.zeros((BLOCK_N,), tl.uint8), mask=present)
        below += tl.sum(marked, axis=0)
    tl.store(clock_ptr, clock + below)
    tl.store(counters_ptr, tl.load(counters_ptr) + below)


def settle_hits(presence: torch.Tensor, slot_of_key: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor,
                counters: torch.Tensor) -> None:
    """Stamp the keys marked in presence uint8 [P] (1 = used this step) most recently used in ascending key
    order, add their count to counters[0] (hits) and to the clock, clear presence. Every marked key must be
    resident (slot_of_key >= 0): the caller's pool holds every key. Entry P - 1 (the sink) is never read."""
    keys = slot_of_key.numel() - 1
    assert presence.dtype == torch.uint8 and presence.shape == (keys + 1,), \
        f"presence must be uint8 [{keys + 1}], got {presence.dtype} {tuple(presence.shape)}"
    assert slot_of_key.dtype == stamp.dtype == clock.dtype == counters.dtype == torch.int64
    assert clock.numel() == 1 and counters.numel() == 3 and slot_of_key.is_contiguous()
    assert len({t.device for t in (presence, slot_of_key, stamp, clock, counters)}) == 1, "one device"
    _settle_hits_kernel[(1,)](presence, slot_of_key, stamp, clock, counters, keys, BLOCK_N=BLOCK, num_warps=4)
