"""Expert residency kept on the device: the (layer, expert) -> slot table, the slot -> key table, LRU
stamps and pins are tensors, and a lookup is a fixed sequence of tensor ops with no host round trip, so
it can run inside a captured CUDA graph.

`domain.residency.ExpertResidency` is the specification; this class makes the same decisions, lookup
for lookup (tests/contracts/ runs the differential contract against it on the CPU).

Shape legend: L layers, E experts per layer, S slots, n keys of one lookup (duplicates and padding
included); a flat key is layer * E + expert (the host bank's row index), -1 means "no key" (padding).

How the LRU order is encoded: every slot carries a stamp. A resident key's stamp is the logical time of
its last use (>= 0); an empty slot's stamp is slot - S (< 0), so ordering slots by stamp lists the empty
slots first, lowest first (the domain's min-heap of free slots; slots only become free all at once, on
resize), then resident keys least recently used first. A lookup's victims are therefore the n smallest
stamps among slots that are neither pinned nor holding a requested key; the domain takes free slots
first and then LRU keys, in that same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.kernels.moe_align import narrow_keys
from adapters.kernels.moe_route_lookup import moe_route_lookup
from adapters.kernels.moe_router import ResidentSlots, moe_router
from adapters.kernels.residency_lookup import layer_lookup
from adapters.kernels.residency_set_fills import set_fills
from adapters.kernels.residency_set_hits import MAX_EXPERTS as SET_MAX_EXPERTS
from adapters.kernels.residency_set_hits import set_hits
from adapters.kernels.residency_settle_hits import settle_hits
from domain.residency import HOST_ROWS_PER_PASS, Lookup, ResidencyExhausted, host_key_count, host_split

NO_KEY = -1
_NEVER = torch.iinfo(torch.int64).max  # stamp of a slot that can not be a victim in this lookup


@dataclass(frozen=True)
class DeviceLookup:
    """A lookup's decisions as device tensors (nothing copied to the host).

    slots: int64 [n], the slot of each requested key (-1 for padding)
    fill_keys: int64 [n], flat keys to copy from the host bank, in request order, then -1
    fill_slots: int64 [n], the slot each fill_keys entry goes to (-1 where fill_keys is -1)
    evicted: int64 [n], flat keys that lost their slot, in eviction order, then -1
    host_keys: int64 [n], flat keys computed on the host (ADR 0030), in request order, then -1; None when
        the lookup had no host share
    """

    slots: torch.Tensor
    fill_keys: torch.Tensor
    fill_slots: torch.Tensor
    evicted: torch.Tensor
    host_keys: torch.Tensor | None = None


class DeviceResidency:
    """The global LRU over (layer, expert) keys, as tensors on `device`."""

    def __init__(self, num_slots: int, num_layers: int, num_experts: int, device: torch.device | str = "cpu",
                 owner: torch.Tensor | None = None, rank: int = 0):
        """owner: int [L*E], the rank owning each flat key (expert parallelism, ADR 0008); then only keys
        with owner == rank are ever looked up: every lookup path treats the others as padding (slot -1),
        and the host-facing `lookup` refuses them. None: every key is this residency's."""
        if min(num_layers, num_experts) <= 0:
            raise ValueError(f"need at least one layer and expert, got {num_layers} x {num_experts}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # tensors made on "cuda" report "cuda:N": name the index so device checks compare like with like
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank = rank
        self.owner: torch.Tensor | None = None  # int32 [L*E + 1], the sink entry -1 (owned by no rank)
        if owner is not None:
            if tuple(owner.shape) != (num_layers * num_experts,):
                raise ValueError(f"owner must be [{num_layers * num_experts}] (one rank per flat key), "
                                 f"got {tuple(owner.shape)}")
            if not bool((owner == rank).any()):
                raise ValueError(f"rank {rank} owns no key of this residency")
            self.owner = torch.cat((owner.to(torch.int32), torch.full((1,), -1, dtype=torch.int32))).to(self.device)
        # cumulative counters live on the device (one host read when someone asks)
        self._counters = torch.zeros(3, dtype=torch.int64, device=self.device)  # hits, misses, evictions
        self._host_computed = torch.zeros((), dtype=torch.int64, device=self.device)  # host keys (ADR 0030)
        self._reset(num_slots)

    def _reset(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        dev, keys = self.device, self.num_layers * self.num_experts
        self.num_slots = num_slots
        # NOTE: one extra entry at index `keys` is a sink: scatters of padding write there.
        self.slot_of_key = torch.full((keys + 1,), -1, dtype=torch.int64, device=dev)  # [L*E + 1]
        self.key_of_slot = torch.full((num_slots + 1,), NO_KEY, dtype=torch.int64, device=dev)  # [S + 1]
        self.stamp = torch.arange(-num_slots, 1, dtype=torch.int64, device=dev)  # [S + 1], last = sink
        self.pinned = torch.zeros(num_slots + 1, dtype=torch.bool, device=dev)  # [S + 1]
        self.clock = torch.zeros((), dtype=torch.int64, device=dev)
        # set by mark_every_key_resident (after a preload): no lookup can miss, so none needs victims
        self._no_victims: torch.Tensor | None = None
        # with it, the decode step's keys used since the last settle (route_resident / settle_resident)
        self._presence: torch.Tensor | None = None

    # ---- the device-side lookup ------------------------------------------------------------------------
    def lookup_flat(self, flat_keys: torch.Tensor, pin: bool = True, presorted: bool = False,
                    host_permille: int = 0) -> DeviceLookup:
        """Look up flat keys [n] (int, -1 = padding) in request order, entirely with tensor ops.

        The caller guarantees the lookup fits (`can_lookup`); inside a captured graph nothing can be
        refused, so the decode step sizes its batch buckets so that it always does (S >= n, no pins
        held by others). pin=False skips pinning (a lookup released before the next one). presorted: the
        caller guarantees equal keys are adjacent (e.g. sorted ascending, padding anywhere as one run), so
        request order within each run is the given order and the lookup skips its own sort. host_permille:
        the last misses (request order) that domain.residency.host_split sends to the host are host keys (ADR
        0030; a key's weight is the passes its repeats in `flat_keys`, its rows, need): no slot, no victim, no
        pin, slot -1, listed in `host_keys`; the split is computed on the device.
        """
        host_key_count(0, host_permille)  # refuses a bad share before anything changes
        keys = flat_keys.to(device=self.device, dtype=torch.int64).reshape(-1)  # [n]
        n, sink_key, sink_slot = keys.shape[0], self.slot_of_key.shape[0] - 1, self.num_slots
        keys = self.owned_only(keys)
        if n == 0:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return DeviceLookup(empty, empty, empty, empty, empty if host_permille else None)
        valid = keys >= 0  # [n]
        # first occurrence of each key in request order (duplicates collapse like dict.fromkeys): a stable
        # sort puts equal keys together, earliest first; O(n log n), so prefill-sized lookups stay cheap
        if presorted:
            first = torch.ones_like(keys, dtype=torch.bool)
            first[1:] = keys[1:] != keys[:-1]
            distinct = first
        else:
            ordered, order = torch.sort(narrow_keys(keys, sink_key), stable=True)  # [n]
            first = torch.ones_like(ordered, dtype=torch.bool)
            first[1:] = ordered[1:] != ordered[:-1]
            distinct = torch.zeros_like(first)
            distinct[order] = first
        distinct &= valid  # [n]
        safe = torch.where(valid, keys, sink_key)  # [n]
        slot_before = self.slot_of_key[safe]  # [n]
        hit = distinct & (slot_before >= 0)  # [n]
        miss = distinct & (slot_before < 0)  # [n]
        missed = miss  # [n] every miss, host keys included (the counters count them all)
        miss_rank = torch.cumsum(miss.to(torch.int64), 0) - 1  # [n]
        host = None
        if host_permille:
            # NOTE: host keys are the last misses in request order, so the fills keep their miss ranks
            # (0, 1, ...) and take the same victims a lookup without the host keys would. The domain's rule
            # (host_split) on device tensors, no host read inside a graph: each miss weighs the weight passes
            # of its rows (its valid repeats), and the misses whose suffix of weights fits the budget go
            rows = torch.zeros(sink_key + 1, dtype=torch.int64, device=self.device)  # [L*E + 1]
            rows.index_add_(0, safe, valid.to(torch.int64))
            passes = torch.where(miss, (rows[safe] + HOST_ROWS_PER_PASS - 1) // HOST_ROWS_PER_PASS, 0)  # [n]
            suffix = passes.flip(0).cumsum(0).flip(0)  # [n] the weights of this miss and every later one
            host = miss & (suffix <= host_key_count(miss.sum(), host_permille))  # [n]
            miss = miss & ~host
        # victims: smallest stamps among slots not pinned and not holding a requested key
        blocked = self.pinned.clone()  # [S + 1]
        blocked.index_fill_(0, torch.where(hit, slot_before, sink_slot), True)
        fill_sink(blocked, True)
        candidates = torch.where(blocked, _NEVER, self.stamp)  # [S + 1]
        k = min(n, self.num_slots)
        victims = torch.topk(candidates, k, largest=False, sorted=True).indices if k else candidates[:0]  # [k]
        victims = torch.cat((victims, torch.full((n - k,), sink_slot, dtype=torch.int64, device=self.device)))
        fill_slot = torch.where(miss, victims[miss_rank.clamp(min=0)], sink_slot)  # [n]
        old_key = self.key_of_slot[fill_slot]  # [n] key evicted by each fill (-1: the slot was empty)
        evicting = miss & (old_key >= 0)  # [n]
        # table updates: evicted keys leave, filled keys arrive, every requested key becomes MRU in order
        self.slot_of_key.index_fill_(0, torch.where(evicting, old_key, sink_key), -1)
        self.slot_of_key[torch.where(miss, safe, sink_key)] = fill_slot
        self.key_of_slot[fill_slot] = torch.where(miss, safe, NO_KEY)
        slot_after = torch.where(valid, self.slot_of_key[safe], -1)  # [n]
        distinct_rank = torch.cumsum(distinct.to(torch.int64), 0) - 1  # [n]
        # a host key's slot_after is -1: it touches the sink, like padding
        touched = torch.where(distinct & (slot_after >= 0), slot_after, sink_slot)  # [n]
        self.stamp[touched] = self.clock + distinct_rank
        fill_sink(self.stamp, 0)
        fill_sink(self.key_of_slot, NO_KEY)
        self.clock += distinct.sum()
        if pin:
            self.pinned.index_fill_(0, touched, True)
            fill_sink(self.pinned, False)
        self._counters += torch.stack((hit.sum(), missed.sum(), evicting.sum()))
        fill_order = _compact(miss, n)  # [n] positions of misses first, in request order
        evict_order = _compact(evicting, n)
        host_keys = None
        if host is not None:
            self._host_computed += host.sum()
            host_order = _compact(host, n)
            host_keys = torch.where(host[host_order], safe[host_order], -1)
        return DeviceLookup(
            slots=slot_after,
            fill_keys=torch.where(miss[fill_order], safe[fill_order], -1),
            fill_slots=torch.where(miss[fill_order], fill_slot[fill_order], -1),
            evicted=torch.where(evicting[evict_order], old_key[evict_order], -1),
            host_keys=host_keys,
        )

    def preload(self, flat_keys: torch.Tensor) -> DeviceLookup:
        """`lookup_flat(flat_keys, pin=False)` that leaves the hit, miss and eviction counters as they were:
        the start-up fill of a pool whose slots hold every key (DeviceExpertPool.preload). The tables and stamps
        end exactly as after that lookup (the domain LRU fed the same keys in the same order); only the
        counters, which count the workload's lookups, do not see it. No host sync."""
        counted = self._counters.clone()
        found = self.lookup_flat(flat_keys, pin=False)
        self._counters.copy_(counted)
        return found

    def mark_every_key_resident(self) -> None:
        """Say that every key is resident (DeviceExpertPool.preload checked it after the fill, on the host). From
        then on no lookup can miss, so none evicts and the tables hold every key until the next resize; lookup_set
        skips its victim choice (a torch.topk over the S candidate stamps and its sort: ~0.1 ms a layer, 4-5 ms of
        an 8k prefill chunk's 40 layers on the H100, session 28). Raises ValueError if a key is not resident
        (one host sync) or under expert parallelism (a rank holds only its own keys)."""
        if self.owner is not None:
            raise ValueError("mark_every_key_resident is for a residency that holds every key (no owner table)")
        if bool((self.slot_of_key[:-1] < 0).any()):
            raise ValueError("not every key is resident")
        # NOTE: read only where a lookup misses, which no longer happens; valid slots all the same
        self._no_victims = torch.arange(min(self.num_experts, self.num_slots), dtype=torch.int64, device=self.device)
        self._presence = torch.zeros_like(self.slot_of_key, dtype=torch.uint8)  # [L*E + 1]

    @property
    def every_key_resident(self) -> bool:
        return self._no_victims is not None

    def can_lookup_set(self) -> bool:
        """Whether `lookup_set` takes a layer: its E experts fit the slots and the one program's lanes."""
        return self.num_experts <= min(self.num_slots, SET_MAX_EXPERTS)

    def lookup_set(self, layer: int, present: torch.Tensor, shared_slot: int = -1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill chunk's lookup of layer `layer`: present bool [E] marks the experts its pairs route to
        (any number of pairs). Makes lookup_flat's decisions for those keys in ascending order (pin=False)
        in three launches (residency_set_hits, a topk, residency_set_fills) instead of ~100 small torch ops.

        Returns (fill_keys int64 [E], fill_slots int64 [E], slot_map int32 [E+2]): the misses to gather in
        ascending key order (then -1), and each expert's slot after the lookup (-1: not routed, or another
        rank's key), entry E = shared_slot, E+1 = -1. Needs `can_lookup_set()` (E <= S); raises ValueError
        otherwise or on a bad present vector."""
        experts = self.num_experts
        if not self.can_lookup_set():
            raise ValueError(f"lookup_set needs E = {experts} <= min(S = {self.num_slots}, {SET_MAX_EXPERTS})")
        if present.shape != (experts,) or present.dtype != torch.bool or present.device != self.device:
            raise ValueError(f"present must be bool [{experts}] on {self.device}, got {present.dtype} "
                             f"{tuple(present.shape)} on {present.device}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.num_layers - 1}")
        base = layer * experts
        candidates = torch.empty(self.num_slots, dtype=torch.int64, device=self.device)  # [S]
        set_hits(present, base, self.slot_of_key, self.stamp, self.pinned, self.clock, candidates, self.owner,
                 self.rank)
        # [E] ascending stamps; none needed where every key is resident (no key can miss)
        victims = self._no_victims if self._no_victims is not None else torch.topk(
            candidates, experts, largest=False, sorted=True).indices
        fill_keys = torch.empty(experts, dtype=torch.int64, device=self.device)
        fill_slots = torch.empty(experts, dtype=torch.int64, device=self.device)
        slot_map = torch.empty(experts + 2, dtype=torch.int32, device=self.device)
        set_fills(present, base, self.slot_of_key, self.key_of_slot, self.stamp, self.clock, self._counters,
                  victims, fill_keys, fill_slots, slot_map, shared_slot, self.owner, self.rank)
        return fill_keys, fill_slots, slot_map

    def owned_only(self, flat_keys: torch.Tensor) -> torch.Tensor:
        """flat_keys (int64, -1 = padding) with the keys of other ranks replaced by -1 (tensor ops, no sync)."""
        if self.owner is None:
            return flat_keys
        sink = self.owner.shape[0] - 1
        mine = self.owner[torch.where(flat_keys < 0, sink, flat_keys)] == self.rank
        return torch.where(mine, flat_keys, -1)

    def lookup_layer(self, layer: int, ids: torch.Tensor, valid: torch.Tensor, shared_slot: int | None = None,
                     host_permille: int = 0) -> tuple[torch.Tensor, ...]:
        """The decode step's lookup: layer `layer`'s experts ids [T, K] of rows with valid [T] True, in
        ascending expert order, released at once (no pins kept), in one kernel launch.

        Returns (fill_keys int64 [T*K], fill_slots int64 [T*K], slot_ids int32 [T, K]): the misses to
        gather (then -1) and every entry's slot (-1 for invalid rows). Needs T*K <= S and no pinned keys.
        shared_slot: slot_ids gets a column K holding it on valid rows (-1 on the others): [T, K+1].
        host_permille > 0 (ADR 0030; 0, the default, is off): the layer's last misses within host_split's budget
        (domain.residency: host_key_count weight passes, ceil(rows / 4) a key) are computed on the host (slot -1,
        no fill, counted in `host_computed`), and a fourth tensor follows, host_pairs int64 [T*K] (lane t*K + k:
        the pair's flat key where it is a host pair, else -1).
        Raises ValueError for a host_permille that is not an int in 0..1000.
        """
        host_key_count(0, host_permille)  # refuses a bad share before anything is allocated
        host = host_permille > 0
        t, k = ids.shape
        fill_keys = torch.empty(t * k, dtype=torch.int64, device=self.device)
        fill_slots = torch.empty(t * k, dtype=torch.int64, device=self.device)
        slot_ids = torch.empty((t, k + (shared_slot is not None)), dtype=torch.int32, device=self.device)
        host_pairs = torch.empty(t * k, dtype=torch.int64, device=self.device) if host else None
        if ids.dtype != torch.int64 or ids.stride(1) != 1:  # the router's ids pass as they are (a [T, K] view)
            ids = ids.contiguous().to(torch.int64)
        layer_lookup(ids, valid, layer * self.num_experts, self.slot_of_key,
                     self.key_of_slot, self.stamp, self.clock, self._counters, fill_keys, fill_slots, slot_ids,
                     self.num_slots, shared_slot, self.owner, self.rank, host_permille,
                     self._host_computed if host else None, host_pairs)
        return (fill_keys, fill_slots, slot_ids) + ((host_pairs,) if host else ())

    def route_layer(self, layer: int, logits: torch.Tensor, x: torch.Tensor, top_k: int, renormalize: bool,
                    gate_weight: torch.Tensor | None, valid: torch.Tensor, shared_slot: int | None = None,
                    host_permille: int = 0) -> tuple[torch.Tensor, ...]:
        """The decode step's routing and lookup in one launch (moe_route_lookup): router logits fp32 [T, E]
        -> (weights fp32 [T, K(+1 with gate_weight)], slot_ids int32 [T, K(+1 with shared_slot)],
        fill_keys int64 [T*K], fill_slots int64 [T*K]), making lookup_layer's decisions for the top-k ids.
        host_permille > 0: lookup_layer's host split, and a fifth tensor follows, host_pairs int64 [T*K]
        (lane t*K + k: the pair's flat key where it is computed on the host, its weight weights[t, k]).
        Needs moe_route_lookup.fits(T, E, K, S) and no pinned keys."""
        host_key_count(0, host_permille)  # refuses a bad share before anything is allocated
        host = host_permille > 0
        host_pairs = torch.empty(logits.shape[0] * top_k, dtype=torch.int64, device=self.device) if host else None
        found = moe_route_lookup(logits, x, top_k, renormalize, gate_weight, valid, layer * self.num_experts,
                                 self.slot_of_key, self.key_of_slot, self.stamp, self.clock, self._counters,
                                 self.num_slots, shared_slot, self.owner, self.rank, host_permille,
                                 self._host_computed if host else None, host_pairs)
        return found + ((host_pairs,) if host else ())

    def route_resident(self, layer: int, logits: torch.Tensor, x: torch.Tensor, router: torch.Tensor, top_k: int,
                       renormalize: bool, gate_weight: torch.Tensor | None, valid: torch.Tensor,
                       shared_slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step's routing where every key is resident (docs/adr/0027-resident-pool-routing.md): one
        moe_router launch from the router logits fp32 [T, E] gives (weights fp32 [T, K(+1 with gate_weight)],
        slot_ids int32 [T, K(+1 with shared_slot)]) straight from the table, and marks the layer's keys; no
        lookup launch, no miss list (none can miss). The hits and stamps of the layer are made by the step's
        settle_resident, which must run after its last layer (until then they are pending). x [T, H] and
        router [E, H]: the router's input and weight (moe_router checks them; the GEMV is not redone).
        Raises ValueError unless every_key_resident."""
        if self._presence is None:
            raise ValueError("route_resident needs a residency that holds every key (mark_every_key_resident)")
        t = logits.shape[0]
        slot_ids = torch.empty((t, top_k + (shared_slot is not None)), dtype=torch.int32, device=self.device)
        slots = ResidentSlots(self.slot_of_key, layer * self.num_experts, valid, self._presence, slot_ids, shared_slot)
        weights, _ = moe_router(x, router, top_k, renormalize, gate_weight, logits=logits, slots=slots)
        return weights, slot_ids

    def settle_resident(self) -> None:
        """The pending route_resident calls' hits, in one launch: the keys they marked become most recently used
        in ascending key order and count as hits, exactly as their per-layer lookups would have left the tables
        and counters (residency_settle_hits.py). Nothing pending: no stamp moves."""
        if self._presence is None:
            raise ValueError("settle_resident needs a residency that holds every key (mark_every_key_resident)")
        settle_hits(self._presence, self.slot_of_key, self.stamp, self.clock, self._counters)

    def release_all(self) -> None:
        self.pinned.zero_()

    # ---- the ExpertResidency surface (host-facing; these synchronise) -----------------------------------
    def _flat(self, keys) -> torch.Tensor:
        flat = []
        for key in keys:
            if (not isinstance(key, tuple) or len(key) != 2
                    or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in key)):
                raise ValueError(f"expert key must be a (layer, expert) tuple of non-negative ints, got {key!r}")
            layer, expert = key
            if layer >= self.num_layers or expert >= self.num_experts:
                raise ValueError(f"expert key {key} outside {self.num_layers} layers x {self.num_experts} experts")
            flat.append(layer * self.num_experts + expert)
        return torch.tensor(flat, dtype=torch.int64, device=self.device)

    def _key(self, flat: int) -> tuple[int, int]:
        return divmod(int(flat), self.num_experts)

    def can_lookup(self, keys, host_permille: int = 0) -> bool:
        host_key_count(0, host_permille)  # refuses a bad share, keys or not (as the domain does)
        requested = self._flat(keys)  # [n] a key once per row
        flat = requested.unique()
        if flat.numel() == 0:
            return True
        slots = self.slot_of_key[flat]
        pinned_requested = int((self.pinned[slots.clamp(min=0)] & (slots >= 0)).sum())
        pinned_by_others = int(self.pinned[: self.num_slots].sum()) - pinned_requested
        on_host = 0  # host keys need no slot: the domain's split of the misses in request order (repeats: rows)
        if host_permille:
            rows: dict[int, int] = {}
            for k in requested.tolist():
                rows[k] = rows.get(k, 0) + 1
            missed = (self.slot_of_key[list(rows)] < 0).tolist()
            on_host = host_split([n for n, m in zip(rows.values(), missed, strict=True) if m], host_permille)
        return flat.numel() - on_host <= self.num_slots - pinned_by_others

    def lookup(self, keys, host_permille: int = 0) -> Lookup:
        keys = list(keys)
        if self.owner is not None:
            flat = self._flat(keys)
            foreign = [k for k, o in zip(keys, self.owner[flat].tolist(), strict=True) if o != self.rank]
            if foreign:
                raise ValueError(f"rank {self.rank}: expert keys {foreign} belong to other ranks")
        if not self.can_lookup(keys, host_permille):
            raise ResidencyExhausted(f"lookup of {len(set(keys))} distinct experts cannot fit in "
                                     f"{self.num_slots} slots with {int(self.pinned.sum())} pinned")
        flat = self._flat(keys)
        slot_before = self.slot_of_key[flat].tolist() if flat.numel() else []
        found = self.lookup_flat(flat, host_permille=host_permille)
        seen: set[int] = set()
        hits = []
        for f, s in zip(flat.tolist(), slot_before, strict=True):
            if f not in seen and s >= 0:
                hits.append(self._key(f))
            seen.add(f)
        fills = [(self._key(k), s) for k, s in zip(found.fill_keys.tolist(), found.fill_slots.tolist(), strict=True)
                 if k >= 0]
        host = () if found.host_keys is None else tuple(self._key(k) for k in found.host_keys.tolist() if k >= 0)
        return Lookup(slots=tuple(found.slots.tolist()), hits=tuple(hits), fills=tuple(fills),
                      evicted=tuple(self._key(k) for k in found.evicted.tolist() if k >= 0), host=host)

    def release(self, keys=None) -> None:
        if keys is None:
            self.release_all()
            return
        flat = self._flat(list(keys))
        if flat.numel() == 0:
            return
        slots = self.slot_of_key[flat]
        if bool(((slots < 0) | ~self.pinned[slots.clamp(min=0)]).any()):
            raise ValueError(f"release of expert keys that are not pinned: {list(keys)}")
        self.pinned[slots] = False

    def slot_of(self, key: tuple[int, int]) -> int | None:
        slot = int(self.slot_of_key[self._flat([key])[0]])
        return None if slot < 0 else slot

    def is_pinned(self, key: tuple[int, int]) -> bool:
        slot = self.slot_of(key)
        return slot is not None and bool(self.pinned[slot])

    def can_resize(self, num_slots: int) -> bool:
        return (isinstance(num_slots, int) and not isinstance(num_slots, bool) and num_slots >= 0
                and not bool(self.pinned.any()))

    def resize(self, num_slots: int) -> None:
        """Rebuild with `num_slots` empty slots (counters survive). Refused while keys are pinned."""
        if bool(self.pinned.any()):
            raise RuntimeError("cannot resize expert residency while keys are pinned")
        self._reset(num_slots)

    @property
    def hits(self) -> int:
        return int(self._counters[0])

    @property
    def misses(self) -> int:
        return int(self._counters[1])

    @property
    def evictions(self) -> int:
        return int(self._counters[2])

    @property
    def host_computed(self) -> int:
        """Misses computed on the host (ADR 0030), also counted in `misses`."""
        return int(self._host_computed)

    @property
    def counters_tensor(self) -> torch.Tensor:
        """int64 [3] on the device: cumulative hits, misses, evictions (to read back with other values)."""
        return self._counters

    def counters(self) -> tuple[int, int, int]:
        """(hits, misses, evictions) with one host read."""
        h, m, e = self._counters.tolist()
        return h, m, e

    def check_valid(self) -> None:
        s = self.num_slots
        slot_of = self.slot_of_key[:-1].tolist()
        key_of = self.key_of_slot[:s].tolist()
        stamp = self.stamp[:s].tolist()
        for key, slot in enumerate(slot_of):
            if slot >= 0:
                assert slot < s, f"key {self._key(key)} maps to out-of-range slot {slot}"
                assert key_of[slot] == key, f"slot {slot} does not point back to {self._key(key)}"
        for slot, key in enumerate(key_of):
            if key == NO_KEY:
                assert stamp[slot] == slot - s, f"empty slot {slot} has stamp {stamp[slot]}"
            else:
                assert slot_of[key] == slot, f"slot {slot} holds {self._key(key)}, which maps elsewhere"
                assert 0 <= stamp[slot] < int(self.clock), f"slot {slot} stamp {stamp[slot]} not in the past"
        used = [st for st, k in zip(stamp, key_of, strict=True) if k != NO_KEY]
        if self.owner is not None:
            owner = self.owner.tolist()
            foreign = [self._key(k) for k in key_of if k != NO_KEY and owner[k] != self.rank]
            assert not foreign, f"rank {self.rank} holds keys it does not own: {foreign}"
        assert len(set(used)) == len(used), "two resident keys share a stamp"
        assert not bool(self.pinned[s]), "the sink slot is pinned"
        assert all(key_of[i] != NO_KEY for i in range(s) if bool(self.pinned[i])), "an empty slot is pinned"
        hits, misses, evictions = self.counters()
        assert min(hits, misses, evictions) >= 0 and evictions + self.host_computed <= misses, "bad counters"
        assert self._presence is None or not bool(self._presence.any()), "route_resident keys left unsettled"

    def lru_order(self) -> tuple[tuple[int, int], ...]:
        key_of = self.key_of_slot[: self.num_slots].tolist()
        stamp = self.stamp[: self.num_slots].tolist()
        used = sorted((st, k) for st, k in zip(stamp, key_of, strict=True) if k != NO_KEY)
        return tuple(self._key(k) for _, k in used)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.slot_of_key, self.key_of_slot, self.stamp, self.pinned))


def fill_sink(table: torch.Tensor, value: int | bool) -> None:
    """table[-1] = value (the sink entry of a [S + 1] or [L*E + 1] table) as a device fill.
    NOTE: `t[i] = scalar` on a CUDA tensor copies the scalar from pageable host memory and synchronises the
    stream (suspected from the 2026-12-01 4k prefill trace: five H2D copies, each followed by
    cudaStreamSynchronize, in every MoE layer); fill_ and index_fill_ take the scalar as a kernel argument."""
    table[-1:].fill_(value)


def _compact(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Positions [n]: those where mask is true first (in order), then the rest (a stable partition)."""
    return torch.argsort((~mask).to(torch.int8), stable=True)
