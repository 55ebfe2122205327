"""POST /v1/chat/completions: OpenAI chat completions, streamed (SSE) or whole."""

from __future__ import annotations

import time

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream

from app.api.errors import OpenAIError, bad_value, unsupported
from app.api.generation import (
    build_sampling,
    check_model,
    collect,
    events_until_finished,
    raise_if_failed,
    reject_unsupported,
    require_engine,
    runtime_of,
    stop_strings,
    submit,
    token_text,
    usage,
)
from app.api.schemas import ChatCompletionRequest, ChatMessage, decode_body
from app.engine import Engine
from app.streams import StreamEvent

_ROLES = {"system", "user", "assistant", "developer", "tool"}


def _messages(messages: list[ChatMessage]) -> list[dict]:
    if not messages:
        raise bad_value("messages", "messages must contain at least one message")
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise bad_value(f"messages.[{i}].role", f"unknown role {m.role!r}")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise unsupported(f"messages.[{i}].content", "only text content parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out


def _logprobs(engine: Engine, event: StreamEvent) -> dict | None:
    if not event.logprobs:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(engine, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]} for lp in event.logprobs
        ]
    }


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request) -> Response | Stream:
    runtime = runtime_of(request)
    body = decode_body(await request.body(), ChatCompletionRequest)
    check_model(runtime, body.model)
    reject_unsupported(body)
    if body.tools:
        raise unsupported("tools", "tool calls are not supported by this server")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise unsupported("response_format", "only response_format type 'text' is supported")
    if body.top_logprobs and not body.logprobs:
        raise bad_value("top_logprobs", "top_logprobs requires logprobs=true")
    stop = stop_strings(body.stop)
    messages = _messages(body.messages)
    engine = require_engine(runtime)
    prompt_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = build_sampling(
        runtime,
        body,
        prompt_len=len(prompt_ids),
        max_tokens=max_tokens,
        prompt_param="messages",
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
    )
    request_id = engine.new_request_id("chatcmpl")
    events = submit(engine, request_id, prompt_ids, sampling, stop)
    created = int(time.time())
    model = runtime.model.served_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Stream(
            _sse(engine, request_id, events, created, model, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    collected = await collect(request, engine, request_id, events)
    last = collected[-1]
    raise_if_failed(last)
    content_logprobs = [e for lp in collected if (e := _logprobs(engine, lp))]
    return Response(
        content={
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(e.text for e in collected)},
                    "logprobs": {"content": [c for d in content_logprobs for c in d["content"]]}
                    if body.logprobs
                    else None,
                    "finish_reason": last.finish_reason,
                }
            ],
            "usage": usage(last),
            "system_fingerprint": None,
        }
    )


async def _sse(engine: Engine, request_id: str, events, created: int, model: str, include_usage: bool):
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
        if event.finish_reason in ("error",) or (event.finish_reason == "abort" and event.error):
            error = OpenAIError(500, event.error or "generation failed", type="server_error", code="engine_error")
            yield b"data: " + msgspec.json.encode(error.body()) + b"\n\n"
            break
        if event.text or event.logprobs:
            yield chunk({"content": event.text}, logprobs=_logprobs(engine, event))
        if event.finish_reason is not None:
            yield chunk({}, finish_reason=event.finish_reason)
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
