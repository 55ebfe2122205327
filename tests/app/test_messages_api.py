"""POST /v1/messages and /v1/messages/count_tokens with the official `anthropic` client against the
real server (scripted fake model from test_tool_calls: thinks, calls multiply, answers 42)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.app.conftest import MODEL, start_server
from tests.app.scripted import TemplateTokenizer, scripted_fixture
from tests.app.test_tool_calls import script

TOOLS = [{"name": "multiply", "description": "Multiply two integers",
          "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
         {"name": "noop", "input_schema": {"type": "object", "properties": {}}}]
QUESTION = [{"role": "user", "content": "What is 6 × 7?"}]


scripted = scripted_fixture(script, api_key="k3y")


@pytest.fixture(scope="module")
def client(scripted):
    return anthropic.Anthropic(base_url=scripted[0].base_url, api_key="k3y", max_retries=0)


def ask(client, stream: bool, **kw):
    kw = {"model": MODEL, "max_tokens": 200, "messages": QUESTION, **kw}
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        events = [e.type for e in s]
        message = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    return message


@pytest.mark.parametrize("stream", [False, True])
def test_full_tool_round_trip(client, scripted, stream):
    first = ask(client, stream, system=[{"type": "text", "text": "Be brief."}], tools=TOOLS)
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = first.content
    assert thinking.thinking == "I should multiply." and text.text == "Let me compute."
    assert call.name == "multiply" and call.input == {"a": 6, "b": 7} and call.id.startswith("toolu_")
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    history = QUESTION + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}]},
    ]
    second = ask(client, stream, system="Be brief.", tools=TOOLS, messages=history)
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["thinking", "text"] and second.content[1].text == "6 × 7 = 42."
    prompt = scripted[1].prompts[second.id]
    assert prompt.startswith("<|im_start|>system\nBe brief.") and "<think>\nI should multiply.\n</think>" in prompt
    assert "<parameter=a>\n6\n</parameter>" in prompt and "<tool_response>\n42\n</tool_response>" in prompt


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_tool_and_none(client, stream):
    forced = ask(client, stream, tools=TOOLS, tool_choice={"type": "tool", "name": "noop"})
    assert forced.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in forced.content] == [("tool_use", "noop", {})]
    anyone = ask(client, stream, tools=TOOLS, tool_choice={"type": "any"})
    assert [(b.name, b.input) for b in anyone.content] == [("multiply", {"a": 6, "b": 7})]
    none = ask(client, stream, tools=TOOLS, tool_choice={"type": "none"})
    assert none.stop_reason == "end_turn" and none.content[-1].text == "No tools, so: 42."


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_disabled_and_stop_sequences_and_max_tokens(client, stream):
    plain = ask(client, stream, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == "No tools, so: 42."
    stopped = ask(client, stream, thinking={"type": "disabled"}, stop_sequences=["so:", "tools"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "tools"
    assert stopped.content[0].text == "No "
    short = ask(client, stream, thinking={"type": "disabled"}, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3 and short.content[0].text == "No "


def test_count_tokens_equals_the_prompt_the_server_uses(client, scripted):
    kw = {"system": "Be brief.", "tools": TOOLS, "messages": QUESTION}
    counted = client.messages.count_tokens(model=MODEL, **kw).input_tokens
    created = client.messages.create(model=MODEL, max_tokens=50, **kw)
    # NOTE: Anthropic counts prefix-cache reads apart from input_tokens; together they are the prompt
    prompt = created.usage.input_tokens + created.usage.cache_read_input_tokens
    assert counted == prompt == len(TemplateTokenizer().encode(scripted[1].prompts[created.id]))


def test_errors_are_in_anthropic_shape(client, scripted):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="other", max_tokens=10, messages=QUESTION)
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="web_search"):
        client.messages.create(model=MODEL, max_tokens=10, messages=QUESTION,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    raw = httpx.post(scripted[0].base_url + "/v1/messages", headers={"x-api-key": "k3y"},
                     json={"model": MODEL, "messages": QUESTION})
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("max_tokens")
    # a wrong type and a missing field: Anthropic's 400 invalid_request_error (the anthropic client's BadRequestError),
    # not the 422 the OpenAI routes answer
    for body in ({"model": MODEL, "max_tokens": "x", "messages": QUESTION}, {"model": MODEL, "max_tokens": 5}):
        raw = httpx.post(scripted[0].base_url + "/v1/messages", headers={"x-api-key": "k3y"}, json=body)
        assert raw.status_code == 400, raw.text
        assert raw.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text: a text block needs"),
    ({"system": [{"type": "text", "text": 5}]}, "system[0].text: a text block needs"),
    # these three answered 500 (a TypeError joining the texts)
    ({"messages": QUESTION + [{"role": "assistant", "content": [{"type": "text", "text": 5}]}]},
     "messages[1].content[0].text: a text block needs"),
    ({"messages": QUESTION + [{"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}]},
     "messages[1].content[0].thinking: a thinking block needs"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
     "messages[0].content[0].content: content must be a string or a list of text blocks"),
    ({"messages": QUESTION + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": ["f"],
                                                                  "input": {}}]}]},
     "messages[1].content[0]: tool_use needs a name and an object input"),
    ({"tool_choice": {"type": "any"}}, "tool_choice 'any' needs tools"),
    ({"tools": [{"name": "multiply"}]}, "tools[0].input_schema: a client tool needs an input_schema"),
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice.name: tool_choice 'tool' needs the name"),
    # a type that is not a string answered 500 (TypeError: unhashable type, looking it up)
    ({"tool_choice": {"type": ["auto"]}}, "tool_choice.type: tool_choice type must be auto, any, tool or none"),
    ({"tool_choice": {"type": {"tool": "multiply"}}, "tools": TOOLS}, "tool_choice.type: tool_choice type must be"),
    # named Chat Completions' `stop`, a field this route refuses
    ({"stop_sequences": [str(i) for i in range(17)]}, "stop_sequences: at most 16 stop strings"),
    ({"stop_sequences": [""]}, "stop_sequences: stop strings must be non-empty"),
])
def test_bad_blocks_and_tool_choices_are_explained_in_anthropic_terms(scripted, body, message):
    """These once said "content block type 'text' is not supported (text and tool_result are)", "only text
    blocks are supported here", "tool_choice 'required' needs tools" (the OpenAI spelling), "names None", "tool
    type None is not supported"."""
    raw = httpx.post(scripted[0].base_url + "/v1/messages", headers={"x-api-key": "k3y"},
                     json={"model": MODEL, "max_tokens": 20, "messages": QUESTION, **body})
    assert raw.status_code == 400, raw.text
    error = raw.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(message), error


