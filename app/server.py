"""Builds the Litestar app around a Runtime and runs it under uvicorn."""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading

import uvicorn
from litestar import Litestar, Request, Response, Router
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.logging.config import LoggingConfig
from litestar.openapi import OpenAPIConfig

from app.api.admin import (
    cache_rebuild,
    cache_status,
    health,
    metrics,
    reset_peaks,
    routing,
    stats,
    stats_steps,
)
from app.api.auth import require_api_key
from app.api.chat import chat_completions
from app.api.completions import completions
from app.api.errors import EXCEPTION_HANDLERS, http_exception_handler
from app.api.messages import ANTHROPIC_ERRORS, count_tokens, messages
from app.api.models import list_models, retrieve_model
from app.api.openapi_doc import CompletedJsonRenderPlugin
from app.api.responses import responses
from app.http_protocol import OpenAIErrorH11Protocol
from app.runtime import Runtime


def cors_config(allowed_origins: tuple[str, ...]) -> CORSConfig | None:
    """CORS for browser clients. Litestar answers a preflight (OPTIONS) in its middleware, before
    the API-key guard, so a preflight never needs the key; the real request still does."""
    if not allowed_origins:
        return None
    return CORSConfig(allow_origins=list(allowed_origins), allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
                      allow_headers=["*"],  # the openai SDKs send several x-stainless-* headers
                      expose_headers=["retry-after", "x-request-id"], max_age=600)


_ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def _http_error(request: Request, exc: HTTPException) -> Response:
    # NOTE: the router refuses a wrong method before a route's own (Anthropic) handlers could run.
    if request.url.path.rstrip("/") in _ANTHROPIC_PATHS:
        return ANTHROPIC_ERRORS[HTTPException](request, exc)
    return http_exception_handler(request, exc)


def create_app(runtime: Runtime, allowed_origins: tuple[str, ...] = ()) -> Litestar:
    protected = Router(
        path="/",
        guards=[require_api_key],
        route_handlers=[
            chat_completions,
            completions,
            messages,
            count_tokens,
            responses,
            list_models,
            retrieve_model,
            stats,
            reset_peaks,
            stats_steps,
            metrics,
            cache_status,
            cache_rebuild,
            routing,
        ],
    )
    return Litestar(
        # NOTE: Litestar configures the root logger by default (its own handler, format and INFO level), which
        # replaced `ft serve`'s format and, in tests, printed "Logging error" from threads logging after pytest
        # closed the stream it held; it keeps its own "litestar" logger only
        logging_config=LoggingConfig(configure_root_logger=False),
        route_handlers=[health, protected],
        state=State({"runtime": runtime}),
        exception_handlers={**EXCEPTION_HANDLERS, HTTPException: _http_error},
        cors_config=cors_config(allowed_origins),
        openapi_config=OpenAPIConfig(title="fluxtide", version="1", path="/schema",
                                     render_plugins=[CompletedJsonRenderPlugin()]),
        # NOTE: request bodies are parsed by hand (errors in OpenAI's shape); no size cap beyond this.
        request_max_body_size=64 * 1024 * 1024,
    )


def bind_listeners(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for every address ``host`` resolves to, bound as asyncio's create_server binds them
    (SO_REUSEADDR; an IPv6 socket IPv6 only). NOTE: bound here, in the caller's thread, and handed to uvicorn: a port
    in use is an OSError the caller words, before the model loads; uvicorn binding them itself logged its own
    "[Errno 98] ..." line from its thread first, and the caller could only guess why by binding again."""
    infos = dict.fromkeys(socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)  # NOTE: a port another socket bound with SO_REUSEADDR but never listened on fails here
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def host_port(host: str, port: int) -> str:
    """``HOST:PORT`` as a URL writes it (RFC 3986): an IPv6 literal in brackets (``[::1]:1919``), any other host as is.
    NOTE: "http://::1:1919" was no URL a client could use, and "::1:1919" no address one could read."""
    try:
        bracket = ipaddress.ip_address(host).version == 6
    except ValueError:  # a host name, or a literal already in brackets
        bracket = False
    return f"[{host}]:{port}" if bracket else f"{host}:{port}"


def listen_problem(host: str, port: int, exc: OSError) -> str:
    """Why `ft serve` cannot listen on host:port, and the flag that changes it."""
    why = (exc.strerror or str(exc)).lower()
    where = host_port(host, port)
    if exc.errno == errno.EADDRINUSE:
        return f"cannot listen on {where}: address already in use; pass another --port (or stop what listens there)"
    if exc.errno == errno.EACCES:
        return f"cannot listen on {where}: {why}; choose a port above 1023 with --port"
    return f"cannot listen on {where}: {why}; check --host"


# NOTE: longer than any common client keeps an idle connection (httpx, so the openai and anthropic
# clients: 5 s; aiohttp: 15 s). At uvicorn's default of 5 s both ends give up on an idle connection at
# the same moment, and a request written just then meets a closed socket (ECONNRESET: a failed request
# for a client with max_retries=0). A server must outlast its clients' pools, as nginx (75 s) does.
KEEP_ALIVE_S = 75


class ServerThread:
    """uvicorn in a background thread (tests, and `ft serve` while the model loads)."""

    def __init__(self, app: Litestar, host: str = "127.0.0.1", port: int = 1919, log_level: str = "warning") -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5,
                                timeout_keep_alive=KEEP_ALIVE_S, http=OpenAIErrorH11Protocol)
        self.server = uvicorn.Server(config)
        self.sockets: list[socket.socket] = []
        self.thread = threading.Thread(target=lambda: self.server.run(sockets=self.sockets), name="fluxtide-http",
                                       daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        """Bind, then serve in the thread. RuntimeError (one line, naming the flag) when the address cannot be
        listened on: a port in use, a --host this machine does not have."""
        config = self.server.config
        try:
            self.sockets = bind_listeners(config.host, config.port, config.backlog)
        except OSError as exc:  # NOTE: socket.gaierror (an unknown host name) is one too
            raise RuntimeError(listen_problem(config.host, config.port, exc)) from None
        self.thread.start()
        for _ in range(int(timeout / 0.02)):
            if self.server.started or not self.thread.is_alive():
                break
            threading.Event().wait(0.02)
        if not self.server.started:
            raise RuntimeError(f"uvicorn did not start on {host_port(config.host, config.port)}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
