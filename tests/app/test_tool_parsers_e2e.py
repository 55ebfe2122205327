"""The Hermes parser chosen by --tool-call-parser, and malformed model output, through the real server:
markup never leaks, bad calls degrade to content with finish_reason stop, never a 500."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.app.conftest import MODEL
from tests.app.scripted import start_scripted_server
from tests.app.test_tool_calls import QUESTION, TOOLS, stream_to_message

DEEP = "[" * 1500 + "]" * 1500  # nested past the interpreter's recursion limit (1,000): json.loads raised RecursionError
OUTPUTS = {
    "hermes": 'Calling.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>',
    "broken": '<tool_call>\n{"name": "multiply", "arguments": {"a": 6',
    "prose": "x <tool_call> y",
    # not JSON, though Python's json reads them (and wrote them back as NaN / Infinity: arguments no client parses)
    "nan": '<tool_call>\n{"name": "multiply", "arguments": {"a": NaN, "b": 7}}\n</tool_call>',
    "huge": '<tool_call>\n{"name": "multiply", "arguments": {"a": 1e400, "b": 7}}\n</tool_call>',
    "deep": '<tool_call>\n{"name": "multiply", "arguments": {"a": ' + DEEP + ', "b": 7}}\n</tool_call>',
    # Qwen3-XML calls whose values are typed by the schema: a number or an object that is no JSON stays text
    "xml": "<tool_call>\n<function=measure>\n<parameter=x>\nX\n</parameter>\n<parameter=o>\nO\n</parameter>\n"
           "</function>\n</tool_call>",
}
# what the model writes for x (a number) and o (an object) -> the arguments: what is no JSON stays text
XML_VALUES = {"nan": ("nan", '{"v": NaN}', {"x": "nan", "o": '{"v": NaN}'}),
              "inf": ("1e400", '{"v": -Infinity}', {"x": "1e400", "o": '{"v": -Infinity}'}),
              "digits": ("9" * 400, '{"v": 1e999}', {"x": "9" * 400, "o": '{"v": 1e999}'}),
              "deep": ("2.5", DEEP, {"x": 2.5, "o": DEEP})}
MEASURE = [{"type": "function", "function": {"name": "measure", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}, "o": {"type": "object"}}}}}]


def script(prompt: str) -> str:
    for key, (x, o, _) in XML_VALUES.items():
        if f"[xml-{key}]" in prompt:
            return "</think>\n\n" + OUTPUTS["xml"].replace("X", x).replace("O", o)
    for key, text in OUTPUTS.items():
        if f"[{key}]" in prompt:
            return "</think>\n\n" + text
    return "?"


@pytest.fixture(scope="module")
def client():
    server, _ = start_scripted_server(script, tool_call_parser="hermes", kv_tokens=4096)
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    server.stop()


@pytest.fixture(scope="module")
def xml_server():
    server, _ = start_scripted_server(script, tool_call_parser="qwen3_xml", kv_tokens=4096)
    yield server
    server.stop()


def ask(client, key: str, stream: bool):
    messages = [{"role": "user", "content": f"[{key}] " + QUESTION[0]["content"]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=stream)
    if stream:
        content, _, calls, finish, _ = stream_to_message(r)
        return content, [(c["name"], json.loads(c["arguments"])) for c in calls], finish
    m = r.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    return m.content, calls, r.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_hermes_calls_are_parsed(client, stream):
    assert ask(client, "hermes", stream) == ("Calling.", [("multiply", {"a": 6, "b": 7})], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("key", ["broken", "prose", "nan", "huge", "deep"])
def test_malformed_calls_degrade_to_content(client, stream, key):
    """nan and huge were calls whose arguments held NaN / Infinity; deep answered 500 (or cut the stream off)."""
    assert ask(client, key, stream) == (OUTPUTS[key], [], "stop")


def strict_json(text: str):
    """JSON as every client reads it: NaN and Infinity are not JSON."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text[:80]!r}"))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("key", sorted(XML_VALUES))
def test_qwen3_xml_values_that_are_no_json_stay_text_on_every_route(xml_server, stream, key):
    """A number or object parameter the model wrote as nan, 1e400, 400 digits or nested past the recursion limit:
    chat and responses sent arguments with NaN / Infinity (or answered 500, or cut the stream off: deep), and
    /v1/messages answered 500 (its input is decoded from those arguments)."""
    expected = XML_VALUES[key][2]
    question = [{"role": "user", "content": f"[xml-{key}] measure it"}]
    chat = openai.OpenAI(base_url=xml_server.base_url + "/v1", api_key="unused", max_retries=0)
    r = chat.chat.completions.create(model=MODEL, messages=question, tools=MEASURE, stream=stream, max_tokens=3500)
    calls = stream_to_message(r)[2] if stream else [c.function.model_dump() for c in r.choices[0].message.tool_calls]
    assert [(c["name"], strict_json(c["arguments"])) for c in calls] == [("measure", expected)]
    body = {"model": MODEL, "input": question[0]["content"], "max_output_tokens": 3500, "stream": stream,
            "tools": [{"type": "function", **MEASURE[0]["function"]}]}
    answer = httpx.post(xml_server.base_url + "/v1/responses", json=body, timeout=60)
    assert answer.status_code == 200, answer.text[:300]
    final = json.loads(answer.text.rsplit("data: ", 1)[-1])["response"] if stream else answer.json()
    assert [(o["name"], strict_json(o["arguments"])) for o in final["output"] if o["type"] == "function_call"] == [
        ("measure", expected)]
    body = {"model": MODEL, "messages": question, "max_tokens": 3500, "stream": stream, "tools": [
        {"name": "measure", "input_schema": MEASURE[0]["function"]["parameters"]}]}
    answer = httpx.post(xml_server.base_url + "/v1/messages", json=body, timeout=60)
    assert answer.status_code == 200, answer.text[:300]
    if stream:
        deltas = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
        assert deltas[-1]["type"] == "message_stop", deltas[-1]
        arguments = "".join(d["delta"]["partial_json"] for d in deltas if d["type"] == "content_block_delta"
                            and d["delta"]["type"] == "input_json_delta")
        assert strict_json(arguments) == expected
    else:
        assert [b["input"] for b in answer.json()["content"] if b["type"] == "tool_use"] == [expected]


def test_parser_flags_are_checked_and_default_by_architecture():
    from app.containers import _parser_choice
    from app.settings import ServeSettings
    from tests.app.conftest import TINY_SPEC

    with pytest.raises(ValueError, match="--tool-call-parser must be"):
        ServeSettings(tool_call_parser="nope")
    with pytest.raises(ValueError, match="--reasoning-parser must be"):
        ServeSettings(reasoning_parser="nope")
    assert _parser_choice("auto", {"qwen3_5_moe": "qwen3_xml", "qwen3_moe": "hermes"}, TINY_SPEC) == "qwen3_xml"
    assert _parser_choice("none", {}, TINY_SPEC) is None and _parser_choice("hermes", {}, TINY_SPEC) == "hermes"


def test_cli_passes_the_parser_flags(monkeypatch):
    import app.serving
    from app.cli import main

    seen = {}

    class Stop(Exception):
        pass

    def fake_server(container, settings, echo):
        seen.update(tool=settings.tool_call_parser, reasoning=settings.reasoning_parser)
        raise Stop

    monkeypatch.setattr(app.serving, "RunningServer", fake_server)
    with pytest.raises(Stop):
        main(["serve", "--tool-call-parser", "hermes", "--reasoning-parser", "none"])
    assert seen == {"tool": "hermes", "reasoning": "none"}
