"""The high-water marks of running and waiting requests (/v1/stats pools' `running_peak` / `waiting_peak`,
POST /v1/stats/reset_peaks): a request that runs between two polls of /v1/stats still counts, which `ft bench
ladder` reads as `admitted` (a 50 ms poll once reported `admitted 0` for a rung whose request ran 74 ms)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from app.bench import ladder, target
from app.pool_snapshot import PoolPublisher
from app.stats import ServingStats
from domain.kv_pages import PageAllocator
from domain.ports import SampledToken
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from tests.app.conftest import MODEL, make_container, start_server, stats, wait_until_idle


@pytest.fixture(scope="module")
def server():
    srv = start_server(make_container(delay=0.002))  # 2 ms a step: concurrent requests overlap
    yield srv
    srv.stop()


def reset(server) -> dict:
    r = httpx.post(server.base_url + "/v1/stats/reset_peaks")
    assert r.status_code == 200, r.text
    return r.json()


def chat(server, max_tokens: int) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
        "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_a_request_between_two_polls_counts_and_a_reset_restarts_the_marks(server):
    wait_until_idle(server)
    reset(server)
    pools = stats(server)["pools"]
    assert (pools["running"], pools["running_peak"], pools["waiting_peak"]) == (0, 0, 0), pools
    chat(server, max_tokens=1)  # one step: admitted and finished between any two polls
    pools = stats(server)["pools"]
    assert pools["running"] == 0 and pools["running_peak"] == 1, pools
    ended = reset(server)
    assert (ended["running_peak"], ended["waiting_peak"]) == (1, 0) and ended["since_s"] > 0, ended
    assert stats(server)["pools"]["running_peak"] == 0  # restarted from the requests running now: none
    assert reset(server)["running_peak"] == 0


def test_more_requests_than_running_slots_raise_both_marks(server):
    wait_until_idle(server)
    reset(server)
    with ThreadPoolExecutor(6) as pool:  # the fixture's server runs 4 at once: 2 wait
        list(pool.map(lambda _: chat(server, max_tokens=64), range(6)))
    ended = reset(server)
    assert ended["running_peak"] == 4 and 1 <= ended["waiting_peak"] <= 2, ended


def _request(rid: str, prompt: int = 4, max_tokens: int = 1) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_the_engine_thread_feeds_the_running_count_of_every_step():
    """A request admitted and finished in one step is never in a pools snapshot as running (the snapshot after the
    step sees it gone); the publisher's step measurement still counts it."""
    config = SchedulerConfig(max_running=4, max_step_tokens=64, page_size=4, max_context=64)
    allocator = PageAllocator(16)
    scheduler = Scheduler(config, allocator, num_state_slots=4)
    serving = ServingStats()
    publisher = PoolPublisher(serving, executor=object())
    plan = SimpleNamespace(page_size=4, kv_tokens=64, state_slots=4, expert_slots=0, residency=0.0)

    def publish() -> None:
        publisher.publish(scheduler=scheduler, allocator=allocator, plan=plan, state_slots_used=0, held=0,
                          phase="serving")

    publish()
    for rid in ("a", "b"):
        scheduler.add(_request(rid))
    batch = scheduler.schedule()
    publisher.measure_step(batch, 0.001)
    scheduler.complete(batch, {w.request_id: SampledToken(w.request_id, 7) for w in batch.works})
    assert scheduler.num_running == 0
    publish()  # what /v1/stats shows: nothing running
    assert publisher.latest["running"] == 0
    assert serving.peaks() == {"running_peak": 2, "waiting_peak": 0}
    serving.check_valid()


def test_reset_starts_from_the_requests_running_now():
    s = ServingStats()
    s.record_pools({"running": 3, "waiting": 1})
    s.note_load(5, 2)
    assert s.reset_peaks() | {"since_s": 0} == {"running_peak": 5, "waiting_peak": 2, "since_s": 0}
    # still running across the reset: the engine's last noted load (5, 2), newer than the snapshot (3, 1) it
    # publishes a step later (restarting from the snapshot alone lost the 2 requests admitted in between)
    assert s.peaks() == {"running_peak": 5, "waiting_peak": 2}
    s.record_pools({"running": 0, "waiting": 0})
    s.note_load(0, 0)
    assert s.peaks() == {"running_peak": 5, "waiting_peak": 2}
    assert s.reset_peaks()["running_peak"] == 5
    assert s.peaks() == {"running_peak": 0, "waiting_peak": 0}  # idle now: the next period starts at zero
    s.check_valid()


def _client(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://server")


def test_the_bench_takes_only_a_whole_server_s_marks():
    async def peaks(status: int, body: dict | str, workers: int | None = None):
        def answer(request: httpx.Request) -> httpx.Response:
            assert (request.method, request.url.path) == ("POST", "/v1/stats/reset_peaks")
            return httpx.Response(status, json=body) if isinstance(body, dict) else httpx.Response(status, text=body)

        async with _client(answer) as client:
            return await ladder._peaks(SimpleNamespace(client=client), workers)

    marks = {"running_peak": 3, "waiting_peak": 0, "since_s": 1.5}
    assert asyncio.run(peaks(200, marks)) == marks
    assert asyncio.run(peaks(404, {"error": "no such route"})) is None  # another server, an older fluxtide
    assert asyncio.run(peaks(200, "<html>")) is None
    # a data-parallel front without the route forwards it to one worker: that worker's marks are not the server's
    assert asyncio.run(peaks(200, marks, workers=2)) is None
    assert asyncio.run(peaks(200, marks | {"data_parallel": 2}, workers=2)) == marks | {"data_parallel": 2}


def test_unreachable_or_odd_answers_are_no_marks():
    async def call(handler):
        async with _client(handler) as client:
            return await target.reset_peaks(client)

    def refuse(request):
        raise httpx.ConnectError("refused")

    assert asyncio.run(call(refuse)) is None
    assert asyncio.run(call(lambda r: httpx.Response(200, json={"running_peak": "3"}))) is None


def test_load_figures_prefer_the_marks_and_never_report_an_unseen_rung_as_zero():
    def polled(samples: int, running: int | None, waiting: int | None = 0) -> ladder.PoolSampler:
        return SimpleNamespace(samples=samples, max_running=running, max_waiting=waiting)

    marks = {"running_peak": 2, "waiting_peak": 1}
    assert ladder.load_figures(marks, polled(1, 0), completed=2, fluxtide=True) == {
        "admitted": 2, "queued": 1, "admitted_source": "high-water mark", "admitted_note": None}
    # a data-parallel front's marks are its workers' summed: said to be an upper bound, not a measured peak
    front = ladder.load_figures({**marks, "data_parallel": 2}, polled(1, 0), completed=2, fluxtide=True)
    assert front["admitted"] == 2 and front["admitted_source"] == "sum of the workers' high-water marks"
    assert front["admitted_note"].startswith("an upper bound")
    assert ladder.load_figures(None, polled(3, 2, 1), completed=2, fluxtide=False) == {
        "admitted": 2, "queued": 1, "admitted_source": "stats polls", "admitted_note": None}
    missed = ladder.load_figures(None, polled(1, 0), completed=1, fluxtide=True)
    assert (missed["admitted"], missed["queued"], missed["admitted_note"]) == (None, None, "not observed: 1 stats samples")
    # any OpenAI server without fluxtide's or llama.cpp's load figures: null, with the reason, as before
    other = ladder.load_figures(None, polled(0, None, None), completed=1, fluxtide=False)
    assert other["admitted"] is None and other["admitted_note"].startswith("not observed: 0 stats samples (")
