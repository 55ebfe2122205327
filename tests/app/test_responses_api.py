"""POST /v1/responses with the official `openai` client against the real server (scripted fake model
from test_tool_calls: thinks, calls multiply, answers 42)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.app.conftest import MODEL
from tests.app.scripted import scripted_fixture
from tests.app.test_tool_calls import script

TOOLS = [
    {"type": "function", "name": "multiply", "description": "Multiply two integers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
    {"type": "function", "name": "noop", "parameters": {"type": "object", "properties": {}}},
]


scripted = scripted_fixture(script)


@pytest.fixture(scope="module")
def client(scripted):
    return openai.OpenAI(base_url=scripted[0].base_url + "/v1", api_key="unused", max_retries=0)


def create(client, stream: bool, **kw):
    kw = {"model": MODEL, "input": "What is 6 × 7?", **kw}
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    final = events[-1].response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if final.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(final.output)
    # the deltas add up to the final items
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == "".join(o.arguments for o in final.output if o.type == "function_call")
    if final.status == "completed":  # the SDK's own accumulator agrees (it only knows response.completed)
        with client.responses.stream(**kw) as s:
            accumulated = s.get_final_response()
        assert [o.type for o in accumulated.output] == [o.type for o in final.output]
        assert accumulated.output_text == final.output_text
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_full_tool_round_trip(client, scripted, stream):
    first = create(client, stream, instructions="Be brief.", tools=TOOLS)
    assert first.status == "completed" and [o.type for o in first.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = first.output
    assert reasoning.content[0].text == "I should multiply." and first.output_text == "Let me compute."
    assert call.name == "multiply" and json.loads(call.arguments) == {"a": 6, "b": 7}
    assert first.usage.input_tokens > 0 and first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    follow_up = [{"role": "user", "content": "What is 6 × 7?"},
                 *[o.model_dump(exclude_none=True) for o in first.output],
                 {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
    second = create(client, stream, instructions="Be brief.", tools=TOOLS, input=follow_up)
    assert second.output_text == "6 × 7 = 42." and [o.type for o in second.output] == ["reasoning", "message"]
    prompt = scripted[1].prompts[second.id]
    assert prompt.startswith("<|im_start|>system\nBe brief.") and "<think>\nI should multiply.\n</think>" in prompt
    assert "<parameter=b>\n7\n</parameter>" in prompt and "<tool_response>\n42\n</tool_response>" in prompt


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_variants(client, stream):
    named = create(client, stream, tools=TOOLS, tool_choice={"type": "function", "name": "noop"})
    assert [(o.type, o.name, o.arguments) for o in named.output] == [("function_call", "noop", "{}")]
    required = create(client, stream, tools=TOOLS, tool_choice="required")
    assert [o.name for o in required.output] == ["multiply"]
    none = create(client, stream, tools=TOOLS, tool_choice="none")
    assert none.output_text == "No tools, so: 42." and all(o.type != "function_call" for o in none.output)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_effort_none_turns_thinking_off_and_max_output_tokens_is_incomplete(client, stream):
    plain = create(client, stream, reasoning={"effort": "none"})
    assert [o.type for o in plain.output] == ["message"] and plain.output_text == "No tools, so: 42."
    short = create(client, stream, reasoning={"effort": "none"}, max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.output_text == "No " and short.usage.output_tokens == 3


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        # a format that is not an object answered 500 (AttributeError: 'str' object has no attribute 'get')
        ({"text": {"format": "json_object"}}, "text.format"),
        ({"text": {"format": ["text"]}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        # malformed input items: the first two and the reasoning one answered 500
        ({"input": [{"type": "message", "role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]},
                    {"role": "user", "content": "hi"}]}, "input[0].content[0].text"),
        ({"input": [{"type": "function_call_output", "output": "42"}]}, "input[0]"),  # once named `max_tokens`, which this API has not
        # a call id that is no string was taken (200) and reached the chat template as a number
        ({"input": [{"type": "function_call_output", "call_id": 7, "output": "42"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": ["c"], "name": "multiply", "arguments": "{}"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": 3, "arguments": "{}"}]}, "input[0]"),
        # Chat Completions' fields the server declares (shared sampling body) were silently dropped here
        ({"extra_body": {"max_tokens": 5}}, "max_tokens"),
        ({"extra_body": {"max_completion_tokens": 5}}, "max_completion_tokens"),
        ({"extra_body": {"presence_penalty": 1.0}}, "presence_penalty"),
        ({"extra_body": {"frequency_penalty": 1.0}}, "frequency_penalty"),
        ({"extra_body": {"logit_bias": {"1": 2.0}}}, "logit_bias"),
        # silently dropped: a stored prompt the answer was then given without, logprobs the client asked for,
        # a cap on tool calls the answer could exceed
        ({"prompt": {"id": "pmpt_123", "variables": {"x": "y"}}}, "prompt"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"max_tool_calls": 1, "tools": TOOLS}, "max_tool_calls"),
    ],
)
def test_refusals_name_the_parameter(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{"model": MODEL, "input": "hi", **kwargs})
    assert info.value.body["param"] == param
