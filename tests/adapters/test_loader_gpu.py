"""CUDA hosts: the bank is pinned, dense weights land on the GPU (the input embedding stays pinned in host
memory), and qlinear on the GPU (from slot-pool style views of a bank row copied to the device) matches the CPU
result in every format."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adapters.checkpoint.loader import load_checkpoint
from adapters.checkpoint.quant import QTensor, qlinear
from adapters.checkpoint.synth import synthesize
from adapters.checkpoint.synth_config import FORMATS, GEOMETRIES

pytestmark = pytest.mark.gpu
TINY = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pinned_bank_and_cuda_qlinear_match_cpu(fmt, tmp_path):
    out = synthesize(tmp_path, TINY, fmt, seed=3, tokenizer=False)
    ckpt = load_checkpoint(out, device="cuda", progress=False)
    assert ckpt.experts.pinned
    q_proj = ckpt.dense["layers.3.self_attn.q_proj.weight"]
    assert (q_proj.data if isinstance(q_proj, QTensor) else q_proj).is_cuda
    # the input embedding stays in pinned host memory (hosts_embedding: untied, rows the gather copies)
    embed = ckpt.dense["embed_tokens.weight"]
    assert embed.device.type == "cpu" and embed.is_pinned() and ckpt.dense["lm_head.weight"].is_cuda
    layout = ckpt.experts.layout
    slot = torch.empty(layout.row_bytes, dtype=torch.uint8, device="cuda")  # one device slot
    slot.copy_(ckpt.experts.row(2, 5), non_blocking=True)
    on_gpu, on_cpu = layout.view(slot), ckpt.experts.weights(2, 5)
    x = torch.randn(7, TINY.hidden_size)
    for name in ("gate", "up"):
        ref = qlinear(x, getattr(on_cpu, name))
        got = qlinear(x.cuda(), getattr(on_gpu, name)).cpu()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-4
    h = torch.randn(3, TINY.moe_intermediate_size, dtype=torch.bfloat16)
    ref = qlinear(h.float(), on_cpu.down)
    got = qlinear(h.cuda(), on_gpu.down).float().cpu()
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("fmt", FORMATS)
def test_synth_draws_large_geometry_codes_on_the_gpu(fmt, tmp_path):
    out = synthesize(tmp_path, TINY, fmt, seed=3, tokenizer=False, direct=True, device="cuda")
    ckpt = load_checkpoint(out, progress=False)  # written through the host, loads like any other
    weights = ckpt.experts.weights(1, 2)
    from adapters.checkpoint.quant import dequantize

    assert torch.isfinite(dequantize(weights.down)).all()
