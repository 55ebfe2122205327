"""On-disk quantization formats: detection from config.json and conversion to QTensor.

Shape legend: O out features, I in features.
Each on-disk variant names its tensors differently; all of them map to one canonical
QTensor form per WeightFormat (see quant.py). Conventions, from each producer's public layout:
  fp8_block       (quant_method "fp8", weight_block_size [128,128]): weight e4m3, weight_scale_inv
                  fp32 [ceil(O/128), ceil(I/128)]; w = weight * weight_scale_inv
  fp8_pb_wo       (ModelOpt quant_algo "FP8_PB_WO", block weight-only): weight e4m3, weight_scale fp32
                  [ceil(O/128), 1, ceil(I/128), 1]; w = weight * scale (same values as fp8_block)
  fp8_tensor      (ModelOpt "FP8", AutoFP8 quant_method "fp8" without weight_block_size, or
                  compressed-tensors strategy "tensor"): weight e4m3,
                  weight_scale fp32 scalar; input_scale (static activation scale) is not needed
                  for weight-only dequantization and is ignored
  fp8_channel     (compressed-tensors float, strategy "channel"): weight e4m3, weight_scale [O, 1]
  nvfp4_modelopt  (ModelOpt quant_algo "NVFP4"): weight uint8 [O, I/2] e2m1 low nibble first,
                  weight_scale e4m3 [O, I/16], weight_scale_2 fp32 scalar; w = e2m1*scale*scale_2
  nvfp4_ct        (compressed-tensors float 4-bit, strategy "tensor_group", group 16): weight_packed,
                  weight_scale e4m3, weight_global_scale fp32 [1]. NOTE: compressed-tensors stores
                  the global scale as a DIVISOR (global = 448*6/amax; w = e2m1*scale/global), i.e.
                  weight_global_scale == 1 / ModelOpt's weight_scale_2
  int8_channel    (Quark int8 per_channel, or compressed-tensors int 8-bit channel): weight int8,
                  weight_scale [O] or [O, 1]; symmetric (a weight_zero_point must be all zero)
  mxfp4           (compressed-tensors mxfp4-pack-quantized): weight_packed uint8 [O, I/2],
                  weight_scale uint8 e8m0 [O, I/32]
Which variant each module uses is decided by domain.quant_scheme (the planner's detector too);
this module only knows each variant's tensor names and scale shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch

from adapters.checkpoint.quant import FP8_BLOCK, QTensor, expected_parts
from domain.model_spec import WeightFormat
from domain.quant_scheme import VARIANT_FORMATS, QuantScheme, detect_quant_scheme, split_variant


class CheckpointFormatError(ValueError):
    """The checkpoint's format is unknown or its tensors are inconsistent with it."""


@dataclass(frozen=True)
class OnDiskFormat:
    name: str
    fmt: WeightFormat
    data_suffix: str = "weight"
    scale_suffix: str | None = None
    global_suffix: str | None = None
    global_is_divisor: bool = False
    block: tuple[int, int] = (128, 128)  # block FP8: rows x cols one stored scale covers (multiples of 128)

    @property
    def is_quantized(self) -> bool:
        return self.fmt != WeightFormat.BF16

    @property
    def companion_suffixes(self) -> tuple[str, ...]:
        return tuple(s for s in (self.data_suffix, self.scale_suffix, self.global_suffix) if s)


ON_DISK_FORMATS: dict[str, OnDiskFormat] = {
    f.name: f
    for f in (
        OnDiskFormat("bf16", WeightFormat.BF16),
        OnDiskFormat("fp8_block", WeightFormat.FP8_BLOCK, scale_suffix="weight_scale_inv"),
        OnDiskFormat("fp8_block_ct", WeightFormat.FP8_BLOCK, scale_suffix="weight_scale"),
        OnDiskFormat("fp8_pb_wo", WeightFormat.FP8_BLOCK, scale_suffix="weight_scale"),
        OnDiskFormat("fp8_tensor", WeightFormat.FP8_TENSOR, scale_suffix="weight_scale"),
        OnDiskFormat("fp8_channel", WeightFormat.FP8_CHANNEL, scale_suffix="weight_scale"),
        OnDiskFormat("nvfp4_modelopt", WeightFormat.NVFP4, scale_suffix="weight_scale", global_suffix="weight_scale_2"),
        OnDiskFormat(
            "nvfp4_ct",
            WeightFormat.NVFP4,
            data_suffix="weight_packed",
            scale_suffix="weight_scale",
            global_suffix="weight_global_scale",
            global_is_divisor=True,
        ),
        OnDiskFormat("int8_quark", WeightFormat.INT8_CHANNEL, scale_suffix="weight_scale"),
        OnDiskFormat("int8_ct", WeightFormat.INT8_CHANNEL, scale_suffix="weight_scale"),
        OnDiskFormat("mxfp4_ct", WeightFormat.MXFP4, data_suffix="weight_packed", scale_suffix="weight_scale"),
    )
}

assert {k: v.fmt for k, v in ON_DISK_FORMATS.items()} == VARIANT_FORMATS, "variant tables disagree"


@cache
def on_disk_format(variant: str) -> OnDiskFormat:
    """The OnDiskFormat of a variant name from domain.quant_scheme, e.g. "fp8_block_ct@256x128"."""
    base, block = split_variant(variant)
    disk = ON_DISK_FORMATS[base]
    return disk if block is None else replace(disk, name=variant, block=block)

# Companion tensors we know and deliberately do not need (activation/KV-cache scales, zero points).
IGNORED_SUFFIXES = ("input_scale", "input_global_scale", "weight_zero_point", "input_zero_point",
                    "k_scale", "v_scale", "output_scale")


