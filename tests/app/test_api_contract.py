"""Issue 12, "the API does exactly what it says": readiness, HEAD, fields honoured or refused by
name, one spelling of `param`, one code streamed and not, every error in OpenAI's shape."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest

from app.api.generation import event_error
from app.streams import StreamEvent
from tests.app.conftest import MODEL, chat_prompt_ids, fake_model_output, make_container, start_server
from tests.app.test_errors import assert_openai_error


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


# -- readiness ------------------------------------------------------------------------------------------
def test_models_answers_503_with_retry_after_until_the_model_is_ready():
    blocker = threading.Event()
    srv = start_server(make_container(blocker=blocker), wait=False)
    try:
        for path in ("/v1/models", f"/v1/models/{MODEL}"):
            r = httpx.get(srv.base_url + path)
            assert_openai_error(r, 503, code="service_unavailable")
            assert r.headers["retry-after"] == "1" and "loading" in r.json()["error"]["message"]
            head = httpx.head(srv.base_url + path)
            assert head.status_code == 503 and head.headers["retry-after"] == "1" and head.content == b""
        with pytest.raises(openai.APIStatusError) as info:
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0).models.list()
        assert info.value.status_code == 503
        blocker.set()
        assert srv.runtime.wait_ready(10)
        models = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0).models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        blocker.set()
        srv.stop()


@pytest.mark.parametrize("path", ["/health", "/v1/models", f"/v1/models/{MODEL}", "/v1/stats", "/metrics",
                                  "/v1/cache/status"])
def test_head_works_wherever_get_does(server, path):
    get, head = httpx.get(server.base_url + path), httpx.head(server.base_url + path)
    assert get.status_code == head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


# -- every accepted field is honoured or refused by name --------------------------------------------------
def test_max_completion_tokens_is_honoured_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="cap me", extra_body={"max_completion_tokens": 3,
                                                                             "ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_without_stream_is_refused_by_name(server, path):
    body = {"model": MODEL, "stream_options": {"include_usage": True}, "max_tokens": 2,
            **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})}
    assert_openai_error(httpx.post(server.base_url + path, json=body), 400, param="stream_options",
                        code="invalid_value")


# -- param names the field the client sent, in one spelling ----------------------------------------------
def test_param_names_the_field_as_the_client_sent_it(server, client):
    post = lambda path, **body: httpx.post(server.base_url + path, json={"model": MODEL, **body})  # noqa: E731
    msgs = [{"role": "user", "content": "hi"}]
    assert_openai_error(post("/v1/chat/completions", messages=[{"role": "wizard", "content": "x"}]), 400,
                        param="messages[0].role")
    assert_openai_error(post("/v1/chat/completions", messages=[{"role": 7, "content": "x"}]), 422,
                        param="messages[0].role")
    bad_part = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_openai_error(post("/v1/chat/completions", messages=bad_part), 400, param="messages[0].content")
    # a text part without its text is a bad value, not an unsupported part ("only text parts are supported")
    no_text = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]
    assert_openai_error(post("/v1/chat/completions", messages=no_text), 400, param="messages[0].content[1].text",
                        code="invalid_value")
    assert_openai_error(post("/v1/chat/completions", messages=msgs, max_completion_tokens=0), 400,
                        param="max_completion_tokens")
    assert_openai_error(post("/v1/chat/completions", messages=msgs, max_tokens=0), 400, param="max_tokens")
    assert_openai_error(post("/v1/completions", prompt="x", max_completion_tokens=0), 400,
                        param="max_completion_tokens")
    assert_openai_error(post("/v1/completions", prompt="x", logprobs=99), 400, param="logprobs")


def test_the_legacy_function_role_is_handled_like_the_other_legacy_roles(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=4, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "weather?"}, {"role": "function", "name": "w", "content": "sunny"}])
    assert r.usage.completion_tokens == 4
    tok_ids = chat_prompt_ids("weather?")  # sanity: the fake model is deterministic in its prompt
    assert fake_model_output(tok_ids, 2) == fake_model_output(tok_ids, 2)


# -- one condition, one code: streamed and not ------------------------------------------------------------
@pytest.mark.parametrize(("status", "reason", "error", "code"), [
    (400, "error", "does not fit the resized pools", "request_too_large"),
    (503, "error", "engine is not running", "engine_down"),
    (500, "error", "model step failed", "engine_error"),
    (500, "abort", "server shutting down", "service_unavailable"),
])
def test_a_final_event_maps_to_one_error_for_both_answers(status, reason, error, code):
    event = StreamEvent("", (), (), reason, 3, 0, error, status)
    mapped = event_error(event)
    assert mapped is not None and mapped.code == code and error in mapped.message
    assert event_error(StreamEvent("", (), (), "stop", 3, 1)) is None


def test_a_failure_streamed_has_the_code_and_type_it_has_unstreamed():
    srv = start_server(make_container(delay=0.002))
    try:
        srv.container.executor().fail_sampling_seed = 7
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=3, seed=7)
        whole = info.value.body
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "seed": 7,
                "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {\"error\"")]
        streamed = httpx.Response(200, content=lines[0][len("data: "):]).json()["error"]
        assert (streamed["code"], streamed["type"]) == (whole["code"], whole["type"]) == ("engine_error",
                                                                                          "server_error")
    finally:
        srv.stop()


def test_a_failed_responses_stream_ends_with_the_code_and_type_it_has_unstreamed():
    """Responses: the error event and the final response.failed carry the whole answer's code (the latter
    once always said server_error) and type."""
    srv = start_server(make_container(delay=0.002))
    try:
        srv.container.executor().fail_sampling_seed = 7
        body = {"model": MODEL, "input": "a", "max_output_tokens": 3, "seed": 7}
        whole = httpx.post(srv.base_url + "/v1/responses", json=body, timeout=30)
        assert whole.status_code == 500, whole.text
        expected = (whole.json()["error"]["code"], whole.json()["error"]["type"])
        assert expected == ("engine_error", "server_error")
        r = httpx.post(srv.base_url + "/v1/responses", json={**body, "stream": True}, timeout=30)
        events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: {")]
        (error,) = [e for e in events if e["type"] == "error"]
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed", r.text
        failed = events[-1]["response"]["error"]
        assert error["code"] == failed["code"] == expected[0] and failed["type"] == expected[1], r.text
        assert failed["message"] == error["message"] and "sampling failed: injected NaN" in failed["message"]
    finally:
        srv.stop()


# -- 413 / 431 in OpenAI's shape ------------------------------------------------------------------------
def test_an_oversized_body_is_413_in_openai_shape(server):
    body = b'{"prompt": "' + b"x" * (64 * 1024 * 1024 + 1) + b'"}'
    r = httpx.post(server.base_url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert_openai_error(r, 413, code="request_entity_too_large")


def test_oversized_headers_are_431_in_openai_shape(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # NOTE: headers not yet ended and over the 16 KiB limit; sending more after the server
        # answered would reset the connection before the answer is read.
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), head
    r = httpx.Response(431, content=body)
    assert r.json()["error"]["code"] == "request_header_fields_too_large"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- logprobs travel with their token's text ----------------------------------------------------------
def printable_prompt(n: int) -> tuple[str, str]:
    """A chat prompt whose first n fake-model tokens are printable ASCII, and their text."""
    for i in range(100_000):
        content = f"p{i}"
        ids, _ = fake_model_output(chat_prompt_ids(content), n)
        if all(32 <= t < 127 for t in ids):
            return content, "".join(map(chr, ids))
    raise AssertionError("no printable prompt found")


def test_a_stream_held_back_by_a_stop_string_carries_each_tokens_logprob_with_its_text(client):
    content, text = printable_prompt(7)
    stop = text[5:7]
    assert stop not in text[:6]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=7, stop=[stop], stream=True,
        logprobs=True, extra_body={"ignore_eos": True}))
    deltas = [(c.choices[0].delta.content or "", [lp.token for lp in c.choices[0].logprobs.content])
              for c in chunks if c.choices and c.choices[0].logprobs]
    *body, last = deltas
    for delta, tokens in body:
        assert "".join(tokens) == delta, f"logprobs {tokens} sent with the text {delta!r}"
    assert "".join(d for d, _ in deltas) == text[:5]
    assert "".join(t for _, tokens in deltas for t in tokens) == text[:7], "every token's logprob, once"
    assert chunks[-1].choices[0].finish_reason == "stop" or any(c.choices and c.choices[0].finish_reason == "stop"
                                                              for c in chunks)


def test_logprob_bytes_are_the_tokens_own_bytes_and_byte_tokens_stay_distinct(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "bytes"}], max_tokens=24,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    entries = [e for c in r.choices[0].logprobs.content for e in (c, *c.top_logprobs)]
    lone = [e for e in entries if len(e.bytes) == 1 and e.bytes[0] >= 128]
    assert lone, "the fake model's output should include bytes of multi-byte characters"
    for e in lone:
        assert e.token == f"bytes:\\x{e.bytes[0]:02x}"
    assert all(e.bytes != [239, 191, 189] for e in entries), "a byte token came back as U+FFFD"
    for c in r.choices[0].logprobs.content:
        assert len({bytes(t.bytes) for t in c.top_logprobs}) == 3 == len({t.token for t in c.top_logprobs})
    done = client.completions.create(model=MODEL, prompt="bytes", max_tokens=24, logprobs=3,
                                     extra_body={"ignore_eos": True})
    assert all(len(alternatives) == 3 for alternatives in done.choices[0].logprobs.top_logprobs)


# -- CORS ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cors_server():
    srv = start_server(api_key="sekret", allowed_origins=("https://app.example",))
    yield srv
    srv.stop()


def test_cors_preflight_never_needs_the_api_key_and_the_real_request_still_does(cors_server):
    url = cors_server.base_url + "/v1/chat/completions"
    pre = httpx.options(url, headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code in (200, 204), pre.text
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    no_key = httpx.post(url, json=body, headers={"Origin": "https://app.example"})
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == "https://app.example"
    ok = httpx.post(url, json=body, headers={"Origin": "https://app.example", "Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(cors_server.base_url + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_unless_origins_are_allowed(server):
    r = httpx.get(server.base_url + "/health", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_tool_choice_without_tools_is_refused_by_name_and_names_reach_the_template(server, client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    assert_openai_error(httpx.post(server.base_url + "/v1/chat/completions", json=body), 400, param="tool_choice")
    for choice in ("none", "auto"):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi", "name": "ann"}],
                                           max_tokens=2, tool_choice=choice)
        assert r.usage.completion_tokens >= 1
