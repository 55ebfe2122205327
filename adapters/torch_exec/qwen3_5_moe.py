"""Qwen3.5 MoE (architecture `qwen3_5_moe`, e.g. Qwen3.6-35B-A3B): Gated DeltaNet and gated full
attention layers, (1 + w) RMSNorm, partial rotary, softmax -> top-k -> renormalise routing with a
sigmoid-gated shared expert."""

import torch

from adapters.torch_exec.decoder import DecoderOptions, MoeDecoder
from adapters.torch_exec.full_attention import AttentionGeometry
from adapters.torch_exec.gated_deltanet import GdnGeometry
from adapters.torch_exec.rotary import rope_settings

ARCHITECTURE = "qwen3_5_moe"


def options(cfg: dict) -> DecoderOptions:
    theta, partial = rope_settings(cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    return DecoderOptions(
        layer_kinds=tuple(cfg["layer_types"]),
        hidden=cfg["hidden_size"],
        num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),  # transformers 5 saves the latter
        top_k=cfg["num_experts_per_tok"],
        # transformers always renormalises for this architecture; honour an explicit flag if one is given
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        shared_expert=cfg.get("shared_expert_intermediate_size", 0) > 0,
        unit_offset_norm=True,
        eps=eps,
        attention=AttentionGeometry(cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim,
                                    output_gate=True, unit_offset_norm=True, eps=eps),
        rope_theta=theta,
        partial_rotary=partial,
        gdn=GdnGeometry.from_text_config(cfg),
    )


def build(dense: dict, text_config: dict, dtype: torch.dtype, device) -> MoeDecoder:
    return MoeDecoder(dense, options(text_config), dtype, device)
