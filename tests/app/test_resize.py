"""Live pool resize through POST /v1/cache/rebuild while requests stream."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time

import httpx
import openai
import pytest

from domain.fakes import FakeTokenizer
from tests.app.conftest import (
    MODEL,
    chat_prompt_ids,
    fake_model_output,
    make_container,
    open_gate,
    start_server,
    step_until,
    until_running_or_done,
    wait_until_idle,
)
from tests.log_records import logger_records


@pytest.fixture
def srv():
    server = start_server(make_container(delay=0.003), kv_tokens=512)
    yield server
    server.stop()


def rebuild(server, timeout: float = 30, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/cache/rebuild", json=body, timeout=timeout)


def plan(server) -> dict:
    return httpx.get(server.base_url + "/v1/cache/status").json()["plan"]


async def stream(client, content: str, max_tokens: int) -> tuple[str, str]:
    s = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, stream=True,
        extra_body={"ignore_eos": True},
    )
    text, finish = [], None
    async for chunk in s:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def expected(content: str, max_tokens: int) -> tuple[str, str]:
    ids, _ = fake_model_output(chat_prompt_ids(content), max_tokens)
    return FakeTokenizer().decode(ids), "length"


def resize_while_streaming(server, n_streams: int, max_tokens: int, **body):
    """Start streams, resize once they are running, start one more stream during the drain."""

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        tasks = [asyncio.ensure_future(stream(client, f"resize {i}", max_tokens)) for i in range(n_streams)]
        await until_running_or_done(server, tasks)
        resize = asyncio.ensure_future(asyncio.to_thread(rebuild, server, **body))
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(stream(client, "late arrival", max_tokens))
        results = await asyncio.gather(*tasks, late)
        response = await resize
        await client.close()
        return results, response

    results, response = asyncio.run(main())
    prompts = [f"resize {i}" for i in range(n_streams)] + ["late arrival"]
    assert results == [expected(p, max_tokens) for p in prompts], "a request failed or changed across the resize"
    return response


def test_growing_kv_while_streaming_fails_no_request(srv):
    r = resize_while_streaming(srv, 6, 40, kv_tokens=1024, wait_s=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["before"]["kv_tokens"] == 512 and body["after"]["kv_tokens"] == 1024
    assert body["experts_kept"] is True
    assert "prefix cache cleared" in body["message"], body["message"]  # the KV pool was rebuilt
    assert plan(srv)["kv_tokens"] == 1024
    pools = wait_until_idle(srv)
    assert pools["kv_pages_total"] == 64 and pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"]
    assert srv.container.executor().resizes[-1].kv_pages == 64


def test_shrinking_kv_works_live_too(srv):
    r = resize_while_streaming(srv, 4, 30, kv_tokens="256", wait_s=30)
    assert r.status_code == 200, r.text
    assert plan(srv)["kv_tokens"] == 256
    assert wait_until_idle(srv)["kv_pages_total"] == 16


def test_impossible_resize_is_refused_and_serving_continues(srv):
    before = plan(srv)
    r = rebuild(srv, kv_tokens="64m")
    assert r.status_code == 409
    body = r.json()
    assert body["error"]["code"] == "plan_refused" and body["refusal"]["shortfall_bytes"] > 0
    assert "serving continues" in body["error"]["message"]
    assert plan(srv) == before
    assert srv.container.executor().resizes == [], "nothing may be freed before the plan is validated"
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok?"}], max_tokens=4,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


def test_failed_resize_rolls_back(srv):
    before = plan(srv)
    executor = srv.container.executor()
    executor.fail_resize_to = 2048 // 16
    r = rebuild(srv, kv_tokens=2048)
    assert r.status_code == 409 and r.json()["error"]["code"] == "resize_rolled_back", r.text
    assert r.json()["rolled_back"] is True
    assert plan(srv) == before
    assert executor.resizes[-1].kv_pages == before["kv_pages"], "the old pools were not restored"
    content = "after rollback"
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected(content, 8)[0]


def resize_that_gives_up(srv) -> tuple[httpx.Response, str]:
    """A resize to 1024 KV tokens whose 0.1 s drain ends while a 300-token stream still runs: the engine runs step by
    step (step_gate), so the stream is still running when the wait ends, however slow the machine (free running, it
    could finish first or before the poll saw it). Returns the resize's response and the stream's text."""
    srv.container.executor().step_gate = threading.Semaphore(0)

    async def main():
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        task = asyncio.ensure_future(stream(client, "long one", 300))
        await asyncio.to_thread(step_until, srv, lambda pools: pools["running"] > 0)
        resize = asyncio.ensure_future(asyncio.to_thread(rebuild, srv, kv_tokens=1024, wait_s=0.1))
        given_up = await asyncio.to_thread(step_until, srv, lambda pools: resize.done(), limit=250)
        assert given_up["running"] == 1, "the stream must still run when the resize gives up"
        open_gate(srv)
        response = await resize
        result = await task
        await client.close()
        return response, result

    return asyncio.run(main())


def test_drain_timeout_keeps_old_pools_and_the_request(srv):
    response, result = resize_that_gives_up(srv)
    assert response.status_code == 409 and response.json()["error"]["code"] == "resize_not_applied"
    assert "did not finish" in response.json()["error"]["message"]
    times = response.json()
    assert times["waited_s"] >= 0.1 and times["swap_s"] == 0 and times["total_s"] == times["waited_s"]  # no swap
    assert result == expected("long one", 300)
    assert plan(srv)["kv_tokens"] == 512


def test_generation_answers_503_while_pools_are_swapped(srv):
    executor = srv.container.executor()
    executor.resize_gate = threading.Event()
    resize = threading.Thread(target=rebuild, args=(srv,), kwargs={"kv_tokens": 1024})
    resize.start()
    assert executor.resizing.wait(10)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "now?"}], "max_tokens": 2}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body)
    executor.resize_gate.set()
    resize.join(10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(srv.base_url + "/health").json()["status"] == "ok"
    assert plan(srv)["kv_tokens"] == 1024


def test_moe_resize_reports_cold_experts_and_bad_bodies_are_400(srv):
    r = rebuild(srv, moe_slots=4)
    assert r.status_code == 200, r.text
    assert r.json()["experts_kept"] is False and "cold" in r.json()["kept"]
    assert plan(srv)["expert_slots"] == 4
    # no pool given, or only fields it does not know: a 400 that names no single field (it said kv_tokens)
    for body in ({}, {"bogus": 8}):
        r = rebuild(srv, **body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
        assert r.json()["error"]["param"] is None and "at least one of" in r.json()["error"]["message"]
    assert rebuild(srv, kv_tokens="lots").json()["error"]["param"] == "kv_tokens"
    assert rebuild(srv, kv_tokens=1024, wait_s=-1).status_code == 400
    # refused plans name the field the client sent (`param` once held the pool: "kv", "moe", "state")
    for body, param in (({"kv_tokens": 1}, "kv_tokens"), ({"moe_slots": 1}, "moe_slots"),
                        ({"mamba_slots": 0}, "mamba_slots")):
        r = rebuild(srv, **body)
        assert r.status_code == 409 and r.json()["error"]["code"] == "plan_refused", r.text
        assert r.json()["error"]["param"] == param, r.text
    assert plan(srv)["expert_slots"] == 4


@pytest.mark.parametrize("size", [1.024e3, 1024.0, "1.024e3"])
def test_an_integral_json_float_is_a_size(srv, size):
    """docs/serving.md says sizes accept 1e4: the JSON number {"kv_tokens": 1e4} was a 422 invalid_type."""
    r = rebuild(srv, kv_tokens=size)
    assert r.status_code == 200, r.text
    assert plan(srv)["kv_tokens"] == 1024


def _late_error(path: str, stream: bool, r: httpx.Response) -> tuple[int, str, str | None]:
    """(status, error type, code) of a late request's answer, whole or streamed, in its dialect's shape."""
    if not stream:
        error = r.json()["error"]
        return r.status_code, error["type"], error.get("code")
    assert r.status_code == 200, r.text  # the stream had started: the error is an event in it
    payloads = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: {")]
    errors = [e for e in map(json.loads, payloads) if e.get("type") == "error" or "error" in e and "type" not in e]
    assert len(errors) == 1, r.text
    if path == "/v1/messages":
        return 400, errors[0]["error"]["type"], None
    if path == "/v1/responses":  # the error event has no error type; the final response.failed has both
        (failed,) = [e["response"]["error"] for e in map(json.loads, payloads) if e.get("type") == "response.failed"]
        assert failed["code"] == errors[0]["code"] and failed["message"] == errors[0]["message"], r.text
        return 400, failed["type"], failed["code"]
    return 400, errors[0]["error"]["type"], errors[0]["error"]["code"]


LATE_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "too big later"}], "max_tokens": 400},
    "/v1/messages": {"messages": [{"role": "user", "content": "too big later"}], "max_tokens": 400},
    "/v1/responses": {"input": "too big later", "max_output_tokens": 400},
}


def _held_through_a_shrink(server, path: str, body: dict, kv_tokens: int) -> httpx.Response:
    """Send `body` while a shrink to `kv_tokens` drains, once the engine holds it (step_gate: forced, not raced)."""
    server.container.executor().step_gate = threading.Semaphore(0)

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        running = asyncio.ensure_future(stream(client, "keeps the engine busy", 120))
        await asyncio.to_thread(step_until, server, lambda pools: pools["running"] > 0)
        resize = asyncio.ensure_future(asyncio.to_thread(rebuild, server, kv_tokens=kv_tokens, wait_s=30))
        await asyncio.to_thread(step_until, server, lambda pools: pools["phase"] == "draining")
        late = asyncio.ensure_future(asyncio.to_thread(httpx.post, server.base_url + path,
                                                       json={"model": MODEL, **body}, timeout=30))
        held = await asyncio.to_thread(step_until, server, lambda pools: pools["held"] == 1)
        assert held["running"] == 1, "the busy request must still be running when the late one is held"
        open_gate(server)
        results = await asyncio.gather(running, resize, late)
        await client.close()
        return results

    streamed, resized, late = asyncio.run(main())
    assert streamed == expected("keeps the engine busy", 120)
    assert resized.status_code == 200, resized.text
    return late


@pytest.mark.parametrize(("path", "as_stream"), [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                                 ("/v1/messages", False), ("/v1/messages", True),
                                                 ("/v1/responses", False), ("/v1/responses", True)])
def test_a_held_request_that_no_longer_fits_after_a_shrink_gets_400(srv, path, as_stream):
    """The engine runs step by step (step_gate) until the late request is held: the interleaving is
    forced, not raced (it once arrived after the resize had finished on a busy machine). Streamed, the
    error event has the type and code the whole answer has (Messages once said `api_error` and Responses
    `engine_error` for this client-side condition; Responses' final `response.failed` once said `server_error`)."""
    late = _held_through_a_shrink(srv, path, {"stream": as_stream, **LATE_BODIES[path]}, kv_tokens=256)
    assert "resized pools" in late.text and "KV cache pool has 16 (256 tokens)" in late.text, late.text
    status, kind, code = _late_error(path, as_stream, late)
    assert (status, kind) == (400, "invalid_request_error"), late.text
    assert code == (None if path == "/v1/messages" else "request_too_large"), late.text
    pools = wait_until_idle(srv)
    assert pools["state_slots_used"] == 0 and pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "default later"}], "ignore_eos": True}),
    ("/v1/responses", {"input": [{"role": "user", "content": "default later"}], "ignore_eos": True}),
])
def test_a_held_request_without_max_tokens_gets_the_default_of_the_pool_it_is_admitted_into(srv, path, body):
    """Its default max_tokens ("the rest of the context") was computed against the 512-token pool before it was
    held; it once stayed that and the request was refused on the 256-token pool. vLLM's default is what fits."""
    late = _held_through_a_shrink(srv, path, body, kv_tokens=256)
    assert late.status_code == 200, late.text
    answer = late.json()
    if path == "/v1/responses":
        usage = answer["usage"]
        assert usage["output_tokens"] == 256 - usage["input_tokens"] and answer["status"] == "incomplete", late.text
    else:
        usage = answer["usage"]
        assert usage["completion_tokens"] == 256 - usage["prompt_tokens"], late.text
        assert answer["choices"][0]["finish_reason"] == "length", late.text
    wait_until_idle(srv)


