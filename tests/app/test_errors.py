"""Every error leaves in OpenAI's shape with the right status, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.app.conftest import MODEL


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def assert_openai_error(r: httpx.Response, status: int, param=..., code=...) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not ...:
        assert body["error"]["param"] == param, body
    if code is not ...:
        assert body["error"]["code"] == code, body
    return body["error"]


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.base_url + path, **kw)


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def test_malformed_json(server):
    r = post(server, "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert_openai_error(r, 400, code="invalid_json")


def test_empty_body(server):
    assert_openai_error(post(server, "/v1/completions", content=b""), 400, code="invalid_json")


def test_unknown_model_is_404_with_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
])
def test_a_request_without_a_model_is_served_by_the_served_model(server, path, body):
    """docs/serving.md: a missing `model` means the served one (as many OpenAI-compatible servers do); only a wrong
    one is refused (404 model_not_found, above)."""
    r = post(server, path, json=body, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", 2.5, "temperature"),
        ("temperature", -1, "temperature"),
        ("top_p", 0, "top_p"),
        ("top_k", -3, "top_k"),
        ("max_tokens", 0, "max_tokens"),
        ("stop", [""], "stop"),
        ("n", 0, "n"),
    ],
)
def test_bad_values_are_400_naming_the_parameter(server, field, value, param):
    assert_openai_error(post(server, "/v1/chat/completions", json=chat_body(**{field: value})), 400, param=param,
                        code="invalid_value")


def test_wrong_types_are_422_naming_the_parameter(server):
    r = post(server, "/v1/chat/completions", json=chat_body(max_tokens="many"))
    assert_openai_error(r, 422, param="max_tokens")
    r = post(server, "/v1/chat/completions", json={"model": MODEL})
    assert_openai_error(r, 422, param="messages")


def test_unsupported_parameters_are_named(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert info.value.body["param"] == "n" and "n=2" in info.value.body["message"]
    for field, value in [("presence_penalty", 0.5), ("logit_bias", {"1": 2.0})]:
        assert_openai_error(post(server, "/v1/chat/completions", json=chat_body(**{field: value})), 400, param=field)
    r = post(server, "/v1/completions", json={"model": MODEL, "prompt": "a", "echo": True})
    assert_openai_error(r, 400, param="echo", code="unsupported_parameter")
    r = post(server, "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert_openai_error(r, 400, param="prompt", code="unsupported_parameter")


FN = {"name": "multiply", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


@pytest.mark.parametrize(("path", "field", "value"), [
    # each answered 200 as if it had not been sent: the legacy function-calling fields (no call could come back),
    # audio output, a web search, and vLLM's structured-output and sampling extras (the text not constrained)
    ("/v1/chat/completions", "functions", [FN]),
    ("/v1/chat/completions", "function_call", {"name": "multiply"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/chat/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "guided_regex", "[0-9]+"),
    ("/v1/chat/completions", "guided_choice", ["yes", "no"]),
    ("/v1/completions", "guided_grammar", "root ::= 'a'"),
    ("/v1/chat/completions", "structured_outputs", {"json": {"type": "object"}}),
    ("/v1/chat/completions", "min_tokens", 5),
    ("/v1/completions", "repetition_penalty", 1.3),
    ("/v1/chat/completions", "min_p", 0.1),
])
def test_fields_that_would_change_the_answer_are_refused_not_dropped(server, path, field, value):
    body = chat_body(**{field: value}) if "chat" in path else {"model": MODEL, "prompt": "a", field: value}
    assert_openai_error(post(server, path, json=body), 400, param=field, code="unsupported_parameter")


def test_the_neutral_values_of_those_fields_are_accepted(server):
    neutral = {"modalities": ["text"], "min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0.0, "functions": []}
    assert post(server, "/v1/chat/completions", json=chat_body(**neutral)).status_code == 200


def test_context_length_exceeded(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=100_000
        )
    assert info.value.body["code"] == "context_length_exceeded"
    r = post(server, "/v1/completions", json={"model": MODEL, "prompt": "x" * 3000, "max_tokens": 16})
    assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")


def test_bad_prompts_and_messages(server):
    assert_openai_error(post(server, "/v1/completions", json={"model": MODEL, "prompt": []}), 400, param="prompt")
    assert_openai_error(post(server, "/v1/completions", json={"model": MODEL, "prompt": [1, 99999]}), 400)
    # a one-element batch holding something that is no prompt: not "batched prompts (1) are not supported"
    for bad in ([["a"]], [[[1]]]):
        assert_openai_error(post(server, "/v1/completions", json={"model": MODEL, "prompt": bad}), 400,
                            param="prompt", code="invalid_value")
    assert_openai_error(post(server, "/v1/chat/completions", json=chat_body(messages=[])), 400, param="messages")
    body = chat_body(messages=[{"role": "wizard", "content": "hi"}])
    assert_openai_error(post(server, "/v1/chat/completions", json=body), 400)
    body = chat_body(logprobs=False, top_logprobs=2)
    assert_openai_error(post(server, "/v1/chat/completions", json=body), 400, param="top_logprobs")


def test_unknown_route_and_method_keep_the_shape(server):
    assert_openai_error(httpx.get(server.base_url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.base_url + "/v1/chat/completions"), 405)


def test_server_still_serves_after_errors(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still?"}], max_tokens=2)
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}, {"role": "system", "content": None},
                                     {"role": "tool", "tool_call_id": "c1"}, {"role": "assistant", "content": None}])
def test_a_message_without_content_is_a_400_naming_it(server, message):
    """OpenAI refuses these (content is required but for an assistant message with tool calls); they were served."""
    body = chat_body()
    body["messages"] = [{"role": "user", "content": "hi"}, message]
    err = assert_openai_error(post(server, "/v1/chat/completions", json=body), 400, param="messages[1].content",
                              code="invalid_value")
    assert message["role"] in err["message"]


def test_an_assistant_tool_call_without_content_is_still_accepted(server):
    body = chat_body()
    body["messages"] = [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert post(server, "/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("since", ["abc", "1e9x", "nan", "inf", "-inf", ""])
def test_a_since_that_is_no_finite_number_is_invalid_value_naming_it(server, since):
    """/v1/stats/steps?since=abc was refused by the framework's own validation (code and param null, "Validation
    failed"), while since=inf got invalid_value naming `since`: every spelling of "not a finite number" now gets the
    latter."""
    r = httpx.get(server.base_url + "/v1/stats/steps", params={"since": since})
    err = assert_openai_error(r, 400, param="since", code="invalid_value")
    assert err["type"] == "invalid_request_error"
    assert "since must be a finite number of seconds" in err["message"] and repr(since) in err["message"], err


def test_a_numeric_since_still_selects_steps(server):
    assert httpx.get(server.base_url + "/v1/stats/steps", params={"since": "0"}).json()["clock"] == "unix"
    assert httpx.get(server.base_url + "/v1/stats/steps", params={"since": " 1e18 "}).json()["steps"] == []
