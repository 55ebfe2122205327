"""The engine loop without HTTP: random submit/abort interleavings against the fake model,
executor failures, and the sliding-window statistics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.detokenize import IncrementalDetokenizer
from app.engine import Engine
from app.stats import ServingStats
from domain.budget import GpuBudget, PoolRequest, plan_pools
from domain.fakes import FakeClock, FakeExecutor, FakeTokenizer
from domain.kv_pages import PageAllocator
from domain.request import SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from tests.app.conftest import TINY_SPEC, fake_model_output


def make_engine(kv_tokens: int = 256, executor=None) -> Engine:
    budget = GpuBudget(total_bytes=64 * 2**20)
    plan = plan_pools(TINY_SPEC, budget, PoolRequest(kv_tokens=kv_tokens, expert_slots=8, state_slots=3))
    allocator = PageAllocator(plan.kv_pages)
    tokenizer = FakeTokenizer()
    config = SchedulerConfig(max_running=3, max_step_tokens=64, page_size=plan.page_size, max_context=4096,
                             eos_token_ids=tokenizer.eos_token_ids)
    return Engine(
        scheduler=Scheduler(config, allocator, plan.state_slots),
        allocator=allocator,
        executor=executor or FakeExecutor(plan.page_size, plan.kv_pages, plan.state_slots, TINY_SPEC.vocab_size),
        tokenizer=tokenizer,
        spec=TINY_SPEC,
        budget=budget,
        plan=plan,
        stats=ServingStats(),
        debug=True,
    )


async def drive(engine: Engine, request_id: str, prompt: list[int], max_tokens: int, abort_after: int | None,
                stop: tuple[str, ...] = ()):
    events = engine.submit(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), stop)
    text, count = [], 0
    while True:
        event = await asyncio.wait_for(events.get(), 10)
        text.append(event.text)
        count += 1
        if abort_after is not None and count == abort_after:
            engine.abort(request_id)
        if event.finish_reason:
            return event, "".join(text)


def _stop_string(prompt: list[int], max_tokens: int, at: int | None) -> tuple[str, ...]:
    """A stop string the fake model writes: the text of output tokens at, at+1 (none when at is None)."""
    if at is None:
        return ()
    expected, _ = fake_model_output(prompt, max_tokens)
    text = FakeTokenizer().decode(expected[at % max_tokens:at % max_tokens + 2])
    return (text,) if text.strip() else ()


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 60), st.none() | st.integers(1, 5), st.none() | st.integers(0, 59)),
        min_size=1,
        max_size=10,
    ),
    st.booleans(),
)
def test_random_interleavings_finish_correctly_and_free_everything(requests, hooked):
    """Submits, aborts and stop strings at random, with the text work done before each step (an executor
    without the launch hook) or deferred into the next step's launch (one with it: ADR 0019)."""
    engine = hooked_engine()[0] if hooked else make_engine()
    engine.start()
    prompts = [[(i * 31 + j) % 256 for j in range(n)] for i, (n, *_) in enumerate(requests)]
    stops = [_stop_string(prompts[i], m, at) for i, (_, m, _, at) in enumerate(requests)]

    async def main():
        return await asyncio.gather(
            *(drive(engine, f"r{i}", prompts[i], m, a, stops[i]) for i, (n, m, a, _) in enumerate(requests))
        )

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    for i, ((n, m, abort_after, _), (last, text)) in enumerate(zip(requests, results, strict=True)):
        assert last.prompt_tokens == n
        expected, _ = fake_model_output(prompts[i], m)
        full = FakeTokenizer().decode(expected)
        if last.finish_reason == "length":
            assert last.completion_tokens == m and text == full
            assert not stops[i] or stops[i][0] not in full
        elif last.finish_reason == "stop":
            assert stops[i] and text == full[:full.index(stops[i][0])], (text, full, stops[i])
        else:
            assert last.finish_reason == "abort" and abort_after is not None, last
            assert last.completion_tokens <= m and full.startswith(text)
    engine.check_valid()
    assert engine._allocator.num_free + engine.scheduler.num_cached_pages == engine._allocator.num_pages
    assert engine.pools()["state_slots_used"] == 0 and engine.pools()["running"] == 0


def test_outputs_equal_the_fake_model():
    engine = make_engine()
    engine.start()
    prompt = list(range(10, 30))

    async def main():
        events = engine.submit("solo", prompt, SamplingParams(max_tokens=25, ignore_eos=True))
        text = []
        while True:
            event = await events.get()
            text.append(event.text)
            if event.finish_reason:
                return "".join(text), event

    try:
        text, last = asyncio.run(main())
    finally:
        engine.stop()
    expected, _ = fake_model_output(prompt, 25)
    assert text == FakeTokenizer().decode(expected) and last.finish_reason == "length"


class FlakyExecutor(FakeExecutor):
    """Raises on its 3rd step only."""

    def execute(self, batch):
        if self.num_steps == 2 and not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("device lost (injected)")
        return super().execute(batch)


def test_an_executor_failure_fails_that_batch_and_the_engine_keeps_serving():
    plan_engine = make_engine()
    p = plan_engine.plan
    engine = make_engine(executor=FlakyExecutor(p.page_size, p.kv_pages, p.state_slots, TINY_SPEC.vocab_size))
    engine.start()

    async def one(rid: str):
        events = engine.submit(rid, [1, 2, 3, 4], SamplingParams(max_tokens=8, ignore_eos=True))
        while True:
            event = await asyncio.wait_for(events.get(), 10)
            if event.finish_reason:
                return event

    try:
        first = asyncio.run(one("doomed"))
        second = asyncio.run(one("survivor"))
    finally:
        engine.stop()
    assert first.finish_reason == "error" and "device lost" in first.error
    assert second.finish_reason == "length" and second.completion_tokens == 8
    engine.check_valid()
    assert engine._allocator.num_free + engine.scheduler.num_cached_pages == engine._allocator.num_pages