def test_a_request_too_long_for_the_shrunk_kv_pool_says_the_pool_is_the_limit(srv):
    """The KV pool (256 tokens after the shrink) bounds the request, not the model's context (4096 tokens):
    the message once said "This model's maximum context length is 256 tokens"."""
    assert rebuild(srv, kv_tokens=256).status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "too long"}], "max_tokens": 400}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "context_length_exceeded", "invalid_request_error", "messages"), error
    assert "maximum context length is 256 tokens" in error["message"], error  # the phrase clients match on
    assert "KV cache pool" in error["message"] and "model's own context is 4096 tokens" in error["message"], error
    assert "This model's maximum context length" not in error["message"], error


def test_moe_auto_fills_what_the_new_kv_pool_leaves(srv):
    status = httpx.get(srv.base_url + "/v1/cache/status").json()
    spec_expert_bytes = status["expert_bytes"]
    r = rebuild(srv, kv_tokens=1024, moe_slots="auto")
    assert r.status_code == 200, r.text
    after = r.json()["after"]
    assert after["kv_tokens"] == 1024
    # MoE-first fill: every expert if they fit, else no room for one more slot.
    assert after["expert_slots"] == status["total_experts"] or after["free_bytes"] < spec_expert_bytes
    assert rebuild(srv, kv_tokens="auto", moe_slots="auto").status_code == 400
    r = rebuild(srv, moe_slots=4, kv_tokens="auto")
    assert r.status_code == 200, r.text
    assert r.json()["after"]["expert_slots"] == 4 and r.json()["after"]["kv_tokens"] > 1024


