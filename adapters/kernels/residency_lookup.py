"""One layer's expert lookup in the device-side LRU, as one single-program kernel: the decode step's
whole residency bookkeeping for a layer (hits, victims, table updates, the miss list, each token's slot)
without a host round trip and in one launch instead of dozens of small torch ops.

Shape legend: T rows (padded decode batch), K top-k, n = T*K keys, S slots, L*E flat keys.

Decisions are those of domain.residency.ExpertResidency for a lookup of the layer's distinct experts in
ascending order followed by a release (what the reference executor does per layer):
1. every distinct requested key that is resident (a hit) becomes most recently used, in ascending order;
2. misses, in ascending order, take the slot with the smallest stamp: empty slots first (stamp slot - S,
   lowest slot first), then the least recently used key; each filled key becomes most recently used.
   With a host share (ADR 0030, host_permille p > 0) the last domain.residency.host_split of the m misses
   (the largest keys that fit host_key_count(m, p) weight passes, a key weighing ceil(its rows / 4)) are
   host keys instead: no slot, no victim, no stamp, slot -1; only the first m - that many fill, so they
   take exactly the victims a lookup without the host keys would.
Because a hit is stamped (clock + its rank) before any victim is chosen, and a chosen victim is stamped
at once, "the smallest stamp" never picks a requested key: the scan needs no exclusion list.
The victim scan runs once per filled miss, so a step without fills (all hits, or all misses on the
host) costs no scan at all.
Tables (adapters/cuda_exec/device_residency.py): slot_of_key int64 [L*E+1], key_of_slot int64 [S+1],
stamp int64 [S+1], clock int64 [1], counters int64 [3] (hits, misses, evictions: misses count host keys
too), host_count int64 [] (host keys alone). Outputs: fill_keys/fill_slots int64 [n], slot_ids int32
[T, K(+1)], with a host share host_pairs int64 [n] (lane t*K + k: its flat key where that pair is
computed on the host, else -1).
"""

import torch
import triton
import triton.language as tl

from domain.residency import HOST_ROWS_PER_PASS, host_key_count

MAX_STAMP = tl.constexpr(2**62)
ROWS_PER_PASS = tl.constexpr(HOST_ROWS_PER_PASS)  # the host split's rows a weight pass
# NOTE: the kernel compares every key with every other in one program ([n, n] in registers): right for
# decode steps (n = rows x top-k <= 16 x 8 here), ruinous for prefill chunks (n in the thousands), which
# take the torch path (DeviceResidency.lookup_flat) instead.
MAX_KEYS = 256
# lanes of one block of the victim scan (a power of two): stamps read per dependent load-and-reduce of a miss.
# 4,096 int64 are 32 per thread at 4 warps (64 registers), live only in the scan, after the pairwise tiles die
VICTIM_BLOCK = 4096


