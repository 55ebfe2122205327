"""Route decorators shared by the API modules."""

from __future__ import annotations

from typing import Any

from litestar import HttpMethod, route


def get_or_head(path: str, **kwargs: Any):
    """``@get`` that also answers HEAD (same status and headers, no body: uvicorn drops it), so
    load balancers and uptime checks that probe with HEAD see what GET would say."""
    return route(path, http_method=[HttpMethod.GET, HttpMethod.HEAD], **kwargs)
