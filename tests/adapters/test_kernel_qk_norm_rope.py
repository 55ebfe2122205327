"""q/k RMSNorm + rotary + KV pool write kernel against the torch reference (norms.rms_norm,
rotary.apply_rotary, the indexed pool writes of fast_decoder._attention_decode), on the CPU under
Triton's interpreter; the same tests run on the GPU.

Bounds: fp32 within 1e-5 relative. bf16/fp16: every element within 2 ulps (of the rotary terms'
size |x| + |rotate_half(x)|, since their sum can cancel) on the GPU, where the rsqrt and the sum of
squares' order may flip a rounding; in the interpreter fp16 is bitwise (same rounding points) and bf16
within 4 ulps (the interpreter truncates at the norm cast, the two products and their sum; measured
up to 3.7). v is copied bitwise; pool rows other than kv_rows stay untouched.
"""

import pytest
import torch

from adapters.kernels.qk_norm_rope import qk_norm_rope
from adapters.torch_exec import norms
from adapters.torch_exec.rotary import Rotary, apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, N, M, D, P, G = 3, 4, 2, 32, 5, 4


def reference(q, k, v, qw, kw, eps, unit, cos, sin, k_pool, v_pool, rows):
    qn, kn = norms.rms_norm(q, qw, eps, unit_offset=unit), norms.rms_norm(k, kw, eps, unit_offset=unit)
    q, k = apply_rotary(qn, cos, sin), apply_rotary(kn, cos, sin)
    k_pool, v_pool = k_pool.clone(), v_pool.clone()
    k_pool.view(-1, M, D)[rows] = k.to(k_pool.dtype)
    v_pool.view(-1, M, D)[rows] = v.to(v_pool.dtype)
    return q, k_pool, v_pool, qn, kn


def ulps_off(got, want, normed, r):
    """max |got - want| in ulps of the rotary terms' size |x| + |rotate_half(x)| (x the normed
    input): the sum x*cos + rotate_half(x)*sin can cancel, so ulps of the result alone are too tight."""
    half = torch.cat((normed[..., r // 2:r], normed[..., :r // 2], torch.zeros_like(normed[..., r:])), -1)
    size = normed.float().abs() + half.float().abs()
    ulp = torch.finfo(normed.dtype).eps  # relative spacing at 1.0: bf16 2^-7, fp16 2^-10
    err = (got.float() - want.float()).abs() / (size * ulp)
    return err.max().item()


@pytest.mark.parametrize("rotary_dim", [D, D // 4])  # full rotary (Qwen3), partial (Qwen3.5)
@pytest.mark.parametrize("unit", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_norm_rope_matches_the_reference(rotary_dim, unit, dtype):
    gen = torch.Generator().manual_seed(rotary_dim + 2 * unit)
    # q as the gated projection leaves it: a strided half of [B, N, 2D]
    q = torch.randn(B, N, 2 * D, generator=gen).to(dtype)[..., :D]
    k, v = (torch.randn(B, M, D, generator=gen).to(dtype) for _ in range(2))
    qw, kw = ((torch.randn(D, generator=gen) * 0.2).to(dtype) for _ in range(2))
    rotary = Rotary(D, 10000.0, rotary_dim / D, "cpu")
    cos, sin = rotary.cos_sin(torch.tensor([5, 900, 17]), dtype)
    k_pool, v_pool = (torch.randn(P, G, M, D, generator=gen).to(dtype) for _ in range(2))
    rows = torch.tensor([7, 0, P * G - 1])
    want_q, want_k, want_v, qn, kn = reference(q, k, v, qw, kw, 1e-6, unit, cos, sin, k_pool, v_pool, rows)
    dev = [t.to(DEVICE) for t in (q, k, v, qw, kw, cos, sin, k_pool, v_pool, rows)]
    q_d, k_d, v_d, qw_d, kw_d, cos_d, sin_d, kp_d, vp_d, rows_d = dev
    out = torch.full((B, N, D), float("nan"), dtype=dtype, device=DEVICE)
    got = qk_norm_rope(q_d, k_d, v_d, qw_d, kw_d, 1e-6, unit, cos_d, sin_d, kp_d, vp_d, rows_d, out=out)
    assert got is out
    got_q, got_k, got_v = got.cpu(), kp_d.cpu(), vp_d.cpu()
    assert torch.equal(got_v, want_v)
    others = torch.ones(P * G, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(got_k.view(-1, M, D)[others], k_pool.view(-1, M, D)[others])
    if dtype == torch.float32:
        for g_, w_ in ((got_q, want_q), (got_k, want_k)):
            assert ((g_ - w_).norm() / w_.norm()).item() < 1e-5
    else:
        # NOTE: the interpreter rounds fp32 -> fp16 to nearest (bitwise here: same rounding points) but
        # truncates fp32 -> bf16; the GPU's rsqrt and reduction order may flip a rounding
        ulps = 2 if DEVICE == "cuda" else {torch.float16: 0, torch.bfloat16: 4}[dtype]
        assert ulps_off(got_q, want_q, qn, rotary_dim) <= ulps
        assert ulps_off(got_k.view(-1, M, D)[rows], want_k.view(-1, M, D)[rows], kn, rotary_dim) <= ulps


def test_qk_norm_rope_writes_an_fp32_pool_from_bf16():
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, N, D, generator=gen).bfloat16(), *torch.randn(2, 1, M, D, generator=gen).bfloat16()
    w = torch.ones(D, dtype=torch.bfloat16)
    cos, sin = Rotary(D, 1e6, 1.0, "cpu").cos_sin(torch.tensor([3]), torch.bfloat16)
    k_pool, v_pool = torch.zeros(2, G, M, D), torch.zeros(2, G, M, D)
    rows = torch.tensor([5])
    want_q, want_k, want_v, qn, kn = reference(q, k, v, w, w, 1e-6, False, cos, sin, k_pool, v_pool, rows)
    dev = [t.to(DEVICE) for t in (q, k, v, w, cos, sin, k_pool, v_pool, rows)]
    got = qk_norm_rope(dev[0], dev[1], dev[2], dev[3], dev[3], 1e-6, False, *dev[4:])
    assert torch.equal(dev[7].cpu(), want_v)
    assert ulps_off(dev[6].cpu().view(-1, M, D)[5], want_k.view(-1, M, D)[5], kn[0], D) <= 4
    assert ulps_off(got.cpu(), want_q, qn, D) <= 4


def test_qk_norm_rope_refuses_bad_shapes():
    q, k = torch.randn(2, N, D), torch.randn(2, M, D)
    w, cs = torch.ones(D), torch.ones(2, D)
    pool, rows = torch.zeros(P, G, M, D), torch.zeros(2, dtype=torch.int64)
    good = [q, k, k, w, w, 1e-6, True, cs, cs, pool, pool, rows]
    for i, bad, match in ((1, torch.randn(2, M, D + 1), "k must be"), (3, torch.ones(D - 1), "q_norm_w"),
                          (7, torch.ones(2, 3), "rotary dim"), (9, torch.zeros(P, G, M + 1, D), "k_pool"),
                          (11, rows.int(), "kv_rows"), (7, cs.bfloat16(), "cos")):
        args = list(good)
        args[i] = bad
        if i == 7:
            args[8] = bad
        with pytest.raises(ValueError, match=match):
            qk_norm_rope(*args)