class ReleasingExecutor(FakeExecutor):
    """FakeExecutor with the port's optional release (what it keeps between steps for a request goes): records the
    requests released; fails its step ``fail_step`` (0-based) or samples request ``bad`` with an error; each step
    takes ``delay`` seconds at least."""

    def __init__(self, *args, fail_step: int | None = None, bad: str | None = None, delay: float = 0.0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_step, self.bad, self.delay = fail_step, bad, delay
        self.released: list[str] = []

    def release(self, request_id: str) -> None:
        assert request_id not in self.live, f"{request_id} released while the scheduler still runs it"
        self.released.append(request_id)

    def execute(self, batch):
        if self.num_steps == self.fail_step:
            self.fail_step = None
            raise RuntimeError("device lost (injected)")
        time.sleep(self.delay)
        out = super().execute(batch)
        return {rid: replace(t, error="non-finite logits (injected)") if rid == self.bad else t
                for rid, t in out.items()}


def releasing_engine(**kw) -> tuple[Engine, ReleasingExecutor]:
    p = make_engine().plan
    executor = ReleasingExecutor(p.page_size, p.kv_pages, p.state_slots, TINY_SPEC.vocab_size, **kw)
    engine = make_engine(executor=executor)
    executor.live = engine.scheduler._live  # what the scheduler runs, read on the engine thread (release's caller)
    return engine, executor


async def _until_finished(engine: Engine, rid: str, prompt=(1, 2, 3, 4), max_tokens: int = 8, abort_after=None):
    events = engine.submit(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    count = 0
    while True:
        event = await asyncio.wait_for(events.get(), 10)
        count += 1
        if count == abort_after:
            engine.abort(rid)
        if event.finish_reason:
            return event


@pytest.mark.parametrize("case", ["abort", "failed step", "failed sampling", "engine failure", "finished"])
def test_the_executor_releases_every_request_the_engine_ends_early(case):
    """ModelExecutor.release: a request aborted, failed with its step or its own sampling, or failed with the
    engine is released to the executor (which drops what it keeps of it: a layered chunk part-way) after the
    scheduler freed it; a request that finishes its tokens is not (the executor keeps nothing of it)."""
    engine, executor = releasing_engine(fail_step=2 if case == "failed step" else None,
                                        bad="r" if case == "failed sampling" else None,
                                        delay=0.02 if case == "abort" else 0.0)  # 40 steps: time to abort
    if case == "engine failure":
        schedule, calls = engine.scheduler.schedule, []

        def failing_schedule():
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("scheduler broke (injected)")
            return schedule()

        engine.scheduler.schedule = failing_schedule
    engine.start()
    try:
        last = asyncio.run(_until_finished(engine, "r", max_tokens=40 if case == "abort" else 8,
                                           abort_after=2 if case == "abort" else None))
        after = asyncio.run(_until_finished(engine, "next"))
    finally:
        engine.stop()
    expected = {"abort": "abort", "finished": "length"}.get(case, "error")
    assert last.finish_reason == expected, last
    assert executor.released == ([] if case == "finished" else ["r"])
    assert after.finish_reason == "length" and after.completion_tokens == 8  # the next request is served
    if case == "engine failure":
        engine.scheduler.schedule = schedule
    engine.check_valid()


class LaunchHookExecutor(FakeExecutor):
    """FakeExecutor with the port's optional launch hook: records, at each step, what the engine still held
    when the step was launched (scheduler events whose text work it deferred, text events in its outbox) and
    what it held after the hook ran. ``call_hook=False``: declares the hook but never calls it (an executor
    that fails before launching)."""

    on_launched = None

    def __init__(self, *args, call_hook: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.call_hook = call_hook
        self.delay = 0.0
        self.engine: Engine | None = None
        self.pending_at_launch: list[tuple[int, int]] = []  # (before the hook, after it) per step

    def execute(self, batch):
        if self.delay:
            time.sleep(self.delay)
        out = super().execute(batch)  # "launched": the tokens are computed, the host has not read them yet
        if self.call_hook:
            before = (len(self.engine._deferred), self.engine._streams.num_pending)
            self.on_launched()
            self.pending_at_launch.append((*before, len(self.engine._deferred) + self.engine._streams.num_pending))
        return out


def hooked_engine(call_hook: bool = True) -> tuple[Engine, LaunchHookExecutor]:
    p = make_engine().plan
    executor = LaunchHookExecutor(p.page_size, p.kv_pages, p.state_slots, TINY_SPEC.vocab_size, call_hook=call_hook)
    engine = make_engine(executor=executor)
    executor.engine = engine
    return engine, executor


def test_an_executor_with_the_launch_hook_gets_the_last_steps_text_work_done_while_its_step_runs():
    engine, executor = hooked_engine()
    assert executor.on_launched is not None, "the engine installs its hook on an executor that declares it"
    engine.start()
    try:
        final, text = asyncio.run(drive(engine, "hooked", [5, 6, 7], 12, None))
    finally:
        engine.stop()
    expected, _ = fake_model_output([5, 6, 7], 12)
    assert text == FakeTokenizer().decode(expected) and final.completion_tokens == 12
    # 12 steps (1 prefill + 11 decodes): each was launched with the previous step's token not yet detokenized
    # (its scheduler event deferred, no text event made) and the hook did that work and handed it over
    assert executor.pending_at_launch == [(0, 0, 0)] + [(1, 0, 0)] * 11
    engine.check_valid()


def test_a_stream_with_stop_strings_gets_its_text_work_done_before_the_next_step_is_scheduled():
    """A stop string can end the stream, which changes the next step's batch: its events are handled at
    once (the text events wait in the outbox for the launch hook, as before ADR 0019)."""
    engine, executor = hooked_engine()
    engine.start()
    try:  # a stop string the fake model never writes: the stream runs to its length
        final, text = asyncio.run(drive(engine, "stops", [5, 6, 7], 12, None, stop=("\x00never",)))
    finally:
        engine.stop()
    expected, _ = fake_model_output([5, 6, 7], 12)
    assert text == FakeTokenizer().decode(expected) and final.finish_reason == "length"
    detok = IncrementalDetokenizer(FakeTokenizer())
    released = [1 if detok.push(token) else 0 for token in expected[:-1]]
    assert executor.pending_at_launch == [(0, 0, 0)] + [(0, n, 0) for n in released]
    assert sum(released) >= 3  # the check above saw text events held, not only empty steps
    engine.check_valid()


def test_a_stop_string_completed_by_the_last_tokens_held_back_bytes_finishes_as_stop():
    """The fake model answers [0] with tokens 52 ("4") and 181 (a lone UTF-8 lead byte, U+FFFD once the
    stream ends): the stop string "4\ufffd" matches only in the final flush, and the finish says so."""
    expected, _ = fake_model_output([0], 2)
    assert FakeTokenizer().decode(expected) == "4\ufffd"
    engine = make_engine()
    engine.start()
    try:
        final, text = asyncio.run(drive(engine, "held", [0], 2, None, stop=("4\ufffd",)))
    finally:
        engine.stop()
    assert (final.finish_reason, final.stop_string, text) == ("stop", "4\ufffd", "")
    engine.check_valid()


def test_a_stop_string_ends_the_stream_before_another_step_runs_for_it():
    """The matched stop string aborts the request before the next schedule(): no step after the one that
    produced the match carries it."""
    engine, executor = hooked_engine()
    expected, _ = fake_model_output([5, 6, 7], 12)
    tokenizer = FakeTokenizer()
    stop = tokenizer.decode(expected[3:5])  # the text of output tokens 4 and 5
    assert stop and stop not in tokenizer.decode(expected[:4])
    steps: list[int] = []
    execute = executor.execute

    def counting(batch):
        steps.extend(1 for w in batch.works if w.request_id == "stopped")
        return execute(batch)

    executor.execute = counting
    engine.start()
    try:
        final, text = asyncio.run(drive(engine, "stopped", [5, 6, 7], 12, None, stop=(stop,)))
    finally:
        engine.stop()
    assert final.finish_reason == "stop" and stop not in text
    assert len(steps) == final.completion_tokens  # one step per generated token, none after the match
    engine.check_valid()


def test_an_executor_that_declares_the_hook_but_never_calls_it_still_streams_every_token(caplog):
    engine, executor = hooked_engine(call_hook=False)
    engine.start()
    try:
        final, text = asyncio.run(drive(engine, "unhooked", [9, 8], 7, None))
    finally:
        engine.stop()
    expected, _ = fake_model_output([9, 8], 7)
    assert text == FakeTokenizer().decode(expected) and final.finish_reason == "length"
    # after its first step the engine stops waiting for the hook (else every token would go out a step late)
    assert not engine._launch_hook
    assert any("declares on_launched but did not call it" in r.getMessage() for r in caplog.records)


def test_a_finish_from_an_abort_between_steps_goes_out_after_the_pools_snapshot_that_freed_it():
    """The abort's finish waits for a step's launch hook; the pools snapshot is republished first, so a
    client that sees the finish sees the request's pages freed (running 0 in the snapshot)."""
    engine, executor = hooked_engine()
    executor.delay = 0.002  # the abort arrives while both requests still decode
    handed: list[tuple[str, int]] = []  # (finish reason of "long"'s event, running in the snapshot) per handover
    flush = engine._streams.flush

    def flush_and_look():
        for live, event in engine._streams._outbox:
            if live.request.request_id == "long" and event.finish_reason is not None:
                handed.append((event.finish_reason, engine.pools()["running"]))
        flush()

    engine._streams.flush = flush_and_look
    engine.start()

    async def main():
        events = engine.submit("long", [1, 2], SamplingParams(max_tokens=100, ignore_eos=True))
        engine.submit("other", [3, 4], SamplingParams(max_tokens=100, ignore_eos=True))
        await asyncio.wait_for(events.get(), 10)
        engine.abort("long")
        while (event := await asyncio.wait_for(events.get(), 10)).finish_reason is None:
            pass
        engine.abort("other")
        return event

    try:
        finish = asyncio.run(main())
    finally:
        engine.stop()
    assert finish.finish_reason == "abort"
    assert executor.pending_at_launch, "the finish went out through the launch hook path"
    # the snapshot published before the finish went out already had "long" gone ("other" still runs)
    assert handed == [("abort", 1)]


def test_the_window_splits_a_tokens_time_into_the_model_call_and_the_host_work_between_calls():
    clock = FakeClock(100.0)
    stats = ServingStats(window_s=10, clock=clock.now)
    stats.record_step(prefill_tokens=16, decode_tokens=0, seconds=0.2, expert_hits=0, expert_misses=0)
    for seconds, host in ((0.003, 0.0004), (0.004, 0.0002), (0.005, None), (0.003, 0.0006)):
        clock.advance(0.01)
        stats.record_step(prefill_tokens=0, decode_tokens=1, seconds=seconds, expert_hits=0, expert_misses=0,
                          host_seconds=host)
    w = stats.window()
    assert w["step_s"]["decode_p50"] == 0.0035  # decode-only steps: the prefill step is not one
    assert w["host_s"]["count"] == 3 and w["host_s"]["p50"] == 0.0004  # after an idle pause: not counted
    assert b"ft_step_host_seconds_count 3.0" in stats.prometheus_text()


def test_the_engine_reports_host_time_between_consecutive_model_calls_only():
    engine = make_engine()
    engine.start()
    try:
        final, _ = asyncio.run(drive(engine, "cmpl-host", [1, 2, 3], 6, None))
    finally:
        engine.stop()
    assert final.completion_tokens == 6
    w = engine.stats.window()
    # 1 prefill step + 5 decode steps back to back: at most 5 gaps between model calls, none before the first
    assert w["steps"] == 6 and 1 <= w["host_s"]["count"] <= 5 and w["host_s"]["p50"] >= 0


def test_the_pool_gauges_show_the_latest_published_snapshot_when_scraped():
    stats = ServingStats()
    assert b"ft_kv_pages_used 0.0" in stats.prometheus_text()  # nothing published yet
    pools = {"running": 3, "waiting": 2, "kv_pages_used": 40, "kv_pages_total": 64, "state_slots_used": 3,
             "state_slots_total": 4, "expert_slots": 8,
             "prefix_cache": {"cached_pages": 7, "snapshot_slots_used": 5, "snapshot_slots_total": 16}}
    stats.record_pools(pools)
    text = stats.prometheus_text()
    for line in (b"ft_running_requests 3.0", b"ft_waiting_requests 2.0", b"ft_kv_pages_used 40.0",
                 b"ft_kv_pages_total 64.0", b"ft_state_slots_used 3.0", b"ft_state_slots_total 4.0",
                 b"ft_expert_slots_total 8.0", b"ft_prefix_cache_pages 7.0", b"ft_snapshot_slots_used 5.0",
                 b"ft_snapshot_slots_total 16.0"):
        assert line + b"\n" in text, line
    stats.record_pools({**pools, "kv_pages_used": 41, "prefix_cache": None})
    text = stats.prometheus_text()
    assert b"ft_kv_pages_used 41.0\n" in text and b"ft_prefix_cache_pages 0.0\n" in text


def test_zero_step_counts_leave_the_counters_alone_and_the_others_add_up():
    stats = ServingStats()
    stats.record_step(prefill_tokens=0, decode_tokens=4, seconds=0.003, expert_hits=0, expert_misses=2)
    stats.record_step(prefill_tokens=16, decode_tokens=0, seconds=0.01, expert_hits=5, expert_misses=0)
    text = stats.prometheus_text()
    for line in (b"ft_generation_tokens_total 4.0", b"ft_prefill_tokens_total 16.0", b"ft_expert_hits_total 5.0",
                 b"ft_expert_misses_total 2.0", b"ft_step_seconds_count 2.0"):
        assert line + b"\n" in text, line


def test_sliding_window_percentiles_and_trimming():
    clock = FakeClock(100.0)
    stats = ServingStats(window_s=10, clock=clock.now)
    for ttft in (0.1, 0.2, 0.3, 0.4, 1.0):
        stats.record_ttft(ttft)
    stats.record_step(prefill_tokens=100, decode_tokens=0, seconds=0.5, expert_hits=3, expert_misses=1)
    clock.advance(1.5)
    stats.record_step(prefill_tokens=0, decode_tokens=4, seconds=0.5, expert_hits=1, expert_misses=3)
    w = stats.window()
    assert w["ttft_s"]["p50"] == 0.3 and w["ttft_s"]["count"] == 5
    assert abs(w["ttft_s"]["p90"] - 0.76) < 1e-9
    assert w["expert_hit_rate"] == 0.5
    assert w["decode_tok_s_while_busy"] == 4.0 and w["prefill_tok_s_while_busy"] == 100.0
    assert abs(w["decode_tok_s"] - 4 / 2.0) < 1e-9  # span: first step's start to now
    clock.advance(9.0)  # the first step and every TTFT leave the 10 s window
    w = stats.window()
    assert w["steps"] == 1 and w["prefill_tokens"] == 0 and w["ttft_s"]["count"] == 0
    stats.check_valid()


def test_commands_after_the_engine_stopped_are_answered_where_they_are_sent():
    """A request or resize sent once the engine thread has answered its last commands (the server shutting down, a
    keep-alive connection still open) sat in a queue nobody read: the stream stayed open until uvicorn cancelled it,
    the resize's caller waited forever. Now the submission ends at once with the shutdown's abort, and the resize is
    answered not applied."""
    import concurrent.futures

    engine = make_engine()
    engine.start()
    engine.stop()

    async def late():
        events = engine.submit("late", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        return await asyncio.wait_for(events.get(), 5)

    event = asyncio.run(late())
    assert event.finish_reason == "abort" and "shutting down" in event.error
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        outcome = pool.submit(engine.resize, kv_tokens=128, wait_s=1).result(timeout=5)
    assert not outcome.ok and "shutting down" in outcome.message