def detect_scheme(config: dict, config_file: Path) -> QuantScheme:
    """The per-module scheme of config.json's quantization_config (top level or text_config)."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    try:
        scheme = detect_quant_scheme(qc or None)
        scheme.expert_variant()  # the one-format-per-bank invariant, checked before any tensor is read
    except ValueError as e:
        raise CheckpointFormatError(f"{config_file}: {e}") from None
    return scheme


# ---- tensor checks and conversion -------------------------------------------------------

def logical_shape(fmt: OnDiskFormat, data_shape: tuple[int, ...]) -> tuple[int, int]:
    if len(data_shape) != 2:
        raise CheckpointFormatError(f"expected a 2-D weight, got shape {data_shape}")
    rows, cols = data_shape
    return (rows, cols * 2) if fmt.fmt in (WeightFormat.NVFP4, WeightFormat.MXFP4) else (rows, cols)


def accepted_scale_shapes(disk: OnDiskFormat, canonical: tuple[int, ...]) -> list[tuple[int, ...]]:
    """On-disk shapes that hold the same values as the canonical scale shape."""
    fmt = disk.fmt
    if disk.name == "fp8_pb_wo":  # ModelOpt keeps the broadcast axes: [O/128, 1, I/128, 1]
        return [(canonical[0], 1, canonical[1], 1)]
    if fmt == WeightFormat.FP8_BLOCK and disk.block != (FP8_BLOCK, FP8_BLOCK):
        rows, cols = (canonical[0] * FP8_BLOCK, canonical[1] * FP8_BLOCK)  # covers the logical shape
        return [(-(-rows // disk.block[0]), -(-cols // disk.block[1]))]
    if fmt == WeightFormat.FP8_TENSOR:
        return [(), (1,), (1, 1)]
    if fmt in (WeightFormat.FP8_CHANNEL, WeightFormat.INT8_CHANNEL):
        return [canonical, (canonical[0],)]
    return [canonical]


def check_weight(fmt: OnDiskFormat, base: str, meta, expect_shape: tuple[int, int] | None = None) -> tuple[int, int]:
    """Validate the tensors of one quantized weight from metadata only; return its [O, I].

    `meta(name)` returns a TensorEntry-like object (dtype, shape, file) or None.
    """
    data = meta(f"{base}.{fmt.data_suffix}")
    if data is None:
        raise CheckpointFormatError(f"missing tensor {base}.{fmt.data_suffix} (format {fmt.name})")
    where = f"{base}.{fmt.data_suffix} in {data.file.name}"
    shape = logical_shape(fmt, data.shape)
    if expect_shape is not None and shape != expect_shape:
        raise CheckpointFormatError(f"{where}: logical shape {shape}, expected {expect_shape} from config.json")
    try:
        parts = expected_parts(fmt.fmt, *shape, float_dtype=data.dtype if not fmt.is_quantized else torch.bfloat16)
    except ValueError as e:
        raise CheckpointFormatError(f"{where}: {e}") from e
    if data.dtype != parts["data"][0]:
        raise CheckpointFormatError(f"{where}: dtype {data.dtype}, format {fmt.name} stores {parts['data'][0]}")
    for part, suffix in (("scale", fmt.scale_suffix), ("global_scale", fmt.global_suffix)):
        if suffix is None:
            continue
        entry = meta(f"{base}.{suffix}")
        if entry is None:
            raise CheckpointFormatError(
                f"missing tensor {base}.{suffix} (format {fmt.name} needs it next to {where})"
            )
        want_dtype, want_shape = parts[part]
        shapes = [(), (1,)] if part == "global_scale" else accepted_scale_shapes(fmt, want_shape)
        if tuple(entry.shape) not in shapes:
            raise CheckpointFormatError(
                f"{base}.{suffix} in {entry.file.name}: shape {tuple(entry.shape)}, expected {want_shape}"
            )
        floaty = entry.dtype in (torch.float32, torch.bfloat16, torch.float16)
        if want_dtype == torch.float32 and not floaty or want_dtype != torch.float32 and entry.dtype != want_dtype:
            raise CheckpointFormatError(
                f"{base}.{suffix} in {entry.file.name}: dtype {entry.dtype}, expected {want_dtype}"
            )
    return shape


def read_weight(fmt: OnDiskFormat, base: str, get) -> QTensor:
    """Canonical QTensor of one checked weight; `get(name)` returns the stored tensor."""
    data = get(f"{base}.{fmt.data_suffix}")
    shape = logical_shape(fmt, tuple(data.shape))
    if not fmt.is_quantized:
        return QTensor(WeightFormat.BF16, shape, data)
    parts = expected_parts(fmt.fmt, *shape)
    scale = get(f"{base}.{fmt.scale_suffix}")
    scale_dtype, scale_shape = parts["scale"]
    if fmt.block != (FP8_BLOCK, FP8_BLOCK):
        # one stored scale per block of whole 128x128 tiles: repeat it over its tiles (exact)
        scale = scale.repeat_interleave(fmt.block[0] // FP8_BLOCK, 0).repeat_interleave(fmt.block[1] // FP8_BLOCK, 1)
        scale = scale[: scale_shape[0], : scale_shape[1]]
    scale = scale.to(scale_dtype).reshape(scale_shape)
    glob = None
    if fmt.global_suffix is not None:
        glob = get(f"{base}.{fmt.global_suffix}").to(torch.float32).reshape(1)
        if fmt.global_is_divisor:
            glob = 1.0 / glob
    return QTensor(fmt.fmt, shape, data, scale, glob)
