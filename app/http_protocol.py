"""uvicorn's HTTP/1.1 protocol with errors in OpenAI's shape even before the app sees a request.

uvicorn answers a request it cannot parse (headers over ``h11_max_incomplete_event_size``, a
malformed request line) itself, with a plain-text 400. This subclass answers the same cases with
the status h11 suggests (431 for oversized headers) and an ``{"error": {...}}`` JSON body, so a
client's error handling sees one shape for every error the server sends.
"""

from __future__ import annotations

import json
import sys

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_CODES = {431: ("request_header_fields_too_large", "request headers are too large"),
          400: ("invalid_http_request", "invalid HTTP request")}


def protocol_error_body(status: int) -> bytes:
    code, message = _CODES.get(status, _CODES[400])
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class OpenAIErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        # NOTE: uvicorn calls this inside its `except h11.RemoteProtocolError`, so the error that
        # caused it (and h11's status hint) is the exception being handled.
        exc = sys.exc_info()[1]
        status = exc.error_status_hint if isinstance(exc, h11.RemoteProtocolError) else 400
        status = status if status in _CODES else 400
        body = protocol_error_body(status)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
