"""FP8 activations for the Triton prefill (--prefill-fp8-activations, docs/adr/0018-fp8-prefill-activations.md):
the per-token-group quantization (act_quant_fp8) bitwise against torch's e4m3 rounding; the W8A8 paths of the
grouped MoE GEMMs and the dense GEMM against the exact product of what they multiply (dequantized e4m3 rows x
dequantized weights, fp32); the noise they add against the bf16-activation path, bounded; and the executor
with the option on: its prefill steps quantize, its decode-bucket steps do not, and it still generates.

Without CUDA the kernels run in Triton's interpreter with fp32 dot operands (the e4m3 values are exact in fp32)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from adapters.checkpoint.quant import dequantize
from adapters.checkpoint.quantize import quantize
from adapters.kernels import act_quant_fp8 as aq
from adapters.kernels.act_quant_fp8 import Fp8Rows, act_quant_fp8, act_quant_fp8_reference
from adapters.kernels.dense_gemm import dense_gemm
from adapters.kernels.grouped_moe import grouped_moe
from adapters.kernels.moe_align import align_by_slot
from adapters.kernels.moe_grouped_down import moe_grouped_down
from adapters.kernels.moe_grouped_gate_up import moe_grouped_gate_up
from domain.model_spec import WeightFormat
from tests.adapters.test_kernels_moe import FP32_BOUND, make_batch, make_pool, reference, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F_ = WeightFormat
A8_FORMATS = [F_.FP8_BLOCK, F_.FP8_TENSOR, F_.FP8_CHANNEL]
# e4m3 keeps 3 mantissa bits: each rounding is off by up to 1/16 of the value (~2.5 % rms over a dot product's
# terms); the MoE rounds x and h, so its output is a few percent off the bf16-activation path
A8_NOISE_BOUND = 0.08


def _same_values(a: Fp8Rows, b: Fp8Rows) -> bool:
    return torch.equal(a.scales, b.scales) and torch.equal(a.q.float(), b.q.float())


# ---- the quantization -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("rows", "cols", "block_m"), [(37, 300, 16), (5, 128, 4), (64, 256, 32), (3, 40, 1)])
def test_quantization_is_torchs_e4m3_rounding_of_the_scaled_group(dtype, rows, cols, block_m):
    """Every group's scale is amax / 448 and every value x / scale rounded to nearest even in e4m3, bitwise
    what torch computes; values span seven decades inside a group, and one row is all zeros."""
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 3, cols)).to(dtype).to(DEVICE)
    x[1 % rows] = 0
    got = act_quant_fp8(x, block_m=block_m)
    want = act_quant_fp8_reference(x)
    assert got.q.dtype == torch.float8_e4m3fn and got.scales.shape == (rows, -(-cols // aq.GROUP))
    assert _same_values(got, want)
    assert (got.q[1 % rows].float() == 0).all() and (got.scales[1 % rows] > 0).all()
    big = x.float().abs() > x.float().abs().amax() * 1e-2  # far from the group's underflow: within half an ulp
    assert ((got.dequantize() - x.float()).abs()[big] <= x.float().abs()[big] / 16 + 1e-30).all()


def test_rounding_carries_into_the_next_power_of_two_and_keeps_subnormals():
    """The values where a mantissa rounding up must carry into the exponent (124.8 -> 128, 7.76 -> 8), exact
    ties (ties to even), e4m3's subnormals (multiples of 2^-9 below 2^-6) and the clamp at 448: the group's
    scale is 1 (its amax is 448), so q is the rounding itself."""
    vals = torch.tensor([448.0, 124.8, -127.9, 7.76, -31.4, 0.01953125, 0.0029296875, 2 ** -10, 2 ** -9 * 1.5,
                         2 ** -9 * 2.5, 8.5, 9.5, 17.0, 19.0, 1.0625, 1.1875] + [0.5] * 112)
    x = vals[None, :].to(DEVICE)
    got = act_quant_fp8(x)
    assert got.scales.item() == 1.0
    assert _same_values(got, act_quant_fp8_reference(x))
    q = got.q.float()[0, :16].tolist()
    ulp = 2 ** -9  # the subnormal spacing; ties go to the even multiple
    assert q == [448.0, 128.0, -128.0, 8.0, -32.0, 0.01953125, 2 * ulp, 0.0, 2 * ulp, 2 * ulp, 8.0, 10.0, 16.0, 20.0,
                 1.0, 1.25]


def test_quantization_reads_strided_rows_and_refuses_bad_input():
    x = torch.randn(8, 256, device=DEVICE)
    assert _same_values(act_quant_fp8(x[:, :128]), act_quant_fp8_reference(x[:, :128].contiguous()))
    empty = act_quant_fp8(torch.empty(0, 256, device=DEVICE))
    assert empty.q.shape == (0, 256) and empty.scales.shape == (0, 2)
    for bad, match in ((x.t(), "unit column stride"), (x[0], r"\[M, K\]"), (x.double(), "bf16/fp16/fp32")):
        with pytest.raises(ValueError, match=match):
            act_quant_fp8(bad)
    with pytest.raises(ValueError, match="power of two"):
        act_quant_fp8(x, block_m=3)


# ---- the W8A8 GEMMs against the exact product of their operands ---------------------------------------------

def _batch(layout, where, tokens, top_k, seed):
    x, slot_ids, weights = make_batch(tokens, top_k, where, seed, skip=None, hidden=layout.hidden)
    slot_ids[1, 0] = -1
    slot_ids[3] = -1
    return x, slot_ids, weights


@pytest.mark.parametrize(("hidden", "inter"), [(256, 128), (320, 96)], ids=["even", "ragged"])
@pytest.mark.parametrize("fmt", A8_FORMATS, ids=lambda f: f.value)
def test_grouped_gemms_multiply_the_e4m3_rows_exactly(fmt, hidden, inter):
    """gate_up on Fp8Rows of x is the reference on x's dequantized rows, and down on Fp8Rows of h the reference
    down on h's: the quantization is the only difference (ragged: partial K steps and scale blocks)."""
    layout, slots, where = make_pool(fmt, hidden, inter, experts=4, num_slots=6, seed=1)
    x, slot_ids, weights = _batch(layout, where, tokens=21, top_k=2, seed=2)
    xq = act_quant_fp8(x)
    h_ref, _ = reference(xq.dequantize(), slot_ids, weights, slots, layout)
    align = align_by_slot(slot_ids, slots.shape[0], 16)
    live = align.pairs >= 0
    used = (align.block_slots >= 0).repeat_interleave(16)
    h = moe_grouped_gate_up(xq, align, 2, slots, layout, block_n=64, out_dtype=torch.float32)
    assert h.dtype == torch.float32
    assert rel_err(h[live], h_ref.reshape(-1, inter)[align.pairs[live].long()]) < FP32_BOUND
    assert torch.equal(h[used & ~live], torch.zeros_like(h[used & ~live])), "padding rows are zeros"
    hq = act_quant_fp8(h)
    partials = torch.full((21, 2, hidden), float("nan"), device=DEVICE)
    moe_grouped_down(hq, align, weights, slots, layout, partials, block_n=32)
    hd = hq.dequantize()
    for p in torch.nonzero(live).flatten()[::5].tolist():  # a sample of pairs, each against its own product
        pair = int(align.pairs[p])
        t, k = divmod(pair, 2)
        down = dequantize(layout.view(slots[int(slot_ids[t, k])]).down)
        want = weights[t, k] * (hd[p] @ down.T)
        assert rel_err(partials[t, k], want) < FP32_BOUND, pair
    assert torch.isnan(partials[3]).all() and torch.isnan(partials[1, 0]).all(), "skipped pairs are not written"


