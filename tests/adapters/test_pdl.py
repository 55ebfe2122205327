"""Programmatic dependent launch (adapters/kernels/pdl.py): off the GPU it never turns on; built for sm_90 the
PDL-launched kernels wait for the previous grid before their first dependent access and prefetch only their
weights before it, and the kernels before them let them in; on a GPU the PDL launches give the same bits as the
plain ones, eagerly and replayed from a CUDA graph."""

import re

import pytest
import torch

from adapters.kernels import pdl
from tests.adapters.sm90 import build_for_sm90


def test_never_on_off_cuda(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.enabled(torch.zeros(1))
    assert pdl.launch_args(0) == {"USE_GDC": 0}
    assert pdl.launch_args(2) == {"USE_GDC": 2, "launch_pdl": True}


def test_off_by_default_without_the_variable(monkeypatch):
    import importlib
    monkeypatch.delenv("FLUXTIDE_PDL", raising=False)
    try:
        assert importlib.reload(pdl).ENABLED is False
        monkeypatch.setenv("FLUXTIDE_PDL", "1")
        assert importlib.reload(pdl).ENABLED is True
        for bad in ("yes", "3", ""):  # refused, not read as off (as the FLUXTIDE_PREFILL_* settings)
            monkeypatch.setenv("FLUXTIDE_PDL", bad)
            with pytest.raises(ValueError, match="FLUXTIDE_PDL must be 0, 1 or 2"):
                importlib.reload(pdl)
    finally:
        monkeypatch.delenv("FLUXTIDE_PDL", raising=False)
        importlib.reload(pdl)


_COMPILE_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels import (dense_gemm_splitk as sk, dense_gemv, gated_rms_norm, moe_down, moe_gate_up,
                              moe_router, paged_decode_combine, rms_norm)
from adapters.kernels.packed_gemv import FORMAT_CODES, layout_consts
from domain.model_spec import WeightFormat

def ptx(name, kernel, sig, consts):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    src = ASTSource(kernel, sig, consts, {})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"launch_pdl": True}).asm["ptx"]
    body = asm[asm.index(".entry"):]
    print(name, body.replace("\\n", " ").replace(" ", "~").replace("\\t", "~"))

ptx("dense_gemv", dense_gemv._dense_gemv_kernel,
    {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "stride_xm": "i32", "stride_ym": "i32"},
    dict(N=2048, K=4096, scale_cols=32, SCALE_MODE=0, G=128, BLOCK_N=16, BLOCK_K=256, USE_GDC=2))
ptx("splitk", sk._dense_gemm_splitk_kernel,
    {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "g_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32",
     "cnt_ptr": "*i32", "M": "i32", "M_BUCKET": "i32", "stride_xm": "i32", "stride_ym": "i32", "SPLIT_K": "i32"},
    dict(N=12288, K=2048, FMT=FORMAT_CODES[WeightFormat.FP8_BLOCK], GROUP=128, F32_DOT=False, PRECISION="tf32",
         BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, W_LHS=True, USE_GDC=2))
c = layout_consts(ExpertLayout(WeightFormat.FP8_BLOCK, 2048, 512))
common = dict(K=8, H=2048, I=512, R=c.row_bytes, W_DTYPE=c.gate.w_dtype, FMT=c.fmt_code, GROUP=c.group,
              BLOCK_N=16, BLOCK_K=128, USE_GDC=True)
ptx("gate_up", moe_gate_up._moe_gate_up_kernel,
    {"x_ptr": "*bf16", "slot_ids_ptr": "*i32", "slots_ptr": "*u8", "h_ptr": "*bf16", "S": "i32", "PAIRS_BUCKET": "i32"},
    dict(G_DATA=c.gate.data, G_SCALE=c.gate.scale, G_GSCALE=c.gate.global_scale, U_DATA=c.up.data,
         U_SCALE=c.up.scale, U_GSCALE=c.up.global_scale, **common))
