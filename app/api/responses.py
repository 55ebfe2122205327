"""POST /v1/responses: OpenAI's Responses API, stateless, streamed as semantic events or whole.

``input`` is text or items (messages, ``function_call``, ``function_call_output``,
``reasoning``), ``instructions`` becomes the system message, function tools only. Nothing is
stored: ``store: true``, ``previous_response_id``, ``conversation`` and ``background`` are refused
by name, as are hosted tools (web search, file search, ...) and non-text output formats.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream

from app.api.agent import (
    Conversation,
    OutputParser,
    Reasoning,
    apply_reasoning_effort,
    arguments_object,
    check_tool_choice,
    function_tool,
    template_kwargs_of,
    thinking_budget,
)
from app.api.errors import OpenAIError, bad_value, unsupported
from app.api.generation import (
    build_sampling,
    check_model,
    collect,
    event_error,
    events_until_finished,
    guard_stream,
    raise_if_failed,
    require_engine,
    runtime_of,
    submit,
)
from app.api.prompts import prepare_off_loop
from app.api.schemas import _Sampling, decode_body, read_body
from app.api.tool_pairing import PairingWords, ToolPairing
from app.engine import Engine
from app.tool_parsers import ToolCallDelta


class ResponsesRequest(_Sampling, kw_only=True):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt: Any = None  # a stored prompt template: nothing is stored here
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None  # as on chat completions (vLLM's extension)


_CHAT_ONLY = ("n", "stop", "max_tokens", "max_completion_tokens", "presence_penalty", "frequency_penalty",
              "logit_bias")


def _refuse_stateful(body: ResponsesRequest) -> None:
    if body.store:
        raise unsupported("store", "store is not supported: this server keeps no responses (send store: false)")
    if body.previous_response_id is not None:
        raise unsupported("previous_response_id", "previous_response_id is not supported: responses are not stored; "
                          "send the whole conversation as input items")
    if body.conversation is not None:
        raise unsupported("conversation", "conversations are not stored by this server")
    if body.background:
        raise unsupported("background", "background responses are not supported")
    if body.truncation not in (None, "disabled"):
        raise unsupported("truncation", "only truncation 'disabled' is supported")
    if body.prompt is not None:
        raise unsupported("prompt", "stored prompts are not supported: this server keeps none (send the instructions "
                          "and input themselves)")
    if body.top_logprobs or "message.output_text.logprobs" in (body.include or []):
        raise unsupported("top_logprobs" if body.top_logprobs else "include",
                          "logprobs are not supported on /v1/responses (Chat Completions and Completions return them)")
    if body.max_tool_calls is not None:
        raise unsupported("max_tool_calls", "max_tool_calls is not supported (parallel_tool_calls: false keeps one call)")
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad_value("text.format", 'text.format must be an object such as {"type": "text"}')
    if fmt.get("type") != "text":
        raise unsupported("text.format", "only the text output format is supported")


def _text(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is not None and not isinstance(content, list):
        raise bad_value(param, "content must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content or []):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else part
            raise unsupported(f"{param}[{i}]", f"content part {kind!r} is not supported (input_text and output_text are)")
        texts.append(_part_text(part, f"{param}[{i}]"))
    return "".join(texts)


def _nonempty_str(value) -> bool:
    return isinstance(value, str) and bool(value)


def _part_text(part: dict, param: str) -> str:
    if not isinstance(part.get("text"), str):
        raise bad_value(f"{param}.text", f"a {part.get('type')} part needs a `text` string")
    return part["text"]


def _messages(body: ResponsesRequest) -> list[dict]:
    out = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise bad_value("input", "input must not be empty")
    reasoning: str | None = None
    pairing = ToolPairing(_PAIRING)
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_value(f"{param}.role", f"unknown role {role!r}")
            message = {"role": "system" if role == "developer" else role, "content": _text(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": arguments_object(item.get("arguments", "{}"), f"{param}.arguments")}}
            if not _nonempty_str(item.get("name")) or not _nonempty_str(item.get("call_id")):
                raise bad_value(param, "a function_call item needs call_id and name (non-empty strings)")
            pairing.call(item["call_id"], f"{param}.call_id", param)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or reasoning is None):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            if not _nonempty_str(item.get("call_id")):
                raise bad_value(param, "a function_call_output item needs call_id (a non-empty string)")
            # NOTE: nothing is stored (no previous_response_id), so the call it answers is an earlier input item
            pairing.answer(item["call_id"], f"{param}.call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(output, f"{param}.output")})
        elif kind == "reasoning":
            key = "content" if item.get("content") else "summary"
            parts = item.get(key) or []
            if not isinstance(parts, list):
                raise bad_value(f"{param}.{key}", f"{key} must be a list of parts")
            reasoning = "".join(_part_text(p, f"{param}.{key}[{j}]") for j, p in enumerate(parts) if isinstance(p, dict))
        else:
            raise unsupported(param, f"input item type {kind!r} is not supported")
    pairing.settle()  # NOTE: OpenAI's rule: each function_call's output is somewhere after it in the input
    return out


# OpenAI's pairing rules for input items, in its words where it has them
_PAIRING = PairingWords(
    unanswered="No tool output found for function call {ids}: each function_call item needs a "
               "function_call_output item with its call_id after it",
    duplicate_call="duplicate call_id {id}: an earlier function_call has it ({first}); each function_call needs its "
                   "own call_id, as a function_call_output names the call it answers by it",
    duplicate_answer="call_id {id} has a function_call_output already ({first}): each function_call gets one output",
    dangling=lambda call_id, _: f"no function_call item before it has call_id {call_id!r}: a function_call_output "
                                f"answers an earlier function_call",
)


def _conversation(body: ResponsesRequest) -> Conversation:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise unsupported(f"tools[{i}]", f"tool type {tool.get('type')!r} is not supported: only function tools")
        if "name" not in tool and isinstance(tool.get("function"), dict):  # Chat Completions' shape, sent here
            raise bad_value(f"tools[{i}]", 'a Responses function tool is {"type": "function", "name": ..., '
                            '"parameters": ...}, not nested under "function" as in Chat Completions')
        tools.append(function_tool(tool.get("name"), tool.get("description"), tool.get("parameters"), f"tools[{i}]"))
    choice, forced = body.tool_choice if body.tool_choice is not None else "auto", None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise bad_value("tool_choice", 'a named tool_choice is {"type": "function", "name": ...}')
        choice, forced = "function", choice["name"]
    kwargs, switches = template_kwargs_of(body.chat_template_kwargs)
    apply_reasoning_effort(kwargs, (body.reasoning or {}).get("effort"), "reasoning.effort")
    conversation = Conversation(_messages(body), tools, choice, forced, body.parallel_tool_calls is not False, kwargs,
                                thinking_budget(body.thinking_token_budget), **switches)
    check_tool_choice(conversation)
    return conversation


class OutputItems:
    """Parser pieces -> Responses output items and the semantic stream events that build them."""

    def __init__(self) -> None:
        self.output: list[dict] = []
        self._open: dict | None = None
        self.sequence = 0

    def event(self, kind: str, **data) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **data}

    def add(self, piece) -> list[dict]:
        if isinstance(piece, Reasoning):
            out = self._ensure("reasoning")
            self._open["content"][0]["text"] += piece.text
            return out + [self._item_event("response.reasoning_text.delta", content_index=0, delta=piece.text)]
        if isinstance(piece, ToolCallDelta):
            out = []
            if piece.id is not None:
                out = self._close() + self._start({"type": "function_call", "id": "fc_" + secrets.token_hex(12),
                                                   "call_id": piece.id, "name": piece.name, "arguments": "",
                                                   "status": "in_progress"})
            if piece.arguments:
                self._open["arguments"] += piece.arguments
                out.append(self._item_event("response.function_call_arguments.delta", delta=piece.arguments))
            return out
        out = self._ensure("message")
        self._open["content"][0]["text"] += piece
        return out + [self._item_event("response.output_text.delta", content_index=0, delta=piece, logprobs=[])]

    def close(self) -> list[dict]:
        return self._close()

    def _ensure(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self._close()
        if kind == "reasoning":
            return out + self._start({"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "summary": [],
                                      "content": [{"type": "reasoning_text", "text": ""}]})
        out += self._start({"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "in_progress",
                            "role": "assistant", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open["content"].append(part)
        return out + [self._item_event("response.content_part.added", content_index=0, part={**part})]

    def _start(self, item: dict) -> list[dict]:
        self.output.append(item)
        self._open = item
        empty = {**item, "content": []} if "content" in item else dict(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=empty)]

    def _item_event(self, kind: str, **data) -> dict:
        return self.event(kind, item_id=self._open["id"], output_index=len(self.output) - 1, **data)

    def _close(self) -> list[dict]:
        item, out = self._open, []
        if item is None:
            return out
        if item["type"] == "reasoning":
            out.append(self._item_event("response.reasoning_text.done", content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append(self._item_event("response.output_text.done", content_index=0, text=part["text"], logprobs=[]))
            out.append(self._item_event("response.content_part.done", content_index=0, part=part))
        else:
            out.append(self._item_event("response.function_call_arguments.done", name=item["name"],
                                        arguments=item["arguments"] or "{}"))
            item["arguments"] = item["arguments"] or "{}"
        if "status" in item:
            item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=len(self.output) - 1, item=item))
        self._open = None
        return out


@post("/v1/responses", status_code=200)
async def responses(request: Request) -> Response | Stream:
    runtime = runtime_of(request)
    body = decode_body(await read_body(request), ResponsesRequest)
    check_model(runtime, body.model)
    # NOTE: the shared sampling body declares Chat Completions' fields too; sent here they are refused by
    # name, never dropped (a client that sends max_tokens would otherwise get the whole context).
    for name in _CHAT_ONLY:
        if getattr(body, name) is not None:
            hint = " (use max_output_tokens)" if name.startswith("max_") else ""
            raise unsupported(name, f"not a Responses API parameter{hint}")
    _refuse_stateful(body)
    conversation = _conversation(body)
    engine = require_engine(runtime)
    prompt = await prepare_off_loop(runtime, engine, conversation, param="input")
    sampling = build_sampling(runtime, body, prompt_len=len(prompt.ids), max_tokens=body.max_output_tokens,
                              prompt_param="input", max_tokens_param="max_output_tokens")
    response_id = engine.new_request_id("resp")
    events = submit(engine, response_id, prompt.ids, sampling, (), prompt.thinking, prompt.parser.parses_tools)
    shell = {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": runtime.model.served_name, "output": [],
        "parallel_tool_calls": conversation.parallel_tool_calls, "previous_response_id": None,
        "reasoning": body.reasoning or {"effort": None, "summary": None}, "store": False,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "text": {"format": {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": body.tools or [],
        "truncation": "disabled", "usage": None, "metadata": body.metadata or {},
    }
    if body.stream:
        items = OutputItems()  # shared with the failure frames: their sequence numbers go on from the stream's
        return Stream(guard_stream(engine, response_id, _sse(engine, response_id, events, prompt.parser, shell, items),
                                   lambda error: _failed(items, shell, error)), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collected = await collect(request, engine, response_id, events)
    raise_if_failed(collected[-1])
    items = OutputItems()
    for piece in [p for e in collected for p in prompt.parser.feed(e.text)] + prompt.parser.finish():
        items.add(piece)
    items.close()
    prompt.parser.settle(collected[-1])  # ft_requests_total: a function call is "tool_calls", as in Chat Completions
    return Response(content=_finished(shell, items.output, collected[-1]))


def _finished(shell: dict, output: list[dict], last) -> dict:
    complete = last.finish_reason != "length"
    return {**shell, "status": "completed" if complete else "incomplete", "output": output,
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "usage": {"input_tokens": last.prompt_tokens, "input_tokens_details": {"cached_tokens": last.cached_tokens},
                      "output_tokens": last.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": last.reasoning_tokens},
                      "total_tokens": last.prompt_tokens + last.completion_tokens}}


def _frame(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def _failed(items: OutputItems, shell: dict, error: OpenAIError) -> bytes:
    """How a stream that failed ends: an error event, then response.failed whose error carries the same code
    (and type) as the error event and the whole answer (a 400 request_too_large stays that, not server_error),
    so a client reading only the final event knows."""
    failed = {**shell, "status": "failed", "error": {"code": error.code, "message": error.message, "type": error.type}}
    return (_frame(items.event("error", code=error.code, message=error.message, param=None))
            + _frame(items.event("response.failed", response=failed)))


async def _sse(engine: Engine, response_id: str, events, parser: OutputParser, shell: dict, items: OutputItems):
    yield _frame(items.event("response.created", response=shell))
    yield _frame(items.event("response.in_progress", response=shell))
    async for event in events_until_finished(engine, response_id, events):
        if (error := event_error(event)) is not None:  # the code the whole answer would carry
            yield _failed(items, shell, error)
            return
        pieces = parser.feed(event.text) + (parser.finish() if event.finish_reason else [])
        for piece in pieces:
            for frame in items.add(piece):
                yield _frame(frame)
        if event.finish_reason is not None:
            parser.settle(event)
            for frame in items.close():
                yield _frame(frame)
            final = _finished(shell, items.output, event)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield _frame(items.event(kind, response=final))
