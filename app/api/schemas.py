"""Request bodies of the OpenAI-compatible API (msgspec), decoded with errors in OpenAI's shape.

Unknown fields are ignored (clients send many); fields we do not support are declared so that
a non-default value is refused by name instead of being silently dropped.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, TypeVar

import msgspec

from app.api.errors import OpenAIError


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer spelling of max_tokens; wins when both are sent
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions that constrain or reshape the output (Any: refused by name whatever their type)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    min_tokens: Any = None
    repetition_penalty: Any = None
    min_p: Any = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM's extension: False ends the prompt without the assistant header
    continue_final_message: bool = False  # vLLM's extension: the model continues the last message
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking_token_budget: int | None = None  # vLLM's extension: reasoning tokens before the close is forced
    # legacy function calling, audio output and hosted web search: refused by name (never answered as if absent)
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    # NOTE: msgspec allows one array type per union; str | token ids | [str] | [[ids]] is checked by hand.
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class RoutingRequest(msgspec.Struct, kw_only=True):
    replay: bool  # True: replace the routers' choice (--routing-replay); False: natural routing


class CacheRebuildRequest(msgspec.Struct, kw_only=True):
    # sizes: an integer, an integral JSON float (1e4), or a string (8k, 1.5m, 1e4); app.api.admin._count
    kv_tokens: int | float | str | None = None
    moe_slots: int | float | str | None = None
    mamba_slots: int | float | str | None = None
    wait_s: float = 60.0


# A body that stops arriving for this long is abandoned with a 408: the limit is on silence, not on the whole
# body, so a large prompt over a slow link is still read.
BODY_IDLE_S = 30.0


async def read_body(request) -> bytes:
    """The request's body, chunk by chunk; 408 `request_timeout` when no byte arrives for BODY_IDLE_S (half a body
    and then silence held the handler, the connection and the client forever)."""
    chunks: list[bytes] = []
    stream = request.stream()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), BODY_IDLE_S)
            except StopAsyncIteration:
                return b"".join(chunks)
            except TimeoutError:
                raise OpenAIError(408, f"the request body stopped arriving: no bytes for {BODY_IDLE_S:g} s",
                                  code="request_timeout") from None
            chunks.append(chunk)
    finally:
        await stream.aclose()


_T = TypeVar("_T")
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def decode_body(body: bytes, kind: type[_T]) -> _T:
    """Decode a JSON body: malformed JSON -> 400, wrong types or missing fields -> 422, a number past a float's
    range (1e999) -> 400 invalid_value (as the same size spelled "1e999" in a string); param named."""
    if not body.strip():
        raise OpenAIError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc)) or _MISSING.search(str(exc))
        param = match.group(1) if match else None
        if str(exc).startswith("Number out of range"):  # 1e999: a number of the right type, its value unusable
            raise OpenAIError(400, f"invalid request: {exc}", param=param or None, code="invalid_value") from None
        raise OpenAIError(422, f"invalid request: {exc}", param=param or None, code="invalid_type") from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:  # JSON nested ~1,000 deep (in an untyped field): the client's input, a 400
        raise OpenAIError(400, "JSON body is nested too deeply", code="invalid_json") from None
