"""The Hermes parser chosen by --tool-call-parser, and malformed model output, through the real server:
markup never leaks, bad calls degrade to content with finish_reason stop, never a 500."""

from __future__ import annotations

import json

import openai
import pytest

from tests.app.conftest import MODEL
from tests.app.scripted import start_scripted_server
from tests.app.test_tool_calls import QUESTION, TOOLS, stream_to_message

OUTPUTS = {
    "hermes": 'Calling.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>',
    "broken": '<tool_call>\n{"name": "multiply", "arguments": {"a": 6',
    "prose": "x <tool_call> y",
}


def script(prompt: str) -> str:
    for key, text in OUTPUTS.items():
        if f"[{key}]" in prompt:
            return "</think>\n\n" + text
    return "?"


@pytest.fixture(scope="module")
def client():
    server, _ = start_scripted_server(script, tool_call_parser="hermes")
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
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
@pytest.mark.parametrize("key", ["broken", "prose"])
def test_malformed_calls_degrade_to_content(client, stream, key):
    assert ask(client, key, stream) == (OUTPUTS[key], [], "stop")


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
