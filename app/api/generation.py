"""Shared by the generation routes: readiness, parameter validation, sampling defaults, submission
to the engine, the event stream that aborts when the client leaves, and the guard that ends a
stream with an error event when formatting it fails."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

import msgspec
from litestar import Request

from app.api.errors import OpenAIError, bad_value, log, service_unavailable, unsupported
from app.api.schemas import _Sampling
from app.engine import Engine, RequestRejected
from app.reasoning import ThinkingPlan
from app.runtime import Runtime
from app.streams import StreamEvent
from domain.request import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


def require_engine(runtime: Runtime) -> Engine:
    """503 while the model loads, after a load failure, or while pools are being swapped."""
    if runtime.status == "loading":
        p = runtime.progress
        raise service_unavailable(f"model is loading ({p.phase}, {p.bytes_done}/{p.bytes_total} bytes)")
    if runtime.status == "error" or runtime.engine is None:
        raise OpenAIError(503, f"model failed to load: {runtime.error}", type="server_error", code="load_failed")
    engine = runtime.engine
    if engine.phase == "rebuilding":
        raise service_unavailable("cache pools are being rebuilt; retry shortly")
    if engine.phase == "error" or not engine.alive:
        raise OpenAIError(503, f"engine is not running: {engine.last_error}", type="server_error", code="engine_down")
    return engine


def check_model(runtime: Runtime, model: str | None) -> None:
    if model is not None and model != runtime.model.served_name:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist; this server serves `{runtime.model.served_name}`",
            param="model",
            code="model_not_found",
        )


def reject_unsupported(body: _Sampling) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_value("stream_options", "stream_options is only allowed when stream is true")
    if body.n is not None and body.n < 1:  # OpenAI's own answer to n=0: an invalid value, not a missing feature
        raise bad_value("n", f"n must be at least 1, got {body.n}")
    if body.n is not None and body.n != 1:
        raise unsupported("n", f"n={body.n} is not supported: only one choice per request (n=1)")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            raise unsupported(name, f"{name} is not supported (got {value}); leave it unset or 0")
    if body.logit_bias:
        raise unsupported("logit_bias", "logit_bias is not supported")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
        if getattr(body, name) is not None:
            raise unsupported(name, f"{name} is not supported: there is no structured-output (grammar) engine here")
    for name, neutral in (("min_tokens", 0), ("repetition_penalty", 1), ("min_p", 0)):
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise unsupported(name, f"{name} is not supported (got {value!r}); leave it unset or {neutral}")


def max_tokens_of(body: _Sampling, default: int | None) -> tuple[int | None, str]:
    """The completion cap and the name the client gave it (max_completion_tokens wins)."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return (default if body.max_tokens is None else body.max_tokens), "max_tokens"


def stop_strings(stop: str | list[str] | None, param: str = "stop") -> tuple[str, ...]:
    """`param`: the client's name for the field (Anthropic's is stop_sequences)."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_STRINGS:
        raise bad_value(param, f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    if any(not s for s in items):
        raise bad_value(param, "stop strings must be non-empty")
    return tuple(items)


def build_sampling(
    runtime: Runtime,
    body: _Sampling,
    *,
    prompt_len: int,
    max_tokens: int | None,
    prompt_param: str,
    logprobs: bool = False,
    top_logprobs: int = 0,
    max_tokens_param: str = "max_tokens",
    top_logprobs_param: str = "top_logprobs",
) -> SamplingParams:
    """Validate ranges (400 naming the parameter the client sent: ``max_tokens_param`` and
    ``top_logprobs_param`` are its spellings of those two) and the context length, fill defaults."""
    model = runtime.model
    temperature = model.default_temperature if body.temperature is None else body.temperature
    top_p = model.default_top_p if body.top_p is None else body.top_p
    top_k = model.default_top_k if body.top_k is None else body.top_k
    if not 0 <= temperature <= 2:
        raise bad_value("temperature", f"temperature must be between 0 and 2, got {temperature}")
    if not 0 < top_p <= 1:
        raise bad_value("top_p", f"top_p must be in (0, 1], got {top_p}")
    if top_k == -1:  # the vLLM spelling of "no top-k cut"
        top_k = 0
    if top_k < 0:
        raise bad_value("top_k", f"top_k must be >= 0 (or -1 for none), got {top_k}")
    vocab = getattr(runtime.engine.spec, "vocab_size", None) if runtime.engine is not None else None
    if vocab is not None and top_k >= vocab:
        # NOTE: a cut at or past the vocabulary keeps every token (vLLM reads it so too); clamped here, since
        # the sampler packs top_k into an int64 and any integer the JSON carries is accepted.
        top_k = 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_value(top_logprobs_param,
                        f"{top_logprobs_param} must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    if body.seed is not None and not -(2**63) <= body.seed < 2**64:
        raise bad_value("seed", "seed must fit in 64 bits")
    if prompt_len == 0:
        raise bad_value(prompt_param, "the prompt is empty")
    limit, which = runtime.context_limit()
    if max_tokens is not None and max_tokens < 1:
        raise bad_value(max_tokens_param, f"{max_tokens_param} must be >= 1, got {max_tokens}")
    room = limit - prompt_len
    # NOTE: no max_tokens is "the rest of the context"; the scheduler re-derives it from the pools the request
    # is admitted into (a live resize may hold it and change them first).
    is_default = max_tokens is None
    if is_default:
        max_tokens = room
    if room < 1 or prompt_len + max_tokens > limit:
        raise OpenAIError(
            400,
            f"{which} However, you requested "
            f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the prompt, {max(max_tokens, 1)} "
            f"for the completion). Please reduce the prompt or the completion length.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        max_tokens_is_default=is_default,
    )


def submit(
    engine: Engine, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, stop: tuple[str, ...],
    thinking: ThinkingPlan | None = None, relabel_stop: bool = False,
) -> asyncio.Queue:
    """``relabel_stop``: the handler parses tool calls and settles the last event's count with the finish reason
    it gives (StreamEvent.settle)."""
    try:
        return engine.submit(request_id, prompt_ids, sampling, stop, thinking, relabel_stop)
    except RequestRejected as exc:
        raise OpenAIError(400, f"request can not be served: {exc}", code="request_too_large") from None


async def events_until_finished(engine: Engine, request_id: str, events: asyncio.Queue) -> AsyncIterator[StreamEvent]:
    """Yield the request's events; if the consumer stops early (client gone), abort it at once."""
    finished = False
    try:
        while not finished:
            event: StreamEvent = await events.get()
            finished = event.finish_reason is not None
            yield event
    finally:
        if not finished:
            engine.abort(request_id)


