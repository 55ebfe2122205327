"""GET /v1/models and GET /v1/models/{id}."""

from __future__ import annotations

from typing import Annotated

from litestar import Request, get
from litestar.params import PathParameter

from app.api.generation import check_model, runtime_of


def _card(request: Request) -> dict:
    model = runtime_of(request).model
    return {"id": model.served_name, "object": "model", "created": model.created, "owned_by": "fluxtide"}


@get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_card(request)]}


@get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: Annotated[str, PathParameter()]) -> dict:
    check_model(runtime_of(request), model_id.lstrip("/"))
    return _card(request)
