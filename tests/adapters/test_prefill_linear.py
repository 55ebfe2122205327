"""prefill_linear: the right kernel per weight format and row count, each matching the reference
(Triton's interpreter on the CPU)."""

import pytest
import torch
import torch.nn.functional as F

from adapters.checkpoint.quant import QTensor, dequantize, qlinear
from adapters.checkpoint.quantize import quantize
from adapters.cuda_exec import prefill_linear as pl
from domain.model_spec import WeightFormat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _err(got, ref):
    return ((got.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.NVFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("rows", [3, 20])
def test_quantized_weights_match_the_reference_for_any_row_count(fmt, rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    q = quantize(torch.randn(48, 256, generator=gen) * 0.05, fmt).to(DEVICE)
    x = torch.randn(2, rows, 256, generator=gen).to(DEVICE)  # [B, M, I]: leading dims are kept
    called = []
    for mod, name in ((pl.gemv, "dense_gemv"), (pl.gemm, "dense_gemm")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k))
    out = pl.prefill_linear(x, q)
    assert out.shape == (2, rows, 48)
    assert _err(out, x.double().cpu() @ dequantize(q.to("cpu"), torch.float64).T) < 1e-5
    gemv_ok = fmt == WeightFormat.FP8_BLOCK and pl.use_gemv(2 * rows, 256)
    assert called == ["dense_gemv" if gemv_ok else "dense_gemm"]


def test_the_gemv_gemm_crossover_follows_the_h200_measurement():
    # narrow K (qkv projections): the GEMM from 4 rows; wide K (o/out projections): from 9 rows
    assert [pl.use_gemv(r, 2048) for r in (1, 3, 4, 16)] == [True, True, False, False]
    assert [pl.use_gemv(r, 4096) for r in (1, 8, 9, 16)] == [True, True, False, False]


def test_float_weights_and_refusals():
    x = torch.randn(5, 32, device=DEVICE)
    w = torch.randn(16, 32, device=DEVICE)
    assert torch.equal(pl.prefill_linear(x, w), F.linear(x, w))
    bf16 = QTensor(WeightFormat.BF16, (16, 32), w.bfloat16())
    xb = x.bfloat16()
    assert torch.equal(pl.prefill_linear(xb, bf16), qlinear(xb, bf16))
    with pytest.raises(ValueError, match="expects 32"):
        pl.prefill_linear(torch.randn(5, 16, device=DEVICE), quantize(torch.randn(16, 32), WeightFormat.FP8_TENSOR))
