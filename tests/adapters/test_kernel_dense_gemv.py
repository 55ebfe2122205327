"""Dense quantized GEMV against the reference dequantization, every format it reads (Triton's
interpreter on the CPU; the GPU run covers real shapes)."""

import pytest
import torch

from adapters.checkpoint.quant import QTensor, dequantize
from adapters.checkpoint.quantize import quantize
from adapters.kernels.dense_gemv import SUPPORTED, dense_gemv
from domain.model_spec import WeightFormat

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt", sorted(SUPPORTED, key=lambda f: f.value))
@pytest.mark.parametrize("rows", [1, 3])
def test_dense_gemv_matches_the_reference(fmt, rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 200, 384  # N not a multiple of the tile, K three scale blocks
    q = quantize(torch.randn(n, k, generator=gen) * 0.05, fmt)
    x = torch.randn(rows, k, generator=gen)
    out = torch.full((rows, n), float("nan"), device=DEVICE)
    dense_gemv(x.to(DEVICE), q.to(DEVICE), out=out)
    out = out.cpu()
    ref = x.double() @ dequantize(q, torch.float64).T
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err


def test_dense_gemv_refuses_unread_formats_and_bad_shapes():
    q = quantize(torch.randn(32, 128) * 0.05, WeightFormat.FP8_BLOCK)
    with pytest.raises(ValueError, match="must be"):
        dense_gemv(torch.randn(1, 64), q)
    bf16 = QTensor(WeightFormat.BF16, (32, 128), torch.zeros(32, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not read"):
        dense_gemv(torch.randn(1, 128), bf16)
    fp4 = quantize(torch.randn(32, 128) * 0.05, WeightFormat.NVFP4)
    with pytest.raises(ValueError, match="must be"):
        dense_gemv(torch.randn(1, 64), fp4)
    with pytest.raises(ValueError, match="scale group"):
        dense_gemv(torch.randn(1, 128), fp4, block_k=8)
    fp4.global_scale = torch.ones(3)
    with pytest.raises(ValueError, match="holds one value"):
        dense_gemv(torch.randn(1, 128), fp4)


FP4 = [WeightFormat.NVFP4, WeightFormat.MXFP4]


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize(("rows", "n", "k", "tile"), [
    (1, 200, 384, (None, None)),  # N and K not multiples of the tile: the masked loop
    (3, 64, 512, (16, 256)),  # a tile that divides the matrix: the lean loop without masks
    (2, 48, 512, (8, 512)),
])
def test_dense_gemv_reads_the_4_bit_formats(fmt, rows, n, k, tile):
    gen = torch.Generator().manual_seed(rows + n)
    q = quantize(torch.randn(n, k, generator=gen) * 0.05, fmt)
    x = torch.randn(rows, k, generator=gen)
    out = torch.full((rows, n), float("nan"), device=DEVICE)
    dense_gemv(x.to(DEVICE), q.to(DEVICE), out=out, block_n=tile[0], block_k=tile[1])
    ref = x.double() @ dequantize(q, torch.float64).T
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err


@pytest.mark.parametrize("block_n,block_k", [(8, 256), (4, 512)])
def test_dense_gemv_wide_tiles_cover_a_ragged_k(block_n, block_k):
    gen = torch.Generator().manual_seed(7)
    q = quantize(torch.randn(40, 384, generator=gen) * 0.05, WeightFormat.FP8_BLOCK)
    x = torch.randn(2, 384, generator=gen)
    out = dense_gemv(x.to(DEVICE), q.to(DEVICE), block_n=block_n, block_k=block_k).cpu()
    ref = x.double() @ dequantize(q, torch.float64).T
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("fmt", sorted(SUPPORTED, key=lambda f: f.value))
@pytest.mark.parametrize("block_n,block_k", [(16, 128), (8, 256), (256, 128)])
def test_dense_gemv_even_tiles_take_the_lean_loop(fmt, block_n, block_k):
    """Tiles that divide the matrix run without masks; block FP8 tiles of <= 128 rows fold the scales
    into x, wider ones scale per product: every variant matches the reference."""
    gen = torch.Generator().manual_seed(block_n)
    q = quantize(torch.randn(512, 256, generator=gen) * 0.05, fmt)  # 4 x 2 scale blocks, distinct scales
    x = torch.randn(2, 256, generator=gen)
    out = dense_gemv(x.to(DEVICE), q.to(DEVICE), block_n=block_n, block_k=block_k).cpu()
    ref = x.double() @ dequantize(q, torch.float64).T
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
