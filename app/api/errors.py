"""Every error leaves the server in OpenAI's shape: {"error": {message, type, param, code}}.

Handlers raise ``OpenAIError``; Litestar's own exceptions (unknown route, wrong method, body
problems) and anything unexpected are translated here, so a client never sees another shape.
"""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

log = logging.getLogger("fluxtide.api")


class OpenAIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code},
            **self.extra,
        }


def bad_value(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="unsupported_parameter")


def service_unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="service_unavailable", code="service_unavailable", headers={"Retry-After": "1"})


def _respond(error: OpenAIError) -> Response:
    return Response(content=error.body(), status_code=error.status_code, headers=error.headers)


def openai_error_handler(_: Request, exc: OpenAIError) -> Response:
    return _respond(exc)


_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_entity_too_large"}


def http_exception_handler(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    return _respond(
        OpenAIError(status, str(exc.detail), type=_HTTP_TYPES.get(status, "invalid_request_error"),
                    code=_HTTP_CODES.get(status), headers=exc.headers)
    )


def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return _respond(OpenAIError(500, f"internal error: {exc!r}", type="server_error", code="internal_error"))


EXCEPTION_HANDLERS = {
    OpenAIError: openai_error_handler,
    HTTPException: http_exception_handler,
    Exception: internal_error_handler,
}