@pytest.mark.parametrize("kind", [["auto"], {"type": "auto"}, 5])
def test_count_tokens_explains_a_tool_choice_type_that_is_not_a_string(scripted, kind):
    """Answered 500 (TypeError: unhashable type) for a list or an object, like /v1/messages."""
    raw = httpx.post(scripted[0].base_url + "/v1/messages/count_tokens", headers={"x-api-key": "k3y"},
                     json={"model": MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": kind}})
    assert raw.status_code == 400, raw.text
    error = raw.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("tool_choice.type: "), error


@pytest.mark.parametrize("field", [{"stop": ["4"]}, {"n": 2}, {"max_completion_tokens": 5}, {"presence_penalty": 1.0},
                                   {"frequency_penalty": 1.0}, {"logit_bias": {"1": 2.0}},
                                   {"stream_options": {"include_usage": True}}])
def test_chat_completions_fields_are_refused_by_name_not_dropped(scripted, field):
    """The shared sampling body declares them; sent to /v1/messages they were silently ignored (a `stop`
    meant as stop_sequences never stopped anything)."""
    raw = httpx.post(scripted[0].base_url + "/v1/messages", headers={"x-api-key": "k3y"},
                     json={"model": MODEL, "max_tokens": 20, "messages": QUESTION, **field})
    assert raw.status_code == 400, raw.text
    error = raw.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(next(iter(field)))


def test_a_wrong_method_on_the_messages_routes_is_in_anthropic_shape(scripted):
    """The router refuses a wrong method before the routes' own handlers run: it was OpenAI's shape."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.get(scripted[0].base_url + path, headers={"x-api-key": "k3y"})
        assert r.status_code == 405 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    other = httpx.get(scripted[0].base_url + "/v1/chat/completions", headers={"x-api-key": "k3y"})
    assert other.status_code == 405 and other.json()["error"]["code"] == "method_not_allowed"


def test_x_api_key_is_checked_like_the_bearer_key(scripted):
    bad = anthropic.Anthropic(base_url=scripted[0].base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=MODEL, max_tokens=10, messages=QUESTION)
    assert info.value.body["error"]["type"] == "authentication_error"
    ok = httpx.post(scripted[0].base_url + "/v1/messages/count_tokens", headers={"x-api-key": "k3y"},
                    json={"model": MODEL, "messages": QUESTION})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0


def test_a_model_without_a_chat_template_answers_messages_with_a_clear_error():
    from dependency_injector import providers

    from domain.fakes import FakeTokenizer
    from domain.ports import ChatTemplateError
    from tests.app.conftest import make_container

    class NoTemplate(FakeTokenizer):
        def apply_chat_template(self, messages, **kw):
            raise ChatTemplateError("model: this model has no chat template; use /v1/completions", missing=True)

    container = make_container()
    container.tokenizer.override(providers.Singleton(NoTemplate))
    server = start_server(container)
    try:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="no chat template"):
            client.messages.create(model=MODEL, max_tokens=10, messages=QUESTION)
    finally:
        server.stop()
