"""`ft serve --data-parallel N`: N worker processes behind one HTTP front, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import secrets
import signal
import sys
import threading
import time

# NOTE: the front's own choices; every other `ft serve` flag given goes to each worker as it is.
FRONT_ONLY = frozenset({"host", "port", "api_key", "device", "data_parallel", "allowed_origins", "help"})


def worker_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The `ft serve` arguments of one worker: every serve flag whose value differs from its
    default (so flags added later travel without a change here), then loopback and any free port."""
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in FRONT_ONLY:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return [*argv, "--host", "127.0.0.1", "--port", "0"]


def serve_data_parallel(args: argparse.Namespace, parser: argparse.ArgumentParser, settings) -> int:
    """Start the front (bound first, so /health answers while the workers load), then the workers."""
    from app.data_parallel.front import Front, create_front_app
    from app.data_parallel.workers import WorkerPool, WorkerProcess, host_devices
    from app.gc_pauses import GC_PAUSES, freeze_startup_heap
    from app.server import ServerThread, host_port
    from app.serving import say

    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: one line per health poll otherwise
    try:
        devices = host_devices(args.device, args.data_parallel, "--data-parallel")
    except ValueError as exc:
        print(f"ft serve: {exc}", file=sys.stderr)
        return 2
    internal_key = secrets.token_urlsafe(32)  # NOTE: front <-> workers only; in the env, never on argv
    base = worker_argv(parser, args)
    workers = [WorkerProcess(i, [*base, "--device", d.flag], {**d.env, "FT_API_KEY": internal_key}, d.label, echo=True)
               for i, d in enumerate(devices)]
    pool = WorkerPool(workers, internal_key)
    front = Front(pool, api_key=settings.api_key)
    http = ServerThread(create_front_app(front, settings.allowed_origins), settings.host, settings.port)
    try:
        http.start()
    except RuntimeError as exc:
        print(f"ft serve: {exc}", file=sys.stderr)
        return 1
    port = next((s.getsockname()[1] for srv in http.server.servers for s in srv.sockets), settings.port)
    auth = "on" if settings.api_key else "off"
    print(f"listening on http://{host_port(settings.host, port)} (API key {auth}); starting {len(workers)} workers "
          f"({', '.join(d.label for d in devices)}) ...", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # NOTE: the front relays every worker's stream on its one event loop: a full collection of its start-up heap
    # would stall them all, as in a single server (app/gc_pauses.py); its own pauses show as /v1/stats gc.front
    GC_PAUSES.install()
    freeze_startup_heap()
    started = time.monotonic()
    pool.start()
    failed = False
    while not stop.wait(0.5):
        if not http.thread.is_alive():
            break
        if pool.failed_to_start():  # NOTE: as a single `ft serve` whose load failed: exit 1, the reasons above
            why = next((line for w in workers for line in reversed(w.tail) if line.startswith("load failed: ")),
                       f"see the [worker N] lines above ({workers[0].error})")
            say(f"ft serve: every worker exited before serving; {why}")
            failed = True
            break
    stopping = time.monotonic()
    dispatched = sum(w.dispatched for w in workers)
    pool.stop()
    http.stop()
    # NOTE: as a single server ends (app.serving.stopped_line): a clean stop leaves a line in the log
    say(f"stopped: dispatched {dispatched} request{'' if dispatched == 1 else 's'} to {len(workers)} workers in "
        f"{stopping - started:.1f} s; shut down in {time.monotonic() - stopping:.2f} s")
    return 1 if failed else 0
