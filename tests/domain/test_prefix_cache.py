"""RadixPrefixCache: worked examples, then a state machine against a shadow dict of prefixes."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from domain.kv_pages import PageAllocator
from domain.prefix_cache import RadixPrefixCache


def make(num_pages=16, page_size=2):
    dropped = []
    alloc = PageAllocator(num_pages)
    return alloc, RadixPrefixCache(alloc, page_size, on_evict_snapshot=dropped.append), dropped


# ---- worked examples -------------------------------------------------------------------


def test_only_whole_pages_are_cached_and_the_partial_page_is_returned():
    alloc, cache, _ = make()
    pages = alloc.allocate(3)
    assert cache.insert([1, 2, 3, 4, 5], pages) == [pages[2]]
    m = cache.match([1, 2, 3, 4, 5, 6])
    assert (m.pages, m.num_tokens, m.snapshot) == ((pages[0], pages[1]), 4, None)
    assert cache.match([1, 2, 9, 9]).pages == (pages[0],)
    assert cache.match([7, 7]).num_tokens == 0
    cache.check_valid()


def test_shared_prefix_is_stored_once_and_duplicates_are_returned():
    alloc, cache, _ = make()
    first = alloc.allocate(2)
    cache.insert([1, 2, 3, 4], first)
    second = alloc.allocate(3)
    # Same first page content under another page id: that copy is returned for freeing.
    assert cache.insert([1, 2, 5, 6, 7, 8], second) == [second[0]]
    assert cache.num_cached_pages == 4
    # Re-inserting through a locked match shares the cached pages: nothing comes back.
    m = cache.match([1, 2, 3, 4])
    cache.lock(m)
    assert cache.insert([1, 2, 3, 4], list(m.pages)) == []
    cache.unlock(m)
    cache.check_valid()


def test_require_snapshot_returns_the_longest_prefix_ending_at_a_snapshot():
    alloc, cache, dropped = make()
    cache.insert([1, 2, 3, 4], alloc.allocate(2), snapshot="s4")
    shared = list(cache.match([1, 2, 3, 4]).pages)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [*shared, *alloc.allocate(2)])
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert (m.num_tokens, m.snapshot) == (8, None)
    s = cache.match([1, 2, 3, 4, 5, 6, 7, 8], require_snapshot=True)
    assert (s.num_tokens, s.snapshot) == (4, "s4")
    assert cache.match([1, 2], require_snapshot=True).num_tokens == 0
    # A second snapshot for the same boundary is handed straight back to on_evict_snapshot.
    cache.insert([1, 2, 3, 4], list(cache.match([1, 2, 3, 4]).pages), snapshot="dup")
    assert dropped == ["dup"]


def test_evict_frees_lru_leaves_skips_locked_and_drops_snapshots():
    alloc, cache, dropped = make(num_pages=8)
    a = alloc.allocate(2)
    cache.insert([1, 1, 2, 2], a, snapshot="a")
    b = alloc.allocate(2)
    cache.insert([3, 3, 4, 4], b, snapshot="b")
    locked = cache.match([3, 3, 4, 4])
    cache.lock(locked)  # b is now the most recent and locked
    assert cache.evictable_pages() == 2
    assert cache.evict(1) == 1 and not alloc.is_used(a[1])
    assert dropped == ["a"]
    assert cache.evict(10) == 1 and alloc.num_used == 2
    assert cache.evict(10) == 0, "locked pages must never be evicted"
    cache.unlock(locked)
    assert cache.evict(10) == 2 and alloc.num_used == 0 and dropped == ["a", "b"]
    cache.check_valid()


def test_lock_refreshes_recency_but_match_does_not():
    alloc, cache, _ = make(num_pages=8)
    a, b = alloc.allocate(1), alloc.allocate(1)
    cache.insert([1, 1], a)
    cache.insert([2, 2], b)
    cache.match([1, 1])  # read-only: a stays the LRU leaf
    assert cache.evict(1) == 1 and not alloc.is_used(a[0])
    cache.insert([1, 1], alloc.allocate(1))
    m = cache.match([2, 2])
    cache.lock(m)
    cache.unlock(m)  # b is now more recent than the re-inserted [1, 1]
    assert cache.evict(1) == 1 and alloc.is_used(b[0])


def test_stale_match_lock_and_double_unlock_are_refused():
    alloc, cache, _ = make()
    cache.insert([1, 2], alloc.allocate(1))
    m = cache.match([1, 2])
    cache.evict(1)
    assert not cache.can_lock(m)
    with pytest.raises(ValueError, match="stale"):
        cache.lock(m)
    cache.insert([1, 2], alloc.allocate(1))
    m = cache.match([1, 2])
    cache.lock(m)
    cache.unlock(m)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m)


@pytest.mark.parametrize(
    ("tokens", "pages", "snapshot", "reason"),
    [
        ([1, 2, 3, 4], [0], None, "need 2 whole pages"),
        ([1, 2], [0, 0], None, "twice"),
        ([1, 2], [15], None, "not an allocated page"),
        ([1, 2, 3], [0, 1], "s", "page-aligned"),
        ([], [], "s", "page-aligned"),
        ([9, 9], [2], None, "already cached"),
        ([1, 2, 7], [0, 2], None, "already cached"),
    ],
)
def test_bad_inserts_are_refused_without_changes(tokens, pages, snapshot, reason):
    alloc, cache, _ = make()
    alloc.allocate(3)
    cache.insert([5, 5], [2])
    before = cache.prefixes()
    assert not cache.can_insert(tokens, pages, snapshot)
    with pytest.raises(ValueError, match=reason):
        cache.insert(tokens, pages, snapshot)
    assert cache.prefixes() == before
    cache.check_valid()


# ---- state machine ---------------------------------------------------------------------


class ShadowCache:
    """Trivially correct model: a dict from cached prefix (token tuple) to its node record."""

    def __init__(self, page_size):
        self.ps = page_size
        self.nodes = {}  # prefix -> {"page", "ref", "tick", "snapshot"}
        self.tick = 0

    def whole(self, tokens):
        return len(tokens) // self.ps

    def match(self, tokens, require_snapshot=False):
        best = 0
        for k in range(1, self.whole(tokens) + 1):
            node = self.nodes.get(tuple(tokens[: k * self.ps]))
            if node is None:
                break
            if not require_snapshot or node["snapshot"] is not None:
                best = k
        prefix = tuple(tokens[: best * self.ps])
        pages = tuple(self.nodes[prefix[: i * self.ps]]["page"] for i in range(1, best + 1))
        snapshot = self.nodes[prefix]["snapshot"] if best else None
        return pages, best * self.ps, snapshot

    def path(self, prefix):
        return [self.nodes[prefix[: i * self.ps]] for i in range(1, len(prefix) // self.ps + 1)]

    def lock(self, prefix):
        self.tick += 1
        for node in self.path(prefix):
            node["ref"] += 1
            node["tick"] = self.tick

    def unlock(self, prefix):
        for node in self.path(prefix):
            node["ref"] -= 1

    def insert(self, tokens, pages, snapshot):
        """Returns (pages not adopted, snapshots dropped)."""
        self.tick += 1
        k = self.whole(tokens)
        returned = []
        for i in range(1, k + 1):
            prefix = tuple(tokens[: i * self.ps])
            node = self.nodes.setdefault(
                prefix, {"page": pages[i - 1], "ref": 0, "tick": 0, "snapshot": None}
            )
            if node["page"] != pages[i - 1]:
                returned.append(pages[i - 1])
            node["tick"] = self.tick
        returned.extend(pages[k:])
        dropped = []
        if snapshot is not None:
            end = self.nodes[tuple(tokens[: k * self.ps])]
            if end["snapshot"] is None:
                end["snapshot"] = snapshot
            else:
                dropped.append(snapshot)
        return returned, dropped

    def is_leaf(self, prefix):
        return not any(len(q) == len(prefix) + self.ps and q[: len(prefix)] == prefix for q in self.nodes)

    def evict(self, n):
        """Returns (pages freed, snapshots dropped) choosing the LRU unreferenced leaf each time."""
        freed, dropped = [], []
        while len(freed) < n:
            leaves = [p for p, node in self.nodes.items() if node["ref"] == 0 and self.is_leaf(p)]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: self.nodes[p]["tick"])
            node = self.nodes.pop(victim)
            freed.append(node["page"])
            if node["snapshot"] is not None:
                dropped.append(node["snapshot"])
        return freed, dropped


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(4, 20), page_size=st.integers(1, 3))
    def setup(self, num_pages, page_size):
        self.alloc = PageAllocator(num_pages)
        self.dropped = []
        self.cache = RadixPrefixCache(self.alloc, page_size, on_evict_snapshot=self.dropped.append)
        self.shadow = ShadowCache(page_size)
        self.expected_dropped = []
        self.held = []  # (PrefixMatch, prefix) locks held by "running requests"
        self.next_snapshot = 0
        self.ps = page_size

    tokens = st.lists(st.integers(0, 1), max_size=10)

    def _match_both(self, tokens, require_snapshot=False):
        got = self.cache.match(tokens, require_snapshot=require_snapshot)
        pages, num_tokens, snapshot = self.shadow.match(tokens, require_snapshot)
        assert (got.pages, got.num_tokens, got.snapshot) == (pages, num_tokens, snapshot)
        return got, tuple(tokens[:num_tokens])

    def _evict_both(self, n):
        used_before = {p for p in range(self.alloc.num_pages) if self.alloc.is_used(p)}
        freed, dropped = self.shadow.evict(n)
        assert self.cache.evictable_pages() >= len(freed)
        assert self.cache.evict(n) == len(freed)
        now_free = {p for p in used_before if not self.alloc.is_used(p)}
        assert now_free == set(freed), "evicted a different set of pages than the LRU shadow"
        self.expected_dropped.extend(dropped)

    def _snapshot(self, tokens, want):
        if not want or not tokens or len(tokens) % self.ps:
            return None
        self.next_snapshot += 1
        return f"snap{self.next_snapshot}"

    @rule(tokens=tokens, want_snapshot=st.booleans(), keep_locked=st.booleans(), require=st.booleans())
    def request(self, tokens, want_snapshot, keep_locked, require):
        """A request: match, lock, allocate the rest (evicting if short), insert, maybe keep the lock."""
        match, prefix = self._match_both(tokens, require_snapshot=require)
        self.cache.lock(match)
        self.shadow.lock(prefix)
        need = -(-len(tokens) // self.ps) - len(match.pages)
        if not self.alloc.can_allocate(need):
            self._evict_both(need - self.alloc.num_free)
        if self.alloc.can_allocate(need):
            pages = [*match.pages, *self.alloc.allocate(need)]
            snapshot = self._snapshot(tokens, want_snapshot)
            returned, dropped = self.shadow.insert(tokens, pages, snapshot)
            assert self.cache.insert(tokens, pages, snapshot) == returned
            self.expected_dropped.extend(dropped)
            self.alloc.free(returned)
        if keep_locked:
            self.held.append((match, prefix))
        else:
            self.cache.unlock(match)
            self.shadow.unlock(prefix)

    @rule(tokens=tokens, want_snapshot=st.booleans())
    def insert_fresh_copy(self, tokens, want_snapshot):
        """Insert with brand-new pages even where the prefix is cached: duplicates come back."""
        need = -(-len(tokens) // self.ps)
        if not self.alloc.can_allocate(need):
            return
        pages = self.alloc.allocate(need)
        snapshot = self._snapshot(tokens, want_snapshot)
        returned, dropped = self.shadow.insert(tokens, pages, snapshot)
        assert self.cache.insert(tokens, pages, snapshot) == returned
        self.expected_dropped.extend(dropped)
        self.alloc.free(returned)

    @rule(tokens=tokens, require=st.booleans(), keep_locked=st.booleans())
    def lock_without_insert(self, tokens, require, keep_locked):
        """A request served wholly from the cache, or aborted before inserting."""
        match, prefix = self._match_both(tokens, require_snapshot=require)
        self.cache.lock(match)
        self.shadow.lock(prefix)
        if keep_locked:
            self.held.append((match, prefix))
        else:
            self.cache.unlock(match)
            self.shadow.unlock(prefix)

    @rule(tokens=tokens, require=st.booleans())
    def match_only(self, tokens, require):
        self._match_both(tokens, require)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def finish_request(self, data):
        match, prefix = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.unlock(match)
        self.shadow.unlock(prefix)

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        self._evict_both(n)

    @invariant()
    def agrees_with_shadow(self):
        self.cache.check_valid()
        self.alloc.check_valid()
        shadow = {p: (node["page"], node["snapshot"]) for p, node in self.shadow.nodes.items()}
        assert self.cache.prefixes() == shadow
        assert self.cache.evictable_pages() == sum(n["ref"] == 0 for n in self.shadow.nodes.values())
        # Every page is either cached or back in the allocator: nothing leaks.
        assert self.alloc.num_used == self.cache.num_cached_pages
        assert self.dropped == self.expected_dropped
        live = [n["snapshot"] for n in self.shadow.nodes.values() if n["snapshot"] is not None]
        assert not set(live) & set(self.dropped), "a snapshot still cached was handed to on_evict_snapshot"


PrefixCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
