"""The OpenAPI document Litestar generates from the routes, completed with the real request and
response shapes, served at /schema/openapi.json (and checked by a schemathesis fuzz in CI).

The handlers parse their bodies by hand (errors in OpenAI's shape, ``param`` named), so Litestar
sees neither request bodies nor response types. This module fills them in from msgspec: request
bodies from the structs the handlers decode (app.api.schemas), responses from the structs below,
which describe what the handlers return (the fuzz validates every response against them).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from litestar import Request
from litestar.openapi.plugins import JsonRenderPlugin

from app.api.schemas import CacheRebuildRequest, ChatCompletionRequest, CompletionRequest, RoutingRequest

REF = "#/components/schemas/{name}"


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every error the server sends (extra keys, e.g. a resize refusal's plan, may follow)."""

    error: ErrorBody


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"]


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"]


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int  # prompt + completion tokens a request may hold now (the model's context or the KV pool)


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


class Health(msgspec.Struct):
    status: Literal["loading", "ok", "error"]
    phase: str
    bytes_done: int
    bytes_total: int
    error: str | None
    engine: str | None
    model: str
    uptime_s: float
    routing: dict[str, Any] | None  # {"mode": "natural"} or the --routing-replay description; null while loading


class StatsPeaks(msgspec.Struct):
    running_peak: int  # the most requests running at once since start or the previous reset
    waiting_peak: int  # the most requests waiting at once
    since_s: float  # the seconds those peaks span


class TraceStep(msgspec.Struct):
    end: float  # when its model call returned, epoch seconds (the server's wall clock)
    seconds: float  # the model call
    host_seconds: float | None  # the engine thread's time since the previous call returned; null after idling
    decode_rows: int
    prefill_tokens: int  # computed by its prefill works (a layered chunk's tokens in each of its groups)
    prefill_works: int
    layers: tuple[int, int] | None  # the layer group [first, end) of a layered chunk's work; null: none
    layer_tokens: int  # that chunk's tokens (0 without a layer group)
    expert_hits: int
    expert_misses: int


class StepTrace(msgspec.Struct):
    clock: Literal["unix"]
    window_s: float  # the trace keeps the steps of the last window_s seconds (the /v1/stats window)
    steps: list[TraceStep]  # oldest first


class CacheRebuildResult(msgspec.Struct):
    status: Literal["ok"]
    message: str
    experts_kept: bool
    max_running: int  # the running requests the new pools admit: min(--max-running-requests, state slots)
    before: dict[str, Any]
    after: dict[str, Any]
    waited_s: float  # waiting for in-flight requests
    swap_s: float  # rebuilding and installing the pools (a rollback included)
    total_s: float


# One server-sent event (the WHATWG fields; validators such as schemathesis check each event of a stream
# against this schema, so it describes an event, not the stream as one string)
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}}}}}
_GENERATION_ERRORS = (400, 401, 404, 413, 422, 499, 500, 503)
# (path, method) -> request body, 200 body, 200 streamed too, error statuses
_OPERATIONS: dict[tuple[str, str], tuple[type | None, type | None, bool, tuple[int, ...]]] = {
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletion, True, _GENERATION_ERRORS),
    ("/v1/completions", "post"): (CompletionRequest, Completion, True, _GENERATION_ERRORS),
    ("/v1/cache/rebuild", "post"): (CacheRebuildRequest, CacheRebuildResult, False, (400, 401, 409, 413, 422, 503)),
    ("/v1/routing", "post"): (RoutingRequest, None, False, (400, 401, 409, 413, 422, 503)),
    ("/v1/models", "get"): (None, ModelList, False, (401, 503)),
    ("/v1/models/{model_id}", "get"): (None, Model, False, (401, 404, 503)),
    ("/health", "get"): (None, Health, False, (503,)),
    ("/v1/stats", "get"): (None, None, False, (401, 503)),
    ("/v1/stats/reset_peaks", "post"): (None, StatsPeaks, False, (401, 503)),
    ("/v1/stats/steps", "get"): (None, StepTrace, False, (400, 401, 503)),
    ("/v1/cache/status", "get"): (None, None, False, (401, 503)),
    ("/metrics", "get"): (None, None, False, (401, 503)),
}
_REASONS = {400: "Bad request", 401: "Missing or wrong API key", 404: "Unknown model or route",
            409: "Resize refused or not applied (/v1/routing: the server has no routing replay)", 413: "Body too large", 422: "Wrong type or missing field",
            499: "Client disconnected", 500: "The model step failed (this request only)",
            503: "Loading, pools being swapped, or the engine cannot serve (see /health)"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def complete_document(generated: dict) -> dict:
    """Litestar's generated document with request bodies, response bodies and error responses."""
    structs = [ErrorResponse, *{t for body, ok, _, _ in _OPERATIONS.values() for t in (body, ok) if t}]
    _, components = msgspec.json.schema_components(structs, ref_template=REF)
    doc = msgspec.json.decode(msgspec.json.encode(generated))  # a deep copy: Litestar caches its own
    doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
    for (path, method), (body, ok, streams, errors) in _OPERATIONS.items():
        operation = doc.get("paths", {}).get(path, {}).get(method)
        if operation is None:
            continue
        if body is not None:
            operation["requestBody"] = {"required": True, "content": _json({"$ref": REF.format(name=body.__name__)})}
        responses = operation.setdefault("responses", {})
        content = _json({"$ref": REF.format(name=ok.__name__)}) if ok else _json({"type": "object"})
        if path == "/metrics":
            content = {"text/plain": {"schema": {"type": "string"}}}
        responses["200"] = {"description": "Success", "content": {**content, **(_SSE if streams else {})}}
        error_ref = {"$ref": REF.format(name="ErrorResponse")}
        for status in errors:
            schema = {"$ref": REF.format(name="Health")} if path == "/health" else error_ref
            responses[str(status)] = {"description": _REASONS[status], "content": _json(schema)}
    return doc


class CompletedJsonRenderPlugin(JsonRenderPlugin):
    """Serves the completed document at /schema/openapi.json."""

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        return self.render_json(request, complete_document(openapi_schema))
