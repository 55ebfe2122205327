"""First half of a prefill chunk's lookup of one layer's expert *set* (DeviceResidency.lookup_set): the
distinct experts the chunk routes to become most recently used where resident, and every slot's victim
candidate stamp is written for the victim choice (a torch.topk between this kernel and residency_set_fills).

Shape legend: E experts of the layer, S slots, L*E flat keys.

Why a set and not the T*K pairs: a prefill chunk routes thousands of pairs but a layer has only E experts, and
the LRU's decisions depend only on the distinct keys in ascending order (domain.residency.ExpertResidency; what
the reference executor looks up per layer). A [E] presence vector in ascending expert order is already that
list, so ranks are prefix sums: no sort, no pairwise compare, one program of E lanes. It replaces ~100 small
torch launches a MoE layer (measured at 4k tokens on the H200: the prefill step was host-bound, 7,900 launches
for 181 ms of GPU work, docs/bench/2026-12-01-bench-prefill-h200-run4-profile.json).

Tables (adapters/cuda_exec/device_residency.py): slot_of_key int64 [L*E+1], stamp int64 [S+1], pinned bool [S+1],
clock int64 [1]. Writes stamp (hits: clock + rank among the distinct keys) and candidates int64 [S] (the stamp
after the hits, NEVER on pinned slots). Because every hit is stamped above every other slot, the n smallest
candidates are never a requested key's slot (the argument of residency_lookup.py).
"""

import torch
import triton
import triton.language as tl

NEVER = torch.iinfo(torch.int64).max  # a pinned slot's candidate stamp: never a victim
MAX_EXPERTS = 4096  # lanes of the one program (E per layer; Qwen3.6: 256, Qwen3-Next: 512)


@triton.jit
def set_keys(present_ptr, owner_ptr, E, base, rank, HAS_OWNER: tl.constexpr, BLOCK_E: tl.constexpr):
    """The layer's lanes (e [BE]), their flat keys (base + e, ascending), which are looked up (valid: routed,
    and this rank's) and each one's rank among those (order: an exclusive prefix sum, the stamp offset).
    A device function both halves of the set lookup share, so they agree lane for lane."""
    e = tl.arange(0, BLOCK_E)
    key = base + e  # [BE] flat keys, ascending
    valid = (e < E) & (tl.load(present_ptr + e, mask=e < E, other=0) != 0)
    if HAS_OWNER:  # expert parallelism: another rank's key is not this residency's (as padding)
        valid = valid & (tl.load(owner_ptr + key, mask=valid, other=-1) == rank)
    order = tl.cumsum(valid.to(tl.int32), axis=0) - 1  # [BE] rank among the distinct keys, ascending
    return e, key, valid, order


# NOTE: the integer arguments are not specialized (Triton would compile a variant per layer base % 16 and per
# shared slot % 16): one binary per E class, compiled by the prefill warm-up
@triton.jit(do_not_specialize=["E", "S", "base", "rank"])
def _set_hits_kernel(present_ptr, slot_of_ptr, stamp_ptr, pinned_ptr, clock_ptr, owner_ptr, cand_ptr, E, S, base,
                     rank, never, HAS_OWNER: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    e, key, valid, order = set_keys(present_ptr, owner_ptr, E, base, rank, HAS_OWNER, BLOCK_E)
    slot_before = tl.load(slot_of_ptr + key, mask=valid, other=-1)
    hit = valid & (slot_before >= 0)
    clock = tl.load(clock_ptr)
    tl.store(stamp_ptr + slot_before, clock + order, mask=hit)
    # NOTE: the candidates below read stamps other threads of this program just wrote
    tl.debug_barrier()
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = s < S
        stamp = tl.load(stamp_ptr + s, mask=ok, other=0)
        pinned = tl.load(pinned_ptr + s, mask=ok, other=0) != 0
        tl.store(cand_ptr + s, tl.where(pinned, never, stamp), mask=ok)


def set_hits(present: torch.Tensor, base: int, slot_of_key: torch.Tensor, stamp: torch.Tensor, pinned: torch.Tensor,
             clock: torch.Tensor, candidates: torch.Tensor, owner: torch.Tensor | None = None, rank: int = 0) -> None:
    """Stamp the resident keys among present [E] (bool, expert e of the layer whose flat keys start at base)
    as most recently used in ascending order, and write candidates int64 [S] (stamps, NEVER where pinned).
    The clock is not advanced here (residency_set_fills does, after the misses). owner: int32 [L*E(+1)], the
    rank owning each flat key (keys of other ranks are skipped). Raises AssertionError on bad shapes."""
    experts, slots = present.shape[0], candidates.shape[0]
    assert present.dtype == torch.bool and present.dim() == 1, "present must be bool [E]"
    assert 0 < experts <= MAX_EXPERTS, f"E = {experts} outside 1..{MAX_EXPERTS}"
    assert stamp.shape == pinned.shape == (slots + 1,), f"stamp and pinned must be [S+1] = [{slots + 1}]"
    assert stamp.dtype == slot_of_key.dtype == candidates.dtype == torch.int64 and pinned.dtype == torch.bool
    assert 0 <= base and base + experts < slot_of_key.shape[0], "the layer's keys must lie in slot_of_key"
    assert owner is None or (owner.dtype == torch.int32 and owner.numel() >= slot_of_key.numel() - 1)
    _set_hits_kernel[(1,)](present, slot_of_key, stamp, pinned, clock, owner if owner is not None else slot_of_key,
                           candidates, experts, slots, base, rank, NEVER, HAS_OWNER=owner is not None,
                           BLOCK_E=max(16, triton.next_power_of_2(experts)), BLOCK_S=1024, num_warps=8)
