"""Dynamic FP8 quantization of activations per token group, the input side of the W8A8 prefill GEMMs:
each row of x is cut into groups of 128 columns and each group is stored as e4m3 values with one fp32 scale.

Shape legend: M rows (tokens or expert pairs), K columns, G = cdiv(K, 128) groups per row.
  x [M, K] bf16/fp16/fp32 (any row stride, unit column stride) -> Fp8Rows(q [M, K] float8_e4m3fn, scales fp32 [M, G])
  with x[m, k] ~= q[m, k] * scales[m, k // 128].
Scheme: the "dynamic, group 128" activation quantization that block-FP8 checkpoints declare
(`activation_scheme: dynamic`, weight_block_size [128, 128]; compressed-tensors' `input_activations`
strategy "group", group_size 128), as DeepSeek-V3's and vLLM's per-token-group quantization computes it:
scale = max(amax, 1e-10) / 448 (448 = e4m3's largest finite value), q = round_to_nearest_even(clamp(x / scale)).
Grid: (cdiv(M, BLOCK_M), G): one program quantizes BLOCK_M rows of one group. No host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

GROUP = 128  # columns per scale: one block-FP8 weight block's K extent, so one scale per K step of the GEMMs
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-10  # an all-zero group gets a tiny scale instead of a division by zero (its q are 0)


@dataclass(frozen=True)
class Fp8Rows:
    """Rows of activations quantized by act_quant_fp8: q [M, K] float8_e4m3fn, scales fp32 [M, cdiv(K, 128)]."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda

    def dequantize(self) -> torch.Tensor:
        """fp32 [M, K]: q * its group's scale (the value the W8A8 GEMMs multiply)."""
        m, k = self.q.shape
        return self.q.float() * self.scales.repeat_interleave(GROUP, dim=1)[:, :k].reshape(m, k)


@triton.jit
def round_e4m3(y):
    """y (fp32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32.

    NOTE: done in fp32 arithmetic instead of by the fp32 -> e4m3 conversion alone because Triton's CPU
    interpreter drops the carry when the mantissa rounds up to the next power of two (124.8 -> 64, not 128);
    after this the conversion is exact on every backend. (a + c) - c with c = 2^(e + 20) rounds a in
    [2^e, 2^(e+1)) to a multiple of 2^(e - 3), e4m3's spacing there (3 mantissa bits); below 2^-6 e4m3 is
    subnormal with the fixed spacing 2^-9, hence the exponent floor."""
    a = tl.abs(y)
    expo = a.to(tl.int32, bitcast=True) & 0x7F800000
    expo = tl.maximum(expo, (127 - 6) << 23)
    c = (expo + (20 << 23)).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(y < 0, -r, r)


@triton.jit(do_not_specialize=["M", "stride_xm"])
def _act_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, K: tl.constexpr, G: tl.constexpr,
                          BLOCK_M: tl.constexpr, GROUP_K: tl.constexpr):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    k = g * GROUP_K + tl.arange(0, GROUP_K)  # [GK]
    ok = (m < M)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [BM]
    scale = tl.maximum(amax, 1e-10) / 448.0
    y = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(q_ptr + m[:, None].to(tl.int64) * K + k[None, :], round_e4m3(y).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + m.to(tl.int64) * G + g, scale, mask=m < M)


def act_quant_fp8(x: torch.Tensor, block_m: int = 16) -> Fp8Rows:
    """Fp8Rows of x [M, K] (bf16/fp16/fp32, unit column stride): e4m3 values and one fp32 scale per row and
    128 columns (module docstring for the formula). block_m: rows per program (power of two, >= 1).
    Raises ValueError on another rank, dtype or a column stride other than 1."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"act_quant_fp8: x must be bf16/fp16/fp32 [M, K], got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"act_quant_fp8: x needs unit column stride, got strides {x.stride()}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"act_quant_fp8: block_m={block_m} must be a power of two")
    rows, cols = x.shape
    groups = triton.cdiv(cols, GROUP)
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows and cols:
        _act_quant_fp8_kernel[(triton.cdiv(rows, block_m), groups)](x, q, scales, rows, x.stride(0), K=cols, G=groups,
                                                                     BLOCK_M=block_m, GROUP_K=GROUP)
    return Fp8Rows(q, scales)


def act_quant_fp8_reference(x: torch.Tensor) -> Fp8Rows:
    """The same quantization in torch ops (the tests' reference): x [M, K] float -> Fp8Rows."""
    rows, cols = x.shape
    groups = -(-cols // GROUP)
    padded = torch.zeros((rows, groups * GROUP), dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    grouped = padded.view(rows, groups, GROUP)
    scales = grouped.abs().amax(dim=2).clamp_min(AMAX_FLOOR) / E4M3_MAX  # [M, G]
    y = (grouped / scales[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = y.to(torch.float8_e4m3fn).view(rows, groups * GROUP)[:, :cols].contiguous()  # torch rounds to nearest even
    return Fp8Rows(q, scales)
