"""Geometries and config.json contents for synthesized checkpoints.

The nested layout mirrors the published Qwen3.6-35B-A3B config (text settings under
`text_config`, quantization_config at the top level); each quantization_config follows its
producer's public schema (Qwen block FP8, ModelOpt, compressed-tensors, Quark).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

QWEN35_ENDOFTEXT, QWEN35_IM_START, QWEN35_IM_END = 248044, 248045, 248046

FORMATS = ("bf16", "fp8_block", "fp8_tensor", "fp8_channel", "nvfp4_modelopt", "nvfp4_ct", "int8_quark", "mxfp4_ct",
           "fp8_pb_wo", "fp8_autofp8", "mixed_modelopt", "mixed_ct", "fp8_block_ct_256x128")

# Formats whose modules are written in more than one on-disk variant, or under another name:
# (routed experts' variant, variant of a dense module) as each producer publishes them.
#   fp8_autofp8     AutoFP8 (quant_method "fp8", no weight_block_size): per-tensor FP8, static input scales
#   mixed_modelopt  ModelOpt MIXED_PRECISION, like the vendor NVFP4 export of Qwen3.6-35B-A3B: NVFP4 experts,
#                   FP8 full attention, and (to make dense formats differ per layer) NVFP4 GDN/shared expert
#   mixed_ct        compressed-tensors "mixed-precision", like community NVFP4 exports: NVFP4 experts,
#                   128x128 block FP8 everything else
#   fp8_block_ct_256x128  compressed-tensors block FP8 with block_structure [256, 128]
def module_variant(fmt: str, canonical: str) -> str:
    """The on-disk variant the producer of `fmt` writes a quantized linear `canonical` in."""
    expert = ".mlp.experts." in canonical
    if fmt == "fp8_autofp8":
        return "fp8_tensor"
    if fmt == "mixed_modelopt":
        return "fp8_tensor" if ".self_attn." in canonical else "nvfp4_modelopt"
    if fmt == "mixed_ct":
        return "nvfp4_ct" if expert else "fp8_block_ct"
    if fmt == "fp8_block_ct_256x128":
        return "fp8_block_ct@256x128"
    return fmt


@dataclass(frozen=True)
class Geometry:
    architecture: str = "qwen3_5_moe"  # or "qwen3_moe"
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    full_attention_interval: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    vocab_size: int = 248320
    max_position_embeddings: int = 262144

    @property
    def layer_types(self) -> list[str]:
        if self.architecture == "qwen3_moe":
            return ["full_attention"] * self.num_hidden_layers
        k = self.full_attention_interval
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.num_hidden_layers)]


GEOMETRIES = {
    "qwen3.6-35b-a3b": Geometry(),
    # Expert parallelism's "does not fit one GPU" model (simulator.expert_parallel.large_synthetic): 155 GB of
    # block-FP8 experts, more than one H200 holds.
    "synthetic-moe-155b": Geometry(hidden_size=4096, num_hidden_layers=48, moe_intermediate_size=1024,
                                   shared_expert_intermediate_size=1024, num_attention_heads=32,
                                   num_key_value_heads=4, head_dim=128),
    # Small but not round: 160 is not a multiple of 128, so block-FP8 scales cover partial blocks.
    "tiny": Geometry(hidden_size=160, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=96, shared_expert_intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096),
    "tiny-qwen3moe": Geometry(architecture="qwen3_moe", hidden_size=160, num_hidden_layers=2, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=96, shared_expert_intermediate_size=0,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              max_position_embeddings=4096),
}

# Linears every producer leaves in bf16: embeddings, lm_head, routers, the shared-expert
# gate and the tiny GDN a/b projections.
UNQUANTIZED = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b")


def is_quantized_linear(canonical: str) -> bool:
    """Projection weights (q/k/v/o_proj, in_proj_qkv/z, out_proj, gate/up/down_proj) except UNQUANTIZED."""
    if not canonical.endswith(".weight"):
        return False
    module = canonical.rsplit(".", 2)[-2]
    return "proj" in module and not any(canonical.endswith(f"{u}.weight") for u in UNQUANTIZED)


def text_config(g: Geometry, mtp_layers: int = 1) -> dict:
    cfg = {
        "model_type": "qwen3_5_moe_text" if g.architecture == "qwen3_5_moe" else "qwen3_moe",
        "hidden_size": g.hidden_size,
        "num_hidden_layers": g.num_hidden_layers,
        "num_attention_heads": g.num_attention_heads,
        "num_key_value_heads": g.num_key_value_heads,
        "head_dim": g.head_dim,
        "num_experts": g.num_experts,
        "num_experts_per_tok": g.num_experts_per_tok,
        "moe_intermediate_size": g.moe_intermediate_size,
        "vocab_size": g.vocab_size,
        "max_position_embeddings": g.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "eos_token_id": QWEN35_ENDOFTEXT,
        "dtype": "bfloat16",
    }
    if g.architecture == "qwen3_5_moe":
        cfg.update({
            "layer_types": g.layer_types,
            "full_attention_interval": g.full_attention_interval,
            "shared_expert_intermediate_size": g.shared_expert_intermediate_size,
            "linear_num_key_heads": g.linear_num_key_heads,
            "linear_num_value_heads": g.linear_num_value_heads,
            "linear_key_head_dim": g.linear_key_head_dim,
            "linear_value_head_dim": g.linear_value_head_dim,
            "linear_conv_kernel_dim": g.linear_conv_kernel_dim,
            "attn_output_gate": True,
            "partial_rotary_factor": 0.25,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            "mtp_num_hidden_layers": mtp_layers,
        })
    else:
        cfg.update({
            "intermediate_size": 4 * g.hidden_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        })
    return cfg


def _exclusions(style: str, architecture: str) -> list[str]:
    names = ["lm_head", "embed_tokens", "mlp.gate", "mlp.shared_expert_gate"]
    if architecture == "qwen3_5_moe":
        names += ["linear_attn.in_proj_a", "linear_attn.in_proj_b"]
    if style == "glob":  # ModelOpt / Quark: fnmatch patterns
        return [n if n == "lm_head" else f"*{n}" for n in names]
    if style == "re":  # compressed-tensors: "re:" regexes
        return [n if n == "lm_head" else f"re:.*{n.replace('.', '[.]')}$" for n in names]
    return names  # Qwen fp8: substrings


def _quantized_layers(g: Geometry, prefix: str, mtp_layers: int = 0) -> dict:
    """ModelOpt MIXED_PRECISION's map: every quantized module by its full name -> its algo (the MTP
    block's full-attention layers under ``mtp.layers.N.``, outside the text prefix)."""
    algo = {"fp8_tensor": {"quant_algo": "FP8"}, "nvfp4_modelopt": {"quant_algo": "NVFP4", "group_size": 16}}
    names = []
    layers = [(prefix + f"layers.{i}.", kind) for i, kind in enumerate(g.layer_types)]
    layers += [(f"mtp.layers.{i}.", "full_attention") for i in range(mtp_layers)]
    for p, kind in layers:
        if kind == "linear_attention":
            names += [p + f"linear_attn.{m}" for m in ("in_proj_qkv", "in_proj_z", "out_proj")]
        else:
            names += [p + f"self_attn.{m}_proj" for m in "qkvo"]
        if g.architecture == "qwen3_5_moe" and g.shared_expert_intermediate_size:
            names += [p + f"mlp.shared_expert.{m}_proj" for m in ("gate", "up", "down")]
        names += [p + f"mlp.experts.{e}.{m}_proj" for e in range(g.num_experts) for m in ("gate", "up", "down")]
    return {n: algo[module_variant("mixed_modelopt", n)] for n in names}


