"""POST /v1/chat/completions: OpenAI chat completions, streamed (SSE) or whole."""

from __future__ import annotations

import time

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
    split,
    template_kwargs_of,
    thinking_budget,
)
from app.api.errors import bad_value, unsupported
from app.api.generation import (
    build_sampling,
    check_model,
    collect,
    event_error,
    events_until_finished,
    guard_stream,
    max_tokens_of,
    openai_sse_error,
    raise_if_failed,
    reject_unsupported,
    require_engine,
    runtime_of,
    stop_strings,
    submit,
    usage,
)
from app.api.logprob_tokens import token_bytes, token_string
from app.api.prompts import prepare_off_loop
from app.api.schemas import ChatCompletionRequest, ChatMessage, decode_body, read_body
from app.api.tool_pairing import PairingWords, ToolPairing
from app.engine import Engine
from app.streams import StreamEvent

_ROLES = {"system", "user", "assistant", "developer", "tool", "function"}
# Legacy roles the chat templates do not know, and the role each is rendered as.
_LEGACY_ROLES = {"developer": "system", "function": "tool"}


def _messages(messages: list[ChatMessage]) -> list[dict]:
    if not messages:
        raise bad_value("messages", "messages must contain at least one message")
    out = []
    pairing = ToolPairing(_PAIRING)
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise bad_value(f"messages[{i}].role", f"unknown role {m.role!r}")
        role = _LEGACY_ROLES.get(m.role, m.role)
        message = {"role": role, "content": _content(m, i)}
        if role != "tool":  # NOTE: OpenAI's rule: the tool messages answering a turn's calls come right after it
            pairing.settle()
        _tool_fields(m, i, message, pairing)
        if m.reasoning_content:
            message["reasoning_content"] = m.reasoning_content
        if m.name is not None:  # NOTE: handed to the chat template, which may render it
            message["name"] = m.name
        out.append(message)
    pairing.settle()
    return out


def _content(m: ChatMessage, i: int) -> str:
    content = m.content
    # NOTE: OpenAI's rule: content is required, except for an assistant message that carries tool calls
    if content is None and not (m.role == "assistant" and m.tool_calls):
        raise bad_value(f"messages[{i}].content", "an assistant message needs content (or tool_calls)"
                        if m.role == "assistant" else f"a {m.role} message needs content")
    if not isinstance(content, list):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text":
            raise unsupported(f"messages[{i}].content", "only text content parts are supported")
        if not isinstance(part.get("text"), str):
            raise bad_value(f"messages[{i}].content[{j}].text", "a text part needs a `text` string")
        texts.append(part["text"])
    return "".join(texts)


def _tool_fields(m: ChatMessage, i: int, message: dict, pairing: ToolPairing) -> None:
    """``tool_calls`` and ``tool_call_id`` onto the template's message, each call and result paired (an assistant
    message's calls are the calls; a call without an id, which no result can name, is not tracked)."""
    if m.tool_calls:
        message["tool_calls"] = [_template_call(call, f"messages[{i}].tool_calls[{j}]")
                                 for j, call in enumerate(m.tool_calls)]
        for j, call in enumerate(message["tool_calls"] if m.role == "assistant" else []):
            if call["id"] is not None:
                pairing.call(call["id"], f"messages[{i}].tool_calls[{j}].id", f"messages[{i}]")
    if m.tool_call_id is not None:
        if message["role"] == "tool":
            pairing.answer(m.tool_call_id, f"messages[{i}].tool_call_id")
        message["tool_call_id"] = m.tool_call_id


def _dangling(call_id: str, pairing: ToolPairing) -> str:
    """A tool message whose tool_call_id names no earlier call: the template would render a result to nothing (the
    model reads an answer no call of its asked for), where OpenAI refuses the request."""
    known = list(pairing.calls)
    hint = f" (the tool call ids so far: {', '.join(map(repr, known[-8:]))}{', ...' if len(known) > 8 else ''})" \
        if known else " (no assistant message before it has tool_calls)"
    return f"tool_call_id {call_id!r} answers no tool call: no earlier assistant message has a tool call with that " \
        f"id{hint}"


# OpenAI's pairing rules, in its words where it has them
_PAIRING = PairingWords(
    unanswered="an assistant message with 'tool_calls' must be followed by tool messages responding to each "
               "'tool_call_id'; these tool_call_ids have no response message: {ids}",
    duplicate_call="duplicate tool call id {id}: an earlier tool call has it ({first}); each tool call needs its own "
                   "id, as a tool message names the call it answers by it",
    duplicate_answer="tool_call_id {id} has a response already ({first}): each tool call gets one tool message",
    dangling=_dangling,
)


