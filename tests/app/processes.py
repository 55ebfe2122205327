"""`ft serve` as a real child process for end-to-end tests: started with `--port 0`, its URL read
from its "listening on URL" line, its output kept (and drained, so it never blocks on a full pipe)."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"listening on (http://\S+)")


class FtServe:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "app", "serve", *args], cwd=REPO, env=full_env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.url: str | None = None
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            # NOTE: searched, not anchored: the loading thread's progress may share the line ("[0.00s] loading
            # modellistening on ..."); a "[worker i] listening on ..." line is a data-parallel worker's, not ours
            match = None if line.startswith("[worker") else LISTENING.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._listening.set()
        self._listening.set()

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = 180.0) -> FtServe:
        self._listening.wait(timeout)
        assert self.url, f"ft serve did not listen:\n{self.output()}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ft serve exited with {self.proc.returncode}:\n{self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"ft serve not ready after {timeout}s:\n{self.output()}")

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        # NOTE: the process is gone, but its last lines may still be in the pipe: output() after stop() is whole
        self._reader.join(5)
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # NOTE: a zombie (exited, not yet reaped by its parent) still answers kill(0)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
