"""PageAllocator: examples for the error paths, and a state machine against a shadow set."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from domain.kv_pages import PageAllocator


def test_allocate_returns_lowest_free_pages_and_free_returns_them():
    alloc = PageAllocator(4)
    assert alloc.allocate(2) == [0, 1]
    alloc.free([0])
    assert alloc.allocate(2) == [0, 2]
    assert (alloc.num_free, alloc.num_used) == (1, 3)
    alloc.check_valid()


def test_over_allocation_raises_and_changes_nothing():
    alloc = PageAllocator(3)
    alloc.allocate(2)
    assert not alloc.can_allocate(2)
    with pytest.raises(MemoryError, match="only 1 of 3 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1


@pytest.mark.parametrize("bad", [[5], [-1], ["0"]])
def test_foreign_page_is_rejected(bad):
    alloc = PageAllocator(4)
    alloc.allocate(4)
    with pytest.raises(ValueError, match="does not belong"):
        alloc.free(bad)
    assert alloc.num_used == 4


def test_double_free_is_rejected_atomically():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    alloc.free([1])
    with pytest.raises(ValueError, match="double free of KV page 1"):
        alloc.free([0, 1])
    assert alloc.is_used(0), "a rejected free must not free the good pages in the same call"
    with pytest.raises(ValueError, match="double free of KV page 2"):
        alloc.free([2, 2])
    assert alloc.is_used(2)
    alloc.check_valid()


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_counts_are_rejected(bad):
    alloc = PageAllocator(4)
    assert not alloc.can_allocate(bad)
    with pytest.raises(ValueError):
        alloc.allocate(bad)


class AllocatorMachine(RuleBasedStateMachine):
    """Drives PageAllocator and a shadow set of used pages side by side."""

    @initialize(num_pages=st.integers(0, 12))
    def setup(self, num_pages):
        self.alloc = PageAllocator(num_pages)
        self.used: set[int] = set()
        self.num_pages = num_pages

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        free = self.num_pages - len(self.used)
        assert self.alloc.can_allocate(n) == (n <= free)
        if n > free:
            with pytest.raises(MemoryError):
                self.alloc.allocate(n)
            return
        pages = self.alloc.allocate(n)
        assert len(pages) == len(set(pages)) == n
        assert not (set(pages) & self.used), "handed out a page already in use"
        # Lowest free pages first.
        assert pages == sorted(set(range(self.num_pages)) - self.used)[:n]
        self.used.update(pages)

    @precondition(lambda self: self.used)
    @rule(data=st.data())
    def free_some(self, data):
        pages = data.draw(st.lists(st.sampled_from(sorted(self.used)), unique=True, min_size=1))
        self.alloc.free(pages)
        self.used.difference_update(pages)

    @rule(page=st.integers(-2, 14))
    def free_bad_page(self, page):
        if page in self.used:
            return
        with pytest.raises(ValueError):
            self.alloc.free([page])

    @invariant()
    def counts_match_shadow(self):
        self.alloc.check_valid()
        assert self.alloc.num_used == len(self.used)
        assert self.alloc.num_free == self.num_pages - len(self.used)
        assert all(self.alloc.is_used(p) for p in self.used)


AllocatorMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=25, deadline=None)
TestAllocatorMachine = AllocatorMachine.TestCase
