"""Hermes JSON tool calls (Qwen2.5, Qwen3, many fine-tunes)::

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

A call is validated whole, so the name and the complete arguments arrive together when
``</tool_call>`` does (or at the end of the output for an unclosed call); a body that is not a
JSON object with a string ``name`` and object ``arguments`` (``parameters`` is accepted too;
arguments given as a JSON string are unwrapped), or that names a function the request did not
offer, is content, markup included.
"""

from __future__ import annotations

import json

from app.tool_parsers.base import END, START, ToolParser, loads_json


class HermesToolParser(ToolParser):
    name = "hermes"

    @classmethod
    def forced_prefix(cls, function: str | None) -> str:
        return START + "\n" + ('{"name": ' + json.dumps(function) + ', "arguments": ' if function else "")

    def _consume_call(self, final: bool) -> bool:
        end = self._buf.find(END)
        if end == -1:
            return False
        body, self._buf = self._buf[:end], self._buf[end + len(END) :]
        self._take_call(body, closed=True)
        return True

    def _finish_call(self) -> None:
        body, self._buf = self._buf, ""
        self._take_call(body, closed=False)

    def _take_call(self, body: str, closed: bool) -> None:
        self._in_call = False
        parsed = _parse(body)
        if parsed is None or not self.allows(parsed[0]):
            self._emit_content(self._held_space + START + body + (END if closed else ""))
            self._held_space = ""
            return
        name, arguments = parsed
        self._open_call(name)
        self._emit_arguments(arguments)


def _parse(body: str) -> tuple[str, str] | None:
    try:
        value = loads_json(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = loads_json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)
