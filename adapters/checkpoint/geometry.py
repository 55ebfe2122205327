"""The dense (non-expert) tensors a model of a given geometry must have, with their logical shapes.

Shape legend: H hidden, V vocab, E experts, C GDN conv channels, Hv value heads, dv value head dim,
K conv kernel, Si shared-expert intermediate, hd head dim.
The loader checks every dense tensor against this before anything is allocated, so a tensor one
row short fails at load naming its file, not at the first request.
"""

from __future__ import annotations

from domain.model_spec import LayerKind, ModelSpec


def expected_dense_shapes(spec: ModelSpec, tied: bool) -> dict[str, tuple[int, ...]]:
    """canonical name -> logical shape ([O, I] for linears); lm_head is left out when `tied`."""
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, h), "norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for layer, kind in enumerate(spec.layer_kinds):
        p = f"layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if kind is LayerKind.LINEAR_ATTENTION:
            hv, c, vd = spec.linear_num_value_heads, spec.linear_conv_channels, \
                spec.linear_num_value_heads * spec.linear_value_head_dim
            a = p + "linear_attn."
            shapes.update({a + "A_log": (hv,), a + "dt_bias": (hv,),
                           a + "conv1d.weight": (c, 1, spec.linear_conv_kernel),
                           a + "in_proj_qkv.weight": (c, h), a + "in_proj_z.weight": (vd, h),
                           a + "in_proj_a.weight": (hv, h), a + "in_proj_b.weight": (hv, h),
                           a + "norm.weight": (spec.linear_value_head_dim,), a + "out_proj.weight": (h, vd)})
        else:
            hd, q_width = spec.head_dim, spec.num_attention_heads * spec.head_dim
            gate = 2 if spec.architecture == "qwen3_5_moe" else 1  # q_proj carries the output gate
            s = p + "self_attn."
            shapes.update({s + "q_proj.weight": (gate * q_width, h), s + "k_proj.weight": (spec.num_kv_heads * hd, h),
                           s + "v_proj.weight": (spec.num_kv_heads * hd, h), s + "o_proj.weight": (h, q_width),
                           s + "q_norm.weight": (hd,), s + "k_norm.weight": (hd,)})
        shapes[p + "mlp.gate.weight"] = (spec.num_experts, h)
        si = spec.shared_expert_intermediate
        if si:
            m = p + "mlp.shared_expert."
            shapes.update({m + "gate_proj.weight": (si, h), m + "up_proj.weight": (si, h),
                           m + "down_proj.weight": (h, si), p + "mlp.shared_expert_gate.weight": (1, h)})
    return shapes


def tie_word_embeddings(config: dict, text_config: dict) -> bool:
    """The checkpoint's tie flag: top level (what a multimodal wrapper uses), else the text config.
    Absent means untied: the default of both supported architectures' configs."""
    for source in (config, text_config):
        if "tie_word_embeddings" in source:
            return bool(source["tie_word_embeddings"])
    return False
