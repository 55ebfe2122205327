"""Snapshot slots: indices 0..N-1 of the executor's linear-attention snapshot pool.

A snapshot slot holds one copy of a sequence's Gated DeltaNet state (recurrent + conv, every
linear-attention layer) taken at a page boundary, so a later request can resume there from the
prefix cache. Slots are interchangeable; like ``PageAllocator`` this only tracks which are free
(lowest-numbered first, deterministic).

Contract: ``take()`` returns a free slot or None (a snapshot is optional: a missing one only
shortens later prefix matches); ``release`` accepts only slots handed out and still held, and
refuses the whole call before changing anything when one is bad.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class SnapshotPool:
    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.num_slots = num_slots
        self._free_heap: list[int] = list(range(num_slots))
        self._free_set: set[int] = set(self._free_heap)

    @property
    def num_free(self) -> int:
        return len(self._free_set)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free_set)

    def is_used(self, slot: int) -> bool:
        return isinstance(slot, int) and 0 <= slot < self.num_slots and slot not in self._free_set

    def take(self) -> int | None:
        if not self._free_heap:
            return None
        slot = heapq.heappop(self._free_heap)
        self._free_set.discard(slot)
        return slot

    def release(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        seen: set[int] = set()
        for slot in slots:
            if not self.is_used(slot) or slot in seen:
                raise ValueError(f"snapshot slot {slot!r} is not held (double release or never taken)")
            seen.add(slot)
        for slot in slots:
            heapq.heappush(self._free_heap, slot)
        self._free_set.update(slots)

    def check_valid(self) -> None:
        assert len(self._free_heap) == len(self._free_set), "free heap and free set disagree in size"
        assert set(self._free_heap) == self._free_set, "free heap and free set disagree"
        assert all(0 <= s < self.num_slots for s in self._free_set), "free snapshot slot out of range"

    def __repr__(self) -> str:
        return f"SnapshotPool(num_slots={self.num_slots}, num_free={self.num_free})"
