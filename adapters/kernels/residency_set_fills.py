"""Second half of a prefill chunk's lookup of one layer's expert set (DeviceResidency.lookup_set; the first,
residency_set_hits.py, stamped the hits and wrote the victim candidates): every miss, in ascending key order,
takes the next victim (victims: the slots of the smallest candidate stamps, ascending, from torch.topk), the
tables change, the clock and counters advance, and the layer's slot map and fill lists are written.

Shape legend: E experts of the layer, S slots, V victims (min(E, S)), L*E flat keys.
Outputs: fill_keys / fill_slots int64 [E] (the misses in ascending key order, then -1: what the gather copies),
slot_map int32 [E+2] (slot of each expert after the lookup, -1 where not routed or another rank's; entry E the
layer's shared-expert slot, E+1 = -1: the map the grouped GEMMs' blocks are translated through).
Decisions are lookup_flat's and domain.residency.ExpertResidency's (residency_lookup.py lists them).
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.residency_set_hits import MAX_EXPERTS, set_keys


# NOTE: the integer arguments are not specialized (Triton would compile a variant per layer base % 16 and per
# shared slot % 16): one binary per E class, compiled by the prefill warm-up
@triton.jit(do_not_specialize=["E", "V", "base", "rank", "shared_slot"])
def _set_fills_kernel(present_ptr, slot_of_ptr, key_of_ptr, stamp_ptr, clock_ptr, counters_ptr, owner_ptr, victims_ptr,
                      fill_keys_ptr, fill_slots_ptr, slot_map_ptr, E, V, base, rank, shared_slot,
                      HAS_OWNER: tl.constexpr, BLOCK_E: tl.constexpr):
    e, key, valid, order = set_keys(present_ptr, owner_ptr, E, base, rank, HAS_OWNER, BLOCK_E)  # set_hits' lanes
    slot_before = tl.load(slot_of_ptr + key, mask=valid, other=-1)
    hit = valid & (slot_before >= 0)
    miss = valid & (slot_before < 0)
    miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1  # [BE] the misses' victims in ascending key order
    victim = tl.load(victims_ptr + miss_rank, mask=miss & (miss_rank < V), other=-1)
    old = tl.load(key_of_ptr + victim, mask=miss & (victim >= 0), other=-1)  # the key each fill evicts
    evicting = miss & (old >= 0)
    clock = tl.load(clock_ptr)
    # NOTE: a victim never holds a requested key (hits are stamped above every candidate, misses hold no
    # slot), so the evicted keys' entries and the filled keys' entries are disjoint writes
    tl.store(slot_of_ptr + old, -1, mask=evicting)
    tl.store(slot_of_ptr + key, victim, mask=miss)
    tl.store(key_of_ptr + victim, key, mask=miss)
    tl.store(stamp_ptr + victim, clock + order, mask=miss)
    lanes = e < E
    tl.store(fill_keys_ptr + e, tl.full((BLOCK_E,), -1, tl.int64), mask=lanes)
    tl.store(fill_slots_ptr + e, tl.full((BLOCK_E,), -1, tl.int64), mask=lanes)
    tl.debug_barrier()  # the misses overwrite the -1s other threads wrote
    tl.store(fill_keys_ptr + miss_rank, key.to(tl.int64), mask=miss)
    tl.store(fill_slots_ptr + miss_rank, victim, mask=miss)
    slot_after = tl.where(hit, slot_before, tl.where(miss, victim, -1))
    tl.store(slot_map_ptr + e, slot_after.to(tl.int32), mask=lanes)
    tl.store(slot_map_ptr + E + e, tl.where(e == 0, shared_slot, -1).to(tl.int32), mask=e < 2)
    tl.store(clock_ptr, clock + tl.sum(valid.to(tl.int64), axis=0))
    n_hit = tl.sum(hit.to(tl.int64), axis=0)
    n_miss = tl.sum(miss.to(tl.int64), axis=0)
    n_evict = tl.sum(evicting.to(tl.int64), axis=0)
    tl.store(counters_ptr, tl.load(counters_ptr) + n_hit)
    tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + n_miss)
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + n_evict)


def set_fills(present: torch.Tensor, base: int, slot_of_key: torch.Tensor, key_of_slot: torch.Tensor,
              stamp: torch.Tensor, clock: torch.Tensor, counters: torch.Tensor, victims: torch.Tensor,
              fill_keys: torch.Tensor, fill_slots: torch.Tensor, slot_map: torch.Tensor, shared_slot: int = -1,
              owner: torch.Tensor | None = None, rank: int = 0) -> None:
    """Finish the set lookup of present [E] (bool) after set_hits: victims int64 [V] are the candidate slots
    in ascending stamp order (V >= the misses: callers pass min(E, S) from topk). Writes fill_keys, fill_slots
    int64 [E], slot_map int32 [E+2] (see the module docstring) and updates the tables, the clock and the
    counters int64 [3] (hits, misses, evictions). Raises AssertionError on bad shapes."""
    experts = present.shape[0]
    assert present.dtype == torch.bool and present.dim() == 1 and 0 < experts <= MAX_EXPERTS
    assert fill_keys.shape == fill_slots.shape == (experts,) and fill_keys.dtype == fill_slots.dtype == torch.int64
    assert slot_map.shape == (experts + 2,) and slot_map.dtype == torch.int32
    assert victims.dim() == 1 and victims.dtype == torch.int64 and victims.is_contiguous()
    assert key_of_slot.dtype == stamp.dtype == slot_of_key.dtype == torch.int64 and counters.shape == (3,)
    assert 0 <= base and base + experts < slot_of_key.shape[0], "the layer's keys must lie in slot_of_key"
    assert owner is None or (owner.dtype == torch.int32 and owner.numel() >= slot_of_key.numel() - 1)
    _set_fills_kernel[(1,)](present, slot_of_key, key_of_slot, stamp, clock, counters,
                            owner if owner is not None else slot_of_key, victims, fill_keys, fill_slots, slot_map,
                            experts, victims.shape[0], base, rank, shared_slot, HAS_OWNER=owner is not None,
                            BLOCK_E=max(16, triton.next_power_of_2(experts)), num_warps=8)
