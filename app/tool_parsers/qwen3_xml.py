"""Qwen3-Coder XML tool calls (Qwen3-Coder, Qwen3.5, Qwen3.6)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Streaming: the name is sent as soon as ``<function=NAME>`` is complete (the call is then
committed) and each parameter as soon as its value is complete, as an argument fragment
(``{"a": 6`` then ``, "b": 7`` then ``}``). Values are raw text, typed by the tool's JSON schema
(integer, number, boolean, object/array as JSON; anything else, or a value that does not parse
as its type, stays a string), one newline stripped at each end. Before the header is complete,
anything that is not ``<function=NAME>`` with NAME an offered function turns the attempt back into content; after it,
stray text between parameters is dropped and a missing ``</parameter>`` / ``</function>`` /
``</tool_call>`` is tolerated. Several ``<function=…>`` in one ``<tool_call>`` block are a call each (as vLLM's
``qwen3_coder`` parser reads them); one after the first that is not an offered function is content from there on.
"""

from __future__ import annotations

import json
import math

from app.tool_parsers.base import END, START, ToolParser, loads_json

FUNCTION = "<function="
PARAMETER = "<parameter="
END_PARAMETER = "</parameter>"
END_FUNCTION = "</function>"
MAX_NAME = 256


def convert(value: str, schema: object):
    """A parameter's raw text as the JSON value its schema asks for."""
    # NOTE: a boolean subschema (`true`: anything) or any other non-object types nothing: kept as text.
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if value.strip() == "null" and kind != "string":
        return None
    try:
        if kind in ("integer", "int"):
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            if not math.isfinite(number):  # nan, inf, 1e400: no JSON number (json.dumps writes NaN / Infinity)
                return value
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if kind in ("object", "array"):
            return loads_json(value)
    except ValueError:
        pass
    return value


class Qwen3XmlToolParser(ToolParser):
    name = "qwen3_xml"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stage = "header"  # header -> params -> closing (-> header: another function in the same block)
        self._continued = False  # the header being read follows a function closed inside the same <tool_call>

    @classmethod
    def unusable_name(cls, function: str, arguments: list[str]) -> str | None:
        # NOTE: the header and parameter tags end at the first `>`; `<` and newlines end a header that is read back
        for kind, name in [("function", function)] + [("argument", a) for a in arguments]:
            if any(c in name for c in "<>\n"):
                return (f"{kind} name {name!r} cannot be written in {cls.name} tool-call markup "
                        f"(<function=NAME>, <parameter=NAME>): no '<', '>' or newline")
        return None

    @classmethod
    def forced_prefix(cls, function: str | None) -> str:
        return START + "\n" + (f"{FUNCTION}{function}>\n" if function else "")

    def _consume_call(self, final: bool) -> bool:
        return {"header": self._header, "params": self._params, "closing": self._closing}[self._stage](final)

    def _header(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if body.startswith(FUNCTION):
            close = body.find(">")
            name = body[len(FUNCTION) : close] if close != -1 else body[len(FUNCTION) :]
            if close != -1 and name.strip() and not any(c in name for c in "<\n") and self.allows(name.strip()):
                self._continued = False
                self._open_call(name.strip())
                self._params_sent = 0
                self._buf = body[close + 1 :]
                self._stage = "params"
                return True
            if close == -1 and not final and len(name) <= MAX_NAME and not any(c in name for c in "<\n"):
                return False
        elif not final and FUNCTION.startswith(body):
            return False
        # NOTE: not a call after all: the markup is content and what followed it is text again.
        self._in_call = False
        if self._continued:  # <tool_call> opened the calls already made: only this header on is content
            self._continued = False
            return True
        self._emit_content(self._held_space + START)
        self._held_space = ""
        return True

    def _params(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if body.startswith(PARAMETER):
            close = body.find(">")
            if close == -1:
                if final:
                    self._buf = ""
                return False
            key = body[len(PARAMETER) : close].strip()
            rest = body[close + 1 :]
            ends = [(rest.find(m), m) for m in (END_PARAMETER, PARAMETER, END_FUNCTION, END)]
            found = [(i, m) for i, m in ends if i != -1]
            if not found and not final:
                return False
            at, marker = min(found) if found else (len(rest), "")
            value = rest[:at]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            self._emit_parameter(key, value)
            self._buf = rest[at + len(END_PARAMETER) :] if marker == END_PARAMETER else rest[at:]
            return True
        for marker in (END_FUNCTION, END):
            if body.startswith(marker):
                self._close_arguments()
                self._stage = "closing"
                self._buf = body[len(END_FUNCTION) :] if marker == END_FUNCTION else body
                return True
        if not final and any(m.startswith(body) for m in (PARAMETER, END_FUNCTION, END)):
            return False
        # NOTE: stray text inside a committed call: drop it up to the next tag.
        nxt = body.find("<", 1)
        if nxt == -1:
            self._buf = ""
            return False
        self._buf = body[nxt:]
        return True

    def _closing(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if body.startswith(END):
            self._buf = body[len(END) :]
            self._end_call()
            return True
        if body.startswith(FUNCTION):  # another function in the same block: read its header as a new call
            self._stage, self._continued = "header", True
            return True
        if not final and (not body or END.startswith(body) or FUNCTION.startswith(body)):
            return False
        self._end_call()  # a missing </tool_call>: what follows is text again
        return True

    def _end_call(self) -> None:
        self._in_call = False
        self._stage = "header"

    def _emit_parameter(self, key: str, value: str) -> None:
        properties = (self.schemas.get(self.calls[-1].name) or {}).get("properties")
        schema = properties.get(key) if isinstance(properties, dict) else None
        encoded = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(convert(value, schema), ensure_ascii=False)
        self._emit_arguments(("{" if self._params_sent == 0 else ", ") + encoded)
        self._params_sent += 1

    def _close_arguments(self) -> None:
        self._emit_arguments("{}" if self._params_sent == 0 else "}")

    def _finish_call(self) -> None:
        if self._stage == "header":
            self._header(final=True)
            return
        if self._stage == "params":
            self._params(final=True)
            self._close_arguments()
        self._end_call()