@pytest.mark.parametrize("fmt", A8_FORMATS, ids=lambda f: f.value)
def test_dense_gemm_multiplies_the_e4m3_rows_exactly(fmt):
    gen = torch.Generator().manual_seed(3)
    w = quantize(torch.randn(96, 320, generator=gen) * 0.2, fmt)  # ragged: 320 = 2.5 groups
    w = dataclasses.replace(w, data=w.data.to(DEVICE), scale=w.scale.to(DEVICE))
    x = torch.randn(37, 320, generator=gen).to(DEVICE)
    xq = act_quant_fp8(x)
    y = dense_gemm(xq, w, block_m=16, block_n=32, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (37, 96)
    assert rel_err(y, xq.dequantize() @ dequantize(w).float().T) < FP32_BOUND
    assert dense_gemm(xq, w, block_m=16, block_n=32).dtype == torch.bfloat16  # the default output dtype


def test_w8a8_refuses_layouts_it_cannot_read():
    layout, slots, where = make_pool(F_.NVFP4, 128, 128, experts=2, num_slots=3, seed=4)
    x, slot_ids, weights = _batch(layout, where, tokens=6, top_k=2, seed=5)
    align = align_by_slot(slot_ids, slots.shape[0], 16)
    with pytest.raises(ValueError, match="FP8 weight layout"):
        moe_grouped_gate_up(act_quant_fp8(x), align, 2, slots, layout)
    h = torch.zeros(align.pairs.numel(), 128, device=DEVICE)
    with pytest.raises(ValueError, match="FP8 weight layout"):
        moe_grouped_down(act_quant_fp8(h), align, weights, slots, layout, torch.zeros(6, 2, 128, device=DEVICE))
    w = quantize(torch.randn(64, 128), F_.NVFP4)
    with pytest.raises(ValueError, match="FP8 weight"):
        dense_gemm(act_quant_fp8(torch.randn(4, 128, device=DEVICE)), w)
    fp8 = quantize(torch.randn(64, 128), F_.FP8_BLOCK)
    with pytest.raises(ValueError, match="Fp8Rows"):
        dense_gemm(act_quant_fp8(torch.randn(4, 256, device=DEVICE)), fp8)


@pytest.mark.parametrize("fmt", A8_FORMATS, ids=lambda f: f.value)
def test_grouped_moe_with_fp8_activations_stays_within_the_e4m3_noise(fmt):
    """Against the bf16-activation path (fp32 here): off by the two roundings and no more; and not equal to it,
    so the quantization did run. An NVFP4 layout ignores a8 (its grouped GEMMs have no e4m3 path)."""
    layout, slots, where = make_pool(fmt, 256, 128, experts=4, num_slots=6, seed=6)
    x, slot_ids, weights = _batch(layout, where, tokens=24, top_k=2, seed=7)
    plain = grouped_moe(x, slot_ids, weights, slots, layout)
    a8 = grouped_moe(x, slot_ids, weights, slots, layout, a8=True)
    assert 1e-4 < rel_err(a8, plain) < A8_NOISE_BOUND
    layout, slots, where = make_pool(F_.NVFP4, 256, 128, experts=4, num_slots=6, seed=6)
    x, slot_ids, weights = _batch(layout, where, tokens=24, top_k=2, seed=7)
    assert torch.equal(grouped_moe(x, slot_ids, weights, slots, layout, a8=True),
                       grouped_moe(x, slot_ids, weights, slots, layout))


# ---- the executor with the option on ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    from adapters.checkpoint.loader import load_checkpoint
    from adapters.checkpoint.synth import synthesize
    from adapters.checkpoint.synth_config import GEOMETRIES

    geometry = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)
    directory = synthesize(tmp_path_factory.mktemp("fp8"), geometry, "fp8_block", seed=11, tokenizer=False)
    return load_checkpoint(directory, device="cpu", progress=False)


