"""ptxas' resource use of one Triton kernel built for an H200 (sm_90): imported by the build scripts that
tests/adapters/sm90.py's build_for_sm90 runs in a fresh Python (the interpreter off, the Triton it puts first
on the path), not by pytest itself."""

from __future__ import annotations

import inspect
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def with_defaults(fn, constexprs: dict) -> dict:
    """constexprs plus the default of every parameter of the @triton.jit `fn` that has one and is not given
    (ASTSource binds only what it is handed: a defaulted constexpr such as USE_GDC would otherwise be None)."""
    params = inspect.signature(fn.fn).parameters.values()
    return {**{p.name: p.default for p in params if p.default is not inspect.Parameter.empty}, **constexprs}


def resource_usage(fn, types: dict[str, str], constexprs: dict, options: dict,
                   other: Callable[[str], str] = lambda name: "i32") -> dict[str, int]:
    """{REG, STACK (ptxas' spill stack per thread, bytes), SMEM (bytes)} of the @triton.jit `fn` compiled for
    sm_90: constexprs bound, every other argument typed by `types` (pointers such as "*bf16", scalars) or
    else other(name) (strides and lengths as i32 by default: what a launcher passes for tensors under 2**31
    elements); options: the launch's num_warps / num_stages."""
    constexprs = with_defaults(fn, constexprs)
    sig = {n: "constexpr" if n in constexprs else types.get(n) or other(n) for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    line = next(row for row in text.splitlines() if "REG:" in row)
    found = {kv.split(":")[0]: int(kv.split(":")[1]) for kv in line.split() if kv.split(":")[0] in ("REG", "STACK")}
    return found | {"SMEM": kernel.metadata.shared}
