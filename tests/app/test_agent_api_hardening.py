"""What an agent sends that the server got wrong: Anthropic's assistant prefill (a last assistant turn is the
start of the answer) and tool-call arguments nested past what JSON decoding survives (a 500 before)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.app.conftest import MODEL
from tests.app.scripted import scripted_fixture

PREFILL = "The answer is"
QUESTION = {"role": "user", "content": "What is 6 × 7?"}


def script(prompt: str) -> str:
    """Continues a prefilled answer; anything else is a fresh turn."""
    return " 42." if prompt.endswith(PREFILL) else "A fresh turn."


scripted = scripted_fixture(script)


@pytest.fixture(scope="module")
def client(scripted):
    return anthropic.Anthropic(base_url=scripted[0].base_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_continues_a_prefilled_assistant_turn(client, scripted, stream):
    kw = {"model": MODEL, "max_tokens": 50, "messages": [QUESTION, {"role": "assistant", "content": PREFILL}]}
    if stream:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kw)
    # Anthropic's rule: the response continues the prefill and holds only what follows it
    assert [(b.type, b.text) for b in message.content] == [("text", " 42.")] and message.stop_reason == "end_turn"
    prompt = scripted[1].prompts[message.id]
    assert prompt.endswith("<|im_start|>assistant\n" + PREFILL)
    assert client.messages.count_tokens(model=MODEL, messages=kw["messages"]).input_tokens == len(prompt.encode())


def test_messages_answers_a_fresh_turn_after_an_assistant_turn_with_no_text(client):
    for last in ({"role": "assistant", "content": "  "}, {"role": "user", "content": "And now?"}):
        message = client.messages.create(model=MODEL, max_tokens=50, messages=[QUESTION, last],
                                         thinking={"type": "disabled"})
        assert message.content[0].text == "A fresh turn."


def _deep(depth: int) -> str:
    return '{"x": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [200, 2000])
def test_tool_call_arguments_nested_too_deep_are_a_400_naming_them(scripted, depth):
    base = scripted[0].base_url
    chat = httpx.post(base + "/v1/chat/completions", timeout=30, content=json.dumps({"max_tokens": 5, "messages": [
        QUESTION, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "multiply", "arguments": _deep(depth)}}]},
        {"role": "tool", "tool_call_id": "c", "content": "42"}]}))
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    assert "nested" in chat.json()["error"]["message"]
    responses = httpx.post(base + "/v1/responses", timeout=30, content=json.dumps({"max_output_tokens": 5, "input": [
        QUESTION, {"type": "function_call", "call_id": "c", "name": "multiply", "arguments": _deep(depth)},
        {"type": "function_call_output", "call_id": "c", "output": "42"}]}))
    assert responses.status_code == 400, responses.text
    assert responses.json()["error"]["param"] == "input[1].arguments"


def test_a_tool_in_the_other_openai_shape_is_named_as_such(scripted):
    """Chat Completions nests a function tool under "function", the Responses API does not: a tool in the other
    route's shape was "only function tools are supported" (chat) or "every tool needs a non-empty name" (responses)."""
    base, schema = scripted[0].base_url, {"type": "object", "properties": {}}
    chat = httpx.post(base + "/v1/chat/completions", timeout=30, json={"messages": [QUESTION], "tools": [
        {"type": "function", "name": "multiply", "parameters": schema}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "tools[0]"
    assert chat.json()["error"]["code"] == "invalid_value" and '"function": {"name"' in chat.json()["error"]["message"]
    responses = httpx.post(base + "/v1/responses", timeout=30, json={"input": "hi", "tools": [
        {"type": "function", "function": {"name": "multiply", "parameters": schema}}]})
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "tools[0]"
    assert "not nested" in responses.json()["error"]["message"]


def test_an_assistant_message_without_content_or_calls_is_explained(scripted):
    r = httpx.post(scripted[0].base_url + "/v1/chat/completions", timeout=30, json={"messages": [
        QUESTION, {"role": "assistant", "content": None, "tool_calls": []}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "an assistant message needs content (or tool_calls)"