def test_executor_prefill_steps_quantize_and_decode_buckets_do_not(fp8_ckpt, monkeypatch):
    """With fp8_activations, prefill chunks longer than the decode buckets quantize their rows before the FP8
    GEMMs (dense projections and grouped MoE), decode-bucket steps keep bf16 rows, and the logits stay near
    the bf16 path's (the same model, the same tokens fed)."""
    from adapters.cuda_exec import expert_pool as pool_mod
    from adapters.cuda_exec import prefill_linear as pl
    from adapters.cuda_exec.executor import CudaGraphExecutor
    from adapters.kernels import grouped_moe as gm
    from tests.adapters.torch_exec_models import Sequence, make_plan, pages_for, run_requests

    monkeypatch.setattr(pool_mod, "GEMV_MAX_PAIRS", 8)  # 24-token chunks reach the grouped GEMMs
    quantized: list[int] = []
    real = aq.act_quant_fp8

    def counted(x, *args, **kwargs):
        quantized.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(pl, "act_quant_fp8", counted)
    monkeypatch.setattr(gm, "act_quant_fp8", counted)
    prompts = [[(7 * i + 3) % 256 for i in range(24)], [(5 * i + 1) % 256 for i in range(24)]]

    def run(a8: bool):
        fast = CudaGraphExecutor(fp8_ckpt, make_plan(fp8_ckpt, expert_slots=fp8_ckpt.spec.top_k * 16), DEVICE,
                                 torch.float32, max_decode_rows=4, use_graphs=False, prefill_kernels=True,
                                 fp8_activations=a8)
        fast.model.decode_gemm_rows = fast.decode_rows  # as on CUDA: decode buckets keep bf16 rows
        seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + 4), state_slot=i) for i, p in enumerate(prompts)]
        record: dict = {}
        quantized.clear()
        run_requests(fast, seqs, 3, chunk=24, record=record)
        fast.check_valid()
        return record, list(quantized)

    plain, none = run(False)
    assert none == []
    a8, rows = run(True)
    assert rows and min(rows) > 4, rows  # only prefill-sized inputs (x and h of the MoE, the projections)
    for rid, steps in plain.items():
        first = a8[rid][0]  # the prefill's logits: every layer through the e4m3 GEMMs
        assert 0 < rel_err(first, steps[0]) < A8_NOISE_BOUND * 2, rid


