"""Gated RMSNorm kernel against adapters/torch_exec/norms.py gated_rms_norm called as the fast decoder
does, `gated_rms_norm(core.to(dtype), z, w, eps)` with fp32 core, on the CPU under Triton's
interpreter; the same tests run on the GPU.

Bounds: fp32 within 1e-5 relative. Low precision, elementwise in ulps of the result: within 1 on the
GPU (the sum of squares' order, rsqrt and exp may flip one rounding); in the interpreter fp16 is
bitwise (same rounding points, rounded like the GPU) and bf16 within 4 (it truncates fp32 -> bf16 at
the input cast, the normalised row, the weight product and the final cast; measured up to 2.9).
"""

import pytest
import torch

from adapters.kernels.gated_rms_norm import gated_rms_norm
from adapters.torch_exec import norms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ulps_off(got, want):
    ulp = want.float().abs().clamp_min(torch.finfo(want.dtype).tiny) * torch.finfo(want.dtype).eps
    return ((got.float() - want.float()).abs() / ulp).max().item()


@pytest.mark.parametrize("w_fp32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gated_norm_matches_the_reference(dtype, w_fp32):
    gen = torch.Generator().manual_seed(2 + w_fp32)
    b, nv, d = 3, 4, 96  # D not a power of two (the model's is 128)
    core = torch.randn(b, nv, d, generator=gen) * 3  # fp32, as the GDN recurrence leaves it
    z = torch.randn(b, nv, d, generator=gen).to(dtype)
    w = (1.0 + 0.2 * torch.randn(d, generator=gen)).to(torch.float32 if w_fp32 else dtype)
    want = norms.gated_rms_norm(core.to(dtype), z, w, 1e-6).to(dtype)
    out = torch.full((b, nv, d), float("nan"), dtype=dtype, device=DEVICE)
    got = gated_rms_norm(core.to(DEVICE), z.to(DEVICE), w.to(DEVICE), 1e-6, dtype, out=out)
    assert got is out
    got = got.cpu()
    if dtype == torch.float32:
        assert ((got - want).norm() / want.norm()).item() < 1e-5
    else:
        bound = 1 if DEVICE == "cuda" else {torch.float16: 0, torch.bfloat16: 4}[dtype]
        assert ulps_off(got, want) <= bound
    # x already in dtype (no cast point): the same values (bf16 in the interpreter: the in-kernel cast
    # of the fp32 core truncates where torch's rounds, so only the bound holds)
    again = gated_rms_norm(core.to(dtype).to(DEVICE), z.to(DEVICE), w.to(DEVICE), 1e-6).cpu()
    assert again.dtype == dtype
    if DEVICE == "cuda" or dtype != torch.bfloat16:
        assert torch.equal(again, got)
    else:
        assert ulps_off(again, want) <= 4


def test_gated_norm_refuses_bad_shapes():
    x, z = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.randn(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        gated_rms_norm(x, z, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        gated_rms_norm(x, z, torch.ones(8, dtype=torch.float16), 1e-6, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_strided_gate_view_is_read_in_place_with_the_bits_of_its_copy(dtype, monkeypatch):
    """The prefill's and decode step's gate: the z columns of the stacked qkvz output, [T, Nv, D] with rows C + Nv*D
    wide. Read through its strides, it gives exactly what its contiguous copy gives, and no copy is made (the
    launcher would call .contiguous() on it otherwise); a gate of another layout is still copied."""
    gen = torch.Generator().manual_seed(9)
    t, nv, d, c = 5, 4, 96, 40
    core = (torch.randn(t, nv, d, generator=gen) * 3).to(DEVICE)
    stacked = torch.randn(t, c + nv * d, generator=gen).to(dtype).to(DEVICE)  # [T, C + Nv*D]
    z = stacked[:, c:].reshape(t, nv, d)  # a view: row stride C + Nv*D
    assert not z.is_contiguous() and z.data_ptr() == stacked[:, c:].data_ptr()
    w = (1.0 + 0.2 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE)
    want = gated_rms_norm(core, z.contiguous(), w, 1e-6, dtype)
    import adapters.kernels.gated_rms_norm as mod

    gates, kernel = [], mod._gated_rms_norm_kernel

    class Spy:  # the launcher's kernel[grid](...) call, recording the gate tensor it is handed
        def __getitem__(self, grid):
            def launch(x, g, *args, **kw):
                gates.append(g)
                return kernel[grid](x, g, *args, **kw)
            return launch

    monkeypatch.setattr(mod, "_gated_rms_norm_kernel", Spy())
    got = gated_rms_norm(core, z, w, 1e-6, dtype)
    assert gates[-1] is z  # the strided gate itself, not a copy
    assert torch.equal(got, want)
    transposed = z.transpose(0, 1).contiguous().transpose(0, 1)  # [T, Nv, D] with a head-major layout
    assert torch.equal(gated_rms_norm(core, transposed, w, 1e-6, dtype), want)
    flat = z.reshape(t * nv, d)  # 2-D: copied first, the same values
    assert torch.equal(gated_rms_norm(core.reshape(t * nv, d), flat, w, 1e-6, dtype), want.reshape(t * nv, d))
    assert gates[-1].is_contiguous()