def test_kv_auto_stops_at_every_running_sequence_at_full_context(srv):
    # as at start-up: KV past state slots x context is never used (a new user's `ft ctl cache --kv auto` took
    # 746,992 tokens of a 4 x 4,096-token demo, and the next `--mamba` growth found no room)
    context = 4096  # the fake model's own context (test_prompt_longer_than_the_pool_... above)
    r = rebuild(srv, moe_slots=4, mamba_slots=2, kv_tokens="auto")
    assert r.status_code == 200, r.text
    after = r.json()["after"]
    assert after["state_slots"] == 2 and after["kv_tokens"] == 2 * context, after
    assert after["free_bytes"] > 0  # what the cap left is free, not in a pool
    r = rebuild(srv, mamba_slots=4, kv_tokens="auto")  # back up to --max-running-requests
    assert r.status_code == 200, r.text
    assert r.json()["after"]["kv_tokens"] == 2 * after["kv_tokens"]


@pytest.mark.parametrize("body", [{"mamba_slots": 8}, {"mamba_slots": 5, "kv_tokens": "auto"}])
def test_state_slots_above_max_running_requests_are_refused_by_name(srv, body):
    """`ft ctl cache --mamba 8` on a `--max-running-requests 4` server raised state_slots_total to 8 while the
    running limit stayed 4 (fixed at start-up: the decode graphs are captured up to it): four slots held memory for
    nothing. Refused with 409 plan_refused naming the flag, the old pools kept."""
    before = plan(srv)
    r = rebuild(srv, **body)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("plan_refused", "mamba_slots"), error
    assert f"state_slots {body['mamba_slots']} is above --max-running-requests 4" in error["message"], error
    assert f"restart with --max-running-requests {body['mamba_slots']}" in error["message"], error
    assert r.json()["refusal"]["pool"] == "state"
    assert plan(srv) == before
    ok = rebuild(srv, mamba_slots=4)  # up to the limit is a resize like any other
    assert ok.status_code == 200 and ok.json()["max_running"] == 4, ok.text


