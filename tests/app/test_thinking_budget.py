"""Reasoning-token usage and thinking budgets on every route (Chat Completions, Anthropic Messages,
Responses), streamed and not, with the official `openai` and `anthropic` clients against the real
server. The scripted model thinks for a long time (one byte per token) unless it sees ``</think>`` in
its own sequence; then it answers. So an answer after a budget proves the forced close went through
the scheduler into the model's KV."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from app.reasoning import FORCED_CLOSE
from tests.app.conftest import MODEL
from tests.app.scripted import scripted_fixture, start_scripted_server

THOUGHT = ("Let me think about this carefully. " * 60)[:1500]  # 1500 reasoning tokens if not stopped
ANSWER = "The answer is 42."
NATURAL = THOUGHT + "\n</think>\n\n" + ANSWER
NATURAL_REASONING = len(THOUGHT) + 1  # the newline before </think> is generated inside the block
QUESTION = [{"role": "user", "content": "What is 6 × 7?"}]


def thinker(prompt: str, generated: str) -> str:
    """Thinks while its block is open, answers after any </think> (its own or a forced one)."""
    if not prompt.endswith("<think>\n"):  # thinking off: the template closed the block
        return ANSWER
    if "</think>" in generated:
        head, after = generated.split("</think>", 1)
        rest = "\n\n" + ANSWER
        return generated + rest[len(after):] if rest.startswith(after) else generated
    # NOTE: while a forced close is half-way in (e.g. only its "\n" so far) the sample is replaced
    # anyway: any continuation will do
    return NATURAL if NATURAL.startswith(generated) else generated + "."


def completion_tokens(reasoning: int) -> int:
    """The tokens of a budgeted answer: reasoning, the forced close, the answer, the end-of-turn token."""
    return reasoning + len(FORCED_CLOSE) + len(ANSWER) + 1


scripted = scripted_fixture(thinker, reactive=True, api_key="k3y", kv_tokens=4096)


@pytest.fixture(scope="module")
def oai(scripted):
    return openai.OpenAI(base_url=scripted[0].base_url + "/v1", api_key="k3y", max_retries=0)


@pytest.fixture(scope="module")
def claude(scripted):
    return anthropic.Anthropic(base_url=scripted[0].base_url, api_key="k3y", max_retries=0)


# ---- Chat Completions ------------------------------------------------------------------------------


def chat(client, stream: bool, **kw):
    """(reasoning, content, finish_reason, usage) of one chat completion."""
    kw = {"model": MODEL, "messages": QUESTION, "max_tokens": 2000, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return getattr(m, "reasoning_content", None), m.content, r.choices[0].finish_reason, r.usage
    reasoning, content, finish, usage = "", "", None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning or None, content, finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_chat_budget_stops_thinking_after_exactly_n_tokens_and_the_answer_follows(oai, stream):
    reasoning, content, finish, usage = chat(oai, stream, extra_body={"thinking_token_budget": 25})
    assert reasoning == THOUGHT[:25].strip() and content == ANSWER and finish == "stop"
    assert usage.completion_tokens_details.reasoning_tokens == 25
    assert usage.completion_tokens == completion_tokens(25)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reports_the_real_reasoning_token_count_without_a_budget(oai, stream):
    reasoning, content, _, usage = chat(oai, stream)
    assert reasoning == THOUGHT.strip() and content == ANSWER
    assert usage.completion_tokens_details.reasoning_tokens == NATURAL_REASONING
    assert usage.completion_tokens == len(NATURAL) + 1
    # a budget the model stays within changes nothing
    _, content, _, usage = chat(oai, stream, extra_body={"thinking_token_budget": NATURAL_REASONING + 1})
    assert content == ANSWER and usage.completion_tokens_details.reasoning_tokens == NATURAL_REASONING


def test_chat_max_tokens_bounds_the_total_inside_the_thinking_and_inside_the_forced_close(oai):
    reasoning, content, finish, usage = chat(oai, False, max_tokens=12, extra_body={"thinking_token_budget": 25})
    assert finish == "length" and usage.completion_tokens == 12 and usage.completion_tokens_details.reasoning_tokens == 12
    assert reasoning == THOUGHT[:12].strip() and not content
    _, content, finish, usage = chat(oai, False, max_tokens=25 + 5, extra_body={"thinking_token_budget": 25})
    assert finish == "length" and usage.completion_tokens == 30 and usage.completion_tokens_details.reasoning_tokens == 25
    assert not content


@pytest.mark.parametrize("stream", [False, True])
def test_chat_stop_string_inside_the_thinking_counts_what_was_generated(oai, stream):
    reasoning, content, finish, usage = chat(oai, stream, stop=["carefully"], extra_body={"thinking_token_budget": 500})
    assert finish == "stop" and reasoning == "Let me think about this" and not content
    generated = len("Let me think about this carefully")  # the token completing the stop string is the last
    assert usage.completion_tokens == generated and usage.completion_tokens_details.reasoning_tokens == generated


def test_chat_budget_zero_and_thinking_off(oai, scripted):
    reasoning, content, _, usage = chat(oai, False, extra_body={"thinking_token_budget": 0})
    assert not reasoning and content == ANSWER and usage.completion_tokens_details.reasoning_tokens == 0
    assert usage.completion_tokens == completion_tokens(0)
    for extra in ({"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}):
        reasoning, content, _, usage = chat(oai, False, extra_body=extra)
        assert reasoning is None and content == ANSWER and usage.completion_tokens_details.reasoning_tokens == 0
    # any other effort leaves thinking on (no budget: OpenAI ties no token count to a level)
    reasoning, content, _, usage = chat(oai, False, reasoning_effort="low")
    assert reasoning == THOUGHT.strip() and usage.completion_tokens_details.reasoning_tokens == NATURAL_REASONING


@pytest.mark.parametrize(("extra", "param"), [({"reasoning_effort": "extreme"}, "reasoning_effort"),
                                              ({"thinking_token_budget": -1}, "thinking_token_budget")])
def test_chat_bad_reasoning_parameters_are_400s_naming_them(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(oai, False, extra_body=extra)
    assert info.value.body["param"] == param


def test_a_budget_on_a_server_without_a_reasoning_parser_is_refused_by_name():
    server, _ = start_scripted_server(thinker, reactive=True, reasoning_parser="none")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="reasoning-parser") as info:
            chat(client, False, extra_body={"thinking_token_budget": 5})
        assert info.value.body["param"] == "thinking_token_budget"
        _, content, _, usage = chat(client, False, max_tokens=5)  # no parser: nothing is counted as reasoning
        assert usage.completion_tokens_details.reasoning_tokens == 0
    finally:
        server.stop()


# ---- Anthropic Messages -----------------------------------------------------------------------------


def message(client, stream: bool, **kw):
    kw = {"model": MODEL, "max_tokens": 1200, "messages": QUESTION, **kw}
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        for _ in s:
            pass
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_messages_budget_tokens_stops_thinking_after_exactly_n_tokens(claude, stream):
    m = message(claude, stream, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == THOUGHT[:1024].strip() and m.content[1].text == ANSWER
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == completion_tokens(1024)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_thinking_disabled_and_adaptive(claude, stream):
    m = message(claude, stream, thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ANSWER
    m = message(claude, stream, max_tokens=2000, thinking={"type": "adaptive"})
    assert m.content[0].thinking == THOUGHT.strip() and m.usage.output_tokens == len(NATURAL) + 1


@pytest.mark.parametrize(
    ("thinking", "max_tokens", "needle"),
    [
        ({"type": "enabled", "budget_tokens": 1023}, 1200, "thinking.budget_tokens must be an integer >= 1024"),
        ({"type": "enabled"}, 1200, "thinking.budget_tokens is required"),
        ({"type": "enabled", "budget_tokens": "lots"}, 1200, "thinking.budget_tokens"),
        ({"type": "disabled", "budget_tokens": 2000}, 1200, "only allowed when thinking is enabled"),
        ({"type": "enabled", "budget_tokens": 1200}, 1200, "max_tokens (1200) must be greater than"),
    ],
)
def test_messages_bad_budgets_are_400s_in_anthropics_shape(claude, scripted, thinking, max_tokens, needle):
    with pytest.raises(anthropic.BadRequestError) as info:
        message(claude, False, max_tokens=max_tokens, thinking=thinking)
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert needle in body["error"]["message"]
    if "max_tokens" not in needle:  # count_tokens checks the same thinking object
        raw = httpx.post(scripted[0].base_url + "/v1/messages/count_tokens", headers={"x-api-key": "k3y"},
                         json={"model": MODEL, "messages": QUESTION, "thinking": thinking})
        assert raw.status_code == 400 and needle in raw.json()["error"]["message"]


def test_messages_interleaved_thinking_beta_lets_the_budget_exceed_max_tokens(claude):
    m = claude.messages.create(model=MODEL, max_tokens=40, messages=QUESTION,
                               thinking={"type": "enabled", "budget_tokens": 1024},
                               extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 40 and m.content[0].thinking == THOUGHT[:40].strip()


# ---- Responses --------------------------------------------------------------------------------------


def respond(client, stream: bool, **kw):
    kw = {"model": MODEL, "input": "What is 6 × 7?", "max_output_tokens": 2000, **kw}
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type == "response.completed"
    return events[-1].response


@pytest.mark.parametrize("stream", [False, True])
def test_responses_budget_and_reasoning_tokens(oai, stream):
    r = respond(oai, stream, extra_body={"thinking_token_budget": 30})
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == ANSWER
    assert r.output[0].content[0].text == THOUGHT[:30].strip()
    assert r.usage.output_tokens_details.reasoning_tokens == 30 and r.usage.output_tokens == completion_tokens(30)
    r = respond(oai, stream, reasoning={"effort": "medium"})
    assert r.usage.output_tokens_details.reasoning_tokens == NATURAL_REASONING
    r = respond(oai, stream, reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_bad_effort_is_a_400_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as info:
        respond(oai, False, reasoning={"effort": "maximum"})
    assert info.value.body["param"] == "reasoning.effort"
