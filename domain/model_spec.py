"""Model geometry: what one expert, one KV token and one sequence's linear state cost in bytes.

Shape legend: H hidden, I expert intermediate, L layers, E experts per layer, V vocab.
Everything here is arithmetic on a transformers-style config; no tensors are touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

BF16_BYTES = 2
FP32_BYTES = 4
FP8_BLOCK = 128  # the 128x128 `weight_block_size` of block-FP8 checkpoints
NVFP4_GROUP = 16  # values per fp8 (e4m3) scale
MXFP4_GROUP = 32  # values per e8m0 scale


class LayerKind(StrEnum):
    FULL_ATTENTION = "full_attention"
    LINEAR_ATTENTION = "linear_attention"


class WeightFormat(StrEnum):
    BF16 = "bf16"
    FP8_BLOCK = "fp8_block"
    FP8_TENSOR = "fp8_tensor"
    FP8_CHANNEL = "fp8_channel"
    NVFP4 = "nvfp4"
    INT8_CHANNEL = "int8_channel"
    MXFP4 = "mxfp4"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def matrix_bytes(fmt: WeightFormat, rows: int, cols: int) -> int:
    """Bytes of one [rows, cols] weight matrix in `fmt`: data plus every scale it needs.

    Scales are counted as the loaders store them: fp32 for FP8/INT8 scales, one e4m3 byte per
    16 values plus an fp32 global scale for NVFP4, one e8m0 byte per 32 values for MXFP4.
    4-bit formats pack two values per byte along `cols` (a row never shares a byte).
    """
    if rows <= 0 or cols <= 0:
        raise ValueError(f"matrix shape must be positive, got [{rows}, {cols}]")
    fmt = WeightFormat(fmt)
    values = rows * cols
    if fmt is WeightFormat.BF16:
        return values * BF16_BYTES
    if fmt is WeightFormat.FP8_BLOCK:
        blocks = _ceil_div(rows, FP8_BLOCK) * _ceil_div(cols, FP8_BLOCK)
        return values + blocks * FP32_BYTES
    if fmt is WeightFormat.FP8_TENSOR:
        return values + FP32_BYTES
    if fmt in (WeightFormat.FP8_CHANNEL, WeightFormat.INT8_CHANNEL):
        return values + rows * FP32_BYTES
    packed = rows * _ceil_div(cols, 2)
    if fmt is WeightFormat.NVFP4:
        return packed + rows * _ceil_div(cols, NVFP4_GROUP) + FP32_BYTES
    if fmt is WeightFormat.MXFP4:
        return packed + rows * _ceil_div(cols, MXFP4_GROUP)
    raise ValueError(f"unknown weight format {fmt!r}")  # pragma: no cover - enum is closed


ARCHITECTURES = ("qwen3_5_moe", "qwen3_moe")


@dataclass(frozen=True)
class ModelSpec:
    """The geometry of one MoE language model (MoE in every layer, routed experts gate/up/down)."""

    name: str
    architecture: str
    hidden_size: int
    layer_kinds: tuple[LayerKind, ...]
    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_expert_intermediate: int  # 0 = no shared expert
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int
    vocab_size: int
    max_context: int
    expert_format: WeightFormat = WeightFormat.BF16
    dense_format: WeightFormat = WeightFormat.BF16

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        object.__setattr__(self, "layer_kinds", tuple(LayerKind(k) for k in self.layer_kinds))
        object.__setattr__(self, "expert_format", WeightFormat(self.expert_format))
        object.__setattr__(self, "dense_format", WeightFormat(self.dense_format))
        if not self.layer_kinds:
            raise ValueError("layer_kinds is empty")
        positive = ("hidden_size", "num_experts", "top_k", "expert_intermediate", "num_attention_heads",
                    "num_kv_heads", "head_dim", "vocab_size", "max_context")
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.shared_expert_intermediate < 0:
            raise ValueError("shared_expert_intermediate must be >= 0")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")
        if self.num_linear_attention_layers:
            for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim"):
                if getattr(self, field) <= 0:
                    raise ValueError(f"{field} must be positive when there are linear-attention layers")
            if self.linear_conv_kernel < 1:
                raise ValueError("linear_conv_kernel must be >= 1")

    # ---- derived counts -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def num_full_attention_layers(self) -> int:
        return sum(k is LayerKind.FULL_ATTENTION for k in self.layer_kinds)

    @property
    def num_linear_attention_layers(self) -> int:
        return sum(k is LayerKind.LINEAR_ATTENTION for k in self.layer_kinds)

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

    # ---- per-unit costs -------------------------------------------------------------------
    def expert_bytes(self, fmt: WeightFormat | None = None) -> int:
        """One routed expert: gate [I, H] + up [I, H] + down [H, I], data and scales."""
        fmt = self.expert_format if fmt is None else fmt
        h, i = self.hidden_size, self.expert_intermediate
        return 2 * matrix_bytes(fmt, i, h) + matrix_bytes(fmt, h, i)

    def kv_bytes_per_token(self, dtype_bytes: int = BF16_BYTES) -> int:
        """K and V of one token in every full-attention layer."""
        if dtype_bytes <= 0:
            raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}")
        return self.num_full_attention_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def linear_conv_channels(self) -> int:
        """Channels of the causal conv in a GDN layer: q and k (key dim each) plus v."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        return 2 * key_dim + value_dim

    def linear_state_bytes_per_sequence(self) -> int:
        """fp32 recurrent state [Hv, dk, dv] plus bf16 conv state [channels, kernel-1] per GDN layer."""
        if not self.num_linear_attention_layers:
            return 0
        recurrent = (self.linear_num_value_heads * self.linear_key_head_dim
                     * self.linear_value_head_dim * FP32_BYTES)
        conv = self.linear_conv_channels * (self.linear_conv_kernel - 1) * BF16_BYTES
        return self.num_linear_attention_layers * (recurrent + conv)

    def embedding_bytes(self) -> int:
        """The input embedding table embed_tokens [vocab, H] in bf16: part of dense_weight_bytes(), which a CUDA
        deployment keeps in host memory instead (domain.serve_plan.serve_budget, host_embedding)."""
        return self.vocab_size * self.hidden_size * BF16_BYTES

    def dense_weight_bytes(self) -> int:
        """Every weight that is not a routed expert, as it sits on the GPU.

        Linear projections (attention, GDN, shared expert) are in `dense_format`; embeddings,
        lm_head, routers, the shared-expert gate and all vectors stay bf16, because every
        quantizer in the supported table leaves them unquantized. Embeddings are untied
        (true of both supported architectures).
        """
        fmt, h = self.dense_format, self.hidden_size
        vector_params = h  # final norm
        bf16_matrices = 2 * self.vocab_size * h  # embed_tokens + lm_head
        quantized = 0

        q_width = self.num_attention_heads * self.head_dim
        # qwen3_5_moe's q_proj also carries the sigmoid output gate (twice the width).
        q_rows = 2 * q_width if self.architecture == "qwen3_5_moe" else q_width
        kv_rows = self.num_kv_heads * self.head_dim
        attention = (matrix_bytes(fmt, q_rows, h) + 2 * matrix_bytes(fmt, kv_rows, h)
                     + matrix_bytes(fmt, h, q_width))
        quantized += self.num_full_attention_layers * attention
        vector_params += self.num_full_attention_layers * 2 * self.head_dim  # q_norm, k_norm

        if self.num_linear_attention_layers:
            value_dim = self.linear_num_value_heads * self.linear_value_head_dim
            hv = self.linear_num_value_heads
            gdn = (matrix_bytes(fmt, self.linear_conv_channels, h)  # in_proj_qkv
                   + matrix_bytes(fmt, value_dim, h)  # in_proj_z
                   + 2 * matrix_bytes(fmt, hv, h)  # in_proj_b, in_proj_a
                   + matrix_bytes(fmt, h, value_dim))  # out_proj
            quantized += self.num_linear_attention_layers * gdn
            per_layer_vectors = (self.linear_conv_channels * self.linear_conv_kernel  # conv1d
                                 + 2 * hv  # dt_bias, A_log
                                 + self.linear_value_head_dim)  # gated norm
            vector_params += self.num_linear_attention_layers * per_layer_vectors

        per_layer_bf16 = self.num_experts * h + 2 * h  # router, input/post-attention norms
        if self.shared_expert_intermediate:
            si = self.shared_expert_intermediate
            quantized += self.num_layers * (2 * matrix_bytes(fmt, si, h) + matrix_bytes(fmt, h, si))
            per_layer_bf16 += h  # shared_expert_gate [1, H]
        bf16_matrices += self.num_layers * per_layer_bf16
        return quantized + (bf16_matrices + vector_params) * BF16_BYTES

    # ---- construction from a transformers config ----------------------------------------
    @classmethod
    def from_hf_config(cls, config: dict, expert_format: WeightFormat | None = None) -> ModelSpec:
        """Build from a config.json dict: flat, or nested under `text_config` (multimodal layout).

        The weight formats are detected from `quantization_config` (top level or inside
        `text_config`) by domain.quant_scheme: the experts' one format, and the widest dense format
        (dense modules may differ per layer); `expert_format` overrides the experts' format.
        """
        if not isinstance(config, dict):
            raise ValueError(f"config must be a dict, got {type(config).__name__}")
        text = config.get("text_config")
        text = text if isinstance(text, dict) else config
        quant = config.get("quantization_config", text.get("quantization_config"))
        scheme = _scheme(quant)
        architecture = _architecture_of(config, text)

        def need(key: str) -> Any:
            if key not in text or text[key] is None:
                raise ValueError(f"config field {key!r} is missing")
            return text[key]

        hidden = int(need("hidden_size"))
        num_layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        num_experts = text.get("num_experts", text.get("num_local_experts"))
        if num_experts is None:
            raise ValueError("config field 'num_experts' (or 'num_local_experts') is missing")
        if text.get("mlp_only_layers") or int(text.get("decoder_sparse_step", 1) or 1) != 1:
            raise ValueError("config fields 'mlp_only_layers'/'decoder_sparse_step' ask for dense-MLP "
                             "layers; only MoE-in-every-layer models are supported")

        if architecture == "qwen3_5_moe":
            kinds = _layer_kinds(text, num_layers)
            linear = dict(
                linear_num_key_heads=int(need("linear_num_key_heads")),
                linear_num_value_heads=int(need("linear_num_value_heads")),
                linear_key_head_dim=int(need("linear_key_head_dim")),
                linear_value_head_dim=int(need("linear_value_head_dim")),
                linear_conv_kernel=int(need("linear_conv_kernel_dim")),
            )
            shared = int(text.get("shared_expert_intermediate_size") or 0)
        else:
            kinds = (LayerKind.FULL_ATTENTION,) * num_layers
            linear = dict(linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0,
                          linear_value_head_dim=0, linear_conv_kernel=0)
            shared = 0
        name = config.get("_name_or_path") or text.get("_name_or_path") or architecture
        return cls(
            name=str(name),
            architecture=architecture,
            hidden_size=hidden,
            layer_kinds=kinds,
            num_experts=int(num_experts),
            top_k=int(need("num_experts_per_tok")),
            expert_intermediate=int(need("moe_intermediate_size")),
            shared_expert_intermediate=shared,
            num_attention_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(need("vocab_size")),
            max_context=int(need("max_position_embeddings")),
            expert_format=scheme.expert_format if expert_format is None else WeightFormat(expert_format),
            dense_format=scheme.dense_format,
            **linear,
        )


