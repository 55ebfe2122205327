"""Tool-call and reasoning parsers: whole, split at every position, split at random, malformed."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.reasoning import ThinkParser, prompt_opens_reasoning
from app.tool_parsers import TOOL_PARSERS, ToolCallDelta
from app.tool_parsers.hermes import HermesToolParser
from app.tool_parsers.qwen3_xml import Qwen3XmlToolParser, convert

TOOLS = [
    {
        "name": "multiply",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "opts": {"type": "object"}},
        },
    },
    {"name": "write", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
]
XML_CALL = "<tool_call>\n<function=multiply>\n<parameter=a>\n6\n</parameter>\n<parameter=b>\n7\n</parameter>\n</function>\n</tool_call>"
HERMES_CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(parser_cls, pieces: list[str]):
    """Feed pieces; reassemble (content, [(id, name, arguments)]) and check the delta protocol."""
    parser = parser_cls(TOOLS, new_id=ids())
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    content, calls = "", []
    for event in events:
        if isinstance(event, str):
            content += event
            continue
        assert isinstance(event, ToolCallDelta)
        if event.index == len(calls):  # the first delta of a call names it
            assert event.id and event.name
            calls.append([event.id, event.name, event.arguments])
        else:
            assert event.index == len(calls) - 1 and event.id is None and event.name is None
            calls[-1][2] += event.arguments
    assert [[c.id, c.name, c.arguments] for c in parser.calls] == calls
    return content, [tuple(c) for c in calls]


def splits_everywhere(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)  # one character at a time


CASES = {
    Qwen3XmlToolParser: [
        (XML_CALL, "", [("multiply", {"a": 6, "b": 7})]),
        ("Let me compute.\n\n" + XML_CALL, "Let me compute.", [("multiply", {"a": 6, "b": 7})]),
        (XML_CALL + "\n" + XML_CALL.replace("6", "8"), "", [("multiply", {"a": 6, "b": 7}), ("multiply", {"a": 8, "b": 7})]),
        ("<tool_call>\n<function=write>\n<parameter=path>\na<b>.txt\n\n</parameter>\n</function>\n</tool_call>", "",
         [("write", {"path": "a<b>.txt\n"})]),
        ("<tool_call>\n<function=multiply>\n</function>\n</tool_call>", "", [("multiply", {})]),
        # the model forgot </parameter>, </function> and </tool_call>: still the call it meant
        ("<tool_call>\n<function=multiply>\n<parameter=a>\n6\n<parameter=b>\n7\n", "", [("multiply", {"a": 6, "b": 7})]),
        ('<tool_call><function=multiply><parameter=opts>{"x": [1]}</parameter></function></tool_call> done',
         " done", [("multiply", {"opts": {"x": [1]}})]),
        # malformed before the function header: plain content, markup and all
        ("<tool_call>\nnot a call", "<tool_call>\nnot a call", []),
        ("x < y and <tool_ca", "x < y and <tool_ca", []),
        ("<tool_call><function=bad\nname>", "<tool_call><function=bad\nname>", []),
        ("plain answer 42\n", "plain answer 42\n", []),
        # a function the request did not offer: no call (no delta either), the markup stays content
        (XML_CALL.replace("multiply", "divide"), XML_CALL.replace("multiply", "divide"), []),
        ("Sure.\n" + XML_CALL.replace("multiply", "divide") + "\n" + XML_CALL,
         "Sure.\n" + XML_CALL.replace("multiply", "divide"), [("multiply", {"a": 6, "b": 7})]),
        # several functions in one <tool_call> block: a call each (vLLM's qwen3_coder reads them so), no markup leaks
        ("<tool_call>\n<function=multiply>\n<parameter=a>\n6\n</parameter>\n</function>\n"
         "<function=write>\n<parameter=path>\nx\n</parameter>\n</function>\n</tool_call>", "",
         [("multiply", {"a": 6}), ("write", {"path": "x"})]),
        ("<tool_call><function=multiply></function><function=multiply><parameter=b>2</parameter></function>"
         "</tool_call> ok", " ok", [("multiply", {}), ("multiply", {"b": 2})]),
        # ... and one after the first that is not offered is content from its header on
        ("<tool_call>\n<function=multiply>\n</function>\n<function=divide>\n</function>\n</tool_call>",
         "\n<function=divide>\n</function>\n</tool_call>", [("multiply", {})]),
    ],
    HermesToolParser: [
        (HERMES_CALL, "", [("multiply", {"a": 6, "b": 7})]),
        ("Sure.\n" + HERMES_CALL + "\n" + HERMES_CALL, "Sure.", [("multiply", {"a": 6, "b": 7})] * 2),
        ('<tool_call>{"name": "write", "arguments": "{\\"path\\": \\"x\\"}"}</tool_call>', "", [("write", {"path": "x"})]),
        ('<tool_call>{"name": "multiply", "parameters": {"a": 1}}', "", [("multiply", {"a": 1})]),  # unclosed
        ('<tool_call>{"name": "multiply", "arguments": {"a": 1}', '<tool_call>{"name": "multiply", "arguments": {"a": 1}', []),
        ("<tool_call>[1, 2]</tool_call> ok", "<tool_call>[1, 2]</tool_call> ok", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        (HERMES_CALL.replace("multiply", "divide"), HERMES_CALL.replace("multiply", "divide"), []),
    ],
}


@pytest.mark.parametrize(
    ("parser_cls", "text", "content", "calls"),
    [(cls, *case) for cls, cases in CASES.items() for case in cases],
)
def test_every_split_gives_the_same_calls_and_content(parser_cls, text, content, calls):
    for pieces in splits_everywhere(text):
        got_content, got_calls = run(parser_cls, pieces)
        assert got_content == content, pieces
        assert [(name, json.loads(args)) for _, name, args in got_calls] == calls, pieces
        assert [i for i, _, _ in got_calls] == [f"call_{n}" for n in range(len(calls))]


def test_qwen3_xml_streams_the_name_and_each_parameter_as_soon_as_complete():
    parser = Qwen3XmlToolParser(TOOLS, new_id=ids())
    assert parser.feed("<tool_call>\n<function=multi") == []
    assert parser.feed("ply>\n<parameter=a>\n6\n") == [ToolCallDelta(0, "call_0", "multiply", "")]
    assert parser.feed("</parameter>\n") == [ToolCallDelta(0, arguments='{"a": 6')]
    assert parser.feed("<parameter=b>\n7\n</parameter>\n</function>") == [
        ToolCallDelta(0, arguments=', "b": 7'),
        ToolCallDelta(0, arguments="}"),
    ]
    assert parser.feed("\n</tool_call>") == [] and parser.finish() == []


def test_markup_never_reaches_content_while_streaming():
    parser = Qwen3XmlToolParser(TOOLS, new_id=ids())
    released = [e for ch in "Answer: <tool_call>\n<function=multiply>\n</function>\n</tool_call>" for e in parser.feed(ch)]
    assert "".join(e for e in released if isinstance(e, str)) == "Answer:"


def test_forced_prefixes_open_a_call_the_parser_completes():
    for cls, body in ((Qwen3XmlToolParser, "<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>"),
                      (HermesToolParser, '{"a": 2}}\n</tool_call>')):
        content, calls = run(cls, [cls.forced_prefix("multiply"), body])
        assert content == "" and [(n, json.loads(a)) for _, n, a in calls] == [("multiply", {"a": 2})]
    assert Qwen3XmlToolParser.forced_prefix(None) == HermesToolParser.forced_prefix(None) == "<tool_call>\n"


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [("6", {"type": "integer"}, 6), ("six", {"type": "integer"}, "six"), ("1.5", {"type": "number"}, 1.5),
     ("2", {"type": "number"}, 2), ("True", {"type": "boolean"}, True), ("[1]", {"type": "array"}, [1]),
     ("{bad", {"type": "object"}, "{bad"), ("null", {"type": ["integer", "null"]}, None), ("7", None, "7"),
     ("null", {"type": "string"}, "null"),
     # no JSON value: Python reads them, json.dumps writes NaN / Infinity back (arguments no client parses)
     ("nan", {"type": "number"}, "nan"), ("-inf", {"type": "number"}, "-inf"), ("1e400", {"type": "number"}, "1e400"),
     ('{"v": NaN}', {"type": "object"}, '{"v": NaN}'), ("[1e999]", {"type": "array"}, "[1e999]"),
     ("[" * 200 + "]" * 200, {"type": "array"}, "[" * 200 + "]" * 200)],
)
def test_parameter_values_follow_the_schema(value, schema, expected):
    assert convert(value, schema) == expected


@pytest.mark.parametrize("parser_cls", [Qwen3XmlToolParser, HermesToolParser])
def test_only_the_allowed_functions_are_calls(parser_cls):
    """A named tool_choice allows that function only; with no tools list at all any name is a call."""
    call = XML_CALL if parser_cls is Qwen3XmlToolParser else HERMES_CALL
    for allowed, calls in ((["write"], []), (["multiply"], ["multiply"])):
        parser = parser_cls(TOOLS, allowed=allowed)
        events = parser.feed(call) + parser.finish()
        assert [c.name for c in parser.calls] == calls
        assert "".join(e for e in events if isinstance(e, str)) == ("" if calls else call)
    parser = parser_cls()
    parser.feed(call.replace("multiply", "divide"))
    parser.finish()
    assert [c.name for c in parser.calls] == ["divide"]


FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=multiply>", "<function=", "</function>", "<parameter=a>",
             "</parameter>", "{", "}", '"name": "multiply"', '"arguments": {}', "\n", " ", "6", "<", ">", "x", "é"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(TOOL_PARSERS)), st.lists(st.sampled_from(FRAGMENTS), max_size=25),
       st.lists(st.integers(0, 400), max_size=8))
def test_any_text_any_split_never_raises_and_agrees_with_the_whole(name, fragments, cuts):
    text = "".join(fragments)
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(TOOL_PARSERS[name], pieces) == run(TOOL_PARSERS[name], [text])


def think(text_pieces, starts_in_reasoning=False):
    parser = ThinkParser(starts_in_reasoning)
    reasoning = content = ""
    for piece in [*text_pieces, None]:
        r, c = parser.finish() if piece is None else parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nadd them\n</think>\n\n42", False, ("add them", "42")),
        ("add them\n</think>\n\n42", True, ("add them", "42")),
        ("  42", False, ("", "  42")),
        ("still thinking\n", True, ("still thinking", "")),
        ("<thin", False, ("", "<thin")),
        ("a <think> b", False, ("", "a <think> b")),
        ("x\n\ny</think>z</think>", True, ("x\n\ny", "z</think>")),
    ],
)
def test_think_parser_every_split(text, opened, expected):
    for pieces in splits_everywhere(text):
        assert think(pieces, opened) == expected, pieces


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
