"""Whole-matrix dequantization (dequant_weight) against the reference's dequantize, every quantized format, and
prefill_linear's cuBLAS path over it (Triton's interpreter on the CPU; compiled on a GPU host).

Bounds: fp32 output bit for bit everywhere (the same fp32 products; NVFP4 multiplies its two scales in another
order, which the seeds below do not expose). bf16 bit for bit on a GPU only: the interpreter truncates the fp32
to bf16 cast where the GPU and torch round to nearest even, so there it may differ by one bf16 ulp.
"""

import pytest
import torch

from adapters.checkpoint.quant import dequantize
from adapters.checkpoint.quantize import quantize
from adapters.cuda_exec import prefill_linear as pl
from adapters.kernels.dense_gemm import SUPPORTED, dense_gemm
from adapters.kernels.dequant_weight import dequant_weight
from domain.model_spec import WeightFormat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = sorted(SUPPORTED, key=lambda f: f.value)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS path and bf16 rounding: CUDA only")


def _weight(fmt, n=200, k=384, seed=0):
    # N=200: a partial 128-row tile (and block-FP8 scale block); K=384: three 128-column tiles
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen) * 0.05, fmt).to(DEVICE)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_fp32_copy_is_the_reference_dequantization(fmt):
    q = _weight(fmt)
    out = torch.full(q.shape, float("nan"), device=DEVICE)  # an unwritten element fails below
    assert dequant_weight(q, out) is out
    assert torch.equal(out, dequantize(q, torch.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_bf16_copy_is_within_one_rounding_of_the_reference(fmt):
    q = _weight(fmt, k=320)  # K=320: a partial last tile
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
    ref = dequantize(q, torch.bfloat16)
    dequant_weight(q, out)
    if DEVICE == "cuda":
        assert torch.equal(out, ref)
    else:  # truncation instead of rounding: at most one bf16 ulp (2^-8 relative) apart
        assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all()
        assert (out != ref).any() or fmt in (WeightFormat.NVFP4, WeightFormat.MXFP4)  # 4-bit values are exact


def test_refuses_float_weights_and_wrong_buffers():
    q = _weight(WeightFormat.FP8_BLOCK)
    with pytest.raises(ValueError, match="bf16"):
        dequant_weight(quantize(torch.randn(8, 128), WeightFormat.BF16), torch.empty(8, 128))
    with pytest.raises(ValueError, match=r"\[200, 384\]"):
        dequant_weight(q, torch.empty(200, 256, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        dequant_weight(q, torch.empty(384, 200, device=DEVICE).T)
    with pytest.raises(ValueError, match="contiguous"):
        dequant_weight(q, torch.empty(200, 384, dtype=torch.int32, device=DEVICE))


def test_prefill_linear_takes_the_copy_only_for_long_chunks_on_cuda(monkeypatch):
    monkeypatch.setattr(pl, "DEQUANT_MIN_ROWS", 64)
    assert pl.use_dequant(torch.empty(64, 384, device=DEVICE)) == (DEVICE == "cuda")  # never on the CPU
    assert not pl.use_dequant(torch.empty(63, 384, device=DEVICE))
    monkeypatch.setattr(pl, "DEQUANT_MIN_ROWS", 0)  # FLUXTIDE_PREFILL_DEQUANT_ROWS=0: never
    assert not pl.use_dequant(torch.empty(4096, 384, device=DEVICE))


def test_the_row_setting_refuses_anything_but_a_row_count():
    assert pl._dequant_rows("0") == 0 and pl._dequant_rows("1024") == 1024
    for bad in ("", "-1", "1k", "1.5", "on"):
        with pytest.raises(ValueError, match="FLUXTIDE_PREFILL_DEQUANT_ROWS must be a row count"):
            pl._dequant_rows(bad)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_prefill_linear_on_the_copy_matches_the_reference_and_the_gemm(monkeypatch, fmt, dtype):
    monkeypatch.setattr(pl, "DEQUANT_MIN_ROWS", 64)
    q = _weight(fmt, n=1024, k=2048, seed=3)
    x = torch.randn(300, 2048, device="cuda", dtype=dtype)
    got = pl.prefill_linear(x, q)
    # the same cuBLAS call on the reference's own dequantization: bit for bit
    assert torch.equal(got, torch.nn.functional.linear(x, dequantize(q, dtype)))
    # and the Triton GEMM it replaces, within its own test's bounds (fp32: reordered sums; bf16: one rounding)
    ref = dense_gemm(x, q).double()
    assert ((got.double() - ref).norm() / ref.norm()).item() < (1e-5 if dtype == torch.float32 else 8e-3)
