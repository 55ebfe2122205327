"""Quantization formats: our quantizer, the public on-disk conventions, and the round trip
quantize -> `synthesize` -> `load_checkpoint` -> dequantize / qlinear."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from adapters.checkpoint.formats import ON_DISK_FORMATS, read_weight
from adapters.checkpoint.loader import load_checkpoint
from adapters.checkpoint.quant import E2M1_VALUES, QTensor, dequantize, qlinear
from adapters.checkpoint.quantize import quantize
from adapters.checkpoint.synth import random_qtensor, synthesize
from adapters.checkpoint.synth_config import FORMATS, GEOMETRIES, module_variant
from domain.model_spec import WeightFormat, matrix_bytes
from domain.quant_scheme import variant_format

F = WeightFormat
# relative Frobenius error of quantizing N(0, 1) weights
TOLERANCE = {F.BF16: 0.005, F.FP8_BLOCK: 0.05, F.FP8_TENSOR: 0.05, F.FP8_CHANNEL: 0.05,
             F.INT8_CHANNEL: 0.02, F.NVFP4: 0.15, F.MXFP4: 0.2}
TINY = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("fmt", list(F))
def test_quantize_dequantize_within_tolerance(fmt):
    w = torch.randn(200, 320, generator=torch.Generator().manual_seed(3))
    q = quantize(w, fmt)
    q.check_valid()
    assert rel_err(dequantize(q), w) < TOLERANCE[fmt]
    assert sum(t.numel() * t.element_size() for t in (q.data, q.scale, q.global_scale) if t is not None) == \
        matrix_bytes(fmt, 200, 320) * (2 if fmt == F.BF16 and q.data.dtype == torch.float32 else 1)


@pytest.mark.parametrize("fmt", list(F))
@pytest.mark.parametrize("cols", [96, 640])  # one partial K block, and several blocks
def test_qlinear_matches_dequantize_then_matmul(fmt, cols):
    g = torch.Generator().manual_seed(4)
    q = quantize(torch.randn(72, cols, generator=g), fmt)
    x = torch.randn(5, cols, generator=g)
    torch.testing.assert_close(qlinear(x, q), x @ dequantize(q).T, rtol=1e-4, atol=1e-4)
    xb = x.bfloat16()  # bf16 activations accumulate per K block in fp32
    assert rel_err(qlinear(xb, q).float(), x @ dequantize(q).T) < 1e-2


def test_e2m1_low_nibble_holds_the_even_column():
    # 0x71: low nibble 1 -> 0.5 (column 0), high nibble 7 -> 6.0 (column 1); 0xA9: -0.5, -1.0
    data = torch.tensor([[0x71, 0xA9]], dtype=torch.uint8)
    scale = torch.full((1, 1), 2.0).to(torch.float8_e4m3fn)
    q = QTensor(F.NVFP4, (1, 16), torch.cat([data, torch.zeros(1, 6, dtype=torch.uint8)], 1), scale, torch.tensor([0.5]))
    assert dequantize(q)[0, :4].tolist() == [0.5, 6.0, -0.5, -1.0]
    assert E2M1_VALUES[0b1011].item() == -1.5


def test_fp8_block_scales_cover_partial_blocks():
    data = torch.ones(130, 200).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = dequantize(QTensor(F.FP8_BLOCK, (130, 200), data, scale))
    assert (w[0, 0], w[0, 199], w[129, 0], w[129, 199]) == (1.0, 2.0, 3.0, 4.0)
    assert w[127, 127] == 1.0 and w[128, 128] == 4.0


def test_compressed_tensors_global_scale_is_a_divisor():
    q = quantize(torch.randn(16, 32), F.NVFP4)
    stored = {"w.weight_packed": q.data, "w.weight_scale": q.scale,
              "w.weight_global_scale": (1.0 / q.global_scale)}
    modelopt = {"w.weight": q.data, "w.weight_scale": q.scale, "w.weight_scale_2": q.global_scale.reshape(())}
    ct = read_weight(ON_DISK_FORMATS["nvfp4_ct"], "w", stored.__getitem__)
    mo = read_weight(ON_DISK_FORMATS["nvfp4_modelopt"], "w", modelopt.__getitem__)
    assert torch.equal(dequantize(ct), dequantize(q)) and torch.equal(dequantize(mo), dequantize(q))


# load_checkpoint's format_name where it is not the synth format's own name
FORMAT_NAME = {"fp8_autofp8": "fp8_tensor", "fp8_block_ct_256x128": "fp8_block_ct@256x128",
               "mixed_modelopt": "mixed: experts nvfp4_modelopt, dense fp8_tensor+nvfp4_modelopt",
               "mixed_ct": "mixed: experts nvfp4_ct, dense fp8_block_ct"}


def reference_dequant(t: dict[str, torch.Tensor], on_disk: str) -> torch.Tensor:
    """Plain per-element decoding of each producer's published layout, independent of quant.py."""
    if on_disk == "bf16":
        return t["weight"].float()
    if on_disk in ("nvfp4_modelopt", "nvfp4_ct", "mxfp4_ct"):
        packed = t.get("weight", t.get("weight_packed"))
        rows, half = packed.shape
        codes = torch.empty(rows, half * 2, dtype=torch.long)
        codes[:, 0::2], codes[:, 1::2] = packed & 15, packed >> 4
        mags = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
        vals = mags[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        if on_disk == "mxfp4_ct":
            return vals * (2.0 ** (t["weight_scale"].float() - 127)).repeat_interleave(32, 1)
        s = t["weight_scale"].float().repeat_interleave(16, 1)
        g = t["weight_scale_2"] if on_disk == "nvfp4_modelopt" else 1.0 / t["weight_global_scale"]
        return vals * s * g
    w = t["weight"].float()
    if on_disk.startswith(("fp8_block", "fp8_pb_wo")):
        s = t["weight_scale_inv" if on_disk == "fp8_block" else "weight_scale"]
        s = s[:, 0, :, 0] if on_disk == "fp8_pb_wo" else s  # [O/128, 1, I/128, 1]: broadcast axes
        rows, cols = (int(b) for b in on_disk.split("@")[1].split("x")) if "@" in on_disk else (128, 128)
        s = s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return w * s[: w.shape[0], : w.shape[1]]
    scale = t["weight_scale"].float()
    return w * (scale if scale.dim() == 0 else scale.reshape(-1, 1))


@pytest.fixture(scope="module", params=FORMATS)
def synthesized(request, tmp_path_factory):
    fmt = request.param
    floats: dict[str, torch.Tensor] = {}
    out = synthesize(tmp_path_factory.mktemp(fmt), TINY, fmt, seed=7, tokenizer=False, shard_bytes=300_000,
                     float_weights=floats)
    return fmt, out, floats


def _on_disk(out, base: str) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    names = [n for n in index if n.startswith(base + ".")]
    found = {}
    for n in names:
        found[n[len(base) + 1 :]] = load_file(out / index[n])[n]
    return found


def test_synth_load_round_trip_matches_reference(synthesized):
    fmt, out, floats = synthesized
    ckpt = load_checkpoint(out, progress=False)
    expert_variant = module_variant(fmt, "layers.0.mlp.experts.0.gate_proj.weight")
    assert ckpt.format_name == FORMAT_NAME.get(fmt, fmt)
    assert ckpt.experts.layout.fmt == variant_format(expert_variant)
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded with an index
    for layer, expert, matrix in [(0, 0, "gate"), (1, 5, "up"), (3, 7, "down")]:
        base = f"model.language_model.layers.{layer}.mlp.experts.{expert}.{matrix}_proj"
        q = getattr(ckpt.experts.weights(layer, expert), matrix)
        ref = reference_dequant(_on_disk(out, base), expert_variant)
        torch.testing.assert_close(dequantize(q), ref, rtol=1e-6, atol=1e-9)
        if fmt != "bf16":
            assert rel_err(dequantize(q), floats[base]) < TOLERANCE[q.fmt]
        x = torch.randn(4, q.shape[1])
        torch.testing.assert_close(qlinear(x, q), x @ ref.T, rtol=1e-4, atol=1e-5)
    for dense_name in ("layers.3.self_attn.q_proj", "layers.0.linear_attn.out_proj"):  # formats may differ per layer
        dense_base = "model.language_model." + dense_name
        dense = ckpt.dense[dense_name + ".weight"]
        variant = module_variant(fmt, dense_name + ".weight")
        if fmt == "bf16":
            assert isinstance(dense, torch.Tensor)
        else:
            assert isinstance(dense, QTensor) and dense.fmt == variant_format(variant)
            torch.testing.assert_close(dequantize(dense), reference_dequant(_on_disk(out, dense_base), variant))
            assert rel_err(dequantize(dense), floats[dense_base]) < TOLERANCE[dense.fmt]
    assert isinstance(ckpt.dense["layers.0.mlp.gate.weight"], torch.Tensor)  # routers stay bf16


def test_planner_and_loader_agree_on_formats(synthesized):
    """One detector: the planner's spec (config.json only) has the bank's expert format, and its dense
    format never costs less than any dense module as loaded (mixed layouts: the widest)."""
    from domain.model_spec import ModelSpec

    fmt, out, _ = synthesized
    planned = ModelSpec.from_hf_config(json.loads((out / "config.json").read_text()))
    ckpt = load_checkpoint(out, progress=False, mmap=True)
    assert planned == ckpt.spec and planned.expert_format == ckpt.experts.layout.fmt
    quantized = [w for w in ckpt.dense.values() if isinstance(w, QTensor)]
    assert all(matrix_bytes(planned.dense_format, 256, 256) >= matrix_bytes(q.fmt, 256, 256) for q in quantized)
    assert {q.fmt for q in quantized} == (set() if fmt == "bf16" else {planned.dense_format} if fmt != "mixed_modelopt"
                                          else {F.FP8_TENSOR, F.NVFP4})


@pytest.mark.parametrize("fmt", list(F))
def test_direct_random_codes_are_valid_and_well_scaled(fmt):
    q = random_qtensor(fmt, 256, 512, torch.Generator().manual_seed(0))
    q.check_valid()
    w = dequantize(q)
    assert torch.isfinite(w).all() and 0.01 < w.std().item() < 0.04


def test_transformers_dequantizes_our_block_fp8_identically(tmp_path):
    """Cross-check of the block-FP8 layout against an independent reader: transformers' fine-grained FP8
    loader (CPU dequantize path; needs accelerate) gives the same dense weights as our dequantize."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    g = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256, hidden_size=256, moe_intermediate_size=128,
                            shared_expert_intermediate_size=128, head_dim=64, linear_key_head_dim=64)
    out = synthesize(tmp_path, g, "fp8_block", layout="flat", tokenizer=False)  # transformers needs /128 dims
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    ours = load_checkpoint(out, progress=False).dense
    checked = 0
    for name in ("layers.3.self_attn.q_proj.weight", "layers.0.linear_attn.in_proj_qkv.weight",
                 "layers.2.mlp.shared_expert.down_proj.weight"):
        assert isinstance(ours[name], QTensor)
        assert torch.equal(theirs["model." + name].float(), dequantize(ours[name]))
        checked += 1
    assert checked == 3


def test_modelopt_mixed_precision_from_the_hf_quant_config_side_file(tmp_path):
    """Older ModelOpt exports keep {"producer", "quantization": {"quant_algo": "MIXED_PRECISION",
    "quantized_layers": ...}} in hf_quant_config.json instead of config.json."""
    out = synthesize(tmp_path / "m", TINY, "mixed_modelopt", seed=3, tokenizer=False)
    reference = load_checkpoint(out, progress=False)
    config = json.loads((out / "config.json").read_text())
    qc = config.pop("quantization_config")
    side = {"producer": qc.pop("producer"), "quantization": {k: v for k, v in qc.items() if k != "quant_method"}}
    (out / "config.json").write_text(json.dumps(config))
    (out / "hf_quant_config.json").write_text(json.dumps(side))
    ckpt = load_checkpoint(out, progress=False)
    assert ckpt.format_name == reference.format_name == FORMAT_NAME["mixed_modelopt"]
    assert torch.equal(ckpt.experts.row(2, 1), reference.experts.row(2, 1))
    assert ckpt.dense["layers.3.self_attn.q_proj.weight"].fmt == F.FP8_TENSOR
