"""Stacked projection weights: the stack's GEMV equals the parts' GEMVs, the views replacing the parts
hold the same numbers, and what cannot be stacked is refused."""

import pytest
import torch

from adapters.checkpoint.quant import dequantize
from adapters.checkpoint.quantize import quantize
from adapters.cuda_exec.fused_weights import concat_rows
from domain.model_spec import WeightFormat


@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.FP8_TENSOR, WeightFormat.FP8_CHANNEL,
                                 WeightFormat.INT8_CHANNEL])
def test_stacked_parts_are_the_parts(fmt):
    gen = torch.Generator().manual_seed(0)
    parts = [quantize(torch.randn(r, 256, generator=gen) * 0.1, fmt) for r in (256, 128, 128)]
    stacked, views = concat_rows(parts)
    whole = dequantize(stacked)
    assert torch.equal(whole, torch.cat([dequantize(p) for p in parts]))
    for view, part in zip(views, parts, strict=True):
        assert torch.equal(dequantize(view), dequantize(part))


def test_plain_tensors_stack_and_mixed_parts_do_not():
    a, b = torch.randn(4, 8), torch.randn(2, 8)
    stacked, views = concat_rows([a, b])
    assert torch.equal(stacked, torch.cat([a, b])) and torch.equal(views[1], b)
    fp8 = quantize(torch.randn(128, 8) * 0.1, WeightFormat.FP8_CHANNEL)
    assert concat_rows([a, fp8]) is None
    ragged = [quantize(torch.randn(r, 256) * 0.1, WeightFormat.FP8_BLOCK) for r in (128, 64)]
    assert concat_rows(ragged) is None  # 64 rows are not a whole 128-row scale block
    fp4 = [quantize(torch.randn(32, 64) * 0.1, WeightFormat.NVFP4) for _ in range(2)]
    assert concat_rows(fp4) is None
