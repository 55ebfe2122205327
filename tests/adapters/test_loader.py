"""Loader on checkpoints written by transformers' save_pretrained, and on the layouts
published checkpoints use: nested/flat names, sharded index, fused experts, mtp/vision extras."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.loader import load_checkpoint
from adapters.checkpoint.quant import QTensor, dequantize, qlinear
from domain.model_spec import WeightFormat

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=128)


def save_qwen35(out: Path) -> Path:
    cfg = transformers.Qwen3_5MoeTextConfig(
        num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, shared_expert_intermediate_size=32, **TINY)
    torch.manual_seed(0)
    transformers.Qwen3_5MoeForCausalLM(cfg).save_pretrained(out)
    return out


def save_qwen3(out: Path) -> Path:
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=2, intermediate_size=64, **TINY)
    torch.manual_seed(1)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory) -> Path:
    return save_qwen35(tmp_path_factory.mktemp("q35"))


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory) -> Path:
    return save_qwen3(tmp_path_factory.mktemp("q3"))


def rewrite(src: Path, dst: Path, transform=None, shards: int = 1, config_edit=None) -> Path:
    """Copy a checkpoint, transforming its tensor dict and optionally sharding it."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    if transform is not None:
        tensors = transform(tensors)
    config = json.loads((src / "config.json").read_text())
    if config_edit is not None:
        config = config_edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, dst / "model.safetensors")
        return dst
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, dst / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def assert_matches(ckpt, src: Path, prefix: str) -> None:
    ref = load_file(src / "model.safetensors")
    spec = ckpt.spec
    for layer in range(spec.num_layers):
        for expert in range(spec.num_experts):
            w = ckpt.experts.weights(layer, expert)
            for m in ("gate", "up", "down"):
                want = ref[f"{prefix}layers.{layer}.mlp.experts.{expert}.{m}_proj.weight"]
                assert torch.equal(dequantize(getattr(w, m)), want), (layer, expert, m)
    expected_dense = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in ref.items()
                      if ".mlp.experts." not in k}
    assert set(ckpt.dense) == set(expected_dense)
    for name, t in expected_dense.items():
        assert torch.equal(ckpt.dense[name], t), name


def test_qwen35_save_pretrained_loads_bitwise(q35_dir):
    ckpt = load_checkpoint(q35_dir, progress=False)
    assert ckpt.spec.architecture == "qwen3_5_moe" and ckpt.format_name == "bf16"
    assert ckpt.experts.layout.float_dtype == torch.float32
    assert "layers.0.mlp.shared_expert.gate_proj.weight" in ckpt.dense
    assert "lm_head.weight" in ckpt.dense and "embed_tokens.weight" in ckpt.dense
    assert_matches(ckpt, q35_dir, "model.language_model.")


def test_qwen3_flat_save_pretrained_loads_bitwise(q3_dir):
    ckpt = load_checkpoint(q3_dir, progress=False)
    assert ckpt.spec.architecture == "qwen3_moe" and ckpt.spec.num_layers == 2
    assert_matches(ckpt, q3_dir, "model.")


def test_nested_text_config_and_sharded_index(q35_dir, tmp_path):
    def nest(config):
        return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                "text_config": config, "vision_config": {"depth": 1}}

    dst = rewrite(q35_dir, tmp_path / "nested", shards=3, config_edit=nest)
    assert len(list(dst.glob("*.safetensors"))) == 3
    ckpt = load_checkpoint(dst, progress=False)
    assert ckpt.text_config["hidden_size"] == 64
    assert_matches(ckpt, q35_dir, "model.language_model.")


def test_fused_experts_load_like_per_expert(q35_dir, tmp_path):
    prefix = "model.language_model."

    def fuse(tensors):
        out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
        for layer in range(4):
            p = f"{prefix}layers.{layer}.mlp.experts"
            gate_up = [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
                       for e in range(4)]
            out[f"{p}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
            out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(4)])
        return out

    ckpt = load_checkpoint(rewrite(q35_dir, tmp_path / "fused", fuse), progress=False)
    assert_matches(ckpt, q35_dir, prefix)


def test_mtp_and_vision_tensors_are_ignored_with_a_log_line(q35_dir, tmp_path, caplog):
    def add_extras(tensors):
        tensors = dict(tensors)
        tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)
        tensors["mtp.fc.weight"] = torch.zeros(64, 128)
        tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 8)
        return tensors

    dst = rewrite(q35_dir, tmp_path / "extras", add_extras)
    with caplog.at_level("INFO", logger="adapters.checkpoint"):
        ckpt = load_checkpoint(dst, progress=False)
    assert not any("mtp" in n or "visual" in n for n in ckpt.dense)
    assert "ignoring 2 mtp tensors" in caplog.text and "ignoring 1 vision tensors" in caplog.text
    assert_matches(ckpt, q35_dir, "model.language_model.")


def test_pack_view_round_trip_is_zero_copy():
    layout = ExpertLayout(WeightFormat.BF16, hidden=64, intermediate=32)
    gate, up, down = (torch.randn(32, 64), torch.randn(32, 64), torch.randn(64, 32))
    qs = [QTensor(WeightFormat.BF16, tuple(t.shape), t.bfloat16()) for t in (gate, up, down)]
    row = layout.pack(*qs)
    view = layout.view(row)
    assert row.numel() == layout.row_bytes and layout.row_bytes % 16 == 0
    assert torch.equal(view.down.data, qs[2].data)
    assert view.gate.data.untyped_storage().data_ptr() == row.untyped_storage().data_ptr()
    x = torch.randn(3, 64)
    torch.testing.assert_close(qlinear(x, view.up), x @ dequantize(qs[1]).T, rtol=1e-5, atol=1e-5)


def test_memory_check_refuses_before_allocating(q35_dir):
    with pytest.raises(MemoryError, match="not enough host RAM.*mmap=True"):
        load_checkpoint(q35_dir, progress=False, host_memory_bytes=1000)


def test_mmap_mode_builds_rows_lazily(q35_dir):
    ckpt = load_checkpoint(q35_dir, progress=False, mmap=True, host_memory_bytes=1 << 30)
    assert ckpt.experts.rows is None
    assert_matches(ckpt, q35_dir, "model.language_model.")
