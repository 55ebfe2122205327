"""The scheduler's side of prefix caching: the radix cache of KV pages, the pool of linear-attention
state snapshots, and each running request's share of both.

A hybrid model (full attention + Gated DeltaNet) can resume a sequence at position m only where
both the KV of positions < m and a snapshot of the recurrent + conv state after m tokens exist.
So snapshots are taken at page boundaries only (the radix tree is page-granular) and a match is
cut back to the deepest snapshot (``require_snapshot``); the tokens between it and the end of the
shared prefix, a partial last page included, are recomputed. docs/adr/0004-prefix-cache.md says
why (no copy-on-write of partial pages) and how the snapshot interval was chosen.

Where snapshots are taken, per request (all page boundaries, each only if a slot is free, else
after evicting LRU cache entries, else skipped: a missing snapshot only shortens later matches):
- every multiple of ``interval`` tokens (kept until the request ends);
- the branch point: where the cached KV of its prefix ends when no snapshot was there (it was
  cut back): the next request sharing that prefix (a common system prompt) resumes exactly there;
- the last page boundary of the prompt, in the prefill chunk that reaches it (kept);
- every page boundary a decode reaches (``rolling``: the newer replaces the older, so at the end
  it is the end-of-output snapshot the next turn of a conversation resumes from).

Ownership: a request's ``pages[:num_shared_pages]`` are cache pages locked by its ``prefix``
match; the rest are its own. Its snapshots are its own until ``release`` inserts them (and its
computed tokens) into the cache, or frees them. The cache owns everything inserted; unreferenced
prefixes are evicted least-recently-used when pages or snapshot slots are needed.
"""

from __future__ import annotations

from domain.kv_pages import PageAllocator
from domain.prefix_cache import PrefixMatch, RadixPrefixCache
from domain.request import Request, RequestState
from domain.snapshot_pool import SnapshotPool

# Tokens between kept snapshots, chosen in docs/adr/0004-prefix-cache.md from scripts/snapshot_interval.py:
# on Qwen3.6-35B-A3B one snapshot (61.4 MiB) is the KV of 3,144 tokens; at 4096 snapshots cost 0.77x the
# KV of the tokens they serve, and a diverging prefix recomputes 302 tokens on average (branch points help).
SNAPSHOT_INTERVAL_TOKENS = 4096