@triton.jit
def lookup_keys(key, valid, offs, n, slot_of_ptr, key_of_ptr, stamp_ptr, clock_ptr, counters_ptr, fill_keys_ptr,
                fill_slots_ptr, S, host_permille, host_count_ptr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                HOST: tl.constexpr):
    """The layer's residency decision for the flat keys `key` [BN] (lanes with valid False are -1 and route
    nowhere), at positions `offs` [BN] (distinct, increasing: the request order, which only decides which
    of two equal keys counts as the first); n: the length of the fill lists (>= the keys). A device
    function shared by the lookup kernel below and the fused router (moe_route_lookup.py), so both make
    the same decisions by construction. Returns every lane's slot after the lookup [BN] (-1 where not valid,
    and on every lane of a host key, duplicates included: a valid lane with slot -1 is a host pair).
    HOST (constexpr): split off the host keys (host_permille in 1..1000, their count added to the int64 at
    host_count_ptr); False compiles the plain lookup, host_permille and host_count_ptr unread.
    """
    # pairwise: first occurrences (distinct), rank among distinct keys in ascending order
    # NOTE: compared as int32 (flat keys are < L*E, far below 2^31): the [BN, BN] tiles are the register
    # peak of this code, half the size of int64 ones (no spills at 128 lanes with the fused router)
    key32 = key.to(tl.int32)
    key_i = key32[:, None]
    key_j = key32[None, :]
    earlier = offs[None, :] < offs[:, None]
    valid_j = valid[None, :]
    occurrence = tl.sum((valid_j & (key_j == key_i) & earlier).to(tl.int32), axis=1)  # [BN] earlier equal lanes
    distinct = valid & (occurrence == 0)  # [BN]
    distinct_j = distinct[None, :]
    rank = tl.sum((distinct_j & (key_j < key_i)).to(tl.int32), axis=1)  # [BN] by value: duplicates share it
    slot_before = tl.load(slot_of_ptr + key, mask=valid, other=-1)
    hit = distinct & (slot_before >= 0)
    miss = distinct & (slot_before < 0)
    miss_j = miss[None, :]
    miss_rank = tl.sum((miss_j & (key_j < key_i)).to(tl.int32), axis=1)  # [BN]
    n_distinct = tl.sum(distinct.to(tl.int32), axis=0)
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    n_fill = n_miss
    if HOST:
        # NOTE: domain.residency.host_split in integers (int32: n_miss <= MAX_KEYS, p <= 1000). A missed key
        # weighs ceil(rows / 4) passes, counted one a lane on its 1st, 5th, 9th ... valid lane (the occurrence
        # `distinct` already reduced); the keys are taken from the top miss rank down while their passes fit
        # host_key_count: at most `budget` of them (each weighs >= 1), each a pair of [BN] reductions, and no
        # [BN, BN] tile beyond the plain lookup's (a suffix sum by rank was one: 104 -> 352 B of spill a thread
        # at 128 lanes on Triton 3.6). The host keys are the misses of rank >= n_fill: the loop below fills ranks
        # 0..n_fill-1 only, so they never get a slot (slot_of stays -1), a victim or a stamp, and the fills
        # choose what they would without them
        opens = (valid & (slot_before < 0) & (occurrence % ROWS_PER_PASS == 0)).to(tl.int32)  # [BN]
        budget = (n_miss * host_permille + 500) // 1000
        n_host = n_miss * 0
        used = n_miss * 0
        taking = n_miss >= 0  # still taking keys (a scalar True of the loop's type)
        for t in range(0, budget):
            key_t = tl.sum(tl.where(miss & (miss_rank == n_miss - 1 - t), key32, 0), axis=0)
            used += tl.sum(tl.where(key32 == key_t, opens, 0), axis=0)
            taking = taking & (used <= budget)
            n_host += taking.to(tl.int32)
        n_fill = n_miss - n_host
        tl.store(host_count_ptr, tl.load(host_count_ptr) + n_host)
    clock = tl.load(clock_ptr)
    # 1. hits become most recently used (in ascending key order)
    tl.store(stamp_ptr + slot_before, clock + rank, mask=hit)
    fills = tl.arange(0, BLOCK_N)
    tl.store(fill_keys_ptr + fills, tl.full((BLOCK_N,), -1, tl.int64), mask=fills < n)
    tl.store(fill_slots_ptr + fills, tl.full((BLOCK_N,), -1, tl.int64), mask=fills < n)
    tl.debug_barrier()
    # 2. each miss takes the slot with the smallest stamp
    # NOTE: stamps are distinct (each lookup hands out clock, clock + 1, ...; empty slots slot - S), so the
    # minimum has one index and the block order cannot change the choice: one reduction gives value and index.
    # A miss's scan is a chain of dependent block loads and reductions, so its length is what costs: at 1,024
    # lanes a 24 GiB pool's ~5.5k slots were six links per miss (~146 misses a bs1 step), VICTIM_BLOCK two
    evictions = n_miss * 0
    for m in range(0, n_fill):
        best_val = clock * 0 + MAX_STAMP
        best_idx = n_miss * 0
        for s0 in range(0, S, BLOCK_S):
            s_offs = s0 + tl.arange(0, BLOCK_S)
            vals = tl.load(stamp_ptr + s_offs, mask=s_offs < S, other=MAX_STAMP)
            local, local_idx = tl.min(vals, axis=0, return_indices=True)
            better = local < best_val
            best_idx = tl.where(better, s0 + local_idx, best_idx)
            best_val = tl.where(better, local, best_val)
        this = miss & (miss_rank == m)
        key_m = tl.sum(tl.where(this, key, 0), axis=0)
        rank_m = tl.sum(tl.where(this, rank, 0), axis=0)
        victim = best_idx.to(tl.int64)
        old = tl.load(key_of_ptr + victim)
        if old >= 0:
            tl.store(slot_of_ptr + old, -1)
            evictions += 1
        tl.store(slot_of_ptr + key_m, victim)
        tl.store(key_of_ptr + victim, key_m)
        tl.store(stamp_ptr + victim, clock + rank_m)
        tl.store(fill_keys_ptr + m, key_m)
        tl.store(fill_slots_ptr + m, victim)
        tl.debug_barrier()
    # 3. the clock and the counters (misses include the host keys, as the domain's do); every lane's slot
    # (duplicates and padding included). NOTE: host keys take clock ticks like any requested key, as
    # DeviceResidency.lookup_flat's do: the stamps stay those of the torch path, bit for bit
    tl.store(clock_ptr, clock + n_distinct)
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    tl.store(counters_ptr, tl.load(counters_ptr) + n_hit)
    tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + n_miss)
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + evictions)
    return tl.load(slot_of_ptr + key, mask=valid, other=-1)


@triton.jit
def _layer_lookup_kernel(ids_ptr, valid_ptr, slot_of_ptr, key_of_ptr, stamp_ptr, clock_ptr, counters_ptr,
                         fill_keys_ptr, fill_slots_ptr, slot_ids_ptr, owner_ptr, n, base, S, shared_slot, stride_ids,
                         rank, K: tl.constexpr, KO: tl.constexpr, HAS_OWNER: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_S: tl.constexpr, host_permille=None, host_count_ptr=None, host_pairs_ptr=None,
                         HOST: tl.constexpr = False):
    # NOTE: the host split's arguments default to None, which Triton binds as constexprs: the plain lookup's
    # launches and sm_90 builds need not name them and compile to exactly the kernel without them
    offs = tl.arange(0, BLOCK_N)
    in_range = offs < n
    row_valid = tl.load(valid_ptr + offs // K, mask=in_range, other=0) != 0
    ids = tl.load(ids_ptr + (offs // K) * stride_ids + offs % K, mask=in_range, other=0)  # a [T, K] view
    valid = in_range & row_valid
    if HAS_OWNER:  # expert parallelism: a pair another rank owns routes nowhere here (no key, slot -1)
        valid = valid & (tl.load(owner_ptr + ids + base, mask=valid, other=-1) == rank)
    key = tl.where(valid, ids + base, -1)  # [BN]
    slot_after = lookup_keys(key, valid, offs, n, slot_of_ptr, key_of_ptr, stamp_ptr, clock_ptr, counters_ptr,
                             fill_keys_ptr, fill_slots_ptr, S, host_permille, host_count_ptr, BLOCK_N, BLOCK_S,
                             HOST)
    tl.store(slot_ids_ptr + (offs // K) * KO + offs % K, slot_after.to(tl.int32), mask=in_range)
    if HOST:  # a valid pair left without a slot is computed on the host (padded and foreign pairs: -1)
        tl.store(host_pairs_ptr + offs, tl.where(valid & (slot_after < 0), key, -1), mask=in_range)
    if KO > K:  # the layer's resident shared expert as top-k column K, for valid rows only
        rows_ok = offs < n // K
        live = tl.load(valid_ptr + offs, mask=rows_ok, other=0) != 0
        tl.store(slot_ids_ptr + offs * KO + K, tl.where(live, shared_slot, -1).to(tl.int32), mask=rows_ok)


def check_host_split(host_permille: int, host_count: torch.Tensor | None, host_pairs: torch.Tensor | None,
                     n: int) -> bool:
    """Whether a lookup of n keys splits off host keys (host_permille > 0), after checking its arguments:
    host_permille an int in 0..1000; host_count (an int64 scalar, the running host-key count) and host_pairs
    (int64 [n], contiguous) given exactly when host_permille > 0. Raises ValueError otherwise."""
    host_key_count(0, host_permille)  # the domain's check of the share itself
    if host_permille == 0:
        if host_count is not None or host_pairs is not None:
            raise ValueError("host_count and host_pairs are outputs of a host split: pass them only with "
                             "host_permille > 0")
        return False
    if host_count is None or host_count.dtype != torch.int64 or host_count.numel() != 1:
        got = None if host_count is None else f"{host_count.dtype} {tuple(host_count.shape)}"
        raise ValueError(f"host_permille {host_permille} needs host_count, an int64 scalar tensor, got {got}")
    if host_pairs is None or host_pairs.dtype != torch.int64 or host_pairs.shape != (n,) \
            or not host_pairs.is_contiguous():
        got = None if host_pairs is None else f"{host_pairs.dtype} {tuple(host_pairs.shape)}"
        raise ValueError(f"host_permille {host_permille} needs host_pairs, a contiguous int64 [{n}], got {got}")
    return True


def layer_lookup(ids: torch.Tensor, valid: torch.Tensor, base: int, slot_of_key: torch.Tensor,
                 key_of_slot: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor, counters: torch.Tensor,
                 fill_keys: torch.Tensor, fill_slots: torch.Tensor, slot_ids: torch.Tensor, num_slots: int,
                 shared_slot: int | None = None, owner: torch.Tensor | None = None, rank: int = 0,
                 host_permille: int = 0, host_count: torch.Tensor | None = None,
                 host_pairs: torch.Tensor | None = None) -> None:
    """Look up the experts `ids` [T, K] (rows with valid [T] False route nowhere) of the layer whose
    flat keys start at `base` (= layer * E); writes fill_keys/fill_slots int64 [T*K] (misses in
    ascending key order, then -1) and slot_ids int32 [T, K] (-1 for padded rows), updates the tables.
    shared_slot: slot_ids is [T, K+1] and column K gets this slot (a resident shared expert outside the
    LRU's slots) on valid rows, -1 on padded ones: the fused MoE kernels take it as it is (-1 for every
    row: no shared expert on this rank).
    owner: int32 [L*E(+1)], the rank owning each flat key (expert parallelism): pairs whose key another
    rank owns are not looked up and get slot -1 (zero output), so the LRU only ever sees `rank`'s keys.
    host_permille (ADR 0030, 0 = off, the default): the last domain.residency.host_split of the layer's m
    misses in ascending key order (a key weighing the passes of the rows routed to it) are computed on the
    host: they get slot -1, no fill, no victim;
    `counters` still counts them as misses, host_count (int64 scalar, e.g. DeviceResidency._host_computed)
    gets their number added, and host_pairs int64 [T*K] gets, lane t*K + k, the pair's flat key where that
    valid pair is a host pair, else -1 (padded rows and other ranks' pairs: -1). Both are given exactly when
    host_permille > 0; the off path compiles and runs as without them. The host split's arguments are
    checked (ValueError) before anything is written.

    The caller guarantees T*K <= num_slots and no pinned slots (the decode step's buckets do).
    """
    t, k = ids.shape
    n = t * k
    host = check_host_split(host_permille, host_count, host_pairs, n)
    assert valid.shape == (t,) and valid.dtype == torch.bool, f"valid must be bool [{t}], got {valid.dtype} {tuple(valid.shape)}"
    assert ids.dtype == torch.int64 and ids.stride(1) == 1, "ids must be int64 [T, K] with unit column stride"
    assert fill_keys.shape == fill_slots.shape == (n,), f"fill lists must be [{n}]"
    ko = k + (shared_slot is not None)
    assert slot_ids.shape == (t, ko) and slot_ids.dtype == torch.int32 and slot_ids.is_contiguous()
    assert n <= num_slots, f"{n} keys cannot all be resident in {num_slots} slots"
    assert n <= MAX_KEYS, f"{n} keys: the one-program lookup is for decode steps (<= {MAX_KEYS} keys)"
    assert stamp.dtype == key_of_slot.dtype == slot_of_key.dtype == torch.int64
    assert slot_of_key.numel() <= 2**31, "flat keys are compared as int32 (lookup_keys)"
    assert owner is None or (owner.dtype == torch.int32 and owner.numel() >= slot_of_key.numel() - 1), \
        "owner must be int32 [L*E(+1)]"
    if n == 0:
        return
    block_n = max(16, triton.next_power_of_2(n))
    # off: the host arguments stay at the kernel's defaults, so the launch is the plain lookup's
    extra = dict(host_permille=host_permille, host_count_ptr=host_count, host_pairs_ptr=host_pairs,
                 HOST=True) if host else {}
    _layer_lookup_kernel[(1,)](ids, valid, slot_of_key, key_of_slot, stamp, clock, counters, fill_keys, fill_slots,
                               slot_ids, owner if owner is not None else slot_of_key, n, base, num_slots,
                               -1 if shared_slot is None else shared_slot, ids.stride(0), rank, K=k,
                               KO=ko, HAS_OWNER=owner is not None, BLOCK_N=block_n, BLOCK_S=VICTIM_BLOCK,
                               num_warps=8 if block_n >= 64 else 4, **extra)
