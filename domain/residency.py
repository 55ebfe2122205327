"""Expert residency: the LRU specification for which (layer, expert) weights sit in GPU slots.

This class is the policy every executor runs (CPU, GPU, simulator). A GPU implementation that
keeps the slot table on the device must match it decision for decision; the differential
contract in tests/contracts/residency_contract.py checks exactly that.

Shape legend: S expert slots.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ExpertKey = tuple[int, int]  # (layer, expert)


class ResidencyExhausted(RuntimeError):
    """A lookup asked for more distinct experts than there are slots not pinned by others."""


@dataclass(frozen=True)
class Lookup:
    slots: tuple[int, ...]  # slot of each requested key, in request order (duplicates repeat)
    hits: tuple[ExpertKey, ...]  # distinct keys already resident, in request order
    fills: tuple[tuple[ExpertKey, int], ...]  # misses: (key, slot to copy it into), in request order
    evicted: tuple[ExpertKey, ...]  # keys that lost their slot to the fills, in eviction order
    host: tuple[ExpertKey, ...] = ()  # misses computed on the host (ADR 0030): no slot, slot -1, request order


def _check_key(key: object) -> ExpertKey:
    if (
        not isinstance(key, tuple)
        or len(key) != 2
        or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in key)
    ):
        raise ValueError(f"expert key must be a (layer, expert) tuple of non-negative ints, got {key!r}")
    return key  # type: ignore[return-value]


def host_key_count(misses: int, host_permille: int) -> int:
    """How many of a lookup's `misses` distinct misses are computed on the host at `host_permille` (ADR 0030):
    m × p / 1000 rounded half up, in integers so a device kernel computes the same count. Rounded, not floored:
    a decode layer has only ~4 misses, and a floor would send none of them to the host below 250 ‰.
    Raises ValueError for a host_permille that is not an int in 0..1000."""
    if not isinstance(host_permille, int) or isinstance(host_permille, bool) or not 0 <= host_permille <= 1000:
        raise ValueError(f"host_permille must be an int in 0..1000, got {host_permille!r}")
    return (misses * host_permille + 500) // 1000


# NOTE: the rows one weight pass of the host kernel serves (MAX_VECTORS in adapters/host_kernels/fp8_block_experts.cpp,
# which this pure module cannot import; change both together): a host key that n rows route to costs the host
# ceil(n / HOST_ROWS_PER_PASS) passes over its bytes, while its copy costs the link one
HOST_ROWS_PER_PASS = 4


# The largest decode call, in rows (a graph's bucket), the host lane serves by default (FLUXTIDE_HOST_LANE_ROWS overrides
# it in the engine; the simulator's CostParams.host_max_rows). With session 44's wait kernel the lane shortened
# bench_decode's one-prompt step at bs1, bs4 and bs6 (-23 / -18 / -9 % on one H100 machine; bs6 in a 6-row graph), and
# its distinct-rows bs4 step was 44 % under another machine's off run. 8 extends the graphs measured (up to 6 rows) by
# one bucket, so that a batch of 6 keeps the lane where the server's buckets are powers of two; no 8-row graph has been
# timed with it. Larger calls copy every miss. docs/fast-decode.md "Session 44"
HOST_LANE_MAX_ROWS = 8


def host_weight_passes(rows: int) -> int:
    """Weight passes the host kernel makes over one host key's expert for the `rows` pairs routed to it in one lookup:
    ceil(rows / HOST_ROWS_PER_PASS), 0 for none. Raises ValueError for negative rows."""
    if rows < 0:
        raise ValueError(f"negative rows {rows}")
    return -(-rows // HOST_ROWS_PER_PASS)


def host_split(miss_rows: Sequence[int], host_permille: int) -> int:
    """How many of a lookup's distinct misses go to the host (ADR 0030, "Session 41"): the longest run of the last
    misses whose summed weight passes (host_weight_passes of the rows routed to each; `miss_rows` in the lookup's
    order) stays within host_key_count(m, p) passes, m = len(miss_rows). Where every miss is routed by at most
    HOST_ROWS_PER_PASS rows (bs1 and up to 4 rows, distinct or alike) it equals host_key_count(m, p); a key that more
    rows share weighs more, so the host takes fewer keys where a batch routes alike. Integer arithmetic (a suffix sum
    against a budget), so a device kernel makes the same split. Raises ValueError for a bad share or rows < 1."""
    budget = host_key_count(len(miss_rows), host_permille)
    taken = cost = 0
    for rows in reversed(miss_rows):
        if rows < 1:
            raise ValueError(f"a missed key is routed by at least one row, got {rows}")
        cost += host_weight_passes(rows)
        if cost > budget:
            break
        taken += 1
    return taken


def balanced_host_permille(host_gb_s: float, link_gb_s: float) -> int:
    """The share of misses (per mille) at which the host lane and the PCIe link finish together (ADR 0030; `ft serve
    --host-experts auto` and the simulator's predict): round(1000 × host / (host + link)), both in GB/s of expert
    bytes. Raises ValueError for a rate that is not a finite number > 0. It ignores the fixed costs (host_call_s, a
    copy's latency) and that a lookup sends whole keys (m × p / 1000 rounded), so at a few misses a lookup the split
    is lumpy: more or fewer keys than the share."""
    for name, value in (("host_gb_s", host_gb_s), ("link_gb_s", link_gb_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a finite number > 0 (GB/s), got {value!r}")
    return round(1000 * host_gb_s / (host_gb_s + link_gb_s))


def _distinct(keys: Sequence[ExpertKey]) -> list[ExpertKey]:
    # NOTE: dict preserves first-occurrence order, which is how duplicates collapse.
    return list(dict.fromkeys(_check_key(k) for k in keys))


class ExpertResidency:
    """One global LRU over (layer, expert) keys mapped to slots 0..S-1.

    Rules (the specification):
    - ``lookup`` processes distinct keys in request order. A hit moves the key to
      most-recently-used. A miss takes the lowest free slot, else the slot of the
      least-recently-used key that is neither pinned nor requested by this same lookup;
      the filled key becomes most-recently-used.
    - Every requested key is pinned until ``release``; pinned keys are never evicted.
    - ``lookup`` is all-or-nothing: when it cannot be satisfied it raises
      ``ResidencyExhausted`` and changes nothing (probe first with ``can_lookup``).
    - ``lookup(keys, host_permille=p)`` (ADR 0030, host expert compute): of the lookup's m
      distinct misses, the last ``host_split(rows, p)`` in request order are computed on the host:
      as many of the last misses as fit in ``host_key_count(m, p)`` (m × p / 1000 rounded half up)
      weight passes, a miss that n of the requested keys repeat (n rows routed to it) weighing
      ``host_weight_passes(n)``; with no key repeated more than 4 times, the last host_key_count. They
      take no slot, evict nothing, are not pinned and stay non-resident; their ``slots`` entries
      are -1. The rest fill as above. Integer arithmetic, so a device kernel makes the same split.
      ``misses`` counts every non-resident key looked up (fills and host keys), so the hit rate
      stays hits / (hits + misses); ``host_computed`` counts the host keys alone.
    - ``resize`` rebuilds the pool cold (no resident keys), as the MoE pool resize does on
      the device; counters are cumulative and survive it.
    Every operation is O(1) per key (OrderedDict for recency, a heap only for free slots).
    """

    def __init__(self, num_slots: int) -> None:
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.host_computed = 0
        self._reset(num_slots)

    def _reset(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.num_slots = num_slots
        self._lru: OrderedDict[ExpertKey, int] = OrderedDict()  # key -> slot, oldest first
        self._slot_key: list[ExpertKey | None] = [None] * num_slots
        self._free: list[int] = list(range(num_slots))  # min-heap of empty slots
        self._pinned: set[ExpertKey] = set()

    # ---- read-only queries -------------------------------------------------------------

    def slot_of(self, key: ExpertKey) -> int | None:
        return self._lru.get(key)

    def is_pinned(self, key: ExpertKey) -> bool:
        return key in self._pinned

    @property
    def num_resident(self) -> int:
        return len(self._lru)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    def lru_order(self) -> tuple[ExpertKey, ...]:
        """Resident keys, least recently used first (for tests, metrics and the simulator)."""
        return tuple(self._lru)

    def can_lookup(self, keys: Sequence[ExpertKey], host_permille: int = 0) -> bool:
        distinct = _distinct(keys)
        return self._fits(distinct, len(self._host_split(keys, distinct, host_permille)[1]))

    def _fits(self, distinct: list[ExpertKey], num_host: int = 0) -> bool:
        """can_lookup on keys already validated and de-duplicated (lookup validates them once); the
        num_host host keys among them need no slot."""
        pinned_by_others = len(self._pinned) - sum(1 for k in distinct if k in self._pinned)
        return len(distinct) - num_host <= self.num_slots - pinned_by_others

    def _host_split(self, keys: Sequence[ExpertKey], distinct: list[ExpertKey],
                    host_permille: int) -> tuple[list[ExpertKey], list[ExpertKey]]:
        """(the distinct misses in request order, the last host_split of them: `keys` repeat a key per row)."""
        host_key_count(0, host_permille)  # refuses a bad share, misses or not
        missing = [k for k in distinct if k not in self._lru]
        if not host_permille or not missing:
            return missing, []
        rows = Counter(keys)
        return missing, missing[len(missing) - host_split([rows[k] for k in missing], host_permille):]

    def can_release(self, keys: Sequence[ExpertKey] | None = None) -> bool:
        return keys is None or all(_check_key(k) in self._pinned for k in keys)

    def can_resize(self, num_slots: int) -> bool:
        return (
            isinstance(num_slots, int)
            and not isinstance(num_slots, bool)
            and num_slots >= 0
            and not self._pinned
        )

    # ---- mutations ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[ExpertKey], host_permille: int = 0) -> Lookup:
        """Hits, fills and (with host_permille > 0) host keys for ``keys`` (class docstring).
        Raises ResidencyExhausted when the keys that take a slot (all but the host keys) cannot all
        be pinned, ValueError on a bad key or a host_permille outside 0..1000."""
        distinct = _distinct(keys)
        missing, host = self._host_split(keys, distinct, host_permille)
        on_host = set(host)
        if not self._fits(distinct, len(host)):
            pinned_by_others = len(self._pinned - set(distinct))
            raise ResidencyExhausted(
                f"lookup of {len(distinct) - len(host)} distinct experts cannot fit: {self.num_slots} slots, "
                f"{pinned_by_others} pinned by earlier lookups (release them or split the group)"
            )
        requested = set(distinct)
        # NOTE: victims come from the LRU end of the order as it was before this lookup, skipping
        # pinned and requested keys; hits and fills only ever become MRU, so choosing the victims
        # up front is the same as choosing them miss by miss. The scan stops after the victims
        # it needs, so it costs O(misses + pinned + requested), not O(S).
        victims = self._oldest_unpinned(max(0, len(missing) - len(host) - len(self._free)), requested)
        hits: list[ExpertKey] = []
        fills: list[tuple[ExpertKey, int]] = []
        evicted: list[ExpertKey] = []
        for key in distinct:
            slot = self._lru.get(key)
            if slot is not None:
                self._lru.move_to_end(key)
                hits.append(key)
                continue
            if key in on_host:
                continue
            if self._free:
                slot = heapq.heappop(self._free)
            else:
                victim = victims[len(evicted)]
                slot = self._lru.pop(victim)
                evicted.append(victim)
            self._lru[key] = slot
            self._slot_key[slot] = key
            fills.append((key, slot))
        self._pinned.update(k for k in distinct if k not in on_host)
        self.hits += len(hits)
        self.misses += len(missing)
        self.evictions += len(evicted)
        self.host_computed += len(host)
        return Lookup(
            slots=tuple(self._lru.get(k, -1) for k in keys),
            hits=tuple(hits),
            fills=tuple(fills),
            evicted=tuple(evicted),
            host=tuple(host),
        )

    def _oldest_unpinned(self, count: int, requested: set[ExpertKey]) -> list[ExpertKey]:
        victims: list[ExpertKey] = []
        if count == 0:
            return victims
        for key in self._lru:
            if key not in self._pinned and key not in requested:
                victims.append(key)
                if len(victims) == count:
                    break
        return victims

    def release(self, keys: Sequence[ExpertKey] | None = None) -> None:
        """Unpin ``keys`` (all pins when None). Releasing a key that is not pinned is an error."""
        if keys is None:
            self._pinned.clear()
            return
        distinct = _distinct(keys)
        not_pinned = [k for k in distinct if k not in self._pinned]
        if not_pinned:
            raise ValueError(f"release of expert keys that are not pinned: {not_pinned}")
        self._pinned.difference_update(distinct)

    def resize(self, num_slots: int) -> None:
        """Rebuild with ``num_slots`` slots, all empty. Refused while any key is pinned."""
        if self._pinned:
            raise RuntimeError(f"cannot resize expert residency while {len(self._pinned)} keys are pinned")
        self._reset(num_slots)

    # ---- integrity ---------------------------------------------------------------------

    def check_valid(self) -> None:
        assert len(self._slot_key) == self.num_slots, "slot table has the wrong length"
        for key, slot in self._lru.items():
            assert 0 <= slot < self.num_slots, f"{key} maps to out-of-range slot {slot}"
            assert self._slot_key[slot] == key, f"slot {slot} does not point back to {key}"
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        used = set(self._lru.values())
        assert len(used) == len(self._lru), "two keys share a slot"
        assert not (free & used), "a slot is both free and used"
        assert len(free) + len(used) == self.num_slots, "free + used != total"
        assert self._pinned <= self._lru.keys(), "a pinned key is not resident"
        assert min(self.hits, self.misses, self.evictions) >= 0, "negative counter"
        assert self.host_computed >= 0, "negative counter"
        assert self.evictions + self.host_computed <= self.misses, "more evictions and host keys than misses"

    def __repr__(self) -> str:
        return (
            f"ExpertResidency(num_slots={self.num_slots}, resident={self.num_resident}, "
            f"pinned={self.num_pinned}, hits={self.hits}, misses={self.misses}, evictions={self.evictions}, "
            f"host_computed={self.host_computed})"
        )
