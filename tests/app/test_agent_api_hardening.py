"""What an agent sends that the server got wrong: Anthropic's assistant prefill (a last assistant turn is the
start of the answer), tool-call arguments nested past what JSON decoding survives (a 500 before), tool results that
answer no call (served before), and the Messages API's own field rules (Anthropic's ranges and error shape)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
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


# -- tool-call ids: a result must answer a call the conversation made -------------------------------------------------

CALL = {"id": "call_a", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}


@pytest.fixture(scope="module")
def openai_client(scripted):
    return openai.OpenAI(base_url=scripted[0].base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("messages", "param", "said"), [
    # a result to an id no call had: rendered as a tool response to nothing and answered 200
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_zzz", "content": "42"}], "messages[2].tool_call_id",
     "tool_call_id 'call_zzz' answers no tool call: no earlier assistant message has a tool call with that id (the "
     "tool call ids so far: 'call_a')"),
    # a result with no assistant turn before it
    ([QUESTION, {"role": "tool", "tool_call_id": "call_a", "content": "42"}], "messages[1].tool_call_id",
     "(no assistant message before it has tool_calls)"),
    # the legacy `function` role is a tool message too
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "function", "name": "multiply", "tool_call_id": "call_b", "content": "42"}], "messages[2].tool_call_id",
     "tool_call_id 'call_b' answers no tool call"),
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": 7}]},
      {"role": "tool", "tool_call_id": "7", "content": "42"}], "messages[1].tool_calls[0].id",
     "a tool call id must be a string, got 7"),
])
def test_a_tool_message_answering_no_earlier_call_is_a_400_naming_it(openai_client, messages, param, said, stream):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, max_tokens=5, messages=messages, stream=stream)
    error = info.value.body
    assert (error["param"], error["code"], error["type"]) == (param, "invalid_value", "invalid_request_error"), error
    assert said in error["message"], error


def test_tool_results_answering_any_earlier_call_are_served(openai_client, scripted):
    """Two calls answered in turn, a result to the turn before the last, and a tool message without an id (vLLM
    serves it; nothing to check it against) all still render."""
    second = {**CALL, "id": "call_b"}
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL, second]},
                {"role": "tool", "tool_call_id": "call_b", "content": "42"},
                {"role": "tool", "tool_call_id": "call_a", "content": "42"},
                {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": "call_c"}]},
                {"role": "tool", "tool_call_id": "call_a", "content": "again 42"},
                {"role": "tool", "content": "no id"}]
    answer = openai_client.chat.completions.create(model=MODEL, max_tokens=5, messages=messages)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert scripted[1].prompts[answer.id].count("<tool_response>") == 4


def test_a_responses_function_call_output_answering_no_call_is_a_400(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model=MODEL, max_output_tokens=5, input=[
            QUESTION, {"type": "function_call", "call_id": "c1", "name": "multiply", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c2", "output": "42"}])
    assert info.value.body["param"] == "input[2].call_id" and "'c2'" in info.value.body["message"]


# -- Anthropic's Messages API: its fields' rules, in its error shape -------------------------------------------------

TOOL_USE = {"role": "assistant", "content": [{"type": "text", "text": "Computing."},
                                             {"type": "tool_use", "id": "toolu_a", "name": "multiply",
                                              "input": {"a": 6, "b": 7}}]}


def result(tool_use_id: str | None, content: str = "42") -> dict:
    block = {"type": "tool_result", "content": content}
    if tool_use_id is not None:
        block["tool_use_id"] = tool_use_id
    return {"role": "user", "content": [block]}


def assert_anthropic_400(info, starts: str) -> None:
    assert info.value.status_code == 400
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(starts), body


@pytest.mark.parametrize(("messages", "starts"), [
    ([QUESTION, TOOL_USE, result("toolu_zzz")],
     "messages[2].content[0].tool_use_id: unexpected tool_use_id 'toolu_zzz' in a tool_result block: each tool_result "
     "must answer a tool_use block of the previous assistant message (its tool_use ids are toolu_a)"),
    ([result("toolu_a"), QUESTION],
     "messages[0].content[0].tool_use_id: unexpected tool_use_id 'toolu_a'"),
    # Anthropic's rule: the assistant turn right before it, not any earlier one
    ([QUESTION, TOOL_USE, result("toolu_a"), {"role": "assistant", "content": "42."}, result("toolu_a")],
     "messages[4].content[0].tool_use_id: unexpected tool_use_id 'toolu_a'"),
    ([QUESTION, TOOL_USE, result(None)], "messages[2].content[0].tool_use_id: a tool_result block needs"),
    ([QUESTION, {"role": "assistant", "content": [{"type": "tool_use", "name": "multiply", "input": {}}]},
      result("toolu_a")], "messages[1].content[0].id: a tool_use block needs an `id` string"),
])
def test_a_tool_result_must_answer_a_tool_use_of_the_previous_assistant_turn(client, messages, starts):
    """These were served (200): a tool response to no call, rendered into the prompt."""
    for create in (client.messages.create, client.messages.count_tokens):
        kw = {"max_tokens": 20} if create == client.messages.create else {}
        with pytest.raises(anthropic.BadRequestError) as info:
            create(model=MODEL, messages=messages, **kw)
        assert_anthropic_400(info, starts)


def test_paired_tool_results_are_served(client, scripted):
    """Every result of the previous turn, one over two user messages (Anthropic joins consecutive ones)."""
    two = {"role": "assistant", "content": [*TOOL_USE["content"], {"type": "tool_use", "id": "toolu_b",
                                                                    "name": "multiply", "input": {}}]}
    message = client.messages.create(model=MODEL, max_tokens=20, messages=[
        QUESTION, two, result("toolu_b"), result("toolu_a", "also 42")], thinking={"type": "disabled"})
    assert message.stop_reason == "end_turn" and message.content[0].text == "A fresh turn."
    assert scripted[1].prompts[message.id].count("<tool_response>") == 2


@pytest.mark.parametrize(("kw", "starts"), [
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": -3}, "max_tokens must be >= 1, got -3"),
    # refused before the thinking budget is compared with it ("max_tokens (0) must be greater than ...")
    ({"max_tokens": 0, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "max_tokens must be >= 1, got 0"),
    # NOTE: through extra_body: this anthropic client's create() no longer takes the sampling fields
    ({"extra_body": {"temperature": 1.5}}, "temperature must be between 0 and 1, got 1.5"),  # (to 2 was served)
    ({"extra_body": {"temperature": -0.1}}, "temperature must be between 0 and 1, got -0.1"),
    ({"extra_body": {"top_p": 1.5}}, "top_p must be between 0 and 1, got 1.5"),
    ({"extra_body": {"top_k": -1}}, "top_k must be >= 0, got -1"),  # vLLM's "no cut" spelling was served
    ({"stop_sequences": "Done"}, "stop_sequences: invalid request: Expected `array | null`, got `str`"),
    ({"stop_sequences": ["Done", 5]}, "stop_sequences[1]: invalid request: Expected `str`, got `int`"),
    ({"messages": [{"role": "system", "content": "Be brief."}, QUESTION]},
     "messages[0].role: role must be 'user' or 'assistant', got 'system'"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     "messages[0].content[0]: content block type 'video' is not supported"),
    ({"messages": [QUESTION, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[1].content[0]: content block type 'tool_result' is not supported in assistant turns"),
    # vLLM's extensions the shared sampling body declares: answered as if they were absent before
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json is not supported"),
    ({"extra_body": {"min_p": 0.5}}, "min_p is not supported"),
])
def test_messages_fields_are_checked_as_anthropic_checks_them(client, kw, starts):
    kw = {"model": MODEL, "max_tokens": 20, "messages": [QUESTION], **kw}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**kw)
    assert_anthropic_400(info, starts)


def test_messages_range_edges_are_served(client):
    message = client.messages.create(model=MODEL, max_tokens=1, messages=[QUESTION], stop_sequences=["never"],
                                     thinking={"type": "disabled"},
                                     extra_body={"temperature": 1.0, "top_p": 1.0, "top_k": 0})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 1
