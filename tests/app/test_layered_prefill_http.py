"""Layered prefill (docs/adr/0024-layered-prefill.md) through HTTP on the demo model (4 layers), in-process: long
prompts sent while streams decode run as layer groups beside them and answer what the prompt alone answers; a
client gone, a live resize and more requests than --max-running-requests while a chunk is part-way leave every
pool as it was; and a later layer group's step is no decode-only step in /v1/stats."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from app.containers import Container
from app.pool_snapshot import PoolPublisher
from app.serving import RunningServer
from app.settings import ServeSettings
from app.stats import ServingStats

pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")
MODEL = "fluxtide-demo-arithmetic"
LAYERS = 4  # the demo model's
# mixed budget 32: beside 3 decodes a prompt over 29 tokens goes layered, as one chunk of up to 29 x 4 tokens, one
# layer a step (k = 29 x 4 // 1024 = 1)
# layer groups sized by the mixed budget (--layer-group-length 32): several groups a chunk on the demo model's layers
SETTINGS = ServeSettings(port=0, device="cpu", max_running_requests=4, max_prefill_length=1024,
                         mixed_prefill_length=32, layer_group_length=32, layered_prefill=True, debug=True)
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server():
    running = RunningServer(Container(), SETTINGS).start(wait_ready=120)
    yield running
    running.stop()


class Steps:
    """Wraps the engine's executor: records each step's layer group (request id, layers) and can hold every step
    that leaves a chunk part-way for `delay` seconds, so a test acts while the chunk is between its groups."""

    def __init__(self, engine) -> None:
        self.executor = engine.executor
        self.inner = self.executor.execute
        self.groups: list[tuple[str, tuple[int, int]]] = []
        self.most_layered = 0  # the most layered works one step carried
        self.delay = 0.0
        self.part_way = threading.Event()  # set once a step left a chunk part-way
        self.executor.execute = self

    def __call__(self, batch):
        out = self.inner(batch)
        layered = [w for w in batch.works if w.layers is not None]
        self.most_layered = max(self.most_layered, len(layered))
        for w in layered:
            self.groups.append((w.request_id, w.layers))
            if w.layers[1] < LAYERS:
                self.part_way.set()
                time.sleep(self.delay)
        return out

    def of(self, request_id: str) -> list[tuple[int, int]]:
        return [layers for rid, layers in self.groups if rid == request_id]

    def remove(self) -> None:
        del self.executor.execute


@pytest.fixture
def steps(server):
    recorder = Steps(server.runtime.engine)
    yield recorder
    recorder.remove()
    check_idle(server)


def long_prompt(lines: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(f"{rng.randint(1, 99)}+{rng.randint(1, 99)}={rng.randint(1, 199)}\n" for _ in range(lines))


def stats(server) -> dict:
    return httpx.get(server.base_url + "/v1/stats", timeout=30).json()


def check_idle(server) -> None:
    """Nothing running, waiting or held; every KV page used is the prefix cache's, every state slot free; the
    idle self-checks (debug) found nothing, and the server still answers."""
    deadline = time.monotonic() + 30
    while True:
        pools = stats(server)["pools"]
        if pools["running"] == pools["waiting"] == pools["held"] == 0:
            break
        assert time.monotonic() < deadline, f"not idle: {pools}"
        time.sleep(0.05)
    assert pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"], pools
    assert pools["state_slots_used"] == 0 and pools["state_slots_free"] == pools["state_slots_total"], pools
    engine = server.runtime.engine
    assert engine.last_error is None and engine.phase == "ready", engine.last_error
    assert httpx.get(server.base_url + "/health").status_code == 200
    answer = client(server).completions.create(model=MODEL, prompt="12+34=", max_tokens=6, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")


def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def alone(server, prompt: str, **kw):
    """The answer of the prompt on an idle server (no decodes: one ordinary chunk)."""
    return client(server).completions.create(model=MODEL, prompt=prompt, **{**GREEDY, **kw})


async def decoding(server, n: int, stop: asyncio.Event, running: asyncio.Event, max_tokens: int) -> list[asyncio.Task]:
    """n streams that decode until `stop` (then their clients leave) or max_tokens; `running` is set once each has
    a token.
    Each task returns its token count and raises if the stream carried an error."""
    counts = [0] * n

    async def one(i: int) -> int:
        body = {"model": MODEL, "prompt": f"{i + 11}+{i + 22}=", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as http, \
                http.stream("POST", server.base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                counts[i] += 1
                if all(counts):
                    running.set()
                if stop.is_set():
                    break
        return counts[i]

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    await asyncio.wait_for(running.wait(), 60)
    return tasks


async def beside_decodes(server, n_streams: int, body, max_tokens: int = 3000):
    """Runs `body(openai_client)` while n_streams decode; returns its result once the streams have left."""
    stop, running = asyncio.Event(), asyncio.Event()
    streams = await decoding(server, n_streams, stop, running, max_tokens)
    api = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        return await body(api)
    finally:
        stop.set()
        counts = await asyncio.gather(*streams)
        assert all(c > 1 for c in counts), counts
        await api.close()


def test_long_prompts_beside_decodes_run_layered_and_answer_as_alone(server, steps):
    prompts = [long_prompt(40, seed=1), long_prompt(75, seed=2), long_prompt(30, seed=3)]
    extra = [{"logprobs": 2}, {"logprobs": 2}, {"max_tokens": 1, "logprobs": 3}]
    before = stats(server)["scheduler"]["layer_groups"]

    async def body(api):
        return await asyncio.gather(*[api.completions.create(model=MODEL, prompt=p, **{**GREEDY, **kw})
                                      for p, kw in zip(prompts, extra, strict=True)])

    answers = asyncio.run(beside_decodes(server, 3, body))
    scheduler = stats(server)["scheduler"]
    assert scheduler["layered_prefill"] is True and scheduler["layer_groups"] > before
    assert steps.most_layered == 1, "at most one layered work per step"
    for a in answers:
        groups = steps.of(a.id)
        assert (0, 1) in groups and (LAYERS - 1, LAYERS) in groups, groups  # it ran layered, a layer a step
    for prompt, kw, a in zip(prompts, extra, answers, strict=True):
        b = alone(server, prompt, **kw)
        assert a.choices[0].text == b.choices[0].text
        got, want = a.choices[0].logprobs, b.choices[0].logprobs
        assert got.token_logprobs[0] == pytest.approx(want.token_logprobs[0], abs=1e-4)  # the prefill's token
        assert got.top_logprobs[0].keys() == want.top_logprobs[0].keys()


@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_gone_mid_chunk_abandons_it_and_frees_everything(server, steps, streamed):
    """A client gone while its long prompt is between layer groups: the request is aborted, the executor drops the
    chunk it kept part-way at once (ModelExecutor.release), not when the next long prompt starts, the pools are
    back to idle and the next long prompt answers as it does alone."""
    prompt, fresh = long_prompt(60, seed=4 + 10 * streamed), long_prompt(45, seed=5 + 10 * streamed)
    steps.delay = 0.3  # each step that leaves a chunk part-way: the client leaves during the first one's

    async def body(api):
        payload = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": streamed}
        async with httpx.AsyncClient(timeout=60) as http:
            async def request():
                if streamed:
                    async with http.stream("POST", server.base_url + "/v1/completions", json=payload) as r:
                        async for _ in r.aiter_lines():
                            pass
                else:
                    await http.post(server.base_url + "/v1/completions", json=payload)

            task = asyncio.ensure_future(request())
            assert await asyncio.to_thread(steps.part_way.wait, 30)
            task.cancel()  # the connection closes mid-chunk
            with pytest.raises(asyncio.CancelledError):
                await task
            rid = steps.groups[0][0]
            engine = server.runtime.engine
            deadline = time.monotonic() + 10
            while engine.scheduler.get(rid) is not None:
                assert time.monotonic() < deadline, "the request outlived its client"
                await asyncio.sleep(0.02)
            # ModelExecutor.release: the executor let go of the abandoned chunk (its [T, H] residual stream) when
            # the engine aborted its request, while the streams decode on; it used to hold it until the next
            # long prompt's first group
            deadline = time.monotonic() + 2
            while engine.executor.kept_request is not None:
                assert engine.executor.kept_request == rid, engine.executor.kept_request
                assert time.monotonic() < deadline, f"the executor still keeps {rid}'s chunk"
                await asyncio.sleep(0.01)
            assert engine.executor._kept is None
            assert engine.scheduler.num_running == 3  # the streams decode on: not an idle engine's doing
        steps.delay = 0.0
        # a new long prompt is layered afresh (the executor's kept chunk was abandoned) and answers as alone
        return rid, await api.completions.create(model=MODEL, prompt=fresh, **GREEDY)

    rid, after = asyncio.run(beside_decodes(server, 3, body))
    abandoned = steps.of(rid)
    assert abandoned and abandoned[0] == (0, 1) and all(end < LAYERS for _, end in abandoned), abandoned
    assert (0, 1) in steps.of(after.id) and (LAYERS - 1, LAYERS) in steps.of(after.id)
    assert after.choices[0].text == alone(server, fresh).choices[0].text
    check_idle(server)
    assert server.runtime.engine.executor.kept_request is None


def test_a_live_resize_while_a_chunk_is_part_way_drains_it_and_fails_nothing(server, steps):
    prompts = [long_prompt(50, seed=6), long_prompt(35, seed=7)]
    kv_before = stats(server)["plan"]["kv_tokens"]
    steps.delay = 0.05

    async def body(api):
        first = asyncio.ensure_future(api.completions.create(model=MODEL, prompt=prompts[0], **GREEDY))
        assert await asyncio.to_thread(steps.part_way.wait, 30)
        async with httpx.AsyncClient(timeout=60) as http:
            resize = asyncio.ensure_future(http.post(server.base_url + "/v1/cache/rebuild",
                                                     json={"kv_tokens": kv_before // 2, "wait_s": 30}))
            await asyncio.sleep(0.05)
            late = asyncio.ensure_future(api.completions.create(model=MODEL, prompt=prompts[1], **GREEDY))
            return await asyncio.gather(first, late, resize)

    # NOTE: the resize waits for the streams to finish (their max_tokens), the chunk part-way goes on beside them
    *answers, resized = asyncio.run(beside_decodes(server, 2, body, max_tokens=200))
    assert resized.status_code == 200, resized.text
    assert stats(server)["plan"]["kv_tokens"] == kv_before // 2
    assert [a.choices[0].text for a in answers] == [alone(server, p).choices[0].text for p in prompts]
    check_idle(server)
    grown = httpx.post(server.base_url + "/v1/cache/rebuild", json={"kv_tokens": kv_before, "wait_s": 30}, timeout=60)
    assert grown.status_code == 200, grown.text


def test_more_long_prompts_than_running_slots_all_finish_and_answer_as_alone(server, steps):
    prompts = [long_prompt(20 + 9 * i, seed=10 + i) for i in range(5)]  # 2 streams + 5 > max_running 4

    async def body(api):
        return await asyncio.gather(*[api.completions.create(model=MODEL, prompt=p, **GREEDY) for p in prompts])

    answers = asyncio.run(beside_decodes(server, 2, body))
    assert steps.most_layered == 1
    assert len({rid for rid, _ in steps.groups}) >= 2, "several prompts ran layered, one chunk at a time"
    assert [a.choices[0].text for a in answers] == [alone(server, p).choices[0].text for p in prompts]


class _Batch:
    def __init__(self, prefill: int, decodes: int, layers: tuple[int, int] | None = None) -> None:
        self.num_prefill_tokens, self.num_decode_tokens = prefill, decodes
        self.layered = None if layers is None else SimpleNamespace(layers=layers, token_ids=range(116))
        self.works = (self.layered,) * (layers is not None) + (None,) * decodes


class _Executor:
    def expert_counters(self):
        return 0, 0


def test_a_later_layer_group_step_is_no_decode_only_step():
    """A layered chunk's later groups count no prefill tokens (the chunk counts once, in its first group), but a
    step that carries one beside decodes is as long as a mixed step: it used to be timed as a decode-only step."""
    stats = ServingStats()
    publisher = PoolPublisher(stats, _Executor())
    publisher.record_step(_Batch(0, 3), 0.005)  # decodes only
    publisher.record_step(_Batch(116, 3, layers=(0, 2)), 0.030)
    publisher.record_step(_Batch(0, 3, layers=(2, 4)), 0.030)
    publisher.record_step(_Batch(0, 3), 0.005)
    window = stats.window()
    assert window["step_s"]["decode_p90"] == pytest.approx(0.005)
    assert window["prefill_tokens"] == 116 and window["decode_tokens"] == 12
    # the step trace names the groups; each carries the chunk's tokens (the window counts them once)
    trace = stats.steps()["steps"]
    assert [(r["layers"], r["prefill_tokens"], r["prefill_works"], r["decode_rows"]) for r in trace] == [
        (None, 0, 0, 3), ([0, 2], 116, 1, 3), ([2, 4], 116, 1, 3), (None, 0, 0, 3)]
    assert [r["end"] for r in trace] == sorted(r["end"] for r in trace)
    assert stats.steps(since=trace[1]["end"])["steps"] == [r for r in trace if r["end"] > trace[1]["end"]]


def test_a_data_parallel_front_shows_the_workers_scheduler(server):
    """The front's /v1/stats had no `scheduler` (only under `workers`), so a record taken through it could not
    say whether layered prefill ran; its budgets are every worker's, its counts add."""
    from app.data_parallel.front import Front, create_front_app
    from app.data_parallel.workers import WorkerPool, WorkerProcess
    from app.server import ServerThread

    workers = [WorkerProcess(i, ["unused"]) for i in range(2)]
    for w in workers:  # never started: both stand for the in-process server
        w.url, w.status = server.base_url, "ok"
    http = ServerThread(create_front_app(Front(WorkerPool(workers, "unused"))), "127.0.0.1", 0)
    http.start()
    try:
        port = next(s.getsockname()[1] for srv in http.server.servers for s in srv.sockets)
        got = httpx.get(f"http://127.0.0.1:{port}/v1/stats", timeout=30).json()["scheduler"]
    finally:
        http.stop()
    one = stats(server)["scheduler"]
    assert got["layered_prefill"] is True and got["layer_groups"] == 2 * one["layer_groups"]
    assert (got["max_step_tokens"], got["mixed_step_tokens"]) == (1024, 32)
    assert got["arrival_window_ms"] == one["arrival_window_ms"] and got["max_running"] == 2 * one["max_running"]


