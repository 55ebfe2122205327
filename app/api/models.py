"""GET /v1/models and GET /v1/models/{id}."""

from __future__ import annotations

from typing import Annotated

from litestar import Request
from litestar.params import PathParameter

from app.api.generation import check_model, require_engine, runtime_of
from app.api.routing import get_or_head


def _card(request: Request) -> dict:
    runtime = runtime_of(request)
    engine = runtime.engine
    # NOTE: "first successful /v1/models" is the readiness milestone of benchmarks and load
    # balancers: 503 (Retry-After while loading) until the model can generate. A pool rebuild
    # does not count: the model is loaded and generation resumes on its own.
    if runtime.status != "ok" or engine is None or engine.phase == "error" or not engine.alive:
        require_engine(runtime)  # raises the 503 that says why
    model = runtime.model
    # max_model_len (vLLM's field; `ft bench prefill` reads it): the longest prompt + completion a request may ask for
    # now, the model's context or a smaller KV pool (a live resize moves it)
    return {"id": model.served_name, "object": "model", "created": model.created, "owned_by": "fluxtide",
            "max_model_len": runtime.max_context()}


@get_or_head("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_card(request)]}


@get_or_head("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: Annotated[str, PathParameter()]) -> dict:
    check_model(runtime_of(request), model_id.lstrip("/"))
    return _card(request)