ptx("down", moe_down._moe_down_kernel,
    {"h_ptr": "*bf16", "slot_ids_ptr": "*i32", "weights_ptr": "*fp32", "slots_ptr": "*u8", "y_ptr": "*fp32",
     "S": "i32", "PAIRS_BUCKET": "i32"},
    dict(D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale, WRITE_SKIPPED=True, **common))
ptx("rms_norm", rms_norm._rms_norm_kernel,
    {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16", "out_ptr": "*bf16",
     "out32_ptr": "*fp32", "D": "i32", "eps": "fp32"},
    dict(HAS_RES=True, UNIT_OFFSET=True, FP32_COPY=True, BLOCK_D=2048, USE_GDC=True))
ptx("gated_rms_norm", gated_rms_norm._gated_rms_norm_kernel,
    {"x_ptr": "*fp32", "g_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "D": "i32", "eps": "fp32",
     "stride_gt": "i32", "stride_gh": "i32"},
    dict(HEADS=32, W_IN_DTYPE=True, BLOCK_D=128, USE_GDC=True))
"""

# (kernel, must wait, must let the next one start, prefetches its weights)
_EXPECT = {"dense_gemv": (True, False, True), "splitk": (True, False, True), "gate_up": (True, True, False),
           "down": (True, False, False), "rms_norm": (False, True, False), "gated_rms_norm": (False, True, False)}


@pytest.mark.slow
def test_pdl_kernels_wait_before_dependent_access_for_sm90():
    """In each PDL-launched kernel's PTX, nothing is loaded from global memory before griddepcontrol.wait except
    through prefetch (the rule that keeps a PDL launch race-free), and no store comes before it; trigger-only
    kernels carry launch_dependents and no wait."""
    out = build_for_sm90(_COMPILE_CHECK, timeout=300)
    bodies = dict(line.split(" ", 1) for line in out.splitlines() if line.split(" ", 1)[0] in _EXPECT)
    assert set(bodies) == set(_EXPECT)
    for name, (waits, lets, prefetches) in _EXPECT.items():
        body = bodies[name].replace("~", " ")
        assert ("griddepcontrol.wait" in body) == waits, name
        assert ("griddepcontrol.launch_dependents" in body) == lets, name
        assert ("prefetch.global.L2" in body) == prefetches, name
        if waits:
            before = body[:body.index("griddepcontrol.wait")]
            assert not re.search(r"\bld\.global", before), f"{name}: a global load before the wait"
            assert not re.search(r"\bst\.global|\batom\.", before), f"{name}: a store before the wait"


# ---- on the GPU: the PDL launches give the plain launches' bits --------------------------------------------

@pytest.mark.gpu
def test_pdl_launches_match_plain_launches_eager_and_in_a_graph(monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs an sm_90+ CUDA device")
    from adapters.checkpoint.quantize import quantize
    from adapters.kernels import dense_gemm_splitk, dense_gemv, rms_norm
    from domain.model_spec import WeightFormat

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = quantize(torch.randn(2048, 4096, device="cuda", generator=gen) * 0.02, WeightFormat.FP8_BLOCK)
    norm_w = torch.randn(4096, device="cuda", generator=gen).to(torch.bfloat16)

    def step(x):  # a norm, then the two dense kernels the decode step runs after norms
        _, h = rms_norm.rms_norm(x, norm_w, 1e-6, unit_offset=True)
        one = dense_gemv.dense_gemv(h[:1], w)
        many = dense_gemm_splitk.dense_gemm_splitk(h, w)
        return one, many

    x = torch.randn(16, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(pdl, "ENABLED", False)
    plain = [t.clone() for t in step(x)]
    monkeypatch.setattr(pdl, "ENABLED", True)
    eager = [t.clone() for t in step(x)]
    graph, static_x = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(graph):
        outs = step(static_x)
    graph.replay()
    torch.cuda.synchronize()
    for a, b, c in zip(plain, eager, outs, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
