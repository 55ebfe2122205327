"""The worker processes of `ft serve --data-parallel N` ([adr/0005](../../docs/adr/0005-data-parallel.md)).

Each worker is an ordinary `ft serve` (`python -m app serve`) on a loopback port it picks itself
(`--port 0`; the front reads the port from its "listening on URL" line), on its own device, with
its own pools, and a key only the front knows (``FT_API_KEY`` in its environment, never on a
command line). ``WorkerPool`` watches them (process exit, /health) and hands out the least-loaded
serving worker for each request.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

log = logging.getLogger("fluxtide.data_parallel")

LISTENING = re.compile(r"listening on (http://\S+)")
# NOTE: a loaded 2-core CI box can take seconds to answer one /health; a worker is taken out of
# rotation only after this many misses in a row (its process exiting takes it out at once).
HEALTH_MISSES = 3


@dataclass(frozen=True)
class DeviceAssignment:
    """One worker's device: the --device it is given, the environment it runs with, the label
    /health shows (the GPU as the front's CUDA_VISIBLE_DEVICES numbers it)."""

    flag: str
    env: dict[str, str]
    label: str


def assign_devices(device: str, n: int, cuda_count: int, visible: str | None,
                   flag: str = "--data-parallel") -> list[DeviceAssignment]:
    """One device per worker. ``device``: the --device given (auto | cpu | cuda); ``cuda_count``:
    GPUs the front sees; ``visible``: the front's CUDA_VISIBLE_DEVICES (None: unset); ``flag``: the
    option that asked for n workers (--data-parallel, --expert-parallel), named in the errors.

    On CUDA, worker i sees only the i-th visible GPU (CUDA_VISIBLE_DEVICES) and runs on "cuda":
    the executors never call torch.cuda.set_device, and Triton launches and graph captures go to
    the current device, so hiding the other GPUs is what keeps a worker on its own card.
    Raises ValueError when the host cannot give N workers a device each."""
    if n < 1:
        raise ValueError(f"{flag} must be >= 1, got {n}")
    if device.startswith("cuda:"):
        raise ValueError(f"{flag} gives worker i the i-th visible GPU itself: use --device cuda (or auto, "
                         "cpu), and CUDA_VISIBLE_DEVICES to choose the GPUs")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda with {flag}, got {device!r}")
    if device == "cpu" or (device == "auto" and cuda_count == 0):
        # NOTE: CPU workers exist for tests and demos; each is its own process with its own pools.
        return [DeviceAssignment("cpu", {}, "cpu") for _ in range(n)]
    if cuda_count < n:
        raise ValueError(f"{flag} {n} needs {n} CUDA devices, {cuda_count} visible")
    ids = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(cuda_count)]
    return [DeviceAssignment("cuda", {"CUDA_VISIBLE_DEVICES": ids[i]}, f"cuda:{ids[i]}") for i in range(n)]


