"""Shared fixtures: a tiny MoE geometry so property tests run in milliseconds."""

import pytest

from domain.model_spec import LayerKind, ModelSpec
from simulator.hardware import get_profile


def tiny_spec(layers: int = 4, experts: int = 16, top_k: int = 2) -> ModelSpec:
    kinds = tuple(LayerKind.FULL_ATTENTION if i % 2 else LayerKind.LINEAR_ATTENTION for i in range(layers))
    return ModelSpec(
        name="tiny", architecture="qwen3_5_moe", hidden_size=64, layer_kinds=kinds, num_experts=experts,
        top_k=top_k, expert_intermediate=32, shared_expert_intermediate=32, num_attention_heads=4,
        num_kv_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel=4, vocab_size=1000,
        max_context=4096,
    )


@pytest.fixture
def spec():
    return tiny_spec()


@pytest.fixture
def rtx3090():
    return get_profile("rtx3090")
