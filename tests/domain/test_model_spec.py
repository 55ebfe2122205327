"""ModelSpec: SPEC.md's per-unit costs, config parsing and format detection."""

import dataclasses

import pytest
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3MoeConfig

from domain.model_spec import (
    LayerKind,
    ModelSpec,
    WeightFormat,
    matrix_bytes,
    qwen36_35b_a3b,
    weight_format_from_quant_config,
)

KiB, MiB, GiB = 1024, 1024**2, 1024**3
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}


def test_spec_per_unit_costs():
    spec = qwen36_35b_a3b()
    assert spec.num_layers == 40
    assert spec.num_full_attention_layers == 10 and spec.num_linear_attention_layers == 30
    assert spec.layer_kinds[:4] == (LayerKind.LINEAR_ATTENTION,) * 3 + (LayerKind.FULL_ATTENTION,)
    assert spec.total_experts == 10_240
    assert spec.kv_bytes_per_token() == 20 * KiB
    # 3 matrices of 2048x512 fp8 + 3 x 64 fp32 block scales
    assert spec.expert_bytes() == 3 * MiB + 3 * 64 * 4
    assert spec.expert_bytes(WeightFormat.BF16) == 6 * MiB
    assert spec.expert_bytes(WeightFormat.NVFP4) == 3 * (512 * 1024 + 512 * 128 + 4)
    # per-channel scales follow the output rows: 512 each for gate/up, 2048 for down
    assert spec.expert_bytes(WeightFormat.FP8_CHANNEL) == 3 * 512 * 2048 + (512 + 512 + 2048) * 4
    assert 1.65 * MiB < spec.expert_bytes(WeightFormat.NVFP4) < 1.75 * MiB
    # 30 layers x (32 x 128 x 128 fp32 + 8192 channels x 3 x bf16)
    assert spec.linear_state_bytes_per_sequence() == 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert 60 * MiB <= spec.linear_state_bytes_per_sequence() < 62 * MiB


def test_matrix_bytes_every_format():
    rows, cols = 512, 2048
    assert matrix_bytes(WeightFormat.BF16, rows, cols) == rows * cols * 2
    assert matrix_bytes(WeightFormat.FP8_BLOCK, rows, cols) == rows * cols + 4 * 16 * 4
    assert matrix_bytes(WeightFormat.FP8_BLOCK, 130, 129) == 130 * 129 + 2 * 2 * 4  # partial blocks
    assert matrix_bytes(WeightFormat.FP8_TENSOR, rows, cols) == rows * cols + 4
    assert matrix_bytes(WeightFormat.FP8_CHANNEL, rows, cols) == rows * cols + rows * 4
    assert matrix_bytes(WeightFormat.INT8_CHANNEL, rows, cols) == rows * cols + rows * 4
    assert matrix_bytes(WeightFormat.NVFP4, rows, cols) == rows * cols // 2 + rows * cols // 16 + 4
    assert matrix_bytes(WeightFormat.MXFP4, rows, cols) == rows * cols // 2 + rows * cols // 32
    assert matrix_bytes(WeightFormat.NVFP4, 3, 17) == 3 * 9 + 3 * 2 + 4  # odd columns pad per row
    with pytest.raises(ValueError):
        matrix_bytes(WeightFormat.BF16, 0, 4)


def test_dense_weight_bytes_by_hand():
    spec = qwen36_35b_a3b(WeightFormat.BF16)
    h = 2048
    attention = 8192 * h + 2 * 512 * h + h * 4096  # q (with gate), k, v, o
    gdn = 8192 * h + 4096 * h + 2 * 32 * h + h * 4096
    shared = 3 * 512 * h
    params = (2 * 248320 * h + h  # embed, lm_head, final norm
              + 10 * (attention + 2 * 256)
              + 30 * (gdn + 8192 * 4 + 2 * 32 + 128)
              + 40 * (shared + h + 256 * h + 2 * h))
    assert spec.dense_weight_bytes() == 2 * params
    fp8 = qwen36_35b_a3b(WeightFormat.FP8_BLOCK)
    # quantizing projections shrinks dense weights but embeddings/lm_head (~1.9 GiB) stay bf16
    assert 1.9 * GiB < fp8.dense_weight_bytes() < spec.dense_weight_bytes()
    assert 3.0 * GiB < fp8.dense_weight_bytes() < 3.6 * GiB


