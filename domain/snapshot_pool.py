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

from collections.abc import Iterable

from domain.kv_pages import PageAllocator


class SnapshotPool:
    """A free list of snapshot slots: PageAllocator's (lowest first, all-or-nothing release) under the
    snapshot pool's contract (``take`` may come back empty)."""

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self.num_slots = num_slots
        self._slots = PageAllocator(num_slots)

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def num_used(self) -> int:
        return self._slots.num_used

    def is_used(self, slot: int) -> bool:
        return isinstance(slot, int) and self._slots.is_used(slot)

    def take(self) -> int | None:
        return self._slots.allocate(1)[0] if self._slots.can_allocate(1) else None

    def release(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        try:
            self._slots.free(slots)
        except ValueError as exc:
            raise ValueError(f"snapshot slots {slots!r} are not all held (double release or never taken): "
                             f"{exc}") from None

    def check_valid(self) -> None:
        self._slots.check_valid()

    def __repr__(self) -> str:
        return f"SnapshotPool(num_slots={self.num_slots}, num_free={self.num_free})"
