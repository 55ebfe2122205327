"""Start-up: bind the HTTP port first (so /health can report loading), build the engine from
the container in a background thread, then flip the runtime to ready."""

from __future__ import annotations

import logging
import sys
import threading
import time

from dependency_injector import providers

from app.containers import Container, served_name
from app.gc_pauses import GC_PAUSES, freeze_startup_heap, unfreeze_heap
from app.runtime import Runtime
from app.server import ServerThread, create_app, host_port
from app.settings import ServeSettings

log = logging.getLogger("fluxtide.serve")


def say(line: str) -> None:
    """One line to stderr in ONE write, newline included. NOTE: print() writes the text and its newline
    separately, and log records reach stderr from another thread (Litestar's queue listener): a record written
    between the two ran onto the line ("load failed: ...ERROR ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def build_engine(container: Container, runtime: Runtime, echo: bool = False) -> None:
    """Load model, plan pools, start the engine thread; errors end up on /health and stderr, not in a crash (the
    HTTP server stays up; `ft serve` exits 1 once it sees the failure)."""
    started = time.monotonic()

    def progress(phase: str, bytes_done: int | None = None, bytes_total: int | None = None) -> None:
        """Byte counts come from the loader, per phase (each from 0 to its own total) and folded
        into one running count; phases without them (planning, building) keep the last count."""
        p = runtime.progress
        new_phase = phase != p.phase
        if bytes_done is None and bytes_total is None:
            p.update(phase, p.bytes_done, p.bytes_total)
        else:
            p.advance(phase, bytes_done or 0, bytes_total or 0)
        # NOTE: the loader reports every expert row; echo a line per phase and at its end only.
        if echo and (new_phase or (bytes_total and bytes_done == bytes_total)):
            size = f" ({p.bytes_done / 2**20:.1f}/{p.bytes_total / 2**20:.1f} MiB)" if p.bytes_total else ""
            say(f"[{time.monotonic() - started:6.2f}s] {phase}{size}")

    try:
        container.progress.override(providers.Object(progress))
        progress("loading model")
        spec = container.model_spec()
        container.tokenizer()
        progress("planning pools")
        plan = container.pool_plan()
        progress(
            f"pools: {plan.kv_tokens} KV tokens, {plan.expert_slots}/{spec.total_experts} expert slots, "
            f"{plan.state_slots} state slots, {plan.snapshot_slots} state snapshot slots (prefix cache), "
            f"{plan.staging_experts} prefill staging experts"
        )
        progress("building executor")
        engine = container.engine()
        engine.start()
        # NOTE: last before ready: what start-up built (weights' metadata, kernels, graphs) is never walked again by
        # a full collection, which took 106-137 ms on the CPU demo server and would stall every stream (gc_pauses)
        frozen = freeze_startup_heap()
        GC_PAUSES.install()
        log.info("froze %d start-up objects out of the garbage collector's full collections", frozen)
        runtime.set_ready(engine, container.model_info())
        if echo:  # NOTE: set_ready already moved the phase to "ready", so progress() would not echo it
            say(f"[{time.monotonic() - started:6.2f}s] ready: serving {runtime.model.served_name}")
    except Exception as exc:  # NOTE: surfaced on /health and stderr; `ft serve` then exits 1 (app.cli._serve)
        if isinstance(exc, (ValueError, OSError)):
            # the checkpoint's or the flags' fault (a damaged file, a plan that does not fit), named by the message;
            # the traceback through the loader helps nobody but a developer (--log-level debug)
            log.error("model load failed: %s", load_error(exc), exc_info=log.isEnabledFor(logging.DEBUG))
        else:
            log.exception("model load failed")
        error = load_error(exc)
        if echo:  # NOTE: before set_error, which lets `ft serve` stop: the reason is out before "stopped: ..."
            say(f"load failed: {error}")
        runtime.set_error(error)


def load_error(exc: BaseException) -> str:
    """Why the load failed, as `ft serve`, its log and /health say it. NOTE: a plain ValueError is how start-up
    refuses the flags or the checkpoint, in a message written for the user ("--moe-slots: expert_slots 2048 outside
    [top_k 2, total experts 32]"): its class name would only be noise. Anything else keeps its class name (a
    FileNotFoundError, a JSONDecodeError or a bug's exception says what it is by it)."""
    if type(exc) is ValueError and str(exc):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def stopped_line(runtime: Runtime, shutdown_s: float) -> str:
    """The line `ft serve` ends with, as it started with "listening on ..." and "ready: serving ...": that it
    stopped, what it served and how long it was up, and how long the shutdown took (listeners, engine, connections).
    NOTE: without it a clean SIGINT left no trace in the log that the server had stopped, or when."""
    up = time.monotonic() - runtime.started_at
    engine = runtime.engine
    if engine is not None:
        n = engine.stats.finished_requests()
        what = f"served {n} request{'' if n == 1 else 's'} in {up:.1f} s"
    else:  # stopped while loading, or after the load failed
        what = f"no model served ({'load failed' if runtime.status == 'error' else 'still loading'}) in {up:.1f} s"
    return f"stopped: {what}; shut down in {shutdown_s:.2f} s"


class RunningServer:
    """A server (HTTP thread + loader thread + engine) that tests and `ft serve` both use."""

    def __init__(self, container: Container, settings: ServeSettings, echo: bool = False) -> None:
        self.container = container
        container.settings.override(providers.Object(settings))
        self.settings = settings
        self.runtime = Runtime(served_name(settings), api_key=settings.api_key)
        self.http = ServerThread(create_app(self.runtime, settings.allowed_origins), settings.host, settings.port)
        self.loader = threading.Thread(
            target=build_engine, args=(container, self.runtime, echo), name="fluxtide-loader", daemon=True
        )

    @property
    def port(self) -> int:
        servers = getattr(self.http.server, "servers", [])
        for server in servers:
            for sock in server.sockets:
                return sock.getsockname()[1]
        return self.settings.port

    @property
    def base_url(self) -> str:
        return f"http://{host_port(self.settings.host, self.port)}"

    def start(self, wait_ready: float | None = None) -> RunningServer:
        self.http.start()
        self.loader.start()
        if wait_ready is not None and not self.runtime.wait_ready(wait_ready):
            raise RuntimeError(f"server did not become ready: {self.runtime.status} {self.runtime.error}")
        return self

    def stop(self) -> None:
        """Listeners closed first (uvicorn's should_exit: no new request), then the engine, which ends every running
        stream with its abort event ("server shutting down"), then uvicorn's graceful wait for the connections.
        NOTE: in the other order uvicorn waited its 5 s for streams only the engine could end, then cancelled
        them: each client got a body cut mid-chunk and the log an ASGI traceback per stream."""
        self.http.server.should_exit = True
        if self.runtime.engine is not None:
            self.runtime.engine.stop()
        self.http.stop()
        unfreeze_heap()
