"""The host lane's spinning worker team (adapters/host_kernels/spin_team.h, ADR 0030 "Session 39") under stress, as
C++: tests/adapters/cpp/spin_team_stress.cpp is compiled with this host's g++ and run, plainly and under
ThreadSanitizer (where the toolchain links it), and must report no failure. The lane's own tests
(test_host_lane.py) check the team's answers against the OpenMP kernel's through the real handshake."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "adapters" / "cpp" / "spin_team_stress.cpp"
INCLUDE = ROOT / "adapters" / "host_kernels"


def _build(tmp_path: Path, flags: list[str]) -> Path | str:
    """The stress binary, or the compiler's error text."""
    cxx = shutil.which("g++")
    assert cxx, "the host kernels' tests need a C++ compiler (g++) on the PATH"
    out = tmp_path / "spin_team_stress"
    done = subprocess.run([cxx, "-std=c++17", "-pthread", *flags, f"-I{INCLUDE}", str(SOURCE), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    return out if done.returncode == 0 else done.stderr


def _run(binary: Path, iters: int) -> str:
    done = subprocess.run([str(binary), str(iters)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "fails=0" in done.stderr and "WARNING: ThreadSanitizer" not in done.stderr, done.stderr[-4000:]
    return done.stderr


def test_every_job_runs_once_with_its_own_calls_function(tmp_path):
    binary = _build(tmp_path, ["-O2"])
    assert isinstance(binary, Path), binary
    report = _run(binary, 150)
    runs = int(report.split("runs=")[1].split()[0])
    assert runs == 6 * 3 * 150


def test_no_data_race_under_thread_sanitizer(tmp_path):
    binary = _build(tmp_path, ["-O1", "-g", "-fsanitize=thread"])
    if not isinstance(binary, Path):
        pytest.skip(f"this toolchain does not link ThreadSanitizer: {binary.strip().splitlines()[-1][:200]}")
    _run(binary, 40)
