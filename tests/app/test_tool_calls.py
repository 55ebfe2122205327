"""Tool calls and reasoning in Chat Completions, with the official `openai` client against the real
server (a scripted fake model that calls `multiply`, then answers with the tool's result)."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest

from tests.app.conftest import MODEL
from tests.app.scripted import scripted_fixture

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]},
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
CALL = "<tool_call>\n<function=multiply>\n<parameter=a>\n6\n</parameter>\n<parameter=b>\n7\n</parameter>\n</function>\n</tool_call>"


def script(prompt: str) -> str:
    """The fake model: think, then call multiply; with a tool result in the prompt, answer it."""
    thinking = "" if prompt.endswith("</think>\n\n") else "I should multiply.\n</think>\n\n"
    if prompt.endswith("<function=noop>\n"):  # forced by a named tool_choice
        return "</function>\n</tool_call>"
    if prompt.endswith("<tool_call>\n"):  # forced by tool_choice "required"
        return CALL[len("<tool_call>\n"):]
    if "<tool_response>\n42\n</tool_response>" in prompt:
        return thinking + "6 × 7 = 42."
    if "# Tools" in prompt:
        return thinking + "Let me compute.\n" + CALL
    return thinking + "No tools, so: 42."


scripted = scripted_fixture(script)


@pytest.fixture(scope="module")
def client(scripted):
    return openai.OpenAI(base_url=scripted[0].base_url + "/v1", api_key="unused", max_retries=0)


QUESTION = [{"role": "user", "content": "What is 6 × 7?"}]


def stream_to_message(stream):
    """Reassemble a streamed chat completion; returns (content, reasoning, calls, finish_reason, chunks)."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, []
    for chunk in stream:
        chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id:
                assert call.index not in calls and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, chunks


@pytest.mark.parametrize("stream", [False, True])
def test_full_tool_round_trip(client, scripted, stream):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, stream=stream)
    if stream:
        content, reasoning, calls, finish, chunks = stream_to_message(first)
        assert sum(1 for c in chunks for ch in c.choices if ch.delta.tool_calls) >= 3  # name, then fragments
    else:
        message = first.choices[0].message
        content, reasoning, finish = message.content, message.reasoning_content, first.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert finish == "tool_calls"
    assert content == "Let me compute." and reasoning == "I should multiply."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("multiply", {"a": 6, "b": 7})]
    assert "<tool_call>" not in content and "<think>" not in reasoning
    history = QUESTION + [
        {"role": "assistant", "content": content,
         "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in calls]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "42"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert second.choices[0].message.content == "6 × 7 = 42." and second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None
    # the tool call went back into the prompt as the template renders it, arguments as an object
    prompt = scripted[1].prompts[second.id]
    assert "<function=multiply>\n<parameter=a>\n6\n</parameter>" in prompt and "<tool_response>\n42\n" in prompt


def test_tool_choice_none_leaves_tools_out_and_parses_nothing(client, scripted):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == "No tools, so: 42." and r.choices[0].finish_reason == "stop"
    assert "# Tools" not in scripted[1].prompts[r.id]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_force_a_call(client, scripted, stream):
    for choice, expected in (("required", ("multiply", {"a": 6, "b": 7})),
                             ({"type": "function", "function": {"name": "noop"}}, ("noop", {}))):
        r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice, stream=stream)
        if stream:
            content, _, calls, finish, _ = stream_to_message(r)
        else:
            m = r.choices[0].message
            content, finish = m.content, r.choices[0].finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
        assert finish == "tool_calls" and not content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [expected]


def test_thinking_off_through_chat_template_kwargs(client, scripted):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "No tools, so: 42."
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert scripted[1].prompts[r.id].endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        # a schema whose properties are not an object once reached the parser and answered 500
        ({"tools": [{"type": "function", "function": {"name": "multiply", "parameters": {
            "type": "object", "properties": ["a", "b"]}}}], "tool_choice": "auto"}, "tools[0]"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_parameter(client, kwargs, param):
    kwargs = {"tools": TOOLS, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)
    assert info.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("name", "arg"), [("a<b>c", "a"), ("line\nbreak", "a"), ("multiply", "x>y")])
def test_a_tool_name_the_call_markup_cannot_carry_is_a_400(client, stream, name, arg):
    """`<function=NAME>` / `<parameter=KEY>` cannot carry `<`, `>` or a newline: a named tool_choice for "a<b>c"
    answered 200 with the forced markup in `content` and no call, and a model's call could never be read back."""
    tools = [TOOLS[1], {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {arg: {"type": "integer"}}}}}]
    for choice in ("auto", {"type": "function", "function": {"name": name}}):
        with pytest.raises(openai.BadRequestError) as info:
            r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, tool_choice=choice,
                                               stream=stream)
            list(r) if stream else None
        assert info.value.body["param"] == "tools[1]" and info.value.body["code"] == "invalid_value"


