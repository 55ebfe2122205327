"""A pytest plugin that compiles every Triton kernel a CPU test launches for an H200 (sm_90) instead of running it.

Why: the lent GPU's image has Triton 3.6 and this machine 3.9, and device time is 30 minutes a session; a kernel
that does not compile there (3.6 rejects constructs 3.9 accepts, see gdn_conv_prefill's note) costs a device
call to find. Run the kernel tests through this plugin with the device's Triton on the path and every launch
is compiled with the launch's own arguments (dtypes, constexprs, pointer alignment) and nothing runs:

    pip install --no-deps --target /work/tri36 triton==3.6.0          # the device image's Triton, once
    PYTHONPATH=/work/tri36:. TRITON_INTERPRET=0 python -m pytest -p scripts.diag.sm90_compile -o addopts="" -q \\
        tests/adapters/test_kernels_prefill.py tests/adapters/test_prefill_spans.py

The tests' own asserts are meaningless here (no kernel writes its outputs) and their outcomes are ignored: the
session's exit status is 1 when a kernel failed to compile and 0 otherwise, and the summary lists per kernel
the specializations compiled, registers and stack bytes per thread (cuobjdump), and each compile error.
Autotuned kernels compile every config. The shapes are the tests' (tiny); launchers that pick tiles from a
CUDA device's tuning pick their CPU defaults. Not a substitute for the GPU tests: it finds compile errors and
register spills early, not wrong results.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import defaultdict

import pytest

os.environ["TRITON_INTERPRET"] = "0"  # NOTE: before any kernel module imports triton.jit (tests/conftest.py too)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import autotuner, driver, jit  # noqa: E402

_compiled: dict[str, list[str]] = defaultdict(list)  # kernel -> one line per specialization
_errors: dict[str, list[str]] = defaultdict(list)


class _Sm90Driver:
    """The parts of a Triton driver that compiling needs, for an H200 that is not there."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def __getattr__(self, name):
        raise RuntimeError(f"sm90_compile: a launch needed the driver's {name!r} (only compiling is possible here)")


def _resources(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"regs {found.group(1)} stack {found.group(2)} B" if found else "resources unknown"


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", repr(fn))


_run = jit.JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    name = _name(self.fn)
    try:
        kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as e:  # noqa: BLE001  # every compile error is the report, not a crash of the run
        first = str(e).strip().splitlines()
        _errors[name].append(f"{type(e).__name__}: {' | '.join(first[-3:])[:400]}")
        return None
    if kernel is not None:
        consts = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, str))}
        line = f"{_resources(kernel.asm['cubin'])} {consts}"
        if line not in _compiled[name]:
            _compiled[name].append(line)
    return kernel


def _autotune_compile_only(self, *args, **kwargs):
    """Every config of an autotuned kernel, compiled (no benchmark: nothing can run)."""
    for config in self.configs:
        self.fn.run(*args, **kwargs, **config.all_kwargs(), grid=None, warmup=True)


def pytest_configure(config):
    driver.set_active(_Sm90Driver())
    jit.JITFunction.run = _compile_only
    autotuner.Autotuner.run = _autotune_compile_only
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="sm90-cache-"))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.exitstatus = 1 if _errors else 0


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section(f"sm_90 compile with Triton {triton.__version__} (test outcomes above are meaningless)")
    for name in sorted(set(_compiled) | set(_errors)):
        tr.write_line(f"{name}: {len(_compiled[name])} specializations compiled, {len(_errors[name])} errors")
        for line in _compiled[name]:
            tr.write_line(f"    ok   {line[:240]}")
        for line in sorted(set(_errors[name])):
            tr.write_line(f"    FAIL {line}")
    if not _compiled and not _errors:
        tr.write_line("no Triton kernel was launched")
