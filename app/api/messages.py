"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (coding CLIs pointed
at a local base URL), streamed as Anthropic's SSE events or whole; errors in Anthropic's shape.

Content blocks map onto the chat template's messages: ``text`` -> content, ``thinking`` ->
``reasoning_content``, ``tool_use`` -> ``tool_calls``, ``tool_result`` -> a ``tool`` message.
Images, documents and Anthropic's server tools are refused by name.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.exceptions import HTTPException
from litestar.response import Stream

from app.api.agent import (
    Conversation,
    OutputParser,
    Prompt,
    Reasoning,
    check_tool_choice,
    function_tool,
)
from app.api.errors import OpenAIError, bad_value, internal_error_handler, unsupported
from app.api.generation import (
    build_sampling,
    check_model,
    collect,
    event_error,
    events_until_finished,
    guard_stream,
    raise_if_failed,
    reject_unsupported,
    require_engine,
    runtime_of,
    stop_strings,
    submit,
)
from app.api.prompts import prepare_off_loop
from app.api.schemas import _Sampling, decode_body, read_body
from app.api.tool_pairing import PairingWords, ToolPairing
from app.engine import Engine
from app.runtime import Runtime
from app.tool_parsers import ToolCallDelta

# Anthropic's documented floor for thinking.budget_tokens (smaller budgets are a 400 there too).
MIN_THINKING_BUDGET = 1024
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error"}


# Anthropic's tool_choice types and the Conversation's tool_choice each one is.
_TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}

_CHAT_ONLY = {"stop": " (use stop_sequences)", "n": "", "max_completion_tokens": " (use max_tokens)",
              "presence_penalty": "", "frequency_penalty": "", "logit_bias": "", "stream_options": ""}


class AnthropicMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]]


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(_Sampling, kw_only=True):
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _error_body(exc: OpenAIError) -> dict:
    kind = "api_error" if exc.status_code >= 500 and exc.status_code != 503 else _ERROR_TYPES.get(exc.status_code)
    message = f"{exc.param}: {exc.message}" if exc.param and not exc.message.startswith(exc.param) else exc.message
    return {"type": "error", "error": {"type": kind or "invalid_request_error", "message": message}}


def _anthropic_error(_: Request, exc: Exception) -> Response:
    if isinstance(exc, HTTPException):
        exc = OpenAIError(exc.status_code, str(exc.detail), headers=exc.headers)
    if not isinstance(exc, OpenAIError):
        internal_error_handler(_, exc)  # logs it
        exc = OpenAIError(500, f"internal error: {exc!r}")
    # NOTE: Anthropic answers a wrong type or a missing field with 400 invalid_request_error, never 422 (the
    # anthropic client raises BadRequestError on it: code written against Anthropic's API expects that class)
    status = 400 if exc.status_code == 422 else exc.status_code
    return Response(content=_error_body(exc), status_code=status, headers=exc.headers)


# NOTE: keyed like the app-level handlers: Litestar picks the most specific class across layers.
ANTHROPIC_ERRORS = {OpenAIError: _anthropic_error, HTTPException: _anthropic_error, Exception: _anthropic_error}


