"""Quantized weight matrices: one canonical in-memory form per WeightFormat, a reference
dequantizer (tests) and a matmul that dequantizes one K block at a time.

Shape legend: T tokens, O output features (rows), I input features (cols), G scale groups.

Canonical forms (the loader converts every on-disk variant into these):
  BF16          data float [O, I] (bf16, fp16 or fp32 as stored); no scales
  FP8_BLOCK     data e4m3 [O, I]; scale fp32 [ceil(O/128), ceil(I/128)], w = data * scale
  FP8_TENSOR    data e4m3 [O, I]; scale fp32 [1, 1]
  FP8_CHANNEL   data e4m3 [O, I]; scale fp32 [O, 1]
  INT8_CHANNEL  data int8 [O, I]; scale fp32 [O, 1]
  NVFP4         data uint8 [O, I/2] (e2m1, low nibble = even column); scale e4m3 [O, I/16];
                global_scale fp32 [1], w = e2m1 * scale * global_scale (ModelOpt's weight_scale_2)
  MXFP4         data uint8 [O, I/2] (e2m1 as above); scale uint8 e8m0 [O, I/32], w = e2m1 * 2^(s-127)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from domain.model_spec import WeightFormat

FP8_BLOCK = 128  # weight_block_size of block-FP8 checkpoints
NVFP4_GROUP = 16
MXFP4_GROUP = 32
FP8_MAX = 448.0
E2M1_MAX = 6.0
INT8_MAX = 127.0

# e2m1 code (sign bit 3) -> value
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class QTensor:
    """A logical [out, in] weight kept in its storage format."""

    fmt: WeightFormat
    shape: tuple[int, int]  # logical [O, I]
    data: torch.Tensor
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def check_valid(self) -> None:
        expected = expected_parts(self.fmt, *self.shape, float_dtype=self.data.dtype)
        actual = {"data": self.data, "scale": self.scale, "global_scale": self.global_scale}
        for name, tensor in actual.items():
            want = expected.get(name)
            if want is None:
                if tensor is not None:
                    raise ValueError(f"{self.fmt.value} QTensor must not carry {name}")
                continue
            if tensor is None:
                raise ValueError(f"{self.fmt.value} QTensor {tuple(self.shape)} is missing {name}")
            dtype, shape = want
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{self.fmt.value} QTensor {tuple(self.shape)}: {name} is {tensor.dtype} "
                    f"{tuple(tensor.shape)}, expected {dtype} {shape}"
                )

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> QTensor:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QTensor(self.fmt, self.shape, move(self.data), move(self.scale), move(self.global_scale))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expected_parts(
    fmt: WeightFormat, rows: int, cols: int, float_dtype: torch.dtype = torch.bfloat16
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """dtype and shape of data/scale/global_scale of the canonical form (absent = not carried)."""
    if fmt == WeightFormat.BF16:
        if float_dtype not in FLOAT_DTYPES:
            raise ValueError(f"bf16-format weights must be a float dtype, got {float_dtype}")
        return {"data": (float_dtype, (rows, cols))}
    if fmt in (WeightFormat.NVFP4, WeightFormat.MXFP4):
        group = NVFP4_GROUP if fmt == WeightFormat.NVFP4 else MXFP4_GROUP
        if cols % group:
            raise ValueError(f"{fmt.value} needs in-features divisible by {group}, got {cols}")
        if fmt == WeightFormat.NVFP4:
            return {
                "data": (torch.uint8, (rows, cols // 2)),
                "scale": (torch.float8_e4m3fn, (rows, cols // group)),
                "global_scale": (torch.float32, (1,)),
            }
        return {"data": (torch.uint8, (rows, cols // 2)), "scale": (torch.uint8, (rows, cols // group))}
    scale_shape = {
        WeightFormat.FP8_BLOCK: (_ceil_div(rows, FP8_BLOCK), _ceil_div(cols, FP8_BLOCK)),
        WeightFormat.FP8_TENSOR: (1, 1),
        WeightFormat.FP8_CHANNEL: (rows, 1),
        WeightFormat.INT8_CHANNEL: (rows, 1),
    }[fmt]
    data_dtype = torch.int8 if fmt == WeightFormat.INT8_CHANNEL else torch.float8_e4m3fn
    return {"data": (data_dtype, (rows, cols)), "scale": (torch.float32, scale_shape)}


def k_block(fmt: WeightFormat) -> int:
    """Columns dequantized per step of qlinear (a multiple of the format's scale group)."""
    return 128 if fmt != WeightFormat.BF16 else 512


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [O, C/2] -> float32 [O, C]; the low nibble holds the even column."""
    table = E2M1_VALUES.to(packed.device)
    low = table[(packed & 0x0F).long()]  # [O, C/2]
    high = table[(packed >> 4).long()]  # [O, C/2]
    return torch.stack((low, high), dim=-1).flatten(-2)  # [O, C]


def _dequant_cols(q: QTensor, c0: int, c1: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize columns [c0, c1) of q; c0 must be a multiple of the format's scale group."""
    fmt = q.fmt
    if fmt == WeightFormat.BF16:
        return q.data[:, c0:c1].to(dtype)  # [O, C]
    if fmt in (WeightFormat.NVFP4, WeightFormat.MXFP4):
        values = unpack_e2m1(q.data[:, c0 // 2 : c1 // 2])  # [O, C]
        group = NVFP4_GROUP if fmt == WeightFormat.NVFP4 else MXFP4_GROUP
        raw = q.scale[:, c0 // group : _ceil_div(c1, group)]  # [O, C/g]
        if fmt == WeightFormat.NVFP4:
            scale = raw.float() * q.global_scale.float()
        else:
            scale = torch.exp2(raw.float() - 127.0)
        return (values * scale.repeat_interleave(group, dim=1)[:, : c1 - c0]).to(dtype)
    values = q.data[:, c0:c1].float()  # [O, C]
    if fmt == WeightFormat.FP8_BLOCK:
        scale = q.scale[:, c0 // FP8_BLOCK : _ceil_div(c1, FP8_BLOCK)]  # [O/128, C/128]
        scale = scale.repeat_interleave(FP8_BLOCK, dim=0)[: q.shape[0]]
        scale = scale.repeat_interleave(FP8_BLOCK, dim=1)[:, : c1 - c0]  # [O, C]
    else:
        scale = q.scale  # [1, 1] or [O, 1]
    return (values * scale).to(dtype)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: the whole [O, I] matrix in `dtype`. Tests only; the engine uses qlinear."""
    return _dequant_cols(q, 0, q.shape[1], dtype)


def qlinear(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """x [T, I] -> [T, O] in x's dtype, never materialising more than one K block of q."""
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"qlinear: x has {x.shape[-1]} features, weight expects {q.shape[1]}")
    if q.fmt == WeightFormat.BF16 and q.data.dtype == x.dtype:
        return F.linear(x, q.data)
    cols = q.shape[1]
    block = k_block(q.fmt)
    if cols <= block:
        return F.linear(x, _dequant_cols(q, 0, cols, x.dtype))
    # fp32 accumulation across K blocks keeps bf16 inputs close to a one-shot matmul
    out = torch.zeros(*x.shape[:-1], q.shape[0], dtype=torch.float32, device=x.device)  # [T, O]
    for c0 in range(0, cols, block):
        c1 = min(c0 + block, cols)
        w = _dequant_cols(q, c0, c1, x.dtype)  # [O, C]
        out += F.linear(x[..., c0:c1], w).float()
    return out.to(x.dtype)


def as_linear_weight(w: torch.Tensor | QTensor) -> QTensor:
    """Wrap a plain float weight so callers can treat dense and quantized weights alike."""
    if isinstance(w, QTensor):
        return w
    return QTensor(WeightFormat.BF16, (w.shape[0], w.shape[1]), w)