def test_flat_transformers_config_gives_the_spec_geometry():
    spec = ModelSpec.from_hf_config(Qwen3_5MoeTextConfig().to_dict())
    ref = qwen36_35b_a3b(WeightFormat.BF16)
    assert spec.architecture == "qwen3_5_moe"
    assert spec.expert_format is WeightFormat.BF16 and spec.dense_format is WeightFormat.BF16
    assert spec.layer_kinds == ref.layer_kinds
    assert spec.kv_bytes_per_token() == 20 * KiB
    assert spec.expert_bytes() == 6 * MiB
    assert spec.expert_bytes(WeightFormat.FP8_BLOCK) == ref.expert_bytes(WeightFormat.FP8_BLOCK)
    assert spec.linear_state_bytes_per_sequence() == ref.linear_state_bytes_per_sequence()
    assert spec.dense_weight_bytes() == ref.dense_weight_bytes()
    for field in ("hidden_size", "num_experts", "top_k", "expert_intermediate", "shared_expert_intermediate",
                  "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "linear_conv_kernel"):
        assert getattr(spec, field) == getattr(ref, field), field


def test_nested_config_with_fp8_quantization():
    nested = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "text_config": Qwen3_5MoeTextConfig(max_position_embeddings=262144).to_dict(),
              "quantization_config": FP8_BLOCK_CONFIG}
    spec = ModelSpec.from_hf_config(nested)
    assert spec == dataclasses.replace(qwen36_35b_a3b(WeightFormat.FP8_BLOCK), name=spec.name)
    assert spec.max_context == 262144
    # transformers' own multimodal config nests the same way
    real = ModelSpec.from_hf_config(Qwen3_5MoeConfig().to_dict())
    assert real.layer_kinds == spec.layer_kinds and real.expert_format is WeightFormat.BF16
    assert ModelSpec.from_hf_config(nested, expert_format=WeightFormat.NVFP4).expert_format \
        is WeightFormat.NVFP4


def test_qwen3_moe_config_is_all_full_attention():
    spec = ModelSpec.from_hf_config(Qwen3MoeConfig().to_dict())
    assert spec.architecture == "qwen3_moe"
    assert spec.num_layers == 24 and spec.num_full_attention_layers == 24
    assert spec.num_experts == 128 and spec.top_k == 8 and spec.expert_intermediate == 768
    assert spec.shared_expert_intermediate == 0 and spec.linear_num_value_heads == 0
    assert spec.head_dim == 2048 // 32
    assert spec.linear_state_bytes_per_sequence() == 0
    assert spec.kv_bytes_per_token() == 24 * 2 * 4 * 64 * 2
    # the real Qwen3-30B-A3B config.json spells it num_experts and sets head_dim
    real = {**Qwen3MoeConfig().to_dict(), "num_experts": 128, "head_dim": 128, "num_hidden_layers": 48}
    real.pop("num_local_experts")
    assert ModelSpec.from_hf_config(real).kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2


def test_dense_mlp_layers_are_refused():
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelSpec.from_hf_config(Qwen3MoeConfig(mlp_only_layers=[0]).to_dict())


def test_unknown_model_type_names_the_field():
    config = {**Qwen3_5MoeTextConfig().to_dict(), "model_type": "llama"}
    with pytest.raises(ValueError, match="model_type"):
        ModelSpec.from_hf_config(config)
    config = Qwen3_5MoeTextConfig().to_dict()
    del config["num_experts_per_tok"]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("quant, fmt", [
    (None, WeightFormat.BF16),
    (FP8_BLOCK_CONFIG, WeightFormat.FP8_BLOCK),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, WeightFormat.FP8_TENSOR),
    ({"quant_algo": "FP8"}, WeightFormat.FP8_TENSOR),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, WeightFormat.NVFP4),
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}, WeightFormat.NVFP4),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                       "strategy": "tensor_group", "group_size": 16}}}},
     WeightFormat.NVFP4),
    ({"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     WeightFormat.FP8_CHANNEL),
    ({"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}},
     WeightFormat.FP8_TENSOR),
    ({"quant_method": "quark", "global_quant_config": {
        "weight": {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0}}}, WeightFormat.INT8_CHANNEL),
    ({"quant_method": "fp8", "activation_scheme": "static"}, WeightFormat.FP8_TENSOR),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}, WeightFormat.FP8_BLOCK),
    ({"quant_method": "fp8", "weight_block_size": [256, 128]}, WeightFormat.FP8_BLOCK),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 384]}}}}, WeightFormat.FP8_BLOCK),
])
def test_format_detection(quant, fmt):
    assert weight_format_from_quant_config(quant) is fmt
    config = {**Qwen3_5MoeTextConfig().to_dict(), "quantization_config": quant}
    spec = ModelSpec.from_hf_config(config)
    assert spec.expert_format is fmt and spec.dense_format is fmt


