"""Qwen3 MoE (architecture `qwen3_moe`, e.g. Qwen3-30B-A3B): plain full attention with q/k RMSNorm in
every layer, w * x RMSNorm, full rotary, no shared expert, renormalisation from `norm_topk_prob`."""

import torch

from adapters.torch_exec.decoder import FULL, DecoderOptions, MoeDecoder
from adapters.torch_exec.full_attention import AttentionGeometry
from adapters.torch_exec.rotary import rope_settings

ARCHITECTURE = "qwen3_moe"


def options(cfg: dict) -> DecoderOptions:
    layers = cfg["num_hidden_layers"]
    sparse_step = cfg.get("decoder_sparse_step", 1)
    if cfg.get("mlp_only_layers") or sparse_step != 1:
        raise NotImplementedError("qwen3_moe with dense MLP layers (mlp_only_layers / decoder_sparse_step) "
                                  "is not supported: every layer must be MoE")
    if cfg.get("use_sliding_window"):
        raise NotImplementedError("qwen3_moe with sliding-window attention is not supported")
    theta, partial = rope_settings(cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    return DecoderOptions(
        layer_kinds=(FULL,) * layers,
        hidden=cfg["hidden_size"],
        num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),  # transformers 5 saves the latter
        top_k=cfg["num_experts_per_tok"],
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        shared_expert=False,
        unit_offset_norm=False,
        eps=eps,
        attention=AttentionGeometry(cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim,
                                    output_gate=False, unit_offset_norm=False, eps=eps),
        rope_theta=theta,
        partial_rotary=partial,
        gdn=None,
    )


def build(dense: dict, text_config: dict, dtype: torch.dtype, device) -> MoeDecoder:
    return MoeDecoder(dense, options(text_config), dtype, device)
