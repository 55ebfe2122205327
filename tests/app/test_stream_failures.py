"""A server-side failure while a stream formats an event ends that stream with a well-formed error event in
its API's format (then the API's terminator), logged once; the request is aborted and nothing leaks. The
incident: a logprobs lookup raised inside the completions SSE generator and Litestar dropped the connection
mid-body ("incomplete chunked read", no error event, an ExceptionGroup in the log). A client walking away
still just aborts, with no error logged."""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import openai
import pytest

import app.api.chat
import app.api.completions
import app.api.messages
import app.api.responses
from tests.app.conftest import MODEL, make_container, start_server, stats, wait_until_idle
from tests.app.test_concurrency import aborted_count

SECRET = "secret-internal-detail"  # in the injected exception's message: must not reach the client
MAX_TOKENS = 400  # 0.8 s of steps: the request still runs when its stream fails or its client leaves


@pytest.fixture(scope="module")
def slow_server():
    srv = start_server(make_container(delay=0.002))  # 2 ms a step: the request is mid-generation at the failure
    yield srv
    srv.stop()


def held(server) -> dict:
    """What requests hold: zero at idle (prefix-cached pages are free to evict, not held)."""
    pools = stats(server)["pools"]
    return {"running": pools["running"], "waiting": pools["waiting"], "held": pools["held"],
            "kv_pages": pools["kv_pages_used"] - pools["prefix_cache"]["cached_pages"],
            "state_slots": pools["state_slots_used"]}


def fail_on_call(monkeypatch, owner, name: str, n: int = 3, when=lambda *a, **k: True) -> None:
    """Make owner.name raise on its n-th call (counting only the calls `when` accepts)."""
    original, calls = getattr(owner, name), [0]

    def failing(*args, **kwargs):
        if when(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                raise RuntimeError(SECRET)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def raw_events(server, path: str, body: dict) -> list[tuple[str | None, str]]:
    """(event name, data) of every SSE frame; httpx raises RemoteProtocolError on an incomplete chunked body."""
    frames, name, data = [], None, []
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
            elif not line and data:
                frames.append((name, "\n".join(data)))
                name, data = None, []
    assert not data, "a frame was left unterminated"
    return frames


def assert_message(message: str) -> None:
    assert "internal server error" in message and "RuntimeError" in message and SECRET not in message, message


# each endpoint: what to break, the request body, how its official client reads the stream
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "break me"}], "max_tokens": MAX_TOKENS,
        "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "break me", "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 1}
MESSAGE = {"model": MODEL, "messages": [{"role": "user", "content": "break me"}], "max_tokens": MAX_TOKENS}
RESPONSE = {"model": MODEL, "input": "break me", "max_output_tokens": MAX_TOKENS,
            "reasoning": {"effort": "none"}}


def check_openai_tail(frames: list) -> None:
    """Chat Completions and Completions: the error object as a data frame, then [DONE]."""
    assert [name for name, _ in frames[-2:]] == [None, None] and frames[-1][1] == "[DONE]", frames[-3:]
    error = json.loads(frames[-2][1])["error"]
    assert (error["type"], error["code"], error["param"]) == ("server_error", "internal_error", None), error
    assert_message(error["message"])
    assert not any("error" in json.loads(d) for _, d in frames[:-2]), "one error event only"


def check_messages_tail(frames: list) -> None:
    """Anthropic: `event: error` with {"type": "error", "error": {"type": "api_error", ...}}, last."""
    name, data = frames[-1]
    body = json.loads(data)
    assert name == "error" and body["type"] == "error" and body["error"]["type"] == "api_error", frames[-2:]
    assert_message(body["error"]["message"])
    assert [n for n, _ in frames].count("error") == 1 and "message_stop" not in [n for n, _ in frames]


def check_responses_tail(frames: list) -> None:
    """Responses: an `error` event, then `response.failed` carrying the same code and message, last."""
    assert [name for name, _ in frames[-2:]] == ["error", "response.failed"], [n for n, _ in frames]
    error, failed = json.loads(frames[-2][1]), json.loads(frames[-1][1])
    assert error["type"] == "error" and error["code"] == "internal_error" and error["param"] is None
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "internal_error", "message": error["message"],
                                           "type": "server_error"}
    assert_message(error["message"])
    numbers = [json.loads(d)["sequence_number"] for _, d in frames]
    assert numbers == list(range(len(frames))), "sequence numbers go on through the failure"