_MODEL_TYPES = {"qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_moe": "qwen3_moe"}
_ARCH_PREFIXES = {"Qwen3_5Moe": "qwen3_5_moe", "Qwen3Moe": "qwen3_moe"}


def _architecture_of(config: dict, text: dict) -> str:
    for model_type in (config.get("model_type"), text.get("model_type")):
        if model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
    for arch in config.get("architectures") or text.get("architectures") or ():
        for prefix, architecture in _ARCH_PREFIXES.items():
            if str(arch).startswith(prefix + "For"):
                return architecture
    raise ValueError(f"unsupported model: config field 'model_type' is {config.get('model_type')!r} "
                     f"(architectures {config.get('architectures')!r}); supported: {ARCHITECTURES}")


def _layer_kinds(text: dict, num_layers: int) -> tuple[LayerKind, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"config field 'layer_types' has {len(types)} entries, "
                         f"num_hidden_layers is {num_layers}")
    try:
        return tuple(LayerKind(t) for t in types)
    except ValueError as exc:
        raise ValueError(f"config field 'layer_types': {exc}") from None


# ---- quantization_config -> WeightFormat ------------------------------------------------------
def weight_format_from_quant_config(quant: dict | None) -> WeightFormat:
    """The routed experts' weight format a checkpoint's `quantization_config` describes (None -> bf16).

    One detector (domain.quant_scheme) decides for the planner and the loader alike.
    Raises ValueError naming the field it could not interpret.
    """
    return _scheme(quant).expert_format


def _scheme(quant: dict | None):
    from domain.quant_scheme import detect_quant_scheme  # NOTE: quant_scheme imports this module

    return detect_quant_scheme(quant)


def qwen36_35b_a3b(expert_format: WeightFormat = WeightFormat.FP8_BLOCK) -> ModelSpec:
    """Qwen3.6-35B-A3B as in SPEC.md: 40 layers (3 GDN : 1 full attention), 256 experts, top-8."""
    kinds = ((LayerKind.LINEAR_ATTENTION,) * 3 + (LayerKind.FULL_ATTENTION,)) * 10
    return ModelSpec(
        name="Qwen/Qwen3.6-35B-A3B",
        architecture="qwen3_5_moe",
        hidden_size=2048,
        layer_kinds=kinds,
        num_experts=256,
        top_k=8,
        expert_intermediate=512,
        shared_expert_intermediate=512,
        num_attention_heads=16,
        num_kv_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel=4,
        vocab_size=248320,
        max_context=262144,
        expert_format=expert_format,
        dense_format=expert_format,
    )