def _template_call(call: dict, param: str) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_value(param, "a tool call needs function.name")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise bad_value(param + ".id", f"a tool call id must be a string, got {call['id']!r}")
    arguments = arguments_object(function.get("arguments", {}), param + ".function.arguments")
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _conversation(body: ChatCompletionRequest) -> Conversation:
    tools = []
    for i, tool in enumerate(body.tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(tool, dict) and tool.get("type") == "function" and function is None and "name" in tool:
            raise bad_value(f"tools[{i}]", 'a function tool is {"type": "function", "function": {"name": ..., '
                            '"parameters": ...}}: the Responses API\'s flat shape is not accepted here')
        if isinstance(tool, dict) and tool.get("type") == "function" and not isinstance(function, dict):
            raise bad_value(f"tools[{i}].function", 'a function tool needs its "function" object: '
                            '{"type": "function", "function": {"name": ..., "parameters": ...}}')
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise unsupported(f"tools[{i}]", "only function tools are supported")
        tools.append(function_tool(function.get("name"), function.get("description"), function.get("parameters"),
                                   f"tools[{i}]"))
    choice, forced = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none"), None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise bad_value("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
        choice, forced = "function", function["name"]
    template_kwargs, switches = template_kwargs_of(body.chat_template_kwargs)
    apply_reasoning_effort(template_kwargs, body.reasoning_effort, "reasoning_effort")
    conversation = Conversation(
        messages=_messages(body.messages),
        tools=tools,
        tool_choice=choice,
        forced_function=forced,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        template_kwargs=template_kwargs,
        thinking_budget=thinking_budget(body.thinking_token_budget),
        add_generation_prompt=switches.get("add_generation_prompt", body.add_generation_prompt),
        continue_final_message=switches.get("continue_final_message", body.continue_final_message),
    )
    check_tool_choice(conversation)
    return conversation


def _delta(pieces: list) -> dict:
    """A chat.completion.chunk delta from parser pieces (content, reasoning_content, tool_calls)."""
    reasoning, content, calls = split(pieces)
    delta: dict = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [_call_delta(c) for c in calls]
    return delta


def _call_delta(c) -> dict:
    if c.id is not None:
        return {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
    return {"index": c.index, "function": {"arguments": c.arguments}}


def _logprobs(engine: Engine, event: StreamEvent) -> dict | None:
    if not event.logprobs:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        tokenizer = engine.tokenizer
        return {"token": token_string(tokenizer, token_id), "logprob": logprob,
                "bytes": list(token_bytes(tokenizer, token_id))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]} for lp in event.logprobs
        ]
    }


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response | Stream:
    runtime = runtime_of(request)
    body = decode_body(await read_body(request), ChatCompletionRequest)
    check_model(runtime, body.model)
    reject_unsupported(body)
    if body.functions or body.function_call is not None:
        name = "functions" if body.functions else "function_call"
        raise unsupported(name, f"{name} (the legacy function calling) is not supported: send tools and tool_choice")
    if body.modalities not in (None, ["text"]) or body.audio is not None:
        raise unsupported("audio" if body.audio is not None else "modalities", "only text output is supported")
    if body.web_search_options is not None:
        raise unsupported("web_search_options", "web search is not supported")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise unsupported("response_format", "only response_format type 'text' is supported")
    if body.top_logprobs and not body.logprobs:
        raise bad_value("top_logprobs", "top_logprobs requires logprobs=true")
    stop = stop_strings(body.stop)
    conversation = _conversation(body)
    engine = require_engine(runtime)
    prompt = await prepare_off_loop(runtime, engine, conversation)
    prompt_ids = prompt.ids
    max_tokens, max_tokens_param = max_tokens_of(body, None)
    sampling = build_sampling(
        runtime,
        body,
        prompt_len=len(prompt_ids),
        max_tokens=max_tokens,
        prompt_param="messages",
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        max_tokens_param=max_tokens_param,
    )
    request_id = engine.new_request_id("chatcmpl")
    events = submit(engine, request_id, prompt_ids, sampling, stop, prompt.thinking, prompt.parser.parses_tools)
    created = int(time.time())
    model = runtime.model.served_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Stream(
            guard_stream(engine, request_id,
                         _sse(engine, request_id, events, created, model, include_usage, prompt.parser),
                         openai_sse_error),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    collected = await collect(request, engine, request_id, events)
    last = collected[-1]
    raise_if_failed(last)
    content_logprobs = [e for lp in collected if (e := _logprobs(engine, lp))]
    parser = prompt.parser
    pieces = [p for e in collected for p in parser.feed(e.text)] + parser.finish()
    reasoning, content, _ = split(pieces)
    message: dict = {"role": "assistant", "content": content if content or not parser.tool_calls else None}
    if any(isinstance(p, Reasoning) for p in pieces):
        message["reasoning_content"] = reasoning
    if parser.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parser.tool_calls]
    return Response(
        content={
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": [c for d in content_logprobs for c in d["content"]]}
                    if body.logprobs
                    else None,
                    "finish_reason": parser.settle(last),
                }
            ],
            "usage": usage(last),
            "system_fingerprint": None,
        }
    )


async def _sse(engine: Engine, request_id: str, events, created: int, model: str, include_usage: bool,
               parser: OutputParser):
    def chunk(delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        data = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if include_usage:
            data["usage"] = None
        return b"data: " + msgspec.json.encode(data) + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    async for event in events_until_finished(engine, request_id, events):
        if (error := event_error(event)) is not None:
            yield openai_sse_error(error)
            return
        delta = _delta(parser.feed(event.text) + (parser.finish() if event.finish_reason is not None else []))
        if delta or event.logprobs:
            yield chunk(delta or {"content": ""}, logprobs=_logprobs(engine, event))
        if event.finish_reason is not None:
            yield chunk({}, finish_reason=parser.settle(event))
            if include_usage:
                yield b"data: " + msgspec.json.encode(
                    {
                        "id": request_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage(event),
                    }
                ) + b"\n\n"
    yield b"data: [DONE]\n\n"
