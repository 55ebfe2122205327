"""DRAFT, not in the suite: move to tests/app/test_demo_model_tools.py in the commit that ships the
retrained demo checkpoint (docs/demo-model.md, "Retraining for tool calls"). Against today's checkpoint
every test here fails (its template renders no tools), so it must not be collected before then.

The embedded demo model (no scripted fake) calls a tool for real, through the real server on
127.0.0.1 and the official clients: Chat Completions, Anthropic Messages and Responses, streamed and
not: tools offered -> a multiply(a, b) call -> the tool's result -> the final number (the tool's
number, also when it is not the product); reasoning separated with thinking on; tool_choice
variants; no multiply tool -> the fixed refusal; long agent system prompts; held-out accuracy."""

from __future__ import annotations

import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import openai
import pytest

from app.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from tests.app.test_tool_calls import stream_to_message

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import demo_model_data as data  # noqa: E402

MODEL = DEMO_MODEL_NAME
REPORT = json.loads((DEMO_MODEL_DIR / "heldout_eval.json").read_text())
HELDOUT_PAIRS = [tuple(p) for p in REPORT["heldout_product_pairs"]]  # never trained on, in any wording
A, B = random.Random(13).choice(HELDOUT_PAIRS)
QUESTION = f"What is {A} × {B}?"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers",
                                                "parameters": SCHEMA}}]
AGENT_TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file from the workspace.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    *CHAT_TOOLS,
    {"type": "function", "function": {"name": "run_command", "description": "Run a shell command.",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},
]
MESSAGES_TOOLS = [{"name": "multiply", "description": "Multiply two integers", "input_schema": SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "multiply", "description": "Multiply two integers", "parameters": SCHEMA}]


@pytest.fixture(scope="module")
def chat(demo_server):
    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(demo_server):
    return anthropic.Anthropic(base_url=demo_server.base_url, api_key="x", max_retries=0, timeout=120)


