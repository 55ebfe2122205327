"""Scheduler with the prefix cache: the scheduler state machine again, with shared prefixes,
multi-turn follow-ups, snapshots, evictions, aborts that keep their prefix, preemption and pool
replacement; check_valid() across scheduler, allocator, radix cache and snapshot pool after every
rule. FakeExecutor checks that every resumed sequence's cached KV pages and restored snapshot hold
exactly its tokens, and outputs must equal each request's solo run."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from domain.fakes import FakeExecutor
from domain.kv_pages import PageAllocator
from domain.request import Request, RequestState, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from tests.domain.test_scheduler import EOS, VOCAB, SchedulerMachine, run_to_idle, solo_output


class PrefixSchedulerMachine(SchedulerMachine):
    @initialize(
        max_running=st.integers(1, 4),
        extra_budget=st.integers(0, 10),
        mixed_cut=st.integers(0, 10),
        page_size=st.integers(1, 3),
        num_pages=st.integers(4, 16),
        num_slots=st.integers(1, 4),
        max_context=st.integers(8, 40),
        snapshot_slots=st.integers(0, 8),
        interval_pages=st.integers(0, 3),
        linear_state=st.sampled_from([True, True, False]),
        layers=st.sampled_from([0, 1, 3]),
        group_extra=st.integers(0, 10),
        short_prompts=st.booleans(),
        partial=st.booleans(),
    )
    def setup(self, max_running, extra_budget, mixed_cut, page_size, num_pages, num_slots, max_context,
              snapshot_slots, interval_pages, linear_state, layers, group_extra, short_prompts, partial):
        self.config = SchedulerConfig(
            max_running=max_running, max_step_tokens=max_running + extra_budget,
            mixed_step_tokens=max_running + max(extra_budget - mixed_cut, 0), page_size=page_size,
            max_context=max_context, eos_token_ids=EOS, prefix_cache=True,
            snapshot_interval=interval_pages * page_size, linear_state=linear_state, layered_prefill=layers > 0,
            num_layers=max(layers, 1), layer_group_tokens=max_running + min(group_extra, extra_budget),
            layer_short_prompts=short_prompts and layers > 0, partial_residency=partial)  # ADR 0024 "A0
        self.allocator = PageAllocator(num_pages)
        self.snapshot_slots = snapshot_slots
        self.scheduler = Scheduler(self.config, self.allocator, num_slots, snapshot_slots)
        self.executor = FakeExecutor(page_size, num_pages, num_slots, vocab_size=VOCAB,
                                     num_snapshot_slots=snapshot_slots, linear_state=linear_state,
                                     num_layers=max(layers, 1))
        self.live, self.expected, self.received, self.arrival_rank = {}, {}, {}, {}
        self.next_id = 0
        self.finished_sequences: list[list[int]] = []
        self.hits = 0

    def _apply(self, events):
        for ev in events:
            request = self.live.get(ev.request_id)
            if ev.finished and request is not None:
                want, _ = self.expected[ev.request_id]
                self.finished_sequences.append(request.prompt_token_ids + want)
        super()._apply(events)

    def _check_batch(self, batch, waiting_before, decoding_before):
        super()._check_batch(batch, waiting_before, decoding_before)
        for work in batch.works:
            if work.restore_from is not None or (work.start_position and work.request_id in
                                                 {r.request_id for r in waiting_before}):
                self.hits += 1
                event("a request resumed from the prefix cache")
            if work.snapshots:
                event("a snapshot was taken")

    @rule(abort_index=st.none() | st.integers(0, 10), readd=st.booleans())
    def step(self, abort_index, readd):
        evicted = self.scheduler.prefix.evicted_pages
        super().step(abort_index, readd)
        if self.scheduler.prefix.evicted_pages > evicted:
            event("cached pages were evicted")

    @precondition(lambda self: self.finished_sequences)
    @rule(data=st.data(), extra=st.integers(1, 6), max_tokens=st.integers(1, 8), cut=st.integers(0, 4))
    def follow_up(self, data, extra, max_tokens, cut):
        """The next turn of a finished conversation: its prompt + output (maybe cut short: a prefix
        ending mid-page or mid-interval), then new tokens."""
        history = data.draw(st.sampled_from(self.finished_sequences))
        history = history[: max(1, len(history) - cut)]
        prompt = history + [(history[-1] * 3 + i) % VOCAB for i in range(extra)]
        self.next_id += 1
        request_id = f"f{self.next_id}"
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(request_id, prompt, sampling)
        if self.scheduler.check_request(request) is not None:
            return
        self.scheduler.add(request)
        self.live[request_id] = request
        self.expected[request_id] = solo_output(prompt, sampling)
        self.received[request_id] = []
        self.arrival_rank[request] = len(self.arrival_rank)

    @rule(data=st.data())
    def abort_keeping_prefix(self, data):
        """A stop string or a client gone: the computed prefix goes to the cache."""
        request_id = data.draw(st.sampled_from(sorted(self.live) + ["never-seen"]))
        ev = self.scheduler.abort(request_id, keep_prefix=True)
        request = self.live.pop(request_id, None)
        assert (ev is None) == (request is None)
        if request is not None:
            assert request.state is RequestState.ABORTED and not request.pages and request.state_slot is None

    @rule(num_pages=st.integers(3, 16), num_slots=st.integers(1, 4), snapshot_slots=st.integers(0, 8),
          keep=st.booleans())
    def replace_pools(self, num_pages, num_slots, snapshot_slots, keep):
        """keep: the KV and snapshot pools keep their sizes (and the executor their contents): the
        cache survives. Otherwise it is cleared and its pages and snapshots are dropped."""
        allocator = self.allocator if keep else PageAllocator(num_pages)
        snapshot_slots = self.snapshot_slots if keep else snapshot_slots
        if not self.scheduler.is_idle():
            with pytest.raises(RuntimeError):
                self.scheduler.replace_pools(allocator, num_slots, snapshot_slots)
            return
        cached = self.scheduler.num_cached_pages
        dropped = self.scheduler.replace_pools(allocator, num_slots, snapshot_slots)
        assert dropped == (0 if keep else cached)
        if not keep:
            assert self.scheduler.num_cached_pages == 0
        self.allocator, self.snapshot_slots = allocator, snapshot_slots
        self.executor.resize_pools(SimpleNamespace(page_size=self.config.page_size, kv_pages=allocator.num_pages,
                                                   state_slots=num_slots, snapshot_slots=snapshot_slots))

    @invariant()
    def pools_are_consistent(self):
        self.scheduler.check_valid()
        self.allocator.check_valid()
        prefix = self.scheduler.prefix
        own = [p for r in self.live.values() for p in r.pages[r.num_shared_pages:]]
        assert len(own) == len(set(own))
        assert len(own) + prefix.num_cached_pages == self.allocator.num_used, "a page leaked"
        slots = [r.state_slot for r in self.live.values() if r.state_slot is not None]
        assert len(slots) == len(set(slots)), "state slot owned twice"
        assert self.scheduler.num_running + self.scheduler.num_waiting == len(self.live)
        if self.scheduler.is_idle():  # everything is free or the cache's
            assert self.allocator.num_used == prefix.num_cached_pages
            assert prefix.snapshots.num_used == len(prefix.cache.snapshot_handles() if prefix.cache else [])


TestPrefixSchedulerMachine = PrefixSchedulerMachine.TestCase
_PHASES = [Phase.generate] if os.environ.get("FT_NO_SHRINK") else list(Phase)
TestPrefixSchedulerMachine.settings = settings(max_examples=300, stateful_step_count=30, deadline=None, phases=_PHASES)


# ---- targeted cases --------------------------------------------------------------------------------------


def make(num_pages=32, num_slots=4, snapshot_slots=16, page_size=4, interval=8, **config):
    config.setdefault("eos_token_ids", EOS)
    cfg = SchedulerConfig(page_size=page_size, prefix_cache=True, snapshot_interval=interval, **config)
    allocator = PageAllocator(num_pages)
    return (Scheduler(cfg, allocator, num_slots, snapshot_slots), allocator,
            FakeExecutor(page_size, num_pages, num_slots, VOCAB, num_snapshot_slots=snapshot_slots))


def run(scheduler, executor, request):
    scheduler.add(request)
    works = []
    outputs = {}
    while (batch := scheduler.schedule()) is not None:
        works += [w for w in batch.works if w.request_id == request.request_id]
        for ev in scheduler.complete(batch, executor.execute(batch)):
            outputs.setdefault(ev.request_id, []).append(ev.token_id)
        scheduler.check_valid()
    return works, outputs[request.request_id]


def test_second_turn_resumes_at_the_deepest_snapshot_and_only_the_rest_is_prefilled():
    scheduler, allocator, executor = make()
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = [(3 * i + 1) % VOCAB for i in range(19)]
    works, out1 = run(scheduler, executor, Request("t1", prompt, sampling))
    # Snapshots: interval 8 and 16 in the prefill, 16 is also the prompt's last page boundary; decode
    # reaches 20 and 24 (rolling: 24 replaces 20). 19 prompt + 6 out = 25 tokens, 24 computed.
    taken = [p for w in works for p, _ in w.snapshots]
    assert taken == [8, 16, 20, 24]
    assert scheduler.num_cached_pages == 6 and allocator.num_used == 6  # 24 computed tokens
    history = prompt + out1
    turn2 = Request("t2", history + [5, 6, 7], sampling)
    works2, out2 = run(scheduler, executor, turn2)
    first = works2[0]
    # everything but the last token could match; the deepest snapshot is the end-of-output one (24)
    assert (first.start_position, first.restore_from is not None) == (24, True)
    assert turn2.num_cached_tokens == 24
    assert out2 == solo_output(turn2.prompt_token_ids, sampling)[0]
    assert executor.num_restores == 1


def test_a_prefix_ending_mid_page_and_mid_interval_is_cut_back_to_a_snapshot():
    scheduler, _, executor = make()
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    system = [(5 * i + 2) % VOCAB for i in range(30)]
    run(scheduler, executor, Request("a", system + [1, 1], sampling))
    # shares 30 tokens: mid-page (page 4) and mid-interval (8); snapshots at 8, 16, 24, 32(prompt end)
    works, out = run(scheduler, executor, Request("b", system + [2, 2, 2], sampling))
    assert works[0].start_position == 24 and works[0].restore_from is not None
    assert out == solo_output(system + [2, 2, 2], sampling)[0]


def test_whole_prompt_cached_still_recomputes_its_last_token():
    scheduler, _, executor = make()
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = list(range(1, 17))  # 16 tokens: 4 whole pages, snapshot at 16 (prompt end)
    run(scheduler, executor, Request("a", prompt + [1], sampling))
    works, out = run(scheduler, executor, Request("b", prompt, sampling))
    assert works[0].start_position < 16 and works[0].sample
    assert out == solo_output(prompt, sampling)[0]


def test_without_snapshot_slots_a_hybrid_model_caches_nothing_but_a_kv_only_model_does():
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = list(range(1, 20))
    scheduler, allocator, executor = make(snapshot_slots=0)
    run(scheduler, executor, Request("a", prompt, sampling))
    assert scheduler.num_cached_pages == 0 and allocator.num_used == 0
    works, _ = run(scheduler, executor, Request("b", prompt + [3], sampling))
    assert works[0].start_position == 0
    kv_only, _, _ = make(snapshot_slots=0, linear_state=False)
    executor = FakeExecutor(4, 32, 4, VOCAB, linear_state=False)
    _, out = run(kv_only, executor, Request("a", prompt, sampling))
    turn2 = prompt + out + [3]  # 19 + 2 tokens, 20 computed: 5 whole pages
    works, out = run(kv_only, executor, Request("b", turn2, sampling))
    assert works[0].start_position == 20 and works[0].restore_from is None and not works[0].snapshots
    assert out == solo_output(turn2, sampling)[0]


def test_cached_pages_are_evicted_lru_when_a_request_needs_them_and_never_while_locked():
    scheduler, allocator, executor = make(num_pages=12)
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    run(scheduler, executor, Request("old", [1] * 17, sampling))
    run(scheduler, executor, Request("new", [2] * 17, sampling))
    assert scheduler.num_cached_pages == 8
    # 33 tokens need 9 pages: 4 free + the LRU prefix ("old", 4 pages) + 1 of "new"
    works, out = run(scheduler, executor, Request("big", [3] * 33, sampling))
    assert out == solo_output([3] * 33, sampling)[0]
    assert scheduler.prefix.match(Request("x", [1] * 17)) is None  # old was evicted first
    scheduler.check_valid()
    # a locked prefix is not evictable
    follow = Request("f", [3] * 33 + [4], SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.add(follow)
    batch = scheduler.schedule()
    assert follow.prefix is not None
    assert scheduler.prefix.evictable_pages() == scheduler.num_cached_pages - follow.num_shared_pages
    scheduler.complete(batch, executor.execute(batch))
    run_to_idle(scheduler, executor)


def test_abort_keeping_the_prefix_caches_it_and_a_plain_abort_does_not():
    scheduler, allocator, executor = make()
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    for keep in (False, True):
        scheduler.add(Request("a", list(range(1, 14)), sampling))
        batch = scheduler.schedule()
        scheduler.complete(batch, executor.execute(batch))
        scheduler.abort("a", keep_prefix=keep)
        assert scheduler.num_cached_pages == (3 if keep else 0)  # 13 computed tokens: 3 whole pages
        assert allocator.num_used == scheduler.num_cached_pages
        scheduler.check_valid()


def test_abort_in_flight_never_caches():
    scheduler, _, executor = make()
    scheduler.add(Request("a", list(range(1, 14)), SamplingParams(max_tokens=8, ignore_eos=True)))
    batch = scheduler.schedule()
    scheduler.abort("a", keep_prefix=True)
    assert scheduler.num_cached_pages == 0
    scheduler.complete(batch, executor.execute(batch))
    scheduler.check_valid()
    assert scheduler.prefix.snapshots.num_used == 0


def test_preemption_caches_the_victims_prefix_and_it_resumes_from_it():
    scheduler, allocator, executor = make(num_pages=8, page_size=2, interval=2, max_running=2, max_step_tokens=4)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    new = Request("new", [3, 4], sampling)
    scheduler.add(Request("old", [1, 2], sampling))
    scheduler.add(new)
    outputs = {}
    resumed = []
    while (batch := scheduler.schedule()) is not None:
        resumed += [w for w in batch.works if w.request_id == "new" and w.restore_from is not None]
        for ev in scheduler.complete(batch, executor.execute(batch)):
            outputs.setdefault(ev.request_id, []).append(ev.token_id)
        scheduler.check_valid()
    assert new.num_preemptions >= 1 and resumed, "the preempted request did not resume from its cached prefix"
    assert outputs["new"] == solo_output([3, 4], sampling)[0]
    assert outputs["old"] == solo_output([1, 2], sampling)[0]


def test_snapshot_pool_exhaustion_evicts_lru_snapshots_or_skips():
    scheduler, _, executor = make(snapshot_slots=2, interval=4)
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    works, out = run(scheduler, executor, Request("a", list(range(1, 18)), sampling))
    assert [p for w in works for p, _ in w.snapshots] == [4, 8]  # pool of 2: later points skipped
    assert out == solo_output(list(range(1, 18)), sampling)[0]
    works, _ = run(scheduler, executor, Request("b", [9] * 17, sampling))
    assert [p for w in works for p, _ in w.snapshots] == [4, 8]  # "a"'s snapshots evicted LRU
    scheduler.check_valid()


def test_replace_pools_clears_the_cache_unless_kv_and_snapshots_are_kept():
    scheduler, allocator, executor = make()
    run(scheduler, executor, Request("a", list(range(1, 18)), SamplingParams(max_tokens=1, ignore_eos=True)))
    cached = scheduler.num_cached_pages
    assert cached and scheduler.replace_pools(allocator, 2, 16) == 0 and scheduler.num_cached_pages == cached
    assert scheduler.replace_pools(PageAllocator(32), 2, 16) == cached
    assert scheduler.num_cached_pages == 0 and scheduler.prefix.snapshots.num_used == 0
    run(scheduler, executor, Request("b", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1, ignore_eos=True)))
    assert scheduler.clear_prefix_cache() == 1 and scheduler.num_cached_pages == 0


def test_config_refuses_an_interval_that_is_not_whole_pages():
    with pytest.raises(ValueError, match="multiple"):
        SchedulerConfig(page_size=4, snapshot_interval=6)


def test_a_shared_system_prompt_gets_a_branch_snapshot_so_the_third_conversation_resumes_at_its_end():
    scheduler, _, executor = make(interval=16)
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    system = [(7 * i + 3) % VOCAB for i in range(26)]  # 26 tokens: KV of 24 can be shared (6 pages)
    run(scheduler, executor, Request("a", system + [1, 1, 1, 1, 1, 1], sampling))
    works, _ = run(scheduler, executor, Request("b", system + [2, 2, 2, 2, 2, 2], sampling))
    assert works[0].start_position == 16  # cut back to the interval snapshot ("a"'s prompt end is at 32)
    assert 24 in [p for w in works for p, _ in w.snapshots]  # the branch point: where a's KV ended
    works, out = run(scheduler, executor, Request("c", system + [3, 3, 3, 3, 3, 3], sampling))
    assert works[0].start_position == 24 and works[0].restore_from is not None
    assert out == solo_output(system + [3] * 6, sampling)[0]
