"""`ft bench cold-start`: launch `ft serve`, time its start-up milestones, stop it.

Times are seconds since the process was launched, on the client's clock. Phase milestones come
from the lines `ft serve` prints as each loading phase starts (read as they arrive): a phase ends
when the next one starts. Then, polled every ``poll_s``: the first successful /v1/models, /health
ok, and the first token of a one-token chat request. A milestone the server never reports (e.g.
graph capture on an engine that captures no graphs) is null, not zero.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from app.bench.client import chat_body, stream_request
from app.bench.record import Record, redacted
from app.bench.target import BenchError

_PHASE = re.compile(r"\[\s*[\d.]+s\] (.+?)(?: \([\d./]+ MiB\))?$")
_STAMP = re.compile(r"\[\s*\d+\.\d+s\] ")
_LISTEN = re.compile(r"listening on (http://\S+)")
# (milestone, phase whose end marks it)
PHASE_MILESTONES = (("expert_banks_loaded", "expert banks"), ("dense_weights_loaded", "dense weights"),
                    ("experts_resident", "making experts resident"), ("graph_capture_done", "graph"),
                    ("prefill_kernels_tuned", "tuning prefill kernels"))


class _StderrReader(threading.Thread):
    """Reads the server's stderr line by line (tqdm's \\r updates split too), stamping each line."""

    def __init__(self, proc: subprocess.Popen, t0: float) -> None:
        super().__init__(daemon=True)
        self.proc, self.t0 = proc, t0
        self.lines: list[tuple[float, str]] = []
        self.url: str | None = None
        self.listening_s: float | None = None

    def run(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            now = time.monotonic() - self.t0
            text = raw.decode(errors="replace").replace("\r", "\n")
            # NOTE: the loader thread's phase lines can land inside another line (the main
            # thread's, or a progress bar's without its newline): split before each phase stamp.
            for part in _STAMP.sub(lambda m: "\n" + m.group(0), text).splitlines():
                part = part.strip()
                if not part:
                    continue
                self.lines.append((now, part))
                match = _LISTEN.search(part)
                if match and self.url is None:
                    self.url, self.listening_s = match.group(1), now


def phases(lines: list[tuple[float, str]]) -> list[dict]:
    """Each loading phase once, in order, with the time its first line arrived."""
    seen: dict[str, float] = {}
    for at, text in lines:
        match = _PHASE.match(text)
        if match and match.group(1) not in seen:
            seen[match.group(1)] = at
    return [{"phase": name, "started_s": at} for name, at in seen.items()]


def phase_end(order: list[dict], needle: str) -> float | None:
    """When the first phase containing ``needle`` ended: the start of the phase after it."""
    for i, p in enumerate(order):
        if needle in p["phase"] and i + 1 < len(order):
            return order[i + 1]["started_s"]
    return None


def _flag(serve_args: list[str], name: str) -> str | None:
    """The value `ft serve` gets for the option `name` (`--name V` or `--name=V`; the last one given), or None."""
    value = None
    for i, arg in enumerate(serve_args):
        if arg == name and i + 1 < len(serve_args):
            value = serve_args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _served_dir(serve_args: list[str]) -> str | None:
    """The checkpoint `ft serve` will load: its --model, else the embedded demo model."""
    model = _flag(serve_args, "--model")
    if model is not None:
        return model
    from app.demo_model import DEMO_MODEL_DIR

    return str(DEMO_MODEL_DIR)


def _stop(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


async def run(record: Record, progress, *, serve_args: list[str], timeout: float, poll_s: float,
              model_dir: str | None, measure_bandwidth: bool) -> None:
    args = list(serve_args)
    if not any(a == "--port" or a.startswith("--port=") for a in args):
        args += ["--port", "0"]  # any free port; the URL is read from the server's own line
    command = [sys.executable, "-m", "app", "serve", *args]
    model_dir = model_dir or _served_dir(args)
    record.data["settings"]["serve_command"] = redacted(command)
    task = progress.add_task("cold start", total=None)
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    reader = _StderrReader(proc, t0)
    reader.start()
    marks: dict[str, float | None] = {"models_ok": None, "health_ok": None, "first_token": None}
    try:
        await _watch(reader, proc, t0, timeout, poll_s, marks, record, model_dir, measure_bandwidth,
                     _flag(args, "--api-key"))
    except BenchError as exc:
        # NOTE: the start is what this run measures: one that never gets ready is its failed point (exit 3, as a
        # failed point of any subcommand), and the record keeps the milestones it reached and the server's last lines
        record.fail("start", str(exc))
    finally:
        code = _stop(proc)
        reader.join(5)
        progress.update(task, total=1, completed=1)
    order = phases(reader.lines)
    points = [{"milestone": "http_listening", "seconds": reader.listening_s, "source": "server stderr"}]
    for name, needle in PHASE_MILESTONES:
        points.append({"milestone": name, "seconds": phase_end(order, needle), "source": "server stderr"})
    points += [
        {"milestone": "first_models_ok", "seconds": marks["models_ok"], "source": "GET /v1/models"},
        {"milestone": "health_ok", "seconds": marks["health_ok"], "source": "GET /health"},
        {"milestone": "first_token", "seconds": marks["first_token"], "source": "streamed chat, 1 token"},
    ]
    record.points.extend(points)
    record.data["cold_start"] = {"phases": order, "exit_code": code,
                                 "stderr_tail": [text for _, text in reader.lines[-40:]]}


async def _watch(reader, proc, t0, timeout, poll_s, marks, record, model_dir, measure_bandwidth,
                 api_key: str | None) -> None:
    deadline = t0 + timeout
    while reader.url is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = " | ".join(text for _, text in reader.lines[-5:])
            raise BenchError(f"ft serve did not start listening (exit code {proc.poll()}): {tail}")
        await asyncio.sleep(poll_s)
    # NOTE: a server launched with --api-key answers /v1/* only with it (it polled without it and never got ready)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(base_url=reader.url, timeout=30, headers=headers) as client:
        while marks["health_ok"] is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = " | ".join(text for _, text in reader.lines[-5:])  # NOTE: a failed load's reason (it exits 1)
                raise BenchError(f"ft serve exited or timed out before /health was ok (exit code {proc.poll()}): {tail}")
            with_status = await _status(client, "/v1/models"), await _status(client, "/health")
            now = time.monotonic() - t0
            if marks["models_ok"] is None and with_status[0] == 200:
                marks["models_ok"] = now
            if with_status[1] == 200:
                marks["health_ok"] = now
            else:
                await asyncio.sleep(poll_s)
        # Both routes open on the same readiness, so the model can become ready between the two
        # GETs of one poll: /health is then ok while this poll's /v1/models said 503. Poll
        # /v1/models on until it answers rather than leave its milestone empty.
        while (listing := await client.get("/v1/models")).status_code != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"/health was ok but /v1/models answered {listing.status_code} until the deadline")
            await asyncio.sleep(poll_s)
        if marks["models_ok"] is None:
            marks["models_ok"] = time.monotonic() - t0
        models = listing.json()["data"]
        sent = time.monotonic()
        res = await stream_request(client, *chat_body(models[0]["id"], "Hello", 1, ignore_eos=False), 60)
        if not res.ok:
            record.fail("first token", res.error, status=res.status)
        else:
            marks["first_token"] = sent - t0 + res.ttft_s
        await record.describe_target(client, reader.url, models[0]["id"], model_dir)
        record.profile_hardware(measure_bandwidth)


async def _status(client: httpx.AsyncClient, path: str) -> int | None:
    try:
        return (await client.get(path)).status_code
    except httpx.HTTPError:
        return None
