"""Value checks of stored tensors: finite, non-negative quantization scales at every load (cheap:
scales are a small fraction of the bytes) and, on request, NaN/Inf anywhere (`--verify-weights`).

A NaN scale or weight otherwise loads, serves garbage with HTTP 200, and is found by nobody.
Errors name the tensor and its file.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from adapters.checkpoint.formats import CheckpointFormatError
from adapters.checkpoint.safetensors_files import SafetensorsFiles, TensorEntry

# weight_scale(_inv/_2), weight_global_scale, and the fused experts' {gate_up,down}_proj_(global_)scale
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale",
                  "_proj_scale", "_proj_global_scale")
# compressed-tensors divides by its global scale: a zero there is an infinite weight
DIVISOR_SUFFIXES = ("weight_global_scale", "_proj_global_scale")
E8M0_NAN = 0xFF  # the one non-finite e8m0 (MXFP4 scale) code


def _is_scale(canonical: str) -> bool:
    return canonical.endswith(SCALE_SUFFIXES) and not canonical.endswith(("input_scale", "input_global_scale"))


def _bad_values(t: torch.Tensor, divisor: bool) -> torch.Tensor:
    """bool mask of values that are no valid scale."""
    if t.dtype == torch.uint8:  # e8m0 exponents: every code but 0xFF is a finite power of two
        return t == E8M0_NAN
    v = t.float()
    bad = ~torch.isfinite(v) | (v < 0)
    return bad | (v == 0) if divisor else bad


def _describe(entry: TensorEntry, t: torch.Tensor, mask: torch.Tensor, what: str) -> str:
    index = tuple(int(i) for i in mask.nonzero()[0]) if mask.dim() else ()
    value = t[index].float().item() if t.dtype != torch.uint8 else int(t[index])
    return (f"{entry.name} in {entry.file.name}: {int(mask.sum())} {what} value(s), first {value} at index "
            f"{index}; refusing to load a checkpoint that would compute garbage")


def check_scales(files: SafetensorsFiles, canon: Mapping[str, TensorEntry]) -> None:
    """Every quantization scale finite and >= 0 (global divisors > 0); else CheckpointFormatError."""
    for name, entry in canon.items():
        if not _is_scale(name):
            continue
        t = files.get(entry.name)
        mask = _bad_values(t, name.endswith(DIVISOR_SUFFIXES))
        if bool(mask.any()):
            raise CheckpointFormatError(_describe(entry, t, mask, "non-finite, negative or zero-divisor scale"))


def non_finite(t: torch.Tensor) -> torch.Tensor:
    """bool mask of NaN/Inf values of any stored dtype (integers and packed e2m1 are always finite)."""
    if t.dtype in (torch.float8_e4m3fn,):  # no infinities; S.1111.111 is NaN
        return (t.view(torch.uint8) & 0x7F) == 0x7F
    if t.dtype.is_floating_point:
        return ~torch.isfinite(t)
    return torch.zeros(t.shape, dtype=torch.bool)


def scan_weights(files: SafetensorsFiles, canon: Mapping[str, TensorEntry]) -> None:
    """The full scan behind `--verify-weights` / `ft check`: no NaN/Inf in any stored tensor."""
    for _, entry in sorted(canon.items(), key=lambda kv: (str(kv[1].file), kv[1].begin)):
        t = files.get(entry.name)
        mask = non_finite(t)
        if bool(mask.any()):
            raise CheckpointFormatError(_describe(entry, t, mask, "NaN/Inf"))
