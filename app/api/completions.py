"""POST /v1/completions: legacy text completions from a text prompt or a list of token ids."""

from __future__ import annotations

import time

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream

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
    token_text,
    usage,
)
from app.api.logprob_tokens import token_string
from app.api.prompts import text_prompt_ids
from app.api.schemas import CompletionRequest, decode_body, read_body
from app.engine import Engine
from app.runtime import Runtime
from app.streams import StreamEvent


async def _prompt_ids(runtime: Runtime, engine: Engine, prompt: str | list) -> list[int]:
    """A string, a list of token ids, or a one-element batch of either."""
    batch_of_one = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list)
    if batch_of_one:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await text_prompt_ids(runtime, engine.tokenizer, prompt)
    # NOTE: inside a batch of one only token ids remain valid; a nested batch is a bad prompt, not a batch.
    if not batch_of_one and prompt and (all(isinstance(x, list) for x in prompt)
                                        or all(isinstance(x, str) for x in prompt)):
        raise unsupported("prompt", f"batched prompts ({len(prompt)}) are not supported; send one per request")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        raise bad_value("prompt", "prompt must be a string or a list of token ids")
    vocab = getattr(engine.spec, "vocab_size", None)
    if vocab is not None and any(not 0 <= x < vocab for x in prompt):
        raise bad_value("prompt", f"token ids must be in [0, {vocab})")
    return list(prompt)


class _Offsets:
    """Running text offsets for the completions-style logprobs object."""

    def __init__(self) -> None:
        self.offset = 0

    def logprobs(self, engine: Engine, event: StreamEvent) -> dict | None:
        if not event.logprobs:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for lp in event.logprobs:
            tokens.append(token_string(engine.tokenizer, lp.token_id))
            token_logprobs.append(lp.logprob)
            alternatives: dict[str, float] = {}
            for t, p in lp.top:  # best first; byte tokens are told apart by their bytes: strings
                alternatives.setdefault(token_string(engine.tokenizer, t), p)
            top.append(alternatives or None)
            offsets.append(self.offset)
            self.offset += len(token_text(engine, lp.token_id))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response | Stream:
    runtime = runtime_of(request)
    body = decode_body(await read_body(request), CompletionRequest)
    check_model(runtime, body.model)
    reject_unsupported(body)
    if body.echo:
        raise unsupported("echo", "echo is not supported")
    if body.best_of not in (None, 1):
        raise unsupported("best_of", f"best_of={body.best_of} is not supported")
    if body.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported")
    if body.logprobs is not None and body.logprobs < 0:
        raise bad_value("logprobs", f"logprobs must be >= 0, got {body.logprobs}")
    stop = stop_strings(body.stop)
    engine = require_engine(runtime)
    prompt_ids = await _prompt_ids(runtime, engine, body.prompt)
    # NOTE: OpenAI's completions default is 16 tokens (chat defaults to the rest of the context).
    max_tokens, max_tokens_param = max_tokens_of(body, 16)
    sampling = build_sampling(
        runtime,
        body,
        prompt_len=len(prompt_ids),
        max_tokens=max_tokens,
        prompt_param="prompt",
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
        max_tokens_param=max_tokens_param,
        top_logprobs_param="logprobs",
    )
    request_id = engine.new_request_id("cmpl")
    events = submit(engine, request_id, prompt_ids, sampling, stop)
    created = int(time.time())
    model = runtime.model.served_name
    offsets = _Offsets()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Stream(
            guard_stream(engine, request_id, _sse(engine, request_id, events, created, model, include_usage, offsets),
                         openai_sse_error),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    collected = await collect(request, engine, request_id, events)
    last = collected[-1]
    raise_if_failed(last)
    logprobs = None
    if body.logprobs is not None:
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for event in collected:
            part = offsets.logprobs(engine, event)
            for key in logprobs if part else ():
                logprobs[key].extend(part[key])
    return Response(
        content={
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": "".join(e.text for e in collected),
                    "logprobs": logprobs,
                    "finish_reason": last.finish_reason,
                }
            ],
            "usage": usage(last),
            "system_fingerprint": None,
        }
    )


async def _sse(engine, request_id, events, created, model, include_usage, offsets: _Offsets):
    def chunk(choices: list, usage_value=None) -> bytes:
        data = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if include_usage:
            data["usage"] = usage_value
        return b"data: " + msgspec.json.encode(data) + b"\n\n"

    async for event in events_until_finished(engine, request_id, events):
        if (error := event_error(event)) is not None:
            yield openai_sse_error(error)
            return
        if event.text or event.logprobs or event.finish_reason:
            choice = {
                "index": 0,
                "text": event.text,
                "logprobs": offsets.logprobs(engine, event),
                "finish_reason": event.finish_reason,
            }
            yield chunk([choice])
        if event.finish_reason is not None and include_usage:
            yield chunk([], usage(event))
    yield b"data: [DONE]\n\n"