def read_with_openai_chat(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=MAX_TOKENS,
                                            stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError) as info:
        list(stream)
    return info.value.body


def read_with_openai_completions(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt="break me", max_tokens=MAX_TOKENS, logprobs=1,
                                       stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError) as info:
        list(stream)
    return info.value.body


def read_with_anthropic(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        list(client.messages.create(stream=True, **MESSAGE))
    return info.value.body["error"]


def read_with_openai_responses(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    events = list(client.responses.create(stream=True, model=MODEL, input="break me", max_output_tokens=MAX_TOKENS,
                                          reasoning={"effort": "none"}))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.error.code == "internal_error"
    return {"message": events[-2].message, "code": events[-2].code}


ENDPOINTS = {
    # the incident's path: the completions logprobs object, built per event
    "completions": ("/v1/completions", COMPLETION, (app.api.completions._Offsets, "logprobs", {}), check_openai_tail,
                    read_with_openai_completions),
    "chat": ("/v1/chat/completions", CHAT, (app.api.chat, "_delta", {}), check_openai_tail, read_with_openai_chat),
    "messages": ("/v1/messages", MESSAGE,
                 (app.api.messages, "_event", {"when": lambda name, data: name == "content_block_delta"}),
                 check_messages_tail, read_with_anthropic),
    "responses": ("/v1/responses", RESPONSE, (app.api.responses.OutputItems, "add", {}), check_responses_tail,
                  read_with_openai_responses),
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_failure_formatting_an_event_ends_the_stream_with_an_error_event(slow_server, monkeypatch, caplog,
                                                                           endpoint):
    path, body, (owner, name, options), check_tail, read_with_client = ENDPOINTS[endpoint]
    idle = held(slow_server)
    assert idle == {"running": 0, "waiting": 0, "held": 0, "kv_pages": 0, "state_slots": 0}
    aborted_before = aborted_count(slow_server)

    fail_on_call(monkeypatch, owner, name, **options)
    with caplog.at_level(logging.ERROR):
        check_tail(raw_events(slow_server, path, body))  # a complete body: httpx would raise on a dropped one
        wait_until_idle(slow_server)
    assert held(slow_server) == idle, "the failed stream's request must be aborted, its pages and slot freed"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].name == "fluxtide.api", [r.getMessage() for r in errors]
    assert errors[0].exc_info and errors[0].exc_info[0] is RuntimeError, "logged with its traceback"

    # The official client reads the error (a fresh failure: the patch counts on).
    fail_on_call(monkeypatch, owner, name, **options)
    error = read_with_client(slow_server)
    assert (error["type"] == "api_error") if endpoint == "messages" else (error["code"] == "internal_error"), error
    assert_message(error["message"])
    wait_until_idle(slow_server)

    assert aborted_count(slow_server) - aborted_before == 2, "each failed stream aborts its request at once"

    # The next request is served normally.
    monkeypatch.undo()
    frames = raw_events(slow_server, path, {**body, "max_tokens" if "max_tokens" in body else "max_output_tokens": 4})
    assert not any(n == "error" or d.startswith('{"error"') for n, d in frames), frames[-3:]
    assert held(slow_server) == idle


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_client_that_walks_away_is_aborted_without_an_error_logged(slow_server, caplog, endpoint):
    """Cancellation is no failure: the guard lets it through, so nothing is logged and no error event is
    attempted (test_concurrency covers the pages and slots of many walk-aways on chat)."""
    path, body = ENDPOINTS[endpoint][:2]
    aborted_before = aborted_count(slow_server)
    with caplog.at_level(logging.WARNING):
        with httpx.stream("POST", slow_server.base_url + path, json={**body, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)  # then leave mid-stream: closing the block drops the connection
        wait_until_idle(slow_server)
    assert held(slow_server) == {"running": 0, "waiting": 0, "held": 0, "kv_pages": 0, "state_slots": 0}
    assert aborted_count(slow_server) - aborted_before == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