def test_stats_show_the_running_requests_the_resized_state_pool_admits(srv):
    # /v1/stats scheduler.max_running is what the pools admit now, not the setting (a live `--mamba 2` left it at 4)
    before = httpx.get(srv.base_url + "/v1/stats").json()["scheduler"]["max_running"]
    r = rebuild(srv, mamba_slots=2)
    assert r.status_code == 200, r.text
    assert r.json()["max_running"] == 2  # the resize's own answer says the limit it leaves
    assert httpx.get(srv.base_url + "/v1/stats").json()["scheduler"]["max_running"] == min(before, 2) == 2


@pytest.fixture
def engine_log():
    """The engine logger's records (tests/log_records.py)."""
    with logger_records("fluxtide.engine", logging.DEBUG) as records:
        yield records


def test_an_applied_resize_leaves_one_info_line_with_the_pools_before_and_after(srv, engine_log):
    """A live resize logged nothing but "prefix cache cleared": the log could not say when the pools changed, to
    what, or how long the rebuild waited for the running requests."""
    r = rebuild(srv, kv_tokens=1024, moe_slots=4, wait_s=30)
    assert r.status_code == 200, r.text
    lines = [rec for rec in engine_log if "pools" in rec.getMessage() or "prefix cache" in rec.getMessage()]
    assert len(lines) == 1, [rec.getMessage() for rec in engine_log]
    line = lines[0]
    message = line.getMessage()
    assert line.levelname == "INFO" and message.startswith("pools resized: KV tokens 512 -> 1024, "), message
    assert "expert slots 8 -> 4" in message and re.search(r"waited \d+\.\d{3} s for in-flight requests", message)
    assert "expert slots start cold" in message and "prefix cache cleared" in message, message