@pytest.mark.parametrize("stream", [False, True])
def test_a_boolean_property_schema_leaves_that_argument_untyped(client, stream):
    """JSON Schema allows `true` as a subschema (anything goes): the parser once called .get on it (500, or a
    stream cut off mid-call)."""
    tools = [{"type": "function", "function": {"name": "multiply", "parameters": {
        "type": "object", "properties": {"a": True, "b": {"type": "integer"}}}}}]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, stream=stream)
    if stream:
        _, _, calls, finish, _ = stream_to_message(r)
    else:
        finish = r.choices[0].finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in r.choices[0].message.tool_calls]
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("multiply", {"a": "6", "b": 7})]


def test_required_without_tools_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, tool_choice="required")


def test_a_template_without_tools_refuses_them_by_name(server):
    """The plain ChatML fake template can not show tools to the model: a 400, never silently dropped."""
    plain = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
    assert info.value.body["param"] == "messages" and "renders no tools" in info.value.body["message"]


@pytest.mark.parametrize("how", [{"add_generation_prompt": False},
                                 {"chat_template_kwargs": {"add_generation_prompt": False}},
                                 {"add_generation_prompt": True, "chat_template_kwargs": {"add_generation_prompt": False}}])
def test_add_generation_prompt_false_ends_the_prompt_after_the_last_message(client, scripted, how):
    """It was declared in the docs but dropped (the prompt had the assistant header anyway), and through
    chat_template_kwargs it was a 400 quoting a Python signature error."""
    usual = client.chat.completions.create(model=MODEL, messages=QUESTION)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=how)
    prompts = scripted[1].prompts
    assert prompts[usual.id].endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert prompts[r.id] + "<|im_start|>assistant\n<think>\n" == prompts[usual.id]
    assert r.usage.prompt_tokens < usual.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_continue_final_message_continues_the_last_message(client, scripted, stream):
    messages = QUESTION + [{"role": "assistant", "content": "The answer is "}]
    r = client.chat.completions.create(model=MODEL, messages=messages, stream=stream,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    request_id = list(r)[0].id if stream else r.id  # NOTE: read to the end: the prompt is seen at the first step
    assert scripted[1].prompts[request_id].endswith("<|im_start|>assistant\nThe answer is ")


@pytest.mark.parametrize(
    ("extra", "param", "said"),
    [
        ({"chat_template_kwargs": {"tools": 5}}, "chat_template_kwargs", "'tools'"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
        ({"chat_template_kwargs": {"documents": []}}, "chat_template_kwargs", "'documents'"),
        ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs", "'self'"),
        ({"chat_template_kwargs": {"add_generation_prompt": "no"}}, "chat_template_kwargs", "add_generation_prompt"),
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"tool_choice": "required", "tools": TOOLS, "add_generation_prompt": False}, "tool_choice",
         "add_generation_prompt"),
    ],
)
def test_template_arguments_the_server_sets_are_400s_naming_them(client, scripted, extra, param, said):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=extra)
    body = info.value.body
    assert (body["param"], body["code"]) == (param, "invalid_value") and said in body["message"]
    assert "multiple values" not in body["message"] and "apply_chat_template" not in body["message"]
    if "chat_template_kwargs" in extra:  # the Responses route checks them the same way
        r = httpx.post(scripted[0].base_url + "/v1/responses",
                       json={"model": MODEL, "input": "hi", "chat_template_kwargs": extra["chat_template_kwargs"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_call_to_a_function_not_offered_is_content_not_a_call(client, scripted, stream, choice):
    """Offered only `noop`, the model calls `multiply`: that answered tool_calls=[multiply], finish_reason
    tool_calls. Now the markup stays text (as malformed markup does), finish_reason stop, no call delta."""
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[TOOLS[1]], tool_choice=choice,
                                       stream=stream)
    if stream:
        content, _, calls, finish, chunks = stream_to_message(r)
        assert not any(ch.delta.tool_calls for c in chunks for ch in c.choices)
    else:
        content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls or [], \
            r.choices[0].finish_reason
    assert (calls, finish) == ([], "stop")
    assert content == ("Let me compute.\n" + CALL if choice == "auto" else CALL)
    # the same through the other two dialects, which share the parser
    claude = anthropic.Anthropic(base_url=scripted[0].base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=300, messages=QUESTION, tool_choice={
        "type": "auto" if choice == "auto" else "any"}, tools=[{"name": "noop", "input_schema": {"type": "object"}}])
    assert message.stop_reason == "end_turn" and [b.type for b in message.content] == ["thinking", "text"][
        -len(message.content):]
    assert message.content[-1].text.endswith(CALL)
    response = client.responses.create(model=MODEL, input="What is 6 × 7?", tool_choice=choice, tools=[
        {"type": "function", "name": "noop", "parameters": {"type": "object", "properties": {}}}])
    assert all(o.type != "function_call" for o in response.output) and response.output_text.endswith(CALL)


def finished_by_reason(server) -> dict[str, float]:
    """ft_requests_total's samples by finish_reason."""
    text = httpx.get(server.base_url + "/metrics").text
    found = re.findall(r'^ft_requests_total\{finish_reason="([^"]+)"\} (\S+)$', text, re.M)
    return {reason: float(value) for reason, value in found}


def test_metrics_count_a_tool_call_under_tool_calls_not_stop(client, scripted):
    """/metrics counted a request that ended in tool calls under ft_requests_total{finish_reason="stop"}: the
    engine thread counts a finish before the handler's parser reads the text. Every dialect's tool call now counts
    under "tool_calls" (Messages says tool_use, Responses a function call: the same finish), an answer without one
    under "stop", each request once."""
    server = scripted[0]
    before = finished_by_reason(server)
    client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
    stream_to_message(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, stream=True))
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    multiply = [{"name": "multiply", "input_schema": TOOLS[0]["function"]["parameters"]}]
    assert claude.messages.create(model=MODEL, max_tokens=300, messages=QUESTION, tools=multiply).stop_reason == "tool_use"
    with claude.messages.stream(model=MODEL, max_tokens=300, messages=QUESTION, tools=multiply) as s:
        assert s.get_final_message().stop_reason == "tool_use"
    responses_tools = [{"type": "function", **TOOLS[0]["function"]}]
    response = client.responses.create(model=MODEL, input="What is 6 × 7?", tools=responses_tools)
    assert any(o.type == "function_call" for o in response.output)
    with client.responses.stream(model=MODEL, input="What is 6 × 7?", tools=responses_tools) as s:
        assert any(o.type == "function_call" for o in s.get_final_response().output)
    # tools offered, no call made; and no tools at all: "stop" both
    answered = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[TOOLS[1]], tool_choice="none")
    assert answered.choices[0].finish_reason == "stop"
    assert client.chat.completions.create(model=MODEL, messages=QUESTION).choices[0].finish_reason == "stop"
    after = finished_by_reason(server)
    assert after.get("tool_calls", 0) - before.get("tool_calls", 0) == 6, (before, after)
    assert after.get("stop", 0) - before.get("stop", 0) == 2, (before, after)


def test_a_finish_left_to_the_handler_is_counted_once_settled_or_not():
    """The fallback of the count above: a last event its handler never settles (the client left first, the
    formatting failed) counts under the engine's reason when dropped; a settled one is not counted again."""
    import gc

    from app.stats import ServingStats
    from app.streams import FinishTally, StreamEvent

    stats = ServingStats()

    def counts() -> dict:
        return {s.labels["finish_reason"]: s.value for m in stats.requests.collect() for s in m.samples
                if s.name.endswith("_total")}

    settled = StreamEvent("", (), (), "stop", 1, 1, tally=FinishTally(stats, "stop"))
    settled.settle("tool_calls")
    settled.settle("stop")  # once only
    del settled
    dropped = StreamEvent("", (), (), "stop", 1, 1, tally=FinishTally(stats, "stop"))
    del dropped
    gc.collect()
    assert counts() == {"tool_calls": 1.0, "stop": 1.0} and stats.finished_requests() == 2
    StreamEvent("", (), (), "length", 1, 1).settle("length")  # the engine counted it: nothing here
    assert stats.finished_requests() == 2