def host_devices(device: str, n: int, flag: str) -> list[DeviceAssignment]:
    """assign_devices for this host: the GPUs torch sees (none unless --device is auto or cuda) and this
    process's CUDA_VISIBLE_DEVICES. Raises ValueError as assign_devices."""
    from app.containers import cuda_device_count

    cuda = cuda_device_count() if device in ("auto", "cuda") else 0
    return assign_devices(device, n, cuda, os.environ.get("CUDA_VISIBLE_DEVICES"), flag)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the worker gets SIGTERM when the front dies, even by SIGKILL (no orphaned GPU holders)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class WorkerProcess:
    """One `python -m app serve ARGS` child. Its output goes to ``echo`` lines prefixed with
    ``[worker i]`` and a tail kept for error messages; ``url`` is known once it listens."""

    def __init__(self, index: int, argv: Sequence[str], env: dict[str, str] | None = None, label: str = "cpu",
                 echo: bool = False) -> None:
        self.index = index
        self.argv = list(argv)
        self.env = dict(env or {})
        self.label = label
        self.echo = echo
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._listening = threading.Event()
        # Front bookkeeping (WorkerPool's lock guards these).
        self.status = "starting"  # "starting" | "loading" | "ok" | "error" | "exited" | "unreachable"
        self.error: str | None = None
        self.health: dict = {}
        self.in_flight = 0
        self.dispatched = 0
        self.misses = 0
        self.served = False  # it answered /health ok at least once

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        """Spawn; call from a thread that lives as long as the worker (PDEATHSIG follows the thread)."""
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "app", "serve", *self.argv], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                     bufsize=1, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        threading.Thread(target=self._read, name=f"fluxtide-worker-{self.index}-log", daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            match = LISTENING.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._listening.set()
            if self.echo:
                print(f"[worker {self.index}] {line}", file=sys.stderr, flush=True)
        self._listening.set()  # it exited: nobody should wait any longer

    def wait_listening(self, timeout: float) -> str | None:
        self._listening.wait(timeout)
        return self.url

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def last_lines(self, n: int = 3) -> str:
        return " | ".join(list(self.tail)[-n:])

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class WorkerPool:
    """The workers, their state as the front sees it, and the choice of worker per request.

    ``acquire`` picks the serving worker with the fewest requests in flight through the front
    (requests running or queued there), ties to the one that was given fewer so far (so a
    sequential client alternates); ``release`` gives the request back. A monitor thread polls
    every worker's process and /health every ``poll_s``."""

    def __init__(self, workers: Sequence[WorkerProcess], api_key: str, poll_s: float = 0.5) -> None:
        if not workers:
            raise ValueError("a worker pool needs at least one worker")
        self.workers = list(workers)
        self.api_key = api_key
        self.poll_s = poll_s
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def start(self) -> None:
        for worker in self.workers:
            worker.start()
        self._monitor = threading.Thread(target=self._watch, name="fluxtide-worker-monitor", daemon=True)
        self._monitor.start()

    def stop(self) -> None:
        self._stop.set()
        for worker in self.workers:  # NOTE: all get SIGTERM first, so they shut down side by side
            if worker.proc is not None and worker.proc.poll() is None:
                worker.proc.terminate()
        for worker in self.workers:
            worker.stop()
        if self._monitor is not None:
            self._monitor.join(5)

    # -- routing -----------------------------------------------------------------------------
    def acquire(self) -> WorkerProcess | None:
        with self.lock:
            serving = [w for w in self.workers if w.status == "ok"]
            if not serving:
                return None
            worker = min(serving, key=lambda w: (w.in_flight, w.dispatched, w.index))
            worker.in_flight += 1
            worker.dispatched += 1
            return worker

    def release(self, worker: WorkerProcess) -> None:
        with self.lock:
            worker.in_flight -= 1
            assert worker.in_flight >= 0, f"worker {worker.index} released more requests than it was given"

    def mark_unreachable(self, worker: WorkerProcess, error: str) -> None:
        """The front could not connect: out of rotation until its /health answers again."""
        with self.lock:
            if worker.status == "ok":
                worker.status, worker.error = "unreachable", error

    def statuses(self) -> list[str]:
        with self.lock:
            return [w.status for w in self.workers]

    def snapshot(self) -> list[dict]:
        """What /health shows of each worker."""
        with self.lock:
            return [{"worker": w.index, "pid": w.pid, "device": w.label, "url": w.url, "status": w.status,
                     "error": w.error, "in_flight": w.in_flight, "dispatched": w.dispatched,
                     "phase": w.health.get("phase"), "bytes_done": w.health.get("bytes_done", 0),
                     "bytes_total": w.health.get("bytes_total", 0), "engine": w.health.get("engine")}
                    for w in self.workers]

    # -- monitor -----------------------------------------------------------------------------
    def _watch(self) -> None:
        with httpx.Client(timeout=5.0, headers=self.headers) as client:
            while not self._stop.is_set():
                for worker in self.workers:
                    self.refresh(worker, client)
                self._stop.wait(self.poll_s)

    def refresh(self, worker: WorkerProcess, client: httpx.Client) -> None:
        code = worker.exit_code()
        if code is not None:
            with self.lock:
                if worker.status != "exited":
                    log.error("worker %d (pid %s) exited with code %s", worker.index, worker.pid, code)
                worker.status = "exited"
                worker.error = f"worker {worker.index} (pid {worker.pid}) exited with code {code}: {worker.last_lines()}"
            return
        if worker.url is None:
            return  # still starting: no port yet
        try:
            body = client.get(worker.url + "/health").json()
        except (httpx.HTTPError, ValueError) as exc:
            with self.lock:
                worker.misses += 1
                if worker.misses >= HEALTH_MISSES or worker.status == "unreachable":
                    worker.status, worker.error = "unreachable", f"worker {worker.index} /health: {exc!r}"
            return
        with self.lock:
            worker.misses = 0
            worker.health = body
            worker.status = {"ok": "ok", "loading": "loading"}.get(body.get("status"), "error")
            worker.error = None if worker.status == "ok" else body.get("error")
            worker.served = worker.served or worker.status == "ok"

    def failed_to_start(self) -> bool:
        """Every worker exited without ever serving: each one's load failed (they run the same flags, and a failed
        load ends an `ft serve`), so this front can never serve either."""
        with self.lock:
            return all(w.status == "exited" and not w.served for w in self.workers)

    def wait_ready(self, timeout: float) -> bool:
        """True once every worker serves; False on timeout or when one failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = self.statuses()
            if all(s == "ok" for s in statuses):
                return True
            if any(s in ("error", "exited") for s in statuses):
                return False
            time.sleep(0.05)
        return False
