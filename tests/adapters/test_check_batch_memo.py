"""check_batch's page memo: a decode step's page table is last step's plus at most a page, so only the
new tail is range-checked; anything else (a changed prefix, a resized pool, a failed batch) is checked
in full, with the same answers as without the memo."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.torch_exec.step_inputs import check_batch
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams


def decode(rid: str, pages: tuple[int, ...], slot: int, position: int | None = None) -> SequenceWork:
    position = len(pages) * 4 - 1 if position is None else position
    return SequenceWork(rid, (7,), position, pages, slot, True, SamplingParams(), 1)


def test_a_grown_table_has_its_new_page_checked_and_the_memo_follows_the_batch():
    memo: dict = {}
    assert check_batch(StepBatch((decode("a", (0, 1), 0), decode("b", (2,), 1))), 4, 8, 2, 0, memo) is None
    assert memo == {"a": (8, (0, 1)), "b": (8, (2,))}
    # "a" grew by an out-of-range page: caught although its first pages come from the memo
    assert "outside the pool" in check_batch(StepBatch((decode("a", (0, 1, 9), 0),)), 4, 8, 2, 0, memo)
    assert memo == {"a": (8, (0, 1)), "b": (8, (2,))}, "a failed batch leaves the memo alone"
    assert check_batch(StepBatch((decode("a", (0, 1, 3), 0),)), 4, 8, 2, 0, memo) is None
    assert memo == {"a": (8, (0, 1, 3))}, "only the batch's requests are remembered"


def test_a_changed_prefix_or_a_smaller_pool_is_checked_in_full():
    memo: dict = {}
    assert check_batch(StepBatch((decode("a", (5, 6), 0),)), 4, 8, 1, 0, memo) is None
    # same request, different leading page (out of range): the memo does not vouch for it
    assert "outside the pool" in check_batch(StepBatch((decode("a", (11, 6, 7), 0),)), 4, 8, 1, 0, memo)
    # the pool shrank to 6 pages: page 6 remembered as fine under 8 pages is out of range now
    assert "outside the pool" in check_batch(StepBatch((decode("a", (5, 6), 0),)), 4, 6, 1, 0, memo)


@settings(max_examples=200, deadline=None)
@given(first=st.lists(st.integers(-1, 9), min_size=1, max_size=6), second=st.lists(st.integers(-1, 9), max_size=3),
       keep=st.integers(0, 6), pool=st.sampled_from([8, 10]))
def test_the_memo_never_changes_an_answer(first, second, keep, pool):
    memo: dict = {}
    check_batch(StepBatch((decode("a", tuple(first), 0, position=0),)), 4, 10, 1, 0, memo)
    table = tuple(first[:keep] + second) or (0,)
    batch = StepBatch((decode("a", table, 0, position=0),))
    assert check_batch(batch, 4, pool, 1, 0, memo) == check_batch(batch, 4, pool, 1, 0)