def test_executor_refuses_fp8_activations_it_cannot_apply(fp8_ckpt, tmp_path):
    from adapters.checkpoint.loader import load_checkpoint
    from adapters.checkpoint.synth import synthesize
    from adapters.checkpoint.synth_config import GEOMETRIES
    from adapters.cuda_exec.executor import CudaGraphExecutor
    from tests.adapters.torch_exec_models import make_plan

    plan = make_plan(fp8_ckpt, expert_slots=fp8_ckpt.spec.top_k * 4)
    with pytest.raises(ValueError, match="--prefill-kernels triton"):
        CudaGraphExecutor(fp8_ckpt, plan, DEVICE, torch.float32, fp8_activations=True)
    geometry = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)
    bf16 = load_checkpoint(synthesize(tmp_path, geometry, "bf16", seed=1, tokenizer=False), device="cpu",
                           progress=False)
    with pytest.raises(ValueError, match="need FP8 weights"):
        CudaGraphExecutor(bf16, make_plan(bf16, expert_slots=bf16.spec.top_k * 4), DEVICE, torch.float32,
                          prefill_kernels=True, fp8_activations=True)


def test_serve_refuses_the_option_without_the_triton_prefill_or_the_fast_path():
    from app.containers import _torch_executor
    from app.settings import ServeSettings

    with pytest.raises(ValueError, match="--prefill-kernels triton"):
        ServeSettings(prefill_fp8_activations=True, prefill_kernels="reference")
    with pytest.raises(ValueError, match="--executor reference, --mmap-experts"):
        ServeSettings(prefill_fp8_activations=True, prefill_kernels="triton", executor="reference", mmap_experts=True)
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--device", "cpu", "--prefill-kernels", "triton",
                          "--prefill-fp8-activations"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--prefill-fp8-activations" in bad.stderr and "--device cpu" in bad.stderr
    assert "Traceback" not in bad.stderr
    # --device auto that finds no GPU: refused when the executor is built (the server shows it on /health)
    settings = ServeSettings(prefill_fp8_activations=True, prefill_kernels="triton")
    with pytest.raises(ValueError, match="fast path's Triton prefill"):
        _torch_executor(settings, fp8_ckpt_stub(), None, "cuda")  # unpinned bank: no fast path


def fp8_ckpt_stub():
    """A checkpoint as far as the executor choice reads it: a bank without pinned rows (no fast path)."""
    from types import SimpleNamespace

    return SimpleNamespace(experts=SimpleNamespace(rows=None))


# ---- GPU: the Qwen3.6 expert and projection shapes, autotuned tiles, e4m3 wgmma -----------------------------

# Hopper's FP8 tensor cores keep ~14 bits inside one K step's sum (DeepSeek-V3 report, 3.3.2); the kernels add each
# 128-column step into fp32, so the error stays near that of one step
GPU_A8_BOUND = 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 2048])
def test_gpu_w8a8_gemms_at_qwen36_shapes(tokens):
    layout, slots, where = make_pool(F_.FP8_BLOCK, 2048, 512, experts=64, num_slots=80, seed=21, device="cuda")
    x, slot_ids, weights = make_batch(tokens, 8, where, seed=22, hidden=2048, skip=None)
    xq = act_quant_fp8(x.bfloat16())
    assert _same_values(xq, act_quant_fp8_reference(x.bfloat16()))
    groups = 65
    align = align_by_slot(slot_ids, slots.shape[0], 64 if tokens > 64 else 16, groups)
    live = align.pairs >= 0
    h = moe_grouped_gate_up(xq, align, 8, slots, layout, out_dtype=torch.float32)  # autotuned tile
    xd = xq.dequantize()
    for s in torch.unique(slot_ids).tolist()[:8]:  # a few experts, each against its exact product
        w = layout.view(slots[s])
        rows = live & (align.block_slots.repeat_interleave(align.block_m) == s)
        t = align.pairs[rows].long() // 8
        want = torch.nn.functional.silu(xd[t] @ dequantize(w.gate).T) * (xd[t] @ dequantize(w.up).T)
        assert rel_err(h[rows], want) < GPU_A8_BOUND, s
    w = quantize(torch.randn(4096, 2048) * 0.05, F_.FP8_BLOCK)
    w = dataclasses.replace(w, data=w.data.cuda(), scale=w.scale.cuda())
    y = dense_gemm(xq, w, out_dtype=torch.float32)  # autotuned tile
    assert rel_err(y, xd @ dequantize(w).float().T) < GPU_A8_BOUND
    out = grouped_moe(x.bfloat16(), slot_ids, weights, slots, layout, max_groups=groups, a8=True)
    plain = grouped_moe(x.bfloat16(), slot_ids, weights, slots, layout, max_groups=groups)
    assert 1e-4 < rel_err(out, plain) < A8_NOISE_BOUND