def test_a_resize_that_gives_up_on_the_wait_says_so_in_the_log(srv, engine_log):
    response, _ = resize_that_gives_up(srv)
    assert response.status_code == 409
    warned = [rec for rec in engine_log if rec.levelname == "WARNING" and "resize not applied" in rec.getMessage()]
    assert len(warned) == 1 and "old pools kept (KV tokens 512" in warned[0].getMessage(), warned
    assert not any("pools resized" in rec.getMessage() for rec in engine_log)


def layered_beside_a_stream(server) -> bool:
    """Whether a short prompt sent while a stream decodes ran as layer groups beside it (the step trace's `layers`)."""

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        beside = asyncio.ensure_future(stream(client, "a stream beside", 400))
        await until_running_or_done(server, [beside])
        await asyncio.sleep(0.05)  # its prompt is in: it decodes
        since = time.time()
        assert await stream(client, "hi", 2) == expected("hi", 2)
        assert not beside.done(), "the stream ended before the short prompt ran beside it"
        assert await beside == expected("a stream beside", 400)
        await client.close()
        return since

    since = asyncio.run(main())
    steps = httpx.get(server.base_url + "/v1/stats/steps", params={"since": since}).json()["steps"]
    beside_decodes = [s for s in steps if s["prefill_works"] and s["decode_rows"]]
    assert beside_decodes, steps  # the prompt ran beside the stream's decodes
    return all(s["layers"] is not None for s in beside_decodes)