def trace(server, **params) -> httpx.Response:
    return httpx.get(server.base_url + "/v1/stats/steps", params=params, timeout=30)


def test_the_step_trace_shows_a_long_prompts_layer_groups_then_the_decodes(server, steps):
    """GET /v1/stats/steps while a long prompt arrives beside 3 decoding streams: its layer groups, each [0, L) in
    order (every group beside the 3 decodes), then decode-only steps; `since` keeps the steps that ended after it."""
    started = time.time()
    prompt = long_prompt(12, seed=21)

    async def body(api):
        answer = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        deadline = time.monotonic() + 30
        while True:  # the streams decode on: until the trace shows a step after the prompt's last group
            rows = (await asyncio.to_thread(trace, server, since=started)).json()["steps"]
            last = max((i for i, r in enumerate(rows) if r["layers"] is not None), default=None)
            if last is not None and len(rows) > last + 1:
                return answer, rows, last
            assert time.monotonic() < deadline, rows
            await asyncio.sleep(0.01)

    answer, rows, last = asyncio.run(beside_decodes(server, 3, body))
    assert all(r["end"] > started for r in rows)
    groups = [(i, r) for i, r in enumerate(rows) if r["layers"] is not None]
    # only this prompt ran layered since `started`: its groups, as the executor saw them, in trace order
    assert [tuple(r["layers"]) for _, r in groups] == steps.of(answer.id)
    chunks, covered = [], None
    for _, r in groups:  # each chunk's groups cover [0, L) in order, one step after another
        first, end = r["layers"]
        if first == 0:
            chunks.append(r["prefill_tokens"])
        else:
            assert first == covered and r["prefill_tokens"] == chunks[-1], groups
        covered = end
        assert r["decode_rows"] == 3 and r["prefill_works"] >= 1, r
    assert covered == LAYERS and 0 < sum(chunks) <= answer.usage.prompt_tokens  # (a cached prefix is not computed)
    assert [i for i, _ in groups] == list(range(groups[0][0], last + 1)), "no step between a chunk's groups"
    after = rows[last + 1]
    assert after["layers"] is None and after["prefill_works"] == 0 and after["decode_rows"] >= 1, after
    assert all(r["seconds"] >= 0 and (r["host_seconds"] is None or r["host_seconds"] >= 0) for r in rows)
    # since: the steps that ended after the given one, the same rows (a step's row never changes)
    cut = groups[0][1]["end"]
    later = trace(server, since=cut).json()
    assert later["clock"] == "unix" and later["window_s"] == 30.0
    assert later["steps"][: len(rows) - groups[0][0] - 1] == rows[groups[0][0] + 1:]
    assert trace(server, since=time.time() + 3600).json()["steps"] == []
    for bad in ("nan", "inf", "soon"):
        r = trace(server, since=bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (bad, r.text)
