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
@pytest.mark.parametrize("rows,kernel", [(1, "dense_gemv"), (3, "dense_gemm_splitk"), (20, "dense_gemm")])
def test_quantized_weights_match_the_reference_for_any_row_count(fmt, rows, kernel, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    q = quantize(torch.randn(48, 256, generator=gen) * 0.05, fmt).to(DEVICE)
    x = torch.randn(2 if rows > 1 else 1, rows, 256, generator=gen).to(DEVICE)  # [B, M, I]: leading dims kept
    called = []
    for mod, name in ((pl.gemv, "dense_gemv"), (pl.gemm, "dense_gemm"), (pl.splitk, "dense_gemm_splitk")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k))
    out = pl.prefill_linear(x, q)
    assert out.shape == (*x.shape[:2], 48)
    assert _err(out, x.double().cpu() @ dequantize(q.to("cpu"), torch.float64).T) < 1e-5
    # 1 row: the GEMV; 2 x 3 rows: the split-K GEMM; 2 x 20 = 40 rows: the tensor-core GEMM
    assert called == [kernel]


def test_the_kernel_per_row_count(monkeypatch):
    q = quantize(torch.randn(32, 256) * 0.05, WeightFormat.FP8_BLOCK)
    # split-K on (the default): the GEMV for 1-2 rows, split-K for 3..SPLITK_MAX_ROWS, dense_gemm above
    assert [pl.use_gemv(r, 2048) for r in (1, 2, 3, 16)] == [True, True, False, False]
    assert [pl.use_splitk(r, q) for r in (1, 2, 3, 16, pl.SPLITK_MAX_ROWS, pl.SPLITK_MAX_ROWS + 1)] == \
        [False, False, True, True, True, False]
    # off: the H200's GEMV/GEMM crossover per K (narrow K: the GEMM from 4 rows; wide K: from 9)
    monkeypatch.setattr(pl, "SPLITK_MAX_ROWS", 0)
    assert [pl.use_gemv(r, 2048) for r in (1, 3, 4, 16)] == [True, True, False, False]
    assert [pl.use_gemv(r, 4096) for r in (1, 8, 9, 16)] == [True, True, False, False]
    assert not any(pl.use_splitk(r, q) for r in (1, 3, 16, 32))


def test_float_weights_and_refusals():
    x = torch.randn(5, 32, device=DEVICE)
    w = torch.randn(16, 32, device=DEVICE)
    assert torch.equal(pl.prefill_linear(x, w), F.linear(x, w))
    bf16 = QTensor(WeightFormat.BF16, (16, 32), w.bfloat16())
    xb = x.bfloat16()
    assert torch.equal(pl.prefill_linear(xb, bf16), qlinear(xb, bf16))
    with pytest.raises(ValueError, match="expects 32"):
        pl.prefill_linear(torch.randn(5, 16, device=DEVICE), quantize(torch.randn(16, 32), WeightFormat.FP8_TENSOR))
