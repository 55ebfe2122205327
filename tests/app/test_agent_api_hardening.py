"""What an agent sends that the server got wrong: Anthropic's assistant prefill (a last assistant turn is the
start of the answer), tool-call arguments nested past what JSON decoding survives (a 500 before), tool results that
answer no call, tool calls left without a result and call ids used twice (all served before), and the Messages
API's own field rules (Anthropic's ranges and error shape)."""

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


@pytest.mark.parametrize("function", [None, "multiply"])
def test_a_function_tool_without_its_function_object_is_named_as_such(scripted, function):
    """{"type": "function"} without an object under "function" was answered "only function tools are supported"."""
    tool = {"type": "function"} if function is None else {"type": "function", "function": function}
    r = httpx.post(scripted[0].base_url + "/v1/chat/completions", timeout=30,
                   json={"messages": [QUESTION], "tools": [tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function", r.text
    assert r.json()["error"]["code"] == "invalid_value" and "needs its \"function\" object" in r.json()["error"]["message"]


def test_an_assistant_message_without_content_or_calls_is_explained(scripted):
    r = httpx.post(scripted[0].base_url + "/v1/chat/completions", timeout=30, json={"messages": [
        QUESTION, {"role": "assistant", "content": None, "tool_calls": []}]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "an assistant message needs content (or tool_calls)"


# -- tool-call ids: a result answers a call the conversation made, every call gets one result, ids are unique --------

CALL = {"id": "call_a", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}
CALL_B = {**CALL, "id": "call_b"}


def calls(*ids: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": i} for i in ids]}


def answer(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "42"}


UNANSWERED = ("an assistant message with 'tool_calls' must be followed by tool messages responding to each "
              "'tool_call_id'; these tool_call_ids have no response message: ")


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
    # calls left without a result (OpenAI: "The following tool_call_ids did not have response messages"): served
    # before, the model reading its own call go unanswered. Before the next user, assistant or system message ...
    ([QUESTION, calls("call_a", "call_b"), answer("call_a"), {"role": "user", "content": "And?"}], "messages[1]",
     UNANSWERED + "call_b"),
    ([QUESTION, calls("call_a", "call_b"), {"role": "assistant", "content": "42."}], "messages[1]",
     UNANSWERED + "call_a, call_b"),
    ([QUESTION, calls("call_a"), {"role": "system", "content": "Be brief."}, answer("call_a")], "messages[1]",
     UNANSWERED + "call_a"),
    # ... or the end of the conversation, a turn after answered ones too
    ([QUESTION, calls("call_a"), answer("call_a"), calls("call_b")], "messages[3]", UNANSWERED + "call_b"),
    # a tool message without an id answers nothing
    ([QUESTION, calls("call_a"), {"role": "tool", "content": "42"}], "messages[1]", UNANSWERED + "call_a"),
    # one id twice: a result could not say which call it answers
    ([QUESTION, calls("call_a", "call_a"), answer("call_a")], "messages[1].tool_calls[1].id",
     "duplicate tool call id 'call_a': an earlier tool call has it (messages[1].tool_calls[0].id)"),
    ([QUESTION, calls("call_a"), answer("call_a"), calls("call_a"), answer("call_a")], "messages[3].tool_calls[0].id",
     "duplicate tool call id 'call_a': an earlier tool call has it (messages[1].tool_calls[0].id)"),
    # two results to one call, in one turn or after a later one
    ([QUESTION, calls("call_a", "call_b"), answer("call_a"), answer("call_a"), answer("call_b")],
     "messages[3].tool_call_id",
     "tool_call_id 'call_a' has a response already (messages[2].tool_call_id): each tool call gets one tool message"),
    ([QUESTION, calls("call_a"), answer("call_a"), calls("call_b"), answer("call_b"), answer("call_a")],
     "messages[5].tool_call_id", "tool_call_id 'call_a' has a response already (messages[2].tool_call_id)"),
])
def test_unpaired_tool_calls_and_results_are_a_400_naming_them(openai_client, messages, param, said, stream):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, max_tokens=5, messages=messages, stream=stream)
    error = info.value.body
    assert (error["param"], error["code"], error["type"]) == (param, "invalid_value", "invalid_request_error"), error
    assert said in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_paired_tool_calls_over_several_turns_are_served(openai_client, scripted, stream):
    """Parallel calls answered out of order, then more turns, each call answered once before the next message; a
    tool message without an id (vLLM serves it; nothing to check it against) once every call has its result."""
    messages = [QUESTION, calls("call_a", "call_b", "call_c"), answer("call_c"), answer("call_a"), answer("call_b"),
                {"role": "assistant", "content": "Checking once more."}, calls("call_d"), answer("call_d"),
                {"role": "tool", "content": "no id"}, {"role": "user", "content": "And 6 × 8?"}, calls("call_e"),
                {"role": "function", "name": "multiply", "tool_call_id": "call_e", "content": "48"}]
    created = openai_client.chat.completions.create(model=MODEL, max_tokens=5, messages=messages, stream=stream)
    chunks = list(created) if stream else [created]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert scripted[1].prompts[chunks[0].id].count("<tool_response>") == 6


def function_call(call_id: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "multiply", "arguments": '{"a": 6, "b": 7}'}


def output(call_id: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": "42"}


@pytest.mark.parametrize(("items", "param", "said"), [
    ([function_call("c1"), output("c2")], "input[2].call_id",
     "no function_call item before it has call_id 'c2': a function_call_output answers an earlier function_call"),
    # OpenAI: "No tool output found for function call <call_id>." (served before)
    ([function_call("c1")], "input[1]", "No tool output found for function call c1: each function_call item needs"),
    ([function_call("c1"), function_call("c2"), output("c2"), {"role": "user", "content": "And?"}], "input[1]",
     "No tool output found for function call c1:"),
    ([function_call("c1"), function_call("c2"), {"role": "assistant", "content": "Hm."}], "input[1]",
     "No tool output found for function call c1, c2:"),
    ([function_call("c1"), output("c1"), function_call("c2")], "input[3]",
     "No tool output found for function call c2:"),
    # one call_id twice, or two outputs to one call
    ([function_call("c1"), function_call("c1"), output("c1")], "input[2].call_id",
     "duplicate call_id 'c1': an earlier function_call has it (input[1].call_id)"),
    ([function_call("c1"), output("c1"), function_call("c1"), output("c1")], "input[3].call_id",
     "duplicate call_id 'c1': an earlier function_call has it (input[1].call_id)"),
    ([function_call("c1"), output("c1"), output("c1")], "input[3].call_id",
     "call_id 'c1' has a function_call_output already (input[2].call_id): each function_call gets one output"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_unpaired_responses_function_calls_and_outputs_are_a_400(openai_client, items, param, said, stream):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model=MODEL, max_output_tokens=5, input=[QUESTION, *items], stream=stream)
    error = info.value.body
    assert (error["param"], error["code"], error["type"]) == (param, "invalid_value", "invalid_request_error"), error
    assert said in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_paired_responses_function_calls_over_several_turns_are_served(openai_client, scripted, stream):
    """Parallel calls answered out of order, then a message and another call with its output."""
    items = [QUESTION, function_call("c1"), function_call("c2"), output("c2"), output("c1"),
             {"role": "assistant", "content": "Checking once more."}, function_call("c3"), output("c3")]
    created = openai_client.responses.create(model=MODEL, max_output_tokens=5, input=items, stream=stream)
    response = list(created)[-1].response if stream else created
    assert response.status in ("completed", "incomplete")
    assert scripted[1].prompts[response.id].count("<tool_response>") == 3


# -- Anthropic's Messages API: its fields' rules, in its error shape -------------------------------------------------

TOOL_USE = {"role": "assistant", "content": [{"type": "text", "text": "Computing."},
                                             {"type": "tool_use", "id": "toolu_a", "name": "multiply",
                                              "input": {"a": 6, "b": 7}}]}


TWO_TOOL_USES = {"role": "assistant", "content": [*TOOL_USE["content"], {"type": "tool_use", "id": "toolu_b",
                                                                          "name": "multiply", "input": {}}]}
NO_RESULT = "tool_use ids were found without tool_result blocks immediately after: "


def results(tool_use_id: str | None, content: str = "42") -> dict:
    block = {"type": "tool_result", "content": content}
    if tool_use_id is not None:
        block["tool_use_id"] = tool_use_id
    return block


def result(tool_use_id: str | None, content: str = "42") -> dict:
    return {"role": "user", "content": [results(tool_use_id, content)]}


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
    # Anthropic's rule: the assistant turn right before it, not any earlier one (whose calls all have their result
    # by now: one more is a second result)
    ([QUESTION, TOOL_USE, result("toolu_a"), {"role": "assistant", "content": "42."}, result("toolu_a")],
     "messages[4].content[0].tool_use_id: each tool_use must have a single result: tool_use_id 'toolu_a' has a "
     "tool_result block already (messages[2].content[0].tool_use_id)"),
    ([QUESTION, TOOL_USE, {"role": "user", "content": [results("toolu_a"), results("toolu_a")]}],
     "messages[2].content[1].tool_use_id: each tool_use must have a single result: tool_use_id 'toolu_a' has a "
     "tool_result block already (messages[2].content[0].tool_use_id)"),
    # Anthropic: "tool_use ids were found without tool_result blocks immediately after" (served before)
    ([QUESTION, TOOL_USE, QUESTION], f"messages[1]: {NO_RESULT}toolu_a. Each tool_use block must have a "
     "corresponding tool_result block in the next message."),
    ([QUESTION, TOOL_USE], f"messages[1]: {NO_RESULT}toolu_a."),
    ([QUESTION, TWO_TOOL_USES, result("toolu_b"), {"role": "assistant", "content": "42."}],
     f"messages[1]: {NO_RESULT}toolu_a."),
    ([QUESTION, TWO_TOOL_USES, QUESTION, result("toolu_a")], f"messages[1]: {NO_RESULT}toolu_b."),
    ([QUESTION, TWO_TOOL_USES, {"role": "assistant", "content": "42."}], f"messages[1]: {NO_RESULT}toolu_a, toolu_b."),
    # one tool_use id twice, in one turn or two
    ([QUESTION, {"role": "assistant", "content": [*TOOL_USE["content"], TOOL_USE["content"][1]]}, result("toolu_a")],
     "messages[1].content[2].id: tool_use ids must be unique: 'toolu_a' is also the id of an earlier tool_use block "
     "(messages[1].content[1].id)"),
    ([QUESTION, TOOL_USE, result("toolu_a"), TOOL_USE, result("toolu_a")],
     "messages[3].content[1].id: tool_use ids must be unique: 'toolu_a'"),
    ([QUESTION, TOOL_USE, result(None)], "messages[2].content[0].tool_use_id: a tool_result block needs"),
    ([QUESTION, {"role": "assistant", "content": [{"type": "tool_use", "name": "multiply", "input": {}}]},
      result("toolu_a")], "messages[1].content[0].id: a tool_use block needs an `id` string"),
])
def test_a_tool_result_must_answer_a_tool_use_of_the_previous_assistant_turn(client, messages, starts):
    """These were served (200): a tool response to no call or a second one, a tool_use left without its result, a
    tool_use id used twice, all rendered into the prompt."""
    for create in (client.messages.create, client.messages.count_tokens):
        kw = {"max_tokens": 20} if create == client.messages.create else {}
        with pytest.raises(anthropic.BadRequestError) as info:
            create(model=MODEL, messages=messages, **kw)
        assert_anthropic_400(info, starts)


@pytest.mark.parametrize("stream", [False, True])
def test_paired_tool_results_are_served(client, scripted, stream):
    """Every result of the previous turn in any order, one over two user messages (Anthropic joins consecutive
    ones), then a later turn's call answered with text beside its result."""
    later = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_c", "name": "multiply",
                                               "input": {"a": 6, "b": 8}}]}
    messages = [QUESTION, TWO_TOOL_USES, result("toolu_b"), result("toolu_a", "also 42"),
                {"role": "assistant", "content": "42. Once more?"}, QUESTION, later,
                {"role": "user", "content": [results("toolu_c", "48"), {"type": "text", "text": "Thanks."}]}]
    kw = {"model": MODEL, "max_tokens": 20, "messages": messages, "thinking": {"type": "disabled"}}
    if stream:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kw)
    assert message.stop_reason == "end_turn" and message.content[0].text == "A fresh turn."
    assert scripted[1].prompts[message.id].count("<tool_response>") == 3
    assert client.messages.count_tokens(model=MODEL, messages=messages).input_tokens > 0


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


def test_messages_top_p_zero_is_served_as_the_top_token_alone(client, scripted):
    """Anthropic's top_p range includes 0 (Chat Completions' does not): the nucleus is then the top token,
    handed to the sampler as top-k 1 whatever the temperature (the sampler's greedy cut)."""
    message = client.messages.create(model=MODEL, max_tokens=5, messages=[QUESTION],
                                     extra_body={"temperature": 1.0, "top_p": 0})
    assert message.usage.output_tokens == 5
    assert scripted[1].sampling[message.id].top_k == 1


def test_messages_range_edges_are_served(client):
    message = client.messages.create(model=MODEL, max_tokens=1, messages=[QUESTION], stop_sequences=["never"],
                                     thinking={"type": "disabled"},
                                     extra_body={"temperature": 1.0, "top_p": 1.0, "top_k": 0})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 1
