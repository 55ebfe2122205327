"""Our own quantizers: float weight [O, I] -> canonical QTensor of each format, plus the
on-disk tensors each producer would write for it (used by synth and the tests).

Shape legend: O out features, I in features, G scale groups.
Scales are chosen so the on-disk form round-trips exactly: NVFP4 global scales are powers of
two (so compressed-tensors' divisor 1/g is exact), bf16-stored scales are bf16-representable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adapters.checkpoint.quant import (
    E2M1_MAX,
    E2M1_VALUES,
    FP8_BLOCK,
    FP8_MAX,
    INT8_MAX,
    MXFP4_GROUP,
    NVFP4_GROUP,
    QTensor,
)
from domain.model_spec import WeightFormat

TINY = 1e-12


def _safe(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax, torch.ones_like(amax))


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already scaled to [-6, 6]) to the nearest e2m1 code, uint8 [O, I]."""
    magnitudes = E2M1_VALUES[:8].to(x.device)  # [8]
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2  # [7]; ties round toward zero
    mag = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)  # [O, I]
    for m in midpoints.tolist():
        idx += (mag > m).to(torch.uint8)
    sign = ((x < 0) & (idx > 0)).to(torch.uint8) << 3
    return idx | sign


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [O, I] -> packed [O, I/2], even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _fp8_block(w: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> QTensor:
    """One scale per `block` (multiples of 128); the canonical scale repeats it per 128x128 tile."""
    rows, cols = w.shape
    br, bc = block
    pr, pc = -rows % br, -cols % bc
    padded = F.pad(w, (0, pc, 0, pr))  # [O', I']
    blocks = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scale = _safe(blocks.abs().amax(dim=(1, 3))) / FP8_MAX  # [O/br, I/bc]
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]  # [O, I]
    tiles = scale.repeat_interleave(br // FP8_BLOCK, 0).repeat_interleave(bc // FP8_BLOCK, 1)
    tiles = tiles[: -(-rows // FP8_BLOCK), : -(-cols // FP8_BLOCK)]  # [O/128, I/128]
    return QTensor(WeightFormat.FP8_BLOCK, (rows, cols), to_fp8(w / full), tiles.float().contiguous())


def _nvfp4(w: torch.Tensor) -> QTensor:
    rows, cols = w.shape
    groups = w.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)  # [O, G, 16]
    # power-of-two global scale: exact under both the multiplier and the divisor convention
    glob = torch.exp2(torch.ceil(torch.log2(_safe(w.abs().amax()) / (FP8_MAX * E2M1_MAX))))
    scale = to_fp8(groups.abs().amax(dim=-1) / E2M1_MAX / glob)  # [O, G]
    denom = (scale.float() * glob).unsqueeze(-1)  # [O, G, 1]
    scaled = torch.where(denom > 0, groups / torch.where(denom > 0, denom, 1.0), 0.0)
    codes = e2m1_codes(scaled.reshape(rows, cols))  # [O, I]
    return QTensor(WeightFormat.NVFP4, (rows, cols), pack_e2m1(codes), scale, glob.reshape(1).float())


def _mxfp4(w: torch.Tensor) -> QTensor:
    rows, cols = w.shape
    groups = w.reshape(rows, cols // MXFP4_GROUP, MXFP4_GROUP)  # [O, G, 32]
    exp = torch.ceil(torch.log2(_safe(groups.abs().amax(dim=-1)) / E2M1_MAX)).clamp(-127, 127)  # [O, G]
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    codes = e2m1_codes(scaled.reshape(rows, cols))
    return QTensor(WeightFormat.MXFP4, (rows, cols), pack_e2m1(codes), (exp + 127).to(torch.uint8))


def quantize(w: torch.Tensor, fmt: WeightFormat, float_dtype: torch.dtype = torch.bfloat16,
             block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> QTensor:
    """Quantize a float weight [O, I] into the canonical QTensor of `fmt`; block FP8 uses one scale
    per `block` (multiples of 128, as a producer with a larger block_structure would)."""
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight, got shape {tuple(w.shape)}")
    fmt = WeightFormat(fmt)
    w = w.float()
    rows, cols = w.shape
    if fmt == WeightFormat.BF16:
        return QTensor(fmt, (rows, cols), w.to(float_dtype))
    if fmt == WeightFormat.FP8_BLOCK:
        return _fp8_block(w, block)
    if fmt == WeightFormat.FP8_TENSOR:
        scale = (_safe(w.abs().amax()) / FP8_MAX).reshape(1, 1)
        return QTensor(fmt, (rows, cols), to_fp8(w / scale), scale)
    if fmt in (WeightFormat.FP8_CHANNEL, WeightFormat.INT8_CHANNEL):
        limit = FP8_MAX if fmt == WeightFormat.FP8_CHANNEL else INT8_MAX
        # bf16-representable so the bf16 weight_scale that compressed-tensors writes is exact
        scale = (_safe(w.abs().amax(dim=1, keepdim=True)) / limit).bfloat16().float()  # [O, 1]
        if fmt == WeightFormat.FP8_CHANNEL:
            return QTensor(fmt, (rows, cols), to_fp8(w / scale), scale)
        data = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return QTensor(fmt, (rows, cols), data, scale)
    if fmt == WeightFormat.NVFP4:
        if cols % NVFP4_GROUP:
            raise ValueError(f"nvfp4 needs in-features divisible by {NVFP4_GROUP}, got {cols}")
        return _nvfp4(w)
    if fmt == WeightFormat.MXFP4:
        if cols % MXFP4_GROUP:
            raise ValueError(f"mxfp4 needs in-features divisible by {MXFP4_GROUP}, got {cols}")
        return _mxfp4(w)
    raise ValueError(f"no quantizer for {fmt!r}")


# ---- on-disk tensors -----------------------------------------------------------------------------

# Static activation scale written where a producer stores one; weight-only engines ignore it.
INPUT_SCALE = 0.02


def disk_tensors(q: QTensor, on_disk: str) -> dict[str, torch.Tensor]:
    """suffix -> tensor as the named producer writes them (see formats.py for the layouts)."""
    scalar = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731  shape []
    if on_disk == "bf16":
        return {"weight": q.data}
    if on_disk == "fp8_block":
        return {"weight": q.data, "weight_scale_inv": q.scale}
    if on_disk == "fp8_block_ct":  # compressed-tensors block FP8 (block_structure [128, 128])
        return {"weight": q.data, "weight_scale": q.scale}
    if on_disk.startswith("fp8_block_ct@"):  # a larger block_structure, e.g. "@256x128": one scale per block
        rows, cols = (int(b) // FP8_BLOCK for b in on_disk.split("@")[1].split("x"))
        return {"weight": q.data, "weight_scale": q.scale[::rows, ::cols].contiguous()}
    if on_disk == "fp8_pb_wo":  # ModelOpt FP8_PB_WO keeps the broadcast axes: [O/128, 1, I/128, 1]
        rows, cols = q.scale.shape
        return {"weight": q.data, "weight_scale": q.scale.reshape(rows, 1, cols, 1)}
    if on_disk == "fp8_tensor":  # ModelOpt FP8
        return {"weight": q.data, "weight_scale": q.scale.reshape(()), "input_scale": scalar(INPUT_SCALE)}
    if on_disk == "fp8_channel":  # compressed-tensors FP8_DYNAMIC: bf16 scale [O, 1]
        return {"weight": q.data, "weight_scale": q.scale.bfloat16()}
    if on_disk == "nvfp4_modelopt":
        return {"weight": q.data, "weight_scale": q.scale, "weight_scale_2": q.global_scale.reshape(()),
                "input_scale": scalar(INPUT_SCALE)}
    if on_disk == "nvfp4_ct":
        return {"weight_packed": q.data, "weight_scale": q.scale,
                "weight_global_scale": (1.0 / q.global_scale).reshape(1),
                "input_global_scale": torch.tensor([1.0 / INPUT_SCALE], dtype=torch.float32)}
    if on_disk == "int8_quark":
        return {"weight": q.data, "weight_scale": q.scale.reshape(-1),
                "weight_zero_point": torch.zeros(q.shape[0], dtype=torch.int8), "input_scale": scalar(INPUT_SCALE)}
    if on_disk == "mxfp4_ct":
        return {"weight_packed": q.data, "weight_scale": q.scale}
    raise ValueError(f"unknown on-disk format {on_disk!r}")
