"""KV page allocator: hands out page indices 0..P-1 of the paged KV cache.

Pages are interchangeable, so the allocator only tracks which are free. Allocation takes the
lowest-numbered free pages (deterministic, which keeps tests and the simulator reproducible).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class PageAllocator:
    """Free list over ``num_pages`` KV pages.

    Contract: ``allocate(n)`` either returns exactly ``n`` distinct pages or raises (it never
    allocates partially); ``free`` accepts only pages this allocator handed out and that are
    still in use, and rejects the whole call before changing anything if one page is bad.
    """

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        self.num_pages = num_pages
        # NOTE: a min-heap of free pages plus a membership set; both always hold the same pages.
        self._free_heap: list[int] = list(range(num_pages))
        self._free_set: set[int] = set(self._free_heap)

    @property
    def num_free(self) -> int:
        return len(self._free_set)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free_set)

    def is_used(self, page: int) -> bool:
        return 0 <= page < self.num_pages and page not in self._free_set

    def can_allocate(self, n: int) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= len(self._free_set)

    def allocate(self, n: int) -> list[int]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"allocate needs a non-negative int page count, got {n!r}")
        if n > len(self._free_set):
            raise MemoryError(
                f"cannot allocate {n} KV pages: only {len(self._free_set)} of {self.num_pages} free"
            )
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        self._free_set.difference_update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            if not isinstance(page, int) or not 0 <= page < self.num_pages:
                raise ValueError(f"page {page!r} does not belong to this allocator (0..{self.num_pages - 1})")
            if page in self._free_set or page in seen:
                raise ValueError(f"double free of KV page {page}")
            seen.add(page)
        for page in pages:
            heapq.heappush(self._free_heap, page)
        self._free_set.update(pages)

    def check_valid(self) -> None:
        assert len(self._free_heap) == len(self._free_set), "free heap and free set disagree in size"
        assert set(self._free_heap) == self._free_set, "free heap and free set disagree"
        assert all(0 <= p < self.num_pages for p in self._free_set), "free page out of range"
        assert self.num_free + self.num_used == self.num_pages, "free + used != total"

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self.num_pages}, num_free={self.num_free})"
