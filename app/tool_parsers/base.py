"""The streaming tool-call parser skeleton shared by every format.

A parser turns model text, fed in arbitrary pieces, into an ordered list of events: plain
``str`` content and ``ToolCallDelta``s (OpenAI's incremental ``tool_calls``: the first delta of
a call carries its id and name, later ones argument fragments; a call's fragments join into
its JSON arguments). Feeding a text whole or split anywhere gives the same joined result,
markup never reaches the content, and malformed output degrades to content; so does a call to
a function the request did not offer (no delta is emitted for it); parsers never raise on model
output.

Between calls the parser is in text mode: it releases content but holds back anything that
could still become ``<tool_call>`` and trailing whitespace (dropped before a call, so the
newline a model writes before its call is not content). Inside a call a subclass consumes
``self._buf`` through ``_consume_call``.
"""

from __future__ import annotations

import itertools
import json
import math
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass

START = "<tool_call>"
END = "</tool_call>"


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # 0, 1, ... in order of appearance
    id: str | None = None  # set on the first delta of a call only
    name: str | None = None  # set on the first delta of a call only
    arguments: str = ""  # a fragment of the call's JSON arguments


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # the JSON object text, complete after finish()


Event = str | ToolCallDelta


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# NOTE: far deeper than any tool's arguments, far below the interpreter's recursion limit (~1,000 frames), which
# json.loads and every encoder of the answer (json, msgspec) run into on nesting: a value this deep writes back anywhere.
MAX_JSON_DEPTH = 128


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):  # 1e400: json.dumps would write it back as Infinity
        raise ValueError(f"{number} is out of range")
    return value


def loads_json(text: str):
    """``json.loads`` for model output, held to what every client can read back: NaN, Infinity and numbers past a
    float's range (which Python reads, and json.dumps writes back as NaN / Infinity, which no JSON parser takes)
    and nesting deeper than MAX_JSON_DEPTH are a ValueError, never a RecursionError (parsers never raise on
    model output)."""
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH}")
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return value


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    """Subclasses set ``name`` and implement _consume_call / _finish_call / forced_prefix."""

    name = "base"

    def __init__(self, tools: list[dict] | None = None, new_id: Callable[[], str] = random_call_id,
                 allowed: Collection[str] | None = None) -> None:
        self.schemas = {t.get("name"): t.get("parameters") or {} for t in (tools or []) if isinstance(t, dict)}
        # NOTE: a call may only name a function the request offered (``allowed``: the one a named tool_choice
        # forces); markup naming any other is not a call but content, as malformed markup is. None: any name.
        if allowed is None and tools is not None:
            allowed = list(self.schemas)
        self.allowed = None if allowed is None else frozenset(allowed)
        self.calls: list[ToolCall] = []
        self._new_id = new_id
        self._buf = ""  # text not yet turned into events
        self._held_space = ""  # whitespace held back in text mode
        self._in_call = False
        self._out: list[Event] = []

    def allows(self, name: str) -> bool:
        return self.allowed is None or name in self.allowed

    @classmethod
    def unusable_name(cls, function: str, arguments: list[str]) -> str | None:
        """Why this parser's call markup cannot carry a tool with these function and argument names, or None."""
        return None

    # --- public ---------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """End of output: close an open call if it can be, release or drop held text."""
        self._run(final=True)
        if self._in_call:
            self._finish_call()
            self._in_call = False
            self._run(final=True)
        if self._held_space and not self.calls:
            self._emit_content(self._held_space)
        self._held_space = ""
        return self._take()

    @classmethod
    def forced_prefix(cls, function: str | None) -> str:
        """Text appended to the prompt so the model must call a tool (a named one if given)."""
        raise NotImplementedError

    # --- for subclasses -------------------------------------------------------------------
    def _consume_call(self, final: bool) -> bool:
        """Consume from self._buf inside a call; return False when more text is needed.
        Set self._in_call = False when the call (or the malformed attempt) is over."""
        raise NotImplementedError

    def _finish_call(self) -> None:
        """The output ended inside a call: emit what can be salvaged."""
        raise NotImplementedError

    def _open_call(self, name: str) -> int:
        self._held_space = ""  # whitespace right before a call is not content
        index = len(self.calls)
        call = ToolCall(self._new_id(), name)
        self.calls.append(call)
        self._out.append(ToolCallDelta(index, call.id, name, ""))
        return index

    def _emit_arguments(self, fragment: str) -> None:
        if fragment:
            self.calls[-1].arguments += fragment
            self._out.append(ToolCallDelta(len(self.calls) - 1, arguments=fragment))

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._out and isinstance(self._out[-1], str):
            self._out[-1] += text
        else:
            self._out.append(text)

    # --- text mode ------------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        for _ in itertools.count():
            if self._in_call:
                if not self._consume_call(final):
                    return
                continue
            if not self._consume_text(final):
                return

    def _consume_text(self, final: bool) -> bool:
        start = self._buf.find(START)
        if start == -1:
            keep = 0 if final else partial_suffix(self._buf, START)
            self._release(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._release(self._buf[:start])
        self._buf = self._buf[start + len(START) :]
        self._in_call = True
        return True

    def _release(self, text: str) -> None:
        if not text:
            return
        stripped = text.rstrip()
        if stripped:
            self._emit_content(self._held_space + stripped)
            self._held_space = ""
        self._held_space += text[len(stripped) :]

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out
