"""Radix prefix cache over KV pages, with linear-attention state snapshots at page boundaries.

The tree is page-granular: every node below the root holds exactly one KV page and is keyed by
that page's ``page_size`` token ids, so a path from the root spells a whole-page token prefix.
(One node per page rather than compressed edges: eviction then frees exactly as many pages as
asked, and the tree never has to split a node.)

A hybrid model (full attention + linear attention) can only resume a sequence where a snapshot
of its recurrent state exists, so nodes may carry an opaque ``snapshot`` handle taken at the
boundary right after their page. ``match(require_snapshot=True)`` stops at such a node.

Ownership contract (what the caller must do):
- ``match`` is read-only; ``lock`` the match before using its pages and ``unlock`` it when done.
  Locked pages (and their ancestors) are never evicted. A match gone stale (its node evicted
  between match and lock) is refused by ``lock``; probe with ``can_lock``.
- ``insert(tokens, pages, snapshot, snapshots=)``: ``pages[i]`` holds ``tokens[i*P:(i+1)*P]``. The cache
  adopts the pages of the whole-page prefix it did not have yet. It returns the pages it did NOT
  adopt — pages for a part that was already cached under a different page id, the page of a
  partial last page, and any extra pages — and the caller still owns and must free those. A
  page that already is the cached page at that position (it came from a locked match) is
  shared, not returned. The snapshot, if given, must sit at a page boundary
  (``len(tokens) % P == 0``); the cache owns it from then on and hands it to
  ``on_evict_snapshot`` when it drops it (at once if that boundary already has a snapshot).
  ``snapshots`` maps more boundaries inside the prefix (token counts, multiples of P, at most
  the whole-page length) to snapshots taken there, with the same ownership rule: one insert
  of a whole sequence with all its snapshots instead of one walk per snapshot.
- ``evict(n)`` frees unreferenced leaves least-recently-used first (recency = last lock or
  insert touching the node) through the allocator, and returns the number of pages freed.
- A request that needs logits for its last prompt token should match ``prompt[:-1]``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from domain.kv_pages import PageAllocator


class _Node:
    __slots__ = ("id", "parent", "chunk", "page", "children", "ref", "tick", "snapshot", "alive", "depth")

    def __init__(
        self, node_id: int, parent: _Node | None, chunk: tuple[int, ...], page: int, tick: int
    ) -> None:
        self.id = node_id
        self.parent = parent
        self.chunk = chunk  # the page_size token ids this node's page holds
        self.page = page
        self.children: dict[tuple[int, ...], _Node] = {}
        self.ref = 0  # locks on paths through this node
        self.tick = tick  # logical time of the last lock/insert touching this node
        self.snapshot: object | None = None
        self.alive = True
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root

    def path(self) -> list[_Node]:
        """Nodes from the first page down to this one (the root excluded)."""
        nodes: list[_Node] = []
        node: _Node | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes


@dataclass(frozen=True)
class PrefixMatch:
    pages: tuple[int, ...]  # KV pages of the matched prefix, in order
    num_tokens: int  # len(pages) * page_size
    snapshot: object | None  # snapshot stored exactly at the end of the prefix, if any
    _node: _Node | None = field(default=None, compare=False, repr=False)


class RadixPrefixCache:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        on_evict_snapshot: Callable[[object], None] | None = None,
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.allocator = allocator
        self.page_size = page_size
        self.on_evict_snapshot = on_evict_snapshot
        self._ids = itertools.count(1)
        self._tick = 0
        self._root = _Node(0, None, (), -1, 0)
        self._page_owner: dict[int, _Node] = {}
        self._num_unreferenced = 0  # nodes with ref == 0: exactly the evictable pages
        # NOTE: lazy heap of (tick, id, node) for leaves that may be evictable; an entry is acted
        # on only if it still describes an alive, unreferenced leaf with that tick.
        self._leaf_heap: list[tuple[int, int, _Node]] = []

    # ---- read-only ---------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_owner)

    def evictable_pages(self) -> int:
        return self._num_unreferenced

    def can_evict(self, num_pages: int) -> bool:
        return num_pages <= self._num_unreferenced

    def prefixes(self) -> dict[tuple[int, ...], tuple[int, object | None]]:
        """Every cached whole-page prefix -> (its last page, snapshot at its end). O(cached tokens)."""
        out: dict[tuple[int, ...], tuple[int, object | None]] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self._root)]
        while stack:
            prefix, node = stack.pop()
            for chunk, child in node.children.items():
                out[prefix + chunk] = (child.page, child.snapshot)
                stack.append((prefix + chunk, child))
        return out

    def _chunks(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        p = self.page_size
        return [tuple(tokens[i : i + p]) for i in range(0, len(tokens) - p + 1, p)]

    def match(self, tokens: Sequence[int], *, require_snapshot: bool = False) -> PrefixMatch:
        """Longest cached whole-page prefix of ``tokens`` (with a snapshot at its end when
        ``require_snapshot``). Changes nothing, recency included."""
        node = self._root
        best = self._root
        for chunk in self._chunks(tokens):
            child = node.children.get(chunk)
            if child is None:
                break
            node = child
            if not require_snapshot or node.snapshot is not None:
                best = node
        path = best.path()
        return PrefixMatch(
            pages=tuple(n.page for n in path),
            num_tokens=len(path) * self.page_size,
            snapshot=best.snapshot,
            _node=best,
        )

    def unreferenced_in(self, match: PrefixMatch) -> int:
        """Pages of ``match`` that are evictable now (locking it would take them out of
        ``evictable_pages``): the admission probe counts them before it locks."""
        node = match._node
        if node is None or not node.alive:
            return 0
        return sum(1 for n in node.path() if n.ref == 0)

    def prefixes_pages(self) -> set[int]:
        """Every cached page id."""
        return set(self._page_owner)

    def snapshot_handles(self) -> list[object]:
        """Every snapshot the cache owns. O(cached pages)."""
        return [n.snapshot for n in self._page_owner.values() if n.snapshot is not None]

    def can_lock(self, match: PrefixMatch) -> bool:
        node = match._node
        return node is not None and node.alive

    def can_unlock(self, match: PrefixMatch) -> bool:
        node = match._node
        return node is not None and node.alive and all(n.ref > 0 for n in node.path())

    # ---- mutations ---------------------------------------------------------------------

    def lock(self, match: PrefixMatch) -> None:
        if not self.can_lock(match):
            raise ValueError("cannot lock a stale prefix match (its pages were evicted); match again")
        self._tick += 1
        for node in match._node.path():
            if node.ref == 0:
                self._num_unreferenced -= 1
            node.ref += 1
            node.tick = self._tick

    def unlock(self, match: PrefixMatch) -> None:
        if not self.can_unlock(match):
            raise ValueError("unlock of a prefix match that is not locked (or was evicted)")
        node = match._node
        for n in node.path():
            n.ref -= 1
            if n.ref == 0:
                self._num_unreferenced += 1
        if node is not self._root and node.ref == 0 and not node.children:
            self._push_leaf(node)

    def insert_error(
        self, tokens: Sequence[int], pages: Sequence[int], snapshot: object | None = None,
        snapshots: Mapping[int, object] | None = None,
    ) -> str | None:
        """Why ``insert`` would refuse these arguments, or None when it would accept them."""
        num_whole = len(tokens) // self.page_size
        if len(pages) < num_whole:
            return f"{len(tokens)} tokens need {num_whole} whole pages, got {len(pages)}"
        if len(set(pages)) != len(pages):
            return "the same page appears twice in pages"
        for page in pages:
            if not isinstance(page, int) or not self.allocator.is_used(page):
                return f"page {page!r} is not an allocated page of this cache's allocator"
        if snapshot is not None and (num_whole == 0 or len(tokens) % self.page_size):
            return f"a snapshot needs a non-empty page-aligned prefix; got {len(tokens)} tokens (page {self.page_size})"
        for boundary, handle in (snapshots or {}).items():
            if not isinstance(boundary, int) or not 0 < boundary <= num_whole * self.page_size \
                    or boundary % self.page_size:
                return (f"snapshot boundary {boundary!r} is not a page boundary inside the "
                        f"{num_whole * self.page_size}-token whole-page prefix (page {self.page_size})")
            if handle is None:
                return f"snapshot at boundary {boundary} is None"
            if snapshot is not None and boundary == len(tokens):
                return f"two snapshots for boundary {boundary} (snapshot and snapshots)"
        node = self._root
        for i, chunk in enumerate(self._chunks(tokens)):
            node = node.children.get(chunk) if node is not None else None
            owner = self._page_owner.get(pages[i])
            if owner is not None and owner is not node:
                return f"page {pages[i]} is already cached for a different prefix"
        for page in pages[num_whole:]:
            if page in self._page_owner:
                return f"page {page} is already cached; it cannot hold a partial or extra page"
        return None

    def can_insert(self, tokens: Sequence[int], pages: Sequence[int], snapshot: object | None = None,
                   snapshots: Mapping[int, object] | None = None) -> bool:
        return self.insert_error(tokens, pages, snapshot, snapshots) is None

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], snapshot: object | None = None,
        snapshots: Mapping[int, object] | None = None,
    ) -> list[int]:
        """Cache the whole-page prefix of ``tokens``; returns the pages the caller still owns."""
        error = self.insert_error(tokens, pages, snapshot, snapshots)
        if error is not None:
            raise ValueError(f"insert refused: {error}")
        chunks = self._chunks(tokens)
        self._tick += 1
        not_adopted: list[int] = []
        inner = dict(snapshots or {})
        if snapshot is not None:
            inner[len(tokens)] = snapshot
        node = self._root
        for i, (chunk, page) in enumerate(zip(chunks, pages, strict=False)):
            child = node.children.get(chunk)
            if child is None:
                child = _Node(next(self._ids), node, chunk, page, self._tick)
                node.children[chunk] = child
                self._page_owner[page] = child
                self._num_unreferenced += 1
            elif child.page != page:
                not_adopted.append(page)
            child.tick = self._tick
            node = child
            handle = inner.pop((i + 1) * self.page_size, None)
            if handle is not None:
                if node.snapshot is None:
                    node.snapshot = handle
                else:  # keep the one already there: a locked match may be resuming from it
                    self._drop_snapshot(handle)
        not_adopted.extend(pages[len(chunks) :])
        if node is not self._root and node.ref == 0 and not node.children:
            self._push_leaf(node)
        return not_adopted

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unreferenced pages, LRU leaves first; returns pages freed."""
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"evict needs a non-negative int, got {num_pages!r}")
        freed: list[int] = []
        while len(freed) < num_pages and self._leaf_heap:
            tick, _, node = heapq.heappop(self._leaf_heap)
            if not node.alive or node.children or node.ref or node.tick != tick:
                continue  # stale entry
            parent = node.parent
            del parent.children[node.chunk]
            del self._page_owner[node.page]
            node.alive = False
            self._num_unreferenced -= 1
            freed.append(node.page)
            if node.snapshot is not None:
                self._drop_snapshot(node.snapshot)
                node.snapshot = None
            if parent is not self._root and parent.ref == 0 and not parent.children:
                self._push_leaf(parent)
        self.allocator.free(freed)
        if len(self._leaf_heap) > 2 * len(self._page_owner) + 64:
            self._rebuild_heap()
        return len(freed)

    # ---- helpers -----------------------------------------------------------------------

    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._leaf_heap, (node.tick, node.id, node))

    def _rebuild_heap(self) -> None:
        self._leaf_heap = [
            (n.tick, n.id, n) for n in self._page_owner.values() if n.ref == 0 and not n.children
        ]
        heapq.heapify(self._leaf_heap)

    def _drop_snapshot(self, snapshot: object) -> None:
        if self.on_evict_snapshot is not None:
            self.on_evict_snapshot(snapshot)

    def check_valid(self) -> None:
        seen_pages: set[int] = set()
        unreferenced = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            assert node.alive, "a dead node is still in the tree"
            assert node.ref >= 0, f"negative refcount on page {node.page}"
            if node is not self._root:  # NOTE: locks never count on the root
                assert node.ref >= sum(c.ref for c in node.children.values()), (
                    "child locked more than its parent"
                )
                assert len(node.chunk) == self.page_size, "a node does not hold exactly one page"
                assert node.page not in seen_pages, f"page {node.page} is cached twice"
                assert self._page_owner.get(node.page) is node, f"page {node.page} owner map is wrong"
                assert self.allocator.is_used(node.page), f"cached page {node.page} is free in the allocator"
                seen_pages.add(node.page)
                unreferenced += node.ref == 0
            for chunk, child in node.children.items():
                assert child.parent is node and child.chunk == chunk, "broken parent/child link"
                assert child.depth == node.depth + 1, "wrong depth"
                stack.append(child)
        assert self._root.snapshot is None, "the root cannot carry a snapshot"
        assert seen_pages == self._page_owner.keys(), "owner map lists pages not in the tree"
        assert unreferenced == self._num_unreferenced, "evictable page count drifted"
        assert self.allocator.num_used >= len(seen_pages), "allocator has fewer used pages than the cache"
        heap_entries = {(tick, node_id) for tick, node_id, _ in self._leaf_heap}
        for node in self._page_owner.values():
            if node.ref == 0 and not node.children:
                assert (node.tick, node.id) in heap_entries, (
                    f"evictable leaf page {node.page} is missing from the heap"
                )
