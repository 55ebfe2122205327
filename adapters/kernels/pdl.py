"""Programmatic dependent launch (PDL, sm_90+) for the decode step's weight-streaming kernels.

Why: a decode step is ~420 launches (bs1, H100, session 33's profile) of which the dense projections and the
routed experts stream weights at 1.2-2 TB/s where HBM gives ~3: each launch pays its ramp (blocks scheduled,
first weight bytes on their way) after the previous kernel's tail. A kernel launched with PDL may start while
the kernel before it still runs: its programs do what depends on nothing the step writes (issue L2 prefetches
of their weight rows), then wait for the previous grid to finish and flush (`griddepcontrol.wait`), then run as
before. The kernel before it lets it in early by calling `griddepcontrol.launch_dependents` at its start.
CUTLASS's example 63 (Hopper GEMM with weight prefetch) is the same idea; CUDA graphs keep the edges.

Rules every kernel here follows (a PDL-launched kernel that breaks them races):
- launched with PDL only through `launch_args` (USE_GDC > 0 with it), so gdc_wait() runs in every program;
- before gdc_wait(): only static reads (weights) and prefetches; no load of anything an earlier kernel of the
  step writes, no store at all (a store could overwrite what the previous kernel still reads);
- gdc_launch_dependents() anywhere: it only lets the next PDL-launched kernel start its own pre-wait part.
Off by default until measured (FLUXTIDE_PDL=1 turns it on, on sm_90+ CUDA devices; the interpreter never).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def _mode(value: str) -> int:
    """FLUXTIDE_PDL: "0" (or unset) off, "1" PDL launches (the weight kernels wait first thing), "2" the weight
    kernels also prefetch their weight rows into L2 before the wait; anything else is refused, as the
    FLUXTIDE_PREFILL_* settings are. ValueError."""
    if value not in ("0", "1", "2"):
        raise ValueError(f"FLUXTIDE_PDL must be 0, 1 or 2, got {value!r}")
    return int(value)


MODE = _mode(os.environ.get("FLUXTIDE_PDL", "0"))
ENABLED = MODE > 0
PREFETCH = MODE == 2
LINE = tl.constexpr(128)  # bytes one L2 prefetch asks for (one cache line)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether launches over t's device use PDL: FLUXTIDE_PDL=1 and a CUDA device of compute capability 9+."""
    return ENABLED and t.is_cuda and _capable(t.device.index if t.device.index is not None else
                                              torch.cuda.current_device())


def weight_mode(t: torch.Tensor) -> int:
    """USE_GDC of a weight-streaming kernel over t: 0 plain launch, 1 PDL launch that waits first thing, 2 PDL
    launch that prefetches its weight rows into L2 before the wait (FLUXTIDE_PDL=2)."""
    return (2 if PREFETCH else 1) if enabled(t) else 0


def launch_args(use_gdc: int) -> dict:
    """A PDL-launched kernel's USE_GDC and its launch option together (the rule above: a PDL launch always runs
    the wait): {"USE_GDC": use_gdc, "launch_pdl": True}, or {"USE_GDC": 0} for a plain launch."""
    return {"USE_GDC": use_gdc, "launch_pdl": True} if use_gdc else {"USE_GDC": 0}


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at ptrs (a tensor of pointers, any shape); nothing lands in registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(base_ptr, rows, row_stride, col_lo, col_hi):
    """L2 prefetch of bytes [col_lo, col_hi) of each row in rows (int tensor [R], clamped by the caller to
    existing rows) of a byte matrix at base_ptr with row_stride bytes per row: one prefetch per LINE bytes."""
    row_ptrs = base_ptr.to(tl.pointer_type(tl.uint8)) + rows.to(tl.int64) * row_stride
    for c in range(col_lo, col_hi, LINE):
        prefetch_l2(row_ptrs + c)


@triton.jit
def wait_previous():
    """griddepcontrol.wait: the previous kernel of the stream has finished and its writes are visible."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_start():
    """griddepcontrol.launch_dependents: the next kernel, if PDL-launched, may start its pre-wait part."""
    tl.extra.cuda.gdc_launch_dependents()