def _text(blocks, param: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if blocks is not None and not isinstance(blocks, list):
        raise bad_value(param, "content must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(blocks or []):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise unsupported(f"{param}[{i}]", "only text blocks are supported here")
        if not isinstance(block.get("text"), str):
            raise bad_value(f"{param}[{i}].text", "a text block needs a `text` string")
        texts.append(block["text"])
    return "\n".join(texts)


def _messages(system, messages: list[AnthropicMessage]) -> list[dict]:
    if not messages:
        raise bad_value("messages", "messages must contain at least one message")
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    # NOTE: Anthropic's pairing rule: a tool_result answers a tool_use of the assistant turn right before it, and
    # every tool_use is answered there (consecutive user messages are one turn there)
    pairing = ToolPairing(_PAIRING)
    for i, m in enumerate(messages):
        param = f"messages[{i}].content"
        if m.role not in ("user", "assistant"):
            raise bad_value(f"messages[{i}].role", f"role must be 'user' or 'assistant', got {m.role!r}")
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            pairing.settle()
            out.append(_assistant(blocks, i, pairing))
            continue
        texts: list[str] = []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad_value(f"{param}[{j}].text", "a text block needs a `text` string")
                texts.append(block["text"])
            elif kind == "tool_result":
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                content = _text(block.get("content", ""), f"{param}[{j}].content")
                if block.get("is_error"):
                    content = "Error: " + content
                out.append({"role": "tool", "tool_call_id": _answered(block, pairing, f"{param}[{j}]"),
                            "content": content})
            else:
                raise unsupported(f"{param}[{j}]", f"content block type {kind!r} is not supported (text and "
                                  "tool_result are)")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    pairing.settle()
    return out


def _answered(block: dict, pairing: ToolPairing, param: str) -> str:
    """The tool_use id a tool_result block answers, checked: one of the previous assistant turn's tool_use blocks
    not answered yet (a result to no call was rendered as a tool response the model never asked for)."""
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str) or not use_id:
        raise bad_value(f"{param}.tool_use_id", "a tool_result block needs a `tool_use_id` string")
    pairing.answer(use_id, f"{param}.tool_use_id")
    return use_id


def _unexpected(use_id: str, pairing: ToolPairing) -> str:
    answerable = pairing.turn  # the previous assistant turn's tool_use ids: each turn settles the one before
    before = f"its tool_use ids are {', '.join(answerable)}" if answerable else "it has no tool_use blocks"
    return (f"unexpected tool_use_id {use_id!r} in a tool_result block: each tool_result must answer a tool_use "
            f"block of the previous assistant message ({before})")


# Anthropic's pairing rules, in its words where it has them
_PAIRING = PairingWords(
    unanswered="tool_use ids were found without tool_result blocks immediately after: {ids}. Each tool_use block "
               "must have a corresponding tool_result block in the next message.",
    duplicate_call="tool_use ids must be unique: {id} is also the id of an earlier tool_use block ({first})",
    duplicate_answer="each tool_use must have a single result: tool_use_id {id} has a tool_result block already "
                     "({first})",
    dangling=_unexpected,
)


def _assistant(blocks: list, i: int, pairing: ToolPairing) -> dict:
    param = f"messages[{i}].content"
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("text", "thinking"):
            if not isinstance(block.get(kind), str):
                raise bad_value(f"{param}[{j}].{kind}", f"a {kind} block needs a `{kind}` string")
            (texts if kind == "text" else reasoning).append(block[kind])
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing this model can read
        elif kind == "tool_use":
            if not isinstance(block.get("input", {}), dict) or not isinstance(block.get("name"), str) or not block["name"]:
                raise bad_value(f"{param}[{j}]", "tool_use needs a name and an object input")
            if not isinstance(block.get("id"), str) or not block["id"]:
                raise bad_value(f"{param}[{j}].id", "a tool_use block needs an `id` string (its tool_result names it)")
            pairing.call(block["id"], f"{param}[{j}].id", f"messages[{i}]")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        else:
            raise unsupported(f"{param}[{j}]", f"content block type {kind!r} is not supported in assistant turns")
    message: dict = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _conversation(body: MessagesRequest | CountTokensRequest) -> Conversation:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") in (None, "custom") and "input_schema" not in tool:
            raise bad_value(f"tools[{i}].input_schema", "a client tool needs an input_schema")
        if tool.get("type") not in (None, "custom"):
            raise unsupported(f"tools[{i}]", f"tool type {tool.get('type')!r} is not supported: only client "
                              "tools with an input_schema")
        tools.append(function_tool(tool.get("name"), tool.get("description"), tool["input_schema"], f"tools[{i}]"))
    choice = body.tool_choice or {"type": "auto"}
    given = choice.get("type")
    # NOTE: any JSON value may arrive here: only a string is looked up (a list or an object is unhashable)
    kind = _TOOL_CHOICES.get(given) if isinstance(given, str) else None
    if kind is None:
        raise bad_value("tool_choice.type", f"tool_choice type must be auto, any, tool or none, got {given!r}")
    # NOTE: checked here in Anthropic's terms; check_tool_choice below would say 'required' / 'function'.
    if kind in ("required", "function") and not tools:
        raise bad_value("tool_choice", f"tool_choice {choice.get('type')!r} needs tools")
    if kind == "function" and not isinstance(choice.get("name"), str):
        raise bad_value("tool_choice.name", "tool_choice 'tool' needs the name of one of the tools")
    kwargs, budget = _thinking(body.thinking)
    messages = _messages(body.system, body.messages)
    # NOTE: Anthropic's prefill: a last assistant turn with text is the start of the answer, which the model
    # continues (the response holds only what follows); rendered as a whole turn it got a fresh answer instead.
    last = messages[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"].strip())
    conversation = Conversation(
        messages=messages,
        tools=tools,
        tool_choice=kind,
        forced_function=choice.get("name"),
        parallel_tool_calls=not choice.get("disable_parallel_tool_use", False),
        template_kwargs=kwargs,
        thinking_budget=budget,
        budget_param="thinking.budget_tokens",
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
    )
    check_tool_choice(conversation, "tool_choice")
    return conversation


def _thinking(thinking: dict | None) -> tuple[dict, int | None]:
    """``thinking`` -> (chat template kwargs, reasoning-token budget). "disabled" renders the template
    with enable_thinking=False; "enabled" needs budget_tokens >= 1024, enforced by forcing the close."""
    if thinking is None:
        return {}, None
    kind, budget = thinking.get("type"), thinking.get("budget_tokens")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_value("thinking.type", "thinking type must be enabled, disabled or adaptive")
    if kind != "enabled":
        if budget is not None:
            raise bad_value("thinking.budget_tokens", f"budget_tokens is only allowed when thinking is enabled "
                            f"(type {kind!r})")
        return {"enable_thinking": kind != "disabled"}, None
    if budget is None:
        raise bad_value("thinking.budget_tokens", "thinking.budget_tokens is required when thinking is enabled")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
        raise bad_value("thinking.budget_tokens", f"thinking.budget_tokens must be an integer >= "
                        f"{MIN_THINKING_BUDGET}, got {budget!r}")
    return {"enable_thinking": True}, budget


async def _prompt(runtime: Runtime, body) -> tuple[Engine, Prompt]:
    check_model(runtime, body.model)
    conversation = _conversation(body)
    engine = require_engine(runtime)
    return engine, await prepare_off_loop(runtime, engine, conversation, call_id_prefix="toolu_")


@post("/v1/messages/count_tokens", status_code=200, exception_handlers=ANTHROPIC_ERRORS)
async def count_tokens(request: Request) -> Response:
    body = decode_body(await read_body(request), CountTokensRequest)
    _, prompt = await _prompt(runtime_of(request), body)
    return Response(content={"input_tokens": len(prompt.ids)})


@post("/v1/messages", status_code=200, exception_handlers=ANTHROPIC_ERRORS)
async def messages(request: Request) -> Response | Stream:
    runtime = runtime_of(request)
    body = decode_body(await read_body(request), MessagesRequest)
    if body.max_tokens is None:
        raise bad_value("max_tokens", "max_tokens is required")
    # NOTE: the shared sampling body declares Chat Completions' fields too: refused by name, never dropped.
    for name, hint in _CHAT_ONLY.items():
        if getattr(body, name) is not None:
            raise unsupported(name, f"not a Messages API parameter{hint}")
    reject_unsupported(body)  # vLLM's extensions (guided_json, min_p, ...): served as if absent before
    _check_ranges(body)
    if body.top_p == 0:
        # NOTE: Anthropic's range includes 0, where nucleus sampling's smallest prefix is the top token alone:
        # top-k 1 (the sampler keeps the top token at any top_p; Chat Completions' (0, 1] has no such edge)
        body = msgspec.structs.replace(body, top_p=None, top_k=1)
    stop = stop_strings(body.stop_sequences, "stop_sequences")
    engine, prompt = await _prompt(runtime, body)
    budget = prompt.thinking.budget if prompt.thinking is not None else None
    # NOTE: Anthropic's rule; its interleaved-thinking beta lifts it (thinking then spans tool turns).
    if budget is not None and budget >= body.max_tokens and "interleaved-thinking" not in request.headers.get(
            "anthropic-beta", ""):
        raise bad_value("max_tokens", f"max_tokens ({body.max_tokens}) must be greater than "
                        f"thinking.budget_tokens ({budget})")
    sampling = build_sampling(runtime, body, prompt_len=len(prompt.ids), max_tokens=body.max_tokens,
                              prompt_param="messages")
    message_id = engine.new_request_id("msg")
    events = submit(engine, message_id, prompt.ids, sampling, stop, prompt.thinking, prompt.parser.parses_tools)
    model = runtime.model.served_name
    if body.stream:
        stream = _sse(engine, message_id, events, model, prompt.parser, len(prompt.ids))
        return Stream(guard_stream(engine, message_id, stream, _error_event),
                      media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collected = await collect(request, engine, message_id, events)
    last = collected[-1]
    raise_if_failed(last)
    parser = prompt.parser
    blocks: list[dict] = []
    for piece in [p for e in collected for p in parser.feed(e.text)] + parser.finish():
        _add(blocks, piece)
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = msgspec.json.decode(block.pop("partial_json") or "{}")
    return Response(content={
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
        "stop_reason": _stop_reason(parser, last), "stop_sequence": last.stop_string,
        "usage": _usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens),
    })


def _check_ranges(body: MessagesRequest) -> None:
    """Anthropic's ranges, where they are narrower than Chat Completions' (temperature up to 2, top_k -1 for no
    cut); checked before the prompt is rendered, so a max_tokens of 0 is not reported against a thinking budget."""
    if body.max_tokens < 1:
        raise bad_value("max_tokens", f"max_tokens must be >= 1, got {body.max_tokens}")
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise bad_value("temperature", f"temperature must be between 0 and 1, got {body.temperature}")
    if body.top_p is not None and not 0 <= body.top_p <= 1:
        raise bad_value("top_p", f"top_p must be between 0 and 1, got {body.top_p}")
    if body.top_k is not None and body.top_k < 0:
        raise bad_value("top_k", f"top_k must be >= 0, got {body.top_k}")


def _add(blocks: list[dict], piece) -> None:
    """Fold one parser piece into the content blocks (non-streamed answer)."""
    if isinstance(piece, Reasoning):
        if not blocks or blocks[-1]["type"] != "thinking":
            blocks.append({"type": "thinking", "thinking": "", "signature": ""})
        blocks[-1]["thinking"] += piece.text
    elif isinstance(piece, ToolCallDelta):
        if piece.id is not None:
            blocks.append({"type": "tool_use", "id": piece.id, "name": piece.name, "partial_json": ""})
        blocks[-1]["partial_json"] += piece.arguments
    else:
        if not blocks or blocks[-1]["type"] != "text":
            blocks.append({"type": "text", "text": ""})
        blocks[-1]["text"] += piece


def _stop_reason(parser: OutputParser, last) -> str | None:
    """Anthropic's stop_reason for the last event; called once per answer, after the parser read all its text, so
    it also settles the request's count on ft_requests_total (OutputParser.settle)."""
    reason = parser.settle(last)
    if reason == "tool_calls":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if last.stop_string is not None else "end_turn"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    # NOTE: Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens = the whole prompt.
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode({"type": name, **data}) + b"\n\n"


def _error_event(error: OpenAIError) -> bytes:
    """How a stream that failed ends: Anthropic's error event (and nothing after it)."""
    return _event("error", {"error": _error_body(error)["error"]})


async def _sse(engine: Engine, message_id: str, events, model: str, parser: OutputParser, prompt_tokens: int):
    yield _event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_tokens, 0)}})
    open_block: list = [None, -1]  # [type, index]

    def switch(kind: str, start: dict) -> list[bytes]:
        out = []
        if open_block[0] is not None:
            out.append(_event("content_block_stop", {"index": open_block[1]}))
        open_block[:] = [kind, open_block[1] + 1]
        out.append(_event("content_block_start", {"index": open_block[1], "content_block": start}))
        return out

    def frames(pieces) -> list[bytes]:
        out = []
        for piece in pieces:
            if isinstance(piece, Reasoning):
                if open_block[0] != "thinking":
                    out += switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                delta = {"type": "thinking_delta", "thinking": piece.text}
            elif isinstance(piece, ToolCallDelta):
                if piece.id is not None:
                    out += switch("tool_use", {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
                if not piece.arguments:
                    continue
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            else:
                if open_block[0] != "text":
                    out += switch("text", {"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": piece}
            out.append(_event("content_block_delta", {"index": open_block[1], "delta": delta}))
        return out

    async for event in events_until_finished(engine, message_id, events):
        if (error := event_error(event)) is not None:  # the status the whole answer would carry, so one type
            yield _error_event(error)
            return
        for frame in frames(parser.feed(event.text) + (parser.finish() if event.finish_reason else [])):
            yield frame
        if event.finish_reason is not None:
            if open_block[0] is not None:
                yield _event("content_block_stop", {"index": open_block[1]})
            yield _event("message_delta", {
                "delta": {"stop_reason": _stop_reason(parser, event), "stop_sequence": event.stop_string},
                # NOTE: cache reads are known only once the request started, after message_start went out
                # (which counted the whole prompt as input): both are restated so they add up to the prompt.
                "usage": {"output_tokens": event.completion_tokens,
                          "input_tokens": event.prompt_tokens - event.cached_tokens,
                          "cache_read_input_tokens": event.cached_tokens}})
            yield _event("message_stop", {})