def snapshot_interval(page_size: int, tokens: int = SNAPSHOT_INTERVAL_TOKENS) -> int:
    """The interval rounded up to whole pages (snapshots sit on page boundaries)."""
    return -(-tokens // page_size) * page_size


class PrefixStore:
    def __init__(self, allocator: PageAllocator, page_size: int, *, enabled: bool, num_snapshot_slots: int = 0,
                 interval: int = 0, needs_snapshots: bool = True) -> None:
        """enabled: False = no cache (every request prefills from 0, nothing is kept).
        needs_snapshots: the model has linear-attention layers, so a match must end at a snapshot
        (and snapshots are taken); without them KV pages alone make a match.
        interval: tokens between kept snapshots, a positive multiple of page_size (0 = none)."""
        if interval < 0 or interval % page_size:
            raise ValueError(f"snapshot interval {interval} must be a non-negative multiple of the page size {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.interval = interval
        self.needs_snapshots = needs_snapshots
        self.num_snapshot_slots = num_snapshot_slots  # as given (the pool is empty without linear state)
        self.snapshots = SnapshotPool(num_snapshot_slots if needs_snapshots else 0)
        # NOTE: a hybrid model without snapshot slots could never resume: caching pages would only
        # take memory, so the cache is off.
        self.enabled = enabled and (not needs_snapshots or num_snapshot_slots > 0)
        self.cache = RadixPrefixCache(allocator, page_size, on_evict_snapshot=self._drop_snapshot) if self.enabled else None
        self.evicted_pages = 0  # cumulative, for the stats

    def _drop_snapshot(self, handle: object) -> None:
        self.snapshots.release([handle])

    # ---- pages -----------------------------------------------------------------------------------------
    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_cached_pages if self.cache else 0

    def evictable_pages(self) -> int:
        return self.cache.evictable_pages() if self.cache else 0

    def available_pages(self) -> int:
        """Pages an allocation can get: free ones plus unreferenced cached ones (evicted on demand)."""
        return self.allocator.num_free + self.evictable_pages()

    def allocate(self, n: int) -> list[int]:
        """n pages, evicting LRU cached prefixes first when too few are free (MemoryError if even that
        is not enough; probe with available_pages)."""
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.evicted_pages += self.cache.evict(short)
        return self.allocator.allocate(n)

    # ---- admission -------------------------------------------------------------------------------------
    def match(self, request: Request) -> PrefixMatch | None:
        """The longest resumable cached prefix of everything the request has (read-only), or None.
        NOTE: never the whole sequence: its last token must be computed for the next sample."""
        if self.cache is None:
            return None
        found = self.cache.match(request.all_token_ids[:-1], require_snapshot=self.needs_snapshots)
        return found if found.num_tokens > 0 else None

    def pages_locked_by(self, match: PrefixMatch | None) -> int:
        """How many evictable pages locking `match` takes away (for the admission probe)."""
        return self.cache.unreferenced_in(match) if match is not None else 0

    def attach(self, request: Request, match: PrefixMatch | None) -> None:
        """Start a request on `match` (lock it; its pages lead request.pages; state restored from its
        snapshot) or, with None, from position 0."""
        assert not request.pages and request.prefix is None, request
        if self.cache is not None and self.needs_snapshots:
            depth = self.cache.match(request.all_token_ids[:-1]).num_tokens
            if depth > (match.num_tokens if match is not None else 0):
                request.branch_point = depth
        if match is None:
            request.num_computed_tokens = 0
            return
        self.cache.lock(match)
        request.prefix = match
        request.pages = list(match.pages)
        request.num_shared_pages = len(match.pages)
        request.num_computed_tokens = match.num_tokens
        request.restore_snapshot = match.snapshot if self.needs_snapshots else None

    # ---- snapshots -------------------------------------------------------------------------------------
    def take_snapshots(self, request: Request, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """Snapshot slots for a work computing positions [start, end) of `request` (pending until
        commit). Returns the work's (position, slot) pairs."""
        if self.cache is None or not self.needs_snapshots:
            return ()
        if (end - start == 1 and request.state is RequestState.DECODING and end % self.page_size
                and not (self.interval and end % self.interval == 0) and request.branch_point != end):
            # NOTE: the common decode token: no interval point in (start, end] (one exists iff end is a
            # multiple of the interval), no branch point there, no page boundary at end. Same result as
            # below, without building it.
            request.pending_snapshots = []
            return ()
        points: list[tuple[int, bool]] = []
        if self.interval:
            first = (start // self.interval + 1) * self.interval
            points = [(p, False) for p in range(first, end + 1, self.interval) if p != request.branch_point]
        if start < request.branch_point <= end:
            points.append((request.branch_point, False))
        kept = {p for p, _ in points}
        if request.state is RequestState.PREFILLING:  # the prompt's last page boundary, in whichever chunk
            boundary = request.num_tokens // self.page_size * self.page_size
            if start < boundary <= end and boundary not in kept:
                points.append((boundary, False))
        elif request.state is RequestState.DECODING and end % self.page_size == 0 and end not in kept:
            points.append((end, True))
        taken = []
        for position, rolling in sorted(points):
            slot = self._free_slot()
            if slot is None:
                break
            taken.append((position, slot, rolling))
        request.pending_snapshots = taken
        return tuple((p, s) for p, s, _ in taken)

    def _free_slot(self) -> int | None:
        slot = self.snapshots.take()
        while slot is None and self.cache.evictable_pages():
            # NOTE: LRU prefixes go leaf by leaf until one carried a snapshot (their pages go too:
            # without the snapshot above them they could no longer be resumed from anyway).
            self.evicted_pages += self.cache.evict(1)
            slot = self.snapshots.take()
        return slot

    def commit(self, request: Request) -> None:
        """The work that took the pending snapshots completed: they hold real state now."""
        for position, slot, rolling in request.pending_snapshots:
            if rolling:
                if request.rolling_snapshot is not None:
                    self.snapshots.release([request.rolling_snapshot[1]])
                request.rolling_snapshot = (position, slot)
            else:
                request.snapshots.append((position, slot))
        request.pending_snapshots = []

    # ---- the end of a request's stay -------------------------------------------------------------------
    def release(self, request: Request, *, keep: bool) -> None:
        """Give back a request's pages and snapshots. keep=True inserts its computed tokens (their
        whole pages) and its taken snapshots into the cache first; pages the cache already had under
        other ids, the partial last page and pages past the computed tokens are freed."""
        self.snapshots.release([s for _, s, _ in request.pending_snapshots])
        held = list(request.snapshots)
        if request.rolling_snapshot is not None:
            held.append(request.rolling_snapshot)
        own = request.pages[request.num_shared_pages:]
        if keep and self.cache is not None and request.num_computed_tokens >= self.page_size:
            tokens = request.all_token_ids[:request.num_computed_tokens]
            returned = self.cache.insert(tokens, request.pages, snapshots=dict(held))
            self.allocator.free(returned)
        else:
            self.allocator.free(own)
            self.snapshots.release([s for _, s in held])
        if request.prefix is not None:
            self.cache.unlock(request.prefix)
        request.pages = []
        request.prefix = None
        request.num_shared_pages = 0
        request.restore_snapshot = None
        request.branch_point = 0
        request.snapshots = []
        request.rolling_snapshot = None
        request.pending_snapshots = []

    def clear(self) -> int:
        """Drop every cached prefix (nothing may be locked: an idle scheduler); returns pages freed."""
        if self.cache is None:
            return 0
        assert self.cache.evictable_pages() == self.cache.num_cached_pages, "clear() with locked prefixes"
        return self.cache.evict(self.cache.num_cached_pages)

    # ---- invariants ------------------------------------------------------------------------------------
    def check_valid(self, running: list[Request]) -> None:
        """Across the allocator, the cache, the snapshot pool and the running requests: every used page
        is either one request's own or the cache's; every held snapshot slot is one request's or the
        cache's; every request's shared pages are exactly its locked match's."""
        self.snapshots.check_valid()
        own: list[int] = []
        held: list[int] = []
        for r in running:
            own += r.pages[r.num_shared_pages:]
            held += [s for _, s in r.snapshots] + [s for _, s, _ in r.pending_snapshots]
            if r.rolling_snapshot is not None:
                held.append(r.rolling_snapshot[1])
            positions = [p for p, _ in r.snapshots]
            assert positions == sorted(positions) and all(p % self.page_size == 0 for p in positions), r
            if r.prefix is not None:
                assert self.cache is not None and self.cache.can_unlock(r.prefix), f"{r.request_id}: prefix not locked"
                assert tuple(r.pages[:r.num_shared_pages]) == r.prefix.pages, f"{r.request_id}: shared pages drifted"
        cached_pages = 0
        if self.cache is not None:
            self.cache.check_valid()
            cached_pages = self.cache.num_cached_pages
            held += self.cache.snapshot_handles()
            if not running:
                assert self.cache.evictable_pages() == cached_pages, "a prefix is locked with nothing running"
            assert not set(own) & set(self.cache.prefixes_pages()), "a request's own page is also cached"
        assert len(own) == len(set(own)), "a KV page is owned twice"
        assert len(own) + cached_pages == self.allocator.num_used, (
            f"pages owned by requests ({len(own)}) + cached ({cached_pages}) != allocator used "
            f"({self.allocator.num_used})")
        assert len(held) == len(set(held)), "a snapshot slot is held twice"
        assert all(self.snapshots.is_used(s) for s in held), "a held snapshot slot is free in the pool"
        assert len(held) == self.snapshots.num_used, (
            f"snapshot slots held ({len(held)}) != pool used ({self.snapshots.num_used}): a slot leaked")
