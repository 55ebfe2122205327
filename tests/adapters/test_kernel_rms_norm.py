"""Fused residual-add + RMSNorm kernel against adapters/torch_exec/norms.py (Triton's interpreter on the
CPU): bitwise in fp32 up to the reduction order, and the bf16 rounding of the residual sum."""

import pytest
import torch

from adapters.kernels.rms_norm import rms_norm
from adapters.torch_exec import norms


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_matches_the_reference(unit_offset, dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 48, generator=gen).to(dtype)
    res = torch.randn(3, 5, 48, generator=gen).to(dtype)
    w = (torch.randn(48, generator=gen) * 0.1).to(dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    total, out = rms_norm(x.to(dev), w.to(dev), 1e-6, unit_offset=unit_offset, residual=res.to(dev))
    total, out = total.cpu(), out.cpu()
    if dtype == torch.float32 or torch.cuda.is_available():
        assert torch.equal(total, x + res)
    else:  # NOTE: Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even
        ulp = (x + res).float().abs() * 2.0 ** -7
        assert ((total.float() - (x + res).float()).abs() <= ulp).all()
    want = norms.rms_norm(x + res, w, 1e-6, unit_offset=unit_offset)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert ((out.float() - want.float()).norm() / want.float().norm()).item() < tol
    same, plain = rms_norm(x.to(dev), w.to(dev), 1e-6, unit_offset=unit_offset)
    assert torch.equal(same.cpu(), x) and plain.shape == x.shape
    total2, out2, out32 = rms_norm(x.to(dev), w.to(dev), 1e-6, unit_offset=unit_offset, residual=res.to(dev),
                                   fp32_copy=True)
    assert torch.equal(out2.cpu(), out) and torch.equal(total2.cpu(), total)
    assert out32.dtype == torch.float32 and torch.equal(out32.cpu(), out.float())  # the rounded output, widened


def test_norm_refuses_a_wrong_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6, unit_offset=True)
