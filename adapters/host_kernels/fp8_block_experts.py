"""Block-FP8 experts computed on the host CPU from packed bank rows (ADR 0030's host kernel; C++ beside it).

Shape legend: T tokens, P (token, expert) pairs, H hidden, I expert intermediate, N bank rows, R row bytes.

`fp8_block_experts(x, bank, layout, pair_token, pair_row, pair_weight)` returns fp32 [T, H]: for each token
the router-weighted sum, over its pairs in the order given, of down(silu(gate x) * up x) with the expert read
from bank row pair_row[p] as `ExpertLayout` packs it (block FP8 only: e4m3 data, fp32 128×128 block scales,
w = data × scale). Nothing dequantized is stored; see the .cpp for the e4m3 → fp16 bit mapping.

The kernel is compiled for this host (`-O3 -march=native -ffp-contract=off`, OpenMP through ATen's parallel_for) by
`torch.utils.cpp_extension` on first use and cached in torch's extension directory. It needs a C++ compiler
and ninja; `available()` says whether the build succeeded and why not. C++ callers reach the same kernel on raw
pointers through fp8_block_experts.h (host_lane.cpp builds this source into its own module).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from domain.model_spec import WeightFormat

SOURCE = Path(__file__).with_suffix(".cpp")
# this host's vector units; ATen's parallel_for through OpenMP; no FMA contraction of plain C++ arithmetic: GCC's
# tuning for some hosts (AMD's znver) fuses a multiply-add in one template instance of the GEMV's scalar tail and not
# in another, which would make a pair's bits depend on how many rows share its expert (the intrinsics are explicit)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
_PARTS = (("gate", "data"), ("gate", "scale"), ("up", "data"), ("up", "scale"), ("down", "data"), ("down", "scale"))
GRAIN_ROWS = 64  # output rows per parallel job: 16 gate/up jobs per pair at I = 512, 32 down jobs at H = 2,048


@functools.cache
def _module():
    from torch.utils.cpp_extension import load

    return load(name="fluxtide_fp8_block_experts", sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"], verbose=False)


def available() -> tuple[bool, str]:
    """(True, "simd" | "scalar") when the kernel builds here, else (False, the reason)."""
    try:
        return True, "simd" if _module().simd_build() else "scalar"
    except Exception as exc:  # noqa: BLE001 - any build failure is reported, not raised
        return False, f"{type(exc).__name__}: {exc}".splitlines()[0]


def row_offsets(layout: ExpertLayout) -> torch.Tensor:
    """int64 [6]: byte offsets of gate/up/down data and scale inside a packed row."""
    if layout.fmt != WeightFormat.FP8_BLOCK:
        raise ValueError(f"the host expert kernel reads block FP8 rows, not {layout.fmt.value}")
    by_part = {(s.matrix, s.part): s.offset for s in layout.segments}
    return torch.tensor([by_part[p] for p in _PARTS], dtype=torch.int64)


def fp8_block_experts(x: torch.Tensor, bank: torch.Tensor, layout: ExpertLayout, pair_token: torch.Tensor,
                      pair_row: torch.Tensor, pair_weight: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H] (module docstring). x fp32 [T, H] on the CPU; bank uint8 [N, R] (pinned or not);
    pair_token, pair_row int64 [P]; pair_weight fp32 [P]. Raises ValueError on a shape, dtype or index that
    does not fit (the C++ side trusts its inputs)."""
    offsets = row_offsets(layout)
    t, h = x.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"x must be contiguous fp32 on the CPU, got {x.dtype} on {x.device}")
    if h != layout.hidden:
        raise ValueError(f"x has hidden {h}, the layout {layout.hidden}")
    if bank.dtype != torch.uint8 or bank.dim() != 2 or bank.shape[1] != layout.row_bytes or not bank.is_contiguous():
        raise ValueError(f"bank must be contiguous uint8 [N, {layout.row_bytes}], got {bank.dtype} {tuple(bank.shape)}")
    p = pair_token.shape[0]
    for name, v, dtype in (("pair_token", pair_token, torch.int64), ("pair_row", pair_row, torch.int64),
                           ("pair_weight", pair_weight, torch.float32)):
        if v.dtype != dtype or v.shape != (p,) or v.device.type != "cpu":
            raise ValueError(f"{name} must be {dtype} [{p}] on the CPU, got {v.dtype} {tuple(v.shape)}")
    if p and (int(pair_token.min()) < 0 or int(pair_token.max()) >= t):
        raise ValueError(f"pair_token out of [0, {t})")
    if p and (int(pair_row.min()) < 0 or int(pair_row.max()) >= bank.shape[0]):
        raise ValueError(f"pair_row out of [0, {bank.shape[0]})")
    return _module().fp8_block_experts(x, bank, pair_token.contiguous(), pair_row.contiguous(),
                                       pair_weight.contiguous(), offsets, layout.intermediate, GRAIN_ROWS)
