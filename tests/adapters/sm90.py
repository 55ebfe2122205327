"""Runs a kernel-build script for an H200 (sm_90) in a fresh Python without a GPU: the compiled path that
Triton's interpreter never exercises (the compiler's type and shape rules, shared memory, spills)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_for_sm90(script: str, timeout: int = 600) -> str:
    """stdout of `python -c script` with the interpreter off and the repository importable; fails the test
    with the script's stderr when it exits non-zero, skips it where Triton has no NVIDIA backend."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # FT_SM90_TRITON: a folder holding another Triton (the GPU image's 3.6: `pip install --no-deps --target DIR
    # triton==3.6.0`), put first so the build uses the compiler the device will (docs/testing.md)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("FT_SM90_TRITON"), ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
