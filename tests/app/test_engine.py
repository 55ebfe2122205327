"""The engine loop without HTTP: random submit/abort interleavings against the fake model,
executor failures, and the sliding-window statistics."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

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


async def drive(engine: Engine, request_id: str, prompt: list[int], max_tokens: int, abort_after: int | None):
    events = engine.submit(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    text, count = [], 0
    while True:
        event = await asyncio.wait_for(events.get(), 10)
        text.append(event.text)
        count += 1
        if abort_after is not None and count == abort_after:
            engine.abort(request_id)
        if event.finish_reason:
            return event, "".join(text)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 60), st.none() | st.integers(1, 5)),
        min_size=1,
        max_size=10,
    )
)
def test_random_interleavings_finish_correctly_and_free_everything(requests):
    engine = make_engine()
    engine.start()

    async def main():
        return await asyncio.gather(
            *(drive(engine, f"r{i}", [(i * 31 + j) % 256 for j in range(n)], m, a)
              for i, (n, m, a) in enumerate(requests))
        )

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    for i, ((n, m, abort_after), (last, text)) in enumerate(zip(requests, results, strict=True)):
        assert last.prompt_tokens == n
        if last.finish_reason == "length":
            expected, _ = fake_model_output([(i * 31 + j) % 256 for j in range(n)], m)
            assert last.completion_tokens == m and text == FakeTokenizer().decode(expected)
        else:
            assert last.finish_reason == "abort" and abort_after is not None, last
            assert last.completion_tokens <= m
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
