"""Optional API key: ``Authorization: Bearer <key>`` or Anthropic's ``x-api-key: <key>``, compared in
constant time."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from app.api.errors import OpenAIError


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    expected = connection.app.state.runtime.api_key
    if not expected:
        return
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header and "x-api-key" in connection.headers:  # Anthropic clients
        scheme, token = "bearer", connection.headers["x-api-key"]
    # NOTE: compare bytes of equal type; compare_digest leaks only the length, never the content.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise OpenAIError(
            401,
            "Incorrect or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )
