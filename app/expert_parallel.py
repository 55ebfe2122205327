"""`ft serve --expert-parallel N` ([adr/0008](../docs/adr/0008-expert-parallel.md)): this process is rank 0
(HTTP, the scheduler, the engine loop) and starts ranks 1..N-1 as `python -m app serve ... --ep-rank r`
children that load the same model, plan the same pools, join the torch.distributed group and then run
every step rank 0 broadcasts. Until SIGINT/SIGTERM, or until a rank exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def follower_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, rank: int, address: str,
                  device: str) -> list[str]:
    """`python -m app serve` arguments of rank `rank`: every flag given to this process (the same model,
    budget and pool options, so every rank plans the same pools), then its rank, the rendezvous, its device."""
    from app.data_parallel.serve import worker_argv

    return [*worker_argv(parser, args), "--ep-rank", str(rank), "--ep-address", address, "--device", device]


def serve_expert_parallel(args: argparse.Namespace, parser: argparse.ArgumentParser, settings) -> int:
    from app.containers import Container, run_expert_parallel_follower
    from app.data_parallel.workers import _die_with_parent, host_devices
    from app.serving import RunningServer, say, stopped_line

    if settings.ep_rank > 0:
        return run_expert_parallel_follower(settings)
    try:
        devices = host_devices(args.device, settings.expert_parallel, "--expert-parallel")
    except ValueError as exc:
        print(f"ft serve: {exc}", file=sys.stderr)
        return 2
    address = _free_address()
    settings = dataclasses.replace(settings, ep_address=address, device=devices[0].flag)
    server = RunningServer(Container(), settings, echo=True)
    try:
        server.start()
    except RuntimeError as exc:
        print(f"ft serve: {exc}", file=sys.stderr)
        return 1
    followers = [subprocess.Popen([sys.executable, "-m", "app", "serve",
                                   *follower_argv(parser, args, rank, address, d.flag)],
                                  env={**os.environ, **d.env}, preexec_fn=_die_with_parent)
                 for rank, d in enumerate(devices) if rank > 0]
    auth = "on" if settings.api_key else "off"
    print(f"listening on {server.base_url} (API key {auth}); loading the model on {len(devices)} ranks "
          f"({', '.join(d.label for d in devices)}) ...", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    failed = False
    while not stop.wait(0.5):
        if not server.http.thread.is_alive() or server.runtime.status == "error":  # NOTE: a failed load exits, as ft serve
            break
        dead = [f for f in followers if f.poll() is not None]
        if dead:  # NOTE: rank 0 cannot step without every rank: stop serving rather than hang in a collective
            print(f"ft serve: expert-parallel rank(s) exited ({[f.returncode for f in dead]}); stopping",
                  file=sys.stderr, flush=True)
            failed = True
            break
    stopping = time.monotonic()
    server.stop()
    engine = server.runtime.engine
    if engine is not None and not failed:
        engine.executor.stop()  # the followers' follow() returns
    for f in followers:
        if server.runtime.status == "error" and f.poll() is None:
            f.terminate()  # NOTE: rank 0 never loaded: nothing will tell a rank waiting for it to stop
        try:
            f.wait(timeout=30)
        except subprocess.TimeoutExpired:
            f.terminate()
            f.wait(timeout=10)
    say(stopped_line(server.runtime, time.monotonic() - stopping))
    return 1 if failed or server.runtime.status == "error" else 0