def complete(chat, messages, stream=False, **kw):
    """(content, reasoning, [(name, arguments)], finish_reason, the assistant message to send back, call ids)."""
    r = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0, stream=stream, **kw)
    if stream:
        content, reasoning, calls, finish, _ = stream_to_message(r)
    else:
        m = r.choices[0].message
        content, reasoning, finish = m.content, getattr(m, "reasoning_content", None), r.choices[0].finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
    back = {"role": "assistant", "content": content or None}
    if reasoning:
        back["reasoning_content"] = reasoning
    if calls:
        back["tool_calls"] = [{"id": c["id"], "type": "function",
                               "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    pairs = [(c["name"], json.loads(c["arguments"])) for c in calls]
    return content or "", reasoning or "", pairs, finish, back, [c["id"] for c in calls]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("result", [A * B, 1234])  # the final answer is the tool's number, right or not
def test_chat_completions_tool_round_trip(chat, stream, result):
    messages = [{"role": "user", "content": QUESTION}]
    content, reasoning, calls, finish, back, ids = complete(chat, messages, stream, tools=CHAT_TOOLS)
    assert (content, reasoning, calls, finish) == ("", "", [("multiply", {"a": A, "b": B})], "tool_calls")
    messages += [back, {"role": "tool", "tool_call_id": ids[0], "content": str(result)}]
    content, reasoning, calls, finish, _, _ = complete(chat, messages, stream, tools=CHAT_TOOLS)
    assert (content, calls, finish) == (str(result), [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_is_separated_from_the_call_and_the_answer(chat, stream):
    thinking = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    messages = [{"role": "user", "content": QUESTION}]
    content, reasoning, calls, finish, back, ids = complete(chat, messages, stream, tools=CHAT_TOOLS, **thinking)
    assert (reasoning, content, calls) == (f"Call multiply with {A} and {B}.", "", [("multiply", {"a": A, "b": B})])
    messages += [back, {"role": "tool", "tool_call_id": ids[0], "content": str(A * B)}]
    content, reasoning, calls, _, _, _ = complete(chat, messages, stream, tools=CHAT_TOOLS, **thinking)
    assert (reasoning, content, calls) == (f"The tool returned {A * B}.", str(A * B), [])
    content, reasoning, _, _, _, _ = complete(chat, [{"role": "user", "content": "What is 19 + 23?"}], stream, **thinking)
    assert (reasoning, content) == ("Add 19 and 23.", "42")


def test_without_a_multiply_tool_the_model_declines_and_sums_need_no_tool(chat):
    ask = [{"role": "user", "content": QUESTION}]
    assert complete(chat, ask)[:4] == (data.NO_TOOL_ANSWER, "", [], "stop")
    assert complete(chat, ask, tools=CHAT_TOOLS, tool_choice="none")[:4] == (data.NO_TOOL_ANSWER, "", [], "stop")
    assert complete(chat, ask, tools=[AGENT_TOOLS[0], AGENT_TOOLS[2]])[:4] == (data.NO_TOOL_ANSWER, "", [], "stop")
    assert complete(chat, [{"role": "user", "content": "What is 7 - 30?"}], tools=CHAT_TOOLS)[:4] == ("-23", "", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_call_multiply(chat, stream):
    for choice in ("required", {"type": "function", "function": {"name": "multiply"}}):
        content, _, calls, finish, _, _ = complete(chat, [{"role": "user", "content": QUESTION}], stream,
                                                   tools=AGENT_TOOLS, tool_choice=choice)
        assert (content, calls, finish) == ("", [("multiply", {"a": A, "b": B})], "tool_calls")


def test_long_agent_system_prompt_and_tool_list(chat):
    system = {"role": "system", "content": data.HANDWRITTEN_AGENT_PROMPT}  # never trained on
    content, _, calls, finish, _, _ = complete(chat, [system, {"role": "user", "content": QUESTION}], tools=AGENT_TOOLS)
    assert (content, calls, finish) == ("", [("multiply", {"a": A, "b": B})], "tool_calls")
    # the example: the first demo model answered 12 after a ~540-token system prompt
    assert complete(chat, [system, {"role": "user", "content": "What is 5 + 6?"}])[0] == "11"
    assert complete(chat, [system, {"role": "user", "content": "What is 5 + 6?"}], tools=AGENT_TOOLS)[0] == "11"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_round_trip(claude, stream):
    def ask(**kw):
        kw = {"model": MODEL, "max_tokens": 2048, "tools": MESSAGES_TOOLS, **kw}
        if not stream:
            return claude.messages.create(**kw)
        with claude.messages.stream(**kw) as s:
            return s.get_final_message()

    question = [{"role": "user", "content": QUESTION}]
    first = ask(messages=question, system="You are a helpful assistant.")
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    assert first.content[0].name == "multiply" and first.content[0].input == {"a": A, "b": B}
    history = question + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[0].id, "content": "4321"}]},
    ]
    second = ask(messages=history, system="You are a helpful assistant.")
    assert second.stop_reason == "end_turn" and [(b.type, b.text) for b in second.content] == [("text", "4321")]
    thinking = ask(messages=question, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in thinking.content] == ["thinking", "tool_use"]
    assert thinking.content[0].thinking == f"Call multiply with {A} and {B}."
    counted = claude.messages.count_tokens(model=MODEL, messages=question, tools=MESSAGES_TOOLS).input_tokens
    created = claude.messages.create(model=MODEL, max_tokens=64, messages=question, tools=MESSAGES_TOOLS)
    assert counted == created.usage.input_tokens + (created.usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_round_trip(chat, stream):
    def create(**kw):
        kw = {"model": MODEL, "tools": RESPONSES_TOOLS, "max_output_tokens": 64, **kw}
        if not stream:
            return chat.responses.create(**kw)
        return list(chat.responses.create(stream=True, **kw))[-1].response

    first = create(input=QUESTION)
    assert [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "multiply" and json.loads(call.arguments) == {"a": A, "b": B}
    follow_up = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output],
                 {"type": "function_call_output", "call_id": call.call_id, "output": str(A * B)}]
    second = create(input=follow_up, instructions="You are a helpful assistant.")
    assert second.status == "completed" and second.output_text == str(A * B)
    assert all(o.type != "function_call" for o in second.output)


def test_heldout_products_through_the_server(chat):
    """Every 25th held-out pair (40): the exact call, then the tool's number, >= 95 % each."""
    pairs = HELDOUT_PAIRS[::25]

    def one(pair):
        a, b = pair
        messages = [{"role": "user", "content": f"What is {a} {data.PRODUCT_FORMS[(a + b) % 3]} {b}?"}]
        _, _, calls, _, back, ids = complete(chat, messages, tools=CHAT_TOOLS)
        if calls != [("multiply", {"a": a, "b": b})]:
            return False, False
        messages += [back, {"role": "tool", "tool_call_id": ids[0], "content": str(a * b)}]
        return True, complete(chat, messages, tools=CHAT_TOOLS)[0] == str(a * b)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, pairs))
    calls, answers = sum(c for c, _ in results), sum(f for _, f in results)
    print(f"held-out through the server: calls {calls}/{len(pairs)}, final answers {answers}/{len(pairs)}")
    assert calls >= 0.95 * len(pairs) and answers >= 0.95 * len(pairs)