def test_a_resize_across_the_models_experts_turns_short_prompt_layering_on_and_off():
    """ADR 0024 "A0" (--layer-short-prompts auto; off by default since session 30): 8 of the tiny model's 16 experts leave experts out, so
    a short prompt beside a decoding stream runs as layer groups (an ordinary step would copy every expert that is not
    resident); a live resize to all 16 turns that off, one back to 8 on again (Engine._install_pools)."""
    srv = start_server(make_container(delay=0.003), kv_tokens=512, layer_short_prompts="auto")
    try:
        _resize_across_every_expert(srv)
    finally:
        srv.stop()


def _resize_across_every_expert(srv) -> None:
    def scheduler() -> dict:
        return httpx.get(srv.base_url + "/v1/stats").json()["scheduler"]

    assert scheduler()["layer_short_prompts"] is True and scheduler()["partial_residency"] is True
    assert layered_beside_a_stream(srv)
    r = rebuild(srv, moe_slots=16)
    assert r.status_code == 200, r.text
    assert scheduler()["partial_residency"] is False and scheduler()["layer_short_prompts"] is True
    assert not layered_beside_a_stream(srv)  # every expert resident: one ordinary mixed step, as before
    r = rebuild(srv, moe_slots=8)
    assert r.status_code == 200, r.text
    assert scheduler()["partial_residency"] is True and layered_beside_a_stream(srv)


def test_by_default_a_short_prompt_beside_a_stream_is_not_layered(srv):
    """--layer-short-prompts off by default (session 30 measured auto's cost: first token 0.40 -> 0.98 s for a gap p99
    of 342 -> 110 ms): with experts left out, a short prompt beside a decoding stream still takes one mixed step."""
    stats = httpx.get(srv.base_url + "/v1/stats").json()["scheduler"]
    assert stats["layer_short_prompts"] is False and stats["partial_residency"] is True
    assert not layered_beside_a_stream(srv)


def slow_swap(server, monkeypatch, seconds: float) -> None:
    """Every pool swap of the server's executor takes `seconds` longer."""
    executor = server.container.executor()
    swap = executor.resize_pools

    def slow(target):
        time.sleep(seconds)
        swap(target)

    monkeypatch.setattr(executor, "resize_pools", slow)


def test_a_resize_answers_the_wait_for_requests_apart_from_the_swap(srv, monkeypatch):
    """`waited_s` covered the whole resize: `ft ctl cache` printed "waited 0.6764 s" where the log said "waited 0.002 s
    for in-flight requests, swapped in 0.674 s", and the user took it for requests that had blocked the resize."""
    slow_swap(srv, monkeypatch, 0.4)
    r = rebuild(srv, kv_tokens=1024, wait_s=30)  # nothing in flight: no wait to speak of
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["waited_s"] < 0.3 <= 0.4 <= body["swap_s"], body
    assert body["total_s"] == pytest.approx(body["waited_s"] + body["swap_s"], abs=2e-4)
    # and with requests in flight the wait is theirs, the swap still apart
    r = resize_while_streaming(srv, 3, 40, kv_tokens=2048, wait_s=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["waited_s"] > 0 and body["swap_s"] >= 0.4, body
    assert body["total_s"] == pytest.approx(body["waited_s"] + body["swap_s"], abs=2e-4)


def test_the_model_card_states_the_context_a_request_may_hold_now(srv):
    """/v1/models `max_model_len` (vLLM's field; ft bench prefill refuses sizes past it before sending): the model's
    context or, where a smaller KV pool bounds a request, the pool's size, moved by a live resize."""
    def card() -> dict:
        return httpx.get(srv.base_url + "/v1/models").json()["data"][0]

    context = 4096  # the fake model's (tests/app/conftest.py)
    assert card()["max_model_len"] == 512  # the KV pool bounds a request
    assert rebuild(srv, kv_tokens=1024).status_code == 200
    assert card()["max_model_len"] == 1024
    assert httpx.get(srv.base_url + f"/v1/models/{card()['id']}").json()["max_model_len"] == 1024
    assert rebuild(srv, kv_tokens=8192).status_code == 200
    assert card()["max_model_len"] == context  # now the model's context bounds it