async def guard_stream(engine: Engine, request_id: str, stream: AsyncGenerator[bytes, None],
                       final: Callable[[OpenAIError], bytes]) -> AsyncIterator[bytes]:
    """Yield ``stream``'s frames; if it raises, log the failure once and end with ``final(error)``: the API's
    own error event (and terminator), for a 500 naming only the exception's class.

    NOTE: an exception out of a Stream's iterator makes Litestar drop the connection mid-body: on a GPU run a
    failing logprobs lookup left the client with "incomplete chunked read", no error event, and an
    ExceptionGroup in the log. The request is aborted here at once (the events generator nested in ``stream``
    would abort it only once its finalizer runs). A client gone (CancelledError, GeneratorExit) is no Exception:
    it passes through, and ``stream`` is closed either way so its own cleanup runs."""
    try:
        async with contextlib.aclosing(stream):
            async for frame in stream:
                yield frame
    except Exception as exc:
        log.exception("stream %s failed", request_id)
        engine.abort(request_id)  # a no-op if it already finished
        yield final(OpenAIError(500, f"internal server error while streaming ({type(exc).__name__})",
                                type="server_error", code="internal_error"))


def openai_sse_error(error: OpenAIError) -> bytes:
    """The end of a Chat Completions or Completions stream that failed: the error object, then [DONE]."""
    return b"data: " + msgspec.json.encode(error.body()) + b"\n\ndata: [DONE]\n\n"


async def collect(request: Request, engine: Engine, request_id: str, events: asyncio.Queue) -> list[StreamEvent]:
    """Non-streaming: gather every event, aborting if the client disconnects first."""

    async def gather() -> list[StreamEvent]:
        return [e async for e in events_until_finished(engine, request_id, events)]

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gathering = asyncio.ensure_future(gather())
    watching = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({gathering, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if gathering not in done:
        gathering.cancel()
        engine.abort(request_id)
        raise OpenAIError(499, "client disconnected", code="client_closed")
    return gathering.result()


def event_error(event: StreamEvent) -> OpenAIError | None:
    """The error a final event carries, or None. One mapping for both answers, so a condition
    gets the same status, ``type`` and ``code`` streamed (an SSE error event) and not streamed."""
    if event.finish_reason == "error" and event.error_status == 400:
        return OpenAIError(400, event.error or "request rejected", code="request_too_large")
    if event.finish_reason == "error" and event.error_status == 503:
        return OpenAIError(503, event.error or "engine is not running", type="server_error", code="engine_down")
    if event.finish_reason == "error":
        return OpenAIError(500, event.error or "generation failed", type="server_error", code="engine_error")
    if event.finish_reason == "abort" and event.error:
        return service_unavailable(event.error)
    return None


def raise_if_failed(event: StreamEvent) -> None:
    error = event_error(event)
    if error is not None:
        raise error


def usage(event: StreamEvent) -> dict:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": event.reasoning_tokens},  # tokens, not characters
        # prompt tokens whose KV (and GDN state) came from the prefix cache instead of being computed
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }


def token_text(engine: Engine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])