@pytest.mark.parametrize("quant, field", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 192]}, "weight_block_size"),
    ({"quant_method": "mxfp4"}, "quant_method"),  # gpt-oss layout: the loader cannot read it, so neither plans it
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [64, 64]}}}},
     "config_groups.g.weights.block_structure"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "quantized_layers"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.self_attn.q_proj": {"quant_algo": "INT4_AWQ"}}}, "quantized_layers.model.layers.0"),
    ({"quant_method": "compressed-tensors", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}, "config_groups.g.weights"),
    ({"quant_method": "compressed-tensors"}, "config_groups"),
    ({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "uint4"}}},
     "global_quant_config.weight"),
])
def test_unknown_format_names_the_field(quant, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        weight_format_from_quant_config(quant)


def test_bad_geometry_is_refused():
    base = qwen36_35b_a3b().__dict__
    with pytest.raises(ValueError, match="top_k"):
        ModelSpec(**{**base, "top_k": 300})
    with pytest.raises(ValueError, match="architecture"):
        ModelSpec(**{**base, "architecture": "llama"})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        ModelSpec(**{**base, "linear_num_value_heads": 0})


# ---- per-module schemes (mixed precision) --------------------------------------------------------
NVFP4_W = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
BLOCK_W = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}


def test_modelopt_mixed_precision_experts_nvfp4_attention_fp8():
    from domain.quant_scheme import detect_quant_scheme

    quant = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
        "model.layers.0.mlp.experts.0.down_proj": {"quant_algo": "NVFP4", "group_size": 16},
        "model.layers.3.self_attn.q_proj": {"quant_algo": "FP8"},
    }}
    scheme = detect_quant_scheme(quant)
    assert scheme.variant_for("model.language_model.layers.3.self_attn.q_proj") == "fp8_tensor"
    assert scheme.variant_for("layers.0.mlp.experts.0.gate_proj") == "nvfp4_modelopt"
    assert scheme.variant_for("layers.3.self_attn.k_proj") == "bf16"  # not listed: unquantized
    spec = ModelSpec.from_hf_config({**Qwen3_5MoeTextConfig().to_dict(), "quantization_config": quant})
    assert spec.expert_format is WeightFormat.NVFP4 and spec.dense_format is WeightFormat.FP8_TENSOR


def test_compressed_tensors_mixed_groups_pick_by_target():
    from domain.quant_scheme import detect_quant_scheme

    quant = {"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
        "group_0": {"targets": ["re:.*mlp\\.experts.*"], "weights": NVFP4_W, "format": "nvfp4-pack-quantized"},
        "group_1": {"targets": ["Linear"], "weights": BLOCK_W, "format": "float-quantized"}}}
    scheme = detect_quant_scheme(quant)
    assert scheme.variant_for("model.language_model.layers.1.mlp.experts.5.up_proj") == "nvfp4_ct"
    assert scheme.variant_for("model.language_model.layers.1.linear_attn.out_proj") == "fp8_block_ct"
    assert weight_format_from_quant_config(quant) is WeightFormat.NVFP4


def test_experts_in_two_formats_are_refused():
    quant = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4"},
        "model.layers.1.mlp.experts.0.gate_proj": {"quant_algo": "FP8"}}}
    with pytest.raises(ValueError, match="experts of one model must share one format"):
        weight_format_from_quant_config(quant)


def test_block_shape_is_read_into_the_variant():
    from domain.quant_scheme import detect_quant_scheme, split_variant

    block = {"num_bits": 8, "type": "float", "strategy": "block"}
    ct = lambda shape: {"quant_method": "compressed-tensors", "config_groups": {  # noqa: E731
        "g": {"weights": {**block, "block_structure": shape}}}}
    assert detect_quant_scheme(ct([128, 128])).expert_variant() == "fp8_block_ct"
    assert split_variant(detect_quant_scheme(ct([256, 128])).expert_variant()) == ("fp8_block_ct", (256, 128))
    with pytest.raises(ValueError, match=r"block_structure=None: block FP8 needs block dimensions"):
        detect_quant_scheme(ct(None))
