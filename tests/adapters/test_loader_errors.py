"""Unknown or inconsistent checkpoints fail at load, naming the field or tensor and the file,
before any bank is allocated."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import adapters.checkpoint.loader as loader
from adapters.checkpoint.formats import CheckpointFormatError
from adapters.checkpoint.synth import synthesize
from adapters.checkpoint.synth_config import GEOMETRIES

TINY = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256, num_hidden_layers=4, num_experts=4)
EXPERT = "model.language_model.layers.1.mlp.experts.2.down_proj"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {fmt: synthesize(root / fmt, TINY, fmt, seed=1, tokenizer=False, shard_bytes=1 << 30)
            for fmt in ("fp8_block", "int8_quark", "bf16")}


@pytest.fixture(autouse=True)
def no_allocation(monkeypatch):
    """Every failure here must come before the bank is allocated."""
    def refuse(*_a, **_k):
        raise AssertionError("bank allocated before the checkpoint was validated")

    monkeypatch.setattr(loader, "allocate_rows", refuse)


def copy_with(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unknown_quant_method_names_field_and_file(sources, tmp_path):
    dst = copy_with(sources["fp8_block"], tmp_path / "c",
                    edit_config=lambda c: c["quantization_config"].update(quant_method="gptq"))
    with pytest.raises(CheckpointFormatError, match=r"config\.json.*quantization_config\.quant_method='gptq'"):
        loader.load_checkpoint(dst, progress=False)


def test_unsupported_block_size_names_field(sources, tmp_path):
    dst = copy_with(sources["fp8_block"], tmp_path / "c",
                    edit_config=lambda c: c["quantization_config"].update(weight_block_size=[64, 64]))
    with pytest.raises(CheckpointFormatError, match=r"config\.json.*weight_block_size=\[64, 64\]"):
        loader.load_checkpoint(dst, progress=False)


def test_missing_scale_names_tensor_and_file(sources, tmp_path):
    dst = copy_with(sources["fp8_block"], tmp_path / "c",
                    edit_tensors=lambda t: t.pop(EXPERT + ".weight_scale_inv"))
    with pytest.raises(CheckpointFormatError,
                       match=r"missing tensor layers\.1\.mlp\.experts\.2\.down_proj\.weight_scale_inv.*"
                             r"model\.safetensors.*" + EXPERT.replace(".", r"\.")):
        loader.load_checkpoint(dst, progress=False)


def test_wrong_scale_shape_names_tensor_file_and_shapes(sources, tmp_path):
    def bad(t):
        t[EXPERT + ".weight_scale_inv"] = torch.ones(1, 1)

    dst = copy_with(sources["fp8_block"], tmp_path / "c", edit_tensors=bad)
    with pytest.raises(CheckpointFormatError, match=r"down_proj\.weight_scale_inv in model\.safetensors: "
                                                    r"shape \(1, 1\), expected \(2, 1\)"):
        loader.load_checkpoint(dst, progress=False)


def test_quantized_tensors_without_quantization_config(sources, tmp_path):
    dst = copy_with(sources["fp8_block"], tmp_path / "c", edit_config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointFormatError, match=r"experts\.0\.gate_proj\.weight in model\.safetensors"):
        loader.load_checkpoint(dst, progress=False)


def test_missing_expert_names_tensor(sources, tmp_path):
    dst = copy_with(sources["bf16"], tmp_path / "c", edit_tensors=lambda t: t.pop(EXPERT + ".weight"))
    with pytest.raises(CheckpointFormatError, match=r"missing tensor layers\.1\.mlp\.experts\.2\.down_proj\.weight"):
        loader.load_checkpoint(dst, progress=False)


def test_expert_shape_disagreeing_with_config(sources, tmp_path):
    dst = copy_with(sources["bf16"], tmp_path / "c",
                    edit_config=lambda c: c["text_config"].update(moe_intermediate_size=64))
    with pytest.raises(CheckpointFormatError, match=r"logical shape \(96, 160\), expected \(64, 160\) from config"):
        loader.load_checkpoint(dst, progress=False)


def test_asymmetric_quark_zero_point_is_refused(sources, tmp_path):
    def shift(t):
        t[EXPERT + ".weight_zero_point"] = torch.ones_like(t[EXPERT + ".weight_zero_point"])

    dst = copy_with(sources["int8_quark"], tmp_path / "c", edit_tensors=shift)
    with pytest.raises(CheckpointFormatError, match=r"weight_zero_point in model\.safetensors is non-zero"):
        loader.load_checkpoint(dst, progress=False)


def test_valid_copy_loads_and_reaches_allocation(sources, tmp_path):
    """Control: an unedited copy passes validation and gets as far as allocating the bank."""
    dst = copy_with(sources["fp8_block"], tmp_path / "c")
    with pytest.raises(AssertionError, match="bank allocated"):
        loader.load_checkpoint(dst, progress=False)