def quantization_config(fmt: str, architecture: str, g: Geometry | None = None, prefix: str = "model.",
                        mtp_layers: int = 0) -> dict | None:
    if fmt == "bf16":
        return None
    if fmt == "fp8_autofp8":  # AutoFP8's config.json: no weight_block_size
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    if fmt == "fp8_pb_wo":
        return {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO", "kv_cache_quant_algo": None,
                "exclude_modules": _exclusions("glob", architecture),
                "producer": {"name": "modelopt", "version": "0.37.0"}}
    if fmt == "mixed_modelopt":
        if g is None:
            raise ValueError("mixed_modelopt needs the geometry (its config lists every quantized module)")
        return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                "quantized_layers": _quantized_layers(g, prefix, mtp_layers),
                "exclude_modules": _exclusions("glob", architecture),
                "producer": {"name": "modelopt", "version": "0.37.0"}}
    if fmt == "fp8_block_ct_256x128":
        block = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [256, 128],
                 "group_size": None, "symmetric": True, "dynamic": False, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": block, "input_activations": None,
                                              "output_activations": None, "format": "float-quantized"}},
                "ignore": _exclusions("re", architecture), "kv_cache_scheme": None}
    if fmt == "mixed_ct":
        nvfp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                 "dynamic": False, "observer": "minmax"}
        block = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                 "group_size": None, "symmetric": True, "dynamic": False, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
                "config_groups": {
                    "group_0": {"targets": ["re:.*mlp[.]experts.*"], "weights": nvfp4, "input_activations": None,
                                "output_activations": None, "format": "nvfp4-pack-quantized"},
                    "group_1": {"targets": ["Linear"], "weights": block, "input_activations": {
                        "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True,
                        "symmetric": True}, "output_activations": None, "format": "float-quantized"}},
                "ignore": _exclusions("re", architecture), "kv_cache_scheme": None}
    if fmt == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": _exclusions("sub", architecture)}
    if fmt in ("fp8_tensor", "nvfp4_modelopt"):
        algo = "FP8" if fmt == "fp8_tensor" else "NVFP4"
        qc = {"quant_method": "modelopt", "quant_algo": algo, "kv_cache_quant_algo": None,
              "exclude_modules": _exclusions("glob", architecture),
              "producer": {"name": "modelopt", "version": "0.37.0"}}
        if algo == "NVFP4":
            qc["group_size"] = 16
        return qc
    if fmt in ("fp8_channel", "nvfp4_ct", "mxfp4_ct"):
        if fmt == "fp8_channel":
            weights = {"num_bits": 8, "type": "float", "strategy": "channel", "group_size": None}
            acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
            pack = "float-quantized"
        elif fmt == "nvfp4_ct":
            weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
            acts = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                    "dynamic": "local", "symmetric": True}
            pack = "nvfp4-pack-quantized"
        else:
            weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
            acts = None
            pack = "mxfp4-pack-quantized"
        weights.update({"symmetric": True, "dynamic": False, "observer": "minmax"})
        return {"quant_method": "compressed-tensors", "format": pack, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": acts, "output_activations": None,
                                              "format": pack}},
                "ignore": _exclusions("re", architecture), "kv_cache_scheme": None}
    if fmt == "int8_quark":
        return {"quant_method": "quark",
                "global_quant_config": {
                    "weight": {"dtype": "int8", "qscheme": "per_channel", "ch_axis": 0, "symmetric": True,
                               "is_dynamic": False, "round_method": "half_even", "scale_type": "float",
                               "observer_cls": "PerChannelMinMaxObserver"},
                    "input_tensors": {"dtype": "int8", "qscheme": "per_tensor", "symmetric": True,
                                      "is_dynamic": False, "scale_type": "float"},
                    "output_tensors": None, "bias": None},
                "exclude": _exclusions("glob", architecture), "layer_quant_config": {},
                "layer_type_quant_config": {}, "algo_config": None,
                "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized"}}
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def config_json(g: Geometry, fmt: str, layout: str, mtp_layers: int = 1) -> dict:
    """config.json of a synthesized checkpoint; `mtp_layers` is what it declares as
    mtp_num_hidden_layers (qwen3_5_moe only; `ft synth` writes that many MTP layers)."""
    text = text_config(g, mtp_layers)
    prefix = "model.language_model." if layout == "nested" and g.architecture == "qwen3_5_moe" else "model."
    mtp_layers = mtp_layers if g.architecture == "qwen3_5_moe" else 0
    qc = quantization_config(fmt, g.architecture, g, prefix, mtp_layers)
    if layout == "flat":
        arch = "Qwen3_5MoeForCausalLM" if g.architecture == "qwen3_5_moe" else "Qwen3MoeForCausalLM"
        cfg = {"architectures": [arch], **text}
    elif layout == "nested":
        if g.architecture != "qwen3_5_moe":
            raise ValueError("the nested layout exists only for qwen3_5_moe (multimodal checkpoints)")
        cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": text, "tie_word_embeddings": False,
               "image_token_id": 248056, "video_token_id": 248057,
               "vision_start_token_id": 248053, "vision_end_token_id": 248054,
               "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152,
                                 "out_hidden_size": g.hidden_size, "patch_size": 16,
                                 "spatial_merge_size": 2, "temporal_patch_size": 2}}
    else:
        raise ValueError(f"layout must be 'nested' or 'flat', got {layout!r}")
    if qc is not None:
        cfg["quantization_config"] = qc
    cfg["transformers_version"] = "5.2.0"
    cfg["fluxtide_synth"] = {"format": fmt, "geometry": asdict(g)}
    return cfg


def generation_config() -> dict:
    return {"bos_token_id": QWEN35_ENDOFTEXT, "eos_token_id": [QWEN35_IM_END, QWEN35_ENDOFTEXT],
            "pad_token_id": QWEN35_ENDOFTEXT, "do_sample": True, "temperature": 0.6, "top_p": 0.95,
            "top_k": 20, "transformers_version": "5.2.0"}
