"""The one quantization-format detector: config.json's `quantization_config` -> which on-disk
variant every linear module uses. The planner (ModelSpec) and the checkpoint loader both call it.

Variants are on-disk layouts (tensor names and scale shapes); each maps to one WeightFormat,
the canonical in-memory form. Producers and schemas followed (see docs/checkpoints.md):
  quant_method "fp8"        Qwen/DeepSeek block FP8 (weight_block_size [128,128]) -> fp8_block
                            (blocks of whole 128x128 tiles, e.g. [256, 128] -> "fp8_block@256x128");
                            without weight_block_size: AutoFP8 per-tensor FP8 -> fp8_tensor
  quant_method "modelopt"   (or a bare quant_algo / hf_quant_config.json "quantization"): FP8 ->
                            fp8_tensor, NVFP4 -> nvfp4_modelopt, FP8_PB_WO -> fp8_pb_wo,
                            MIXED_PRECISION -> per-module algos from `quantized_layers`
  "compressed-tensors"      one variant per config_group, chosen per module by `targets`
                            (exact name > "re:" regex > "Linear", as compressed-tensors matches)
  "quark"                   global_quant_config.weight: int8 per_channel, fp8 per_tensor/per_channel
Errors are ValueError naming the config field (callers prefix the file).

Invariant: routed experts of one model share one variant (the expert bank has one row layout);
dense modules may differ per layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from domain.model_spec import WeightFormat, matrix_bytes

FP8_BLOCK = 128

VARIANT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat.BF16,
    "fp8_block": WeightFormat.FP8_BLOCK,  # quant_method fp8: weight_scale_inv [O/128, I/128]
    "fp8_block_ct": WeightFormat.FP8_BLOCK,  # compressed-tensors block: weight_scale [O/128, I/128]
    "fp8_pb_wo": WeightFormat.FP8_BLOCK,  # ModelOpt FP8_PB_WO: weight_scale [O/128, 1, I/128, 1]
    "fp8_tensor": WeightFormat.FP8_TENSOR,
    "fp8_channel": WeightFormat.FP8_CHANNEL,
    "nvfp4_modelopt": WeightFormat.NVFP4,
    "nvfp4_ct": WeightFormat.NVFP4,
    "int8_quark": WeightFormat.INT8_CHANNEL,
    "int8_ct": WeightFormat.INT8_CHANNEL,
    "mxfp4_ct": WeightFormat.MXFP4,
}

def split_variant(variant: str) -> tuple[str, tuple[int, int] | None]:
    """"fp8_block_ct@256x128" -> ("fp8_block_ct", (256, 128)): block FP8 with larger blocks than the
    canonical 128x128 carries its block shape in the variant name; other variants have none."""
    base, _, block = variant.partition("@")
    if not block:
        return base, None
    rows, cols = block.split("x")
    return base, (int(rows), int(cols))


def variant_format(variant: str) -> WeightFormat:
    return VARIANT_FORMATS[split_variant(variant)[0]]


def _block_variant(base: str, block: object, field: str) -> str:
    """Block FP8 of any block shape made of whole 128x128 tiles: each stored scale covers whole canonical
    tiles, so it converts exactly; a smaller block has several scales per tile and no exact conversion."""
    try:
        rows, cols = (int(b) for b in block)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        rows = cols = 0
    if rows <= 0 or cols <= 0 or rows % FP8_BLOCK or cols % FP8_BLOCK:
        raise ValueError(f"{field}={block!r}: block FP8 needs block dimensions that are multiples of {FP8_BLOCK} "
                         f"(the canonical form holds one scale per {FP8_BLOCK}x{FP8_BLOCK} tile; smaller blocks "
                         f"have no exact conversion)")
    return base if (rows, cols) == (FP8_BLOCK, FP8_BLOCK) else f"{base}@{rows}x{cols}"


TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_EXPERT = re.compile(r"(^|\.)mlp\.experts(\.|$)")

# Module names the planner asks about (it has no tensors): one expert, the dense projections.
SAMPLE_EXPERTS = ("layers.0.mlp.experts.0.gate_proj", "layers.0.mlp.experts.0.down_proj",
                  "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj")
SAMPLE_DENSE = ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj", "layers.0.linear_attn.in_proj_qkv",
                "layers.0.linear_attn.out_proj", "layers.0.mlp.shared_expert.gate_proj",
                "layers.0.mlp.shared_expert.down_proj")


def canonical_module(name: str) -> str:
    """Strip the text-model prefix (flat `model.`, nested `model.language_model.`)."""
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def is_expert_module(canonical: str) -> bool:
    return bool(_EXPERT.search(canonical))


@dataclass(frozen=True)
class TargetRule:
    kind: str  # "name" (module or ancestor, canonical) | "regex" (re.match on the full name) | "any"
    pattern: str
    variant: str
    source: str  # the config field, for messages

    def matches(self, canonical: str) -> bool:
        if self.kind == "any":
            return True
        if self.kind == "name":
            return canonical == self.pattern or canonical.startswith(self.pattern + ".")
        return any(re.match(self.pattern, full) for full in
                   (canonical, *(p + canonical for p in ("model.", "model.language_model."))))


_PRECEDENCE = {"name": 0, "regex": 1, "any": 2}


@dataclass(frozen=True)
class QuantScheme:
    """Which on-disk variant each linear module uses; modules no rule names stay unquantized."""

    producer: str  # e.g. "modelopt MIXED_PRECISION", for messages
    rules: tuple[TargetRule, ...]

    @property
    def is_uniform(self) -> bool:
        return len({r.variant for r in self.rules}) <= 1

    @cached_property
    def _by_name(self) -> dict[str, TargetRule]:
        # NOTE: a MIXED_PRECISION map lists every quantized module (~30k for a 256-expert model);
        # looking modules up by name keeps the loader's per-module resolution linear.
        return {r.pattern: r for r in reversed(self.rules) if r.kind == "name"}

    def rule_for(self, module: str) -> TargetRule | None:
        """The rule deciding `module`: its own name or an ancestor's, else a regex, else "Linear"."""
        canonical = canonical_module(module)
        parts = canonical.split(".")
        for end in range(len(parts), 0, -1):
            rule = self._by_name.get(".".join(parts[:end]))
            if rule is not None:
                return rule
        hits = [r for r in self.rules if r.kind != "name" and r.matches(canonical)]
        return min(hits, key=lambda r: _PRECEDENCE[r.kind]) if hits else None

    def variant_for(self, module: str) -> str:
        """On-disk variant of one linear module (on-disk or canonical name); "bf16" if none names it."""
        rule = self.rule_for(module)
        return "bf16" if rule is None else rule.variant

    def expert_variant(self) -> str:
        """The one variant of the routed experts; ValueError if the config gives them several."""
        named = {r.variant: r.source for r in self.rules if r.kind == "name" and is_expert_module(r.pattern)}
        if not named:
            named = {self.variant_for(m): self.rule_for(m).source if self.rule_for(m) else "(none)"
                     for m in SAMPLE_EXPERTS}
        if len(named) != 1:
            raise ValueError(f"{self.producer}: routed experts use several formats "
                             f"({', '.join(f'{v} via {s}' for v, s in sorted(named.items()))}); experts of one "
                             f"model must share one format (the expert bank has one row layout)")
        return next(iter(named))

    def dense_variants(self) -> set[str]:
        """Variants of the dense projections: those a per-module map names (it lists every quantized
        module; unlisted ones are the producer's exclusions), else those the rules give sample modules."""
        named = {r.variant for r in self.rules if r.kind == "name" and not is_expert_module(r.pattern)}
        return named or {self.variant_for(m) for m in SAMPLE_DENSE}

    @property
    def expert_format(self) -> WeightFormat:
        return variant_format(self.expert_variant())

    @property
    def dense_format(self) -> WeightFormat:
        """The widest dense format (a budget upper bound when dense modules differ per layer)."""
        formats = {variant_format(v) for v in self.dense_variants()}
        return max(formats, key=lambda f: (matrix_bytes(f, 256, 256), f.value))


def uniform(variant: str, producer: str, source: str = "quantization_config") -> QuantScheme:
    return QuantScheme(producer, (TargetRule("any", "", variant, source),))


BF16_SCHEME = QuantScheme("unquantized", ())


# ---- detection ----------------------------------------------------------------------------------

def detect_quant_scheme(quant: dict | None) -> QuantScheme:
    """The scheme a `quantization_config` (or a ModelOpt hf_quant_config.json) describes."""
    if quant is None:
        return BF16_SCHEME
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config must be a dict, got {type(quant).__name__}")
    method = quant.get("quant_method")
    inner = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
    algo = inner.get("quant_algo")
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is None:  # AutoFP8 / vLLM per-tensor FP8 (weight_scale scalar, optional input_scale)
            return uniform("fp8_tensor", "fp8 per-tensor (AutoFP8)")
        return uniform(_block_variant("fp8_block", block, "quantization_config.weight_block_size"), "fp8 block")
    if method == "modelopt" or (method is None and algo is not None):
        return _modelopt(inner)
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "quark":
        return _quark(quant)
    raise ValueError(f"quantization_config.quant_method={method!r}: supported: fp8, modelopt, "
                     f"compressed-tensors, quark (or no quantization_config for bf16)")


_MODELOPT_ALGOS = {"FP8": "fp8_tensor", "NVFP4": "nvfp4_modelopt", "FP8_PB_WO": "fp8_pb_wo"}


def _modelopt_algo(entry: dict, field: str) -> str:
    algo = entry.get("quant_algo")
    if algo not in _MODELOPT_ALGOS:
        raise ValueError(f"{field}.quant_algo={algo!r}: supported ModelOpt algos: "
                         f"{', '.join(_MODELOPT_ALGOS)}, MIXED_PRECISION")
    group = entry.get("group_size", 16)
    if algo == "NVFP4" and group != 16:
        raise ValueError(f"{field}.group_size={group!r}: ModelOpt NVFP4 needs 16")
    return _MODELOPT_ALGOS[algo]


def _modelopt(inner: dict) -> QuantScheme:
    field = "quantization_config"
    if inner.get("quant_algo") != "MIXED_PRECISION":
        variant = _modelopt_algo(inner, field)
        return uniform(variant, f"modelopt {inner.get('quant_algo')}")
    layers = inner.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{field}.quantized_layers={layers!r}: MIXED_PRECISION needs a per-module map")
    rules = tuple(
        TargetRule("name", canonical_module(name), _modelopt_algo(entry or {}, f"{field}.quantized_layers.{name}"),
                   f"quantized_layers.{name}")
        for name, entry in layers.items()
    )
    return QuantScheme("modelopt MIXED_PRECISION", rules)


def _ct_variant(quant: dict, name: str, group: dict) -> str:
    w = (group or {}).get("weights") or {}
    kind, bits, strategy, size = w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("group_size")
    field = f"quantization_config.config_groups.{name}.weights"
    if kind == "float" and bits == 8:
        if strategy == "channel":
            return "fp8_channel"
        if strategy == "tensor":
            return "fp8_tensor"
        if strategy == "block":
            return _block_variant("fp8_block_ct", w.get("block_structure"), f"{field}.block_structure")
    if kind == "float" and bits == 4:
        if strategy == "tensor_group" and size == 16:
            return "nvfp4_ct"
        fmt = (group or {}).get("format") or quant.get("format")
        if strategy == "group" and size == 32 and fmt == "mxfp4-pack-quantized":
            return "mxfp4_ct"
    if kind == "int" and bits == 8 and strategy == "channel":
        return "int8_ct"
    raise ValueError(f"{field} unsupported: num_bits={bits} type={kind} strategy={strategy} group_size={size}")


def _compressed_tensors(quant: dict) -> QuantScheme:
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"quantization_config.config_groups={groups!r}: compressed-tensors needs config_groups")
    rules: list[TargetRule] = []
    for name, group in groups.items():
        variant = _ct_variant(quant, name, group)
        source = f"config_groups.{name}"
        targets = (group or {}).get("targets") or ["Linear"]
        for target in targets:
            if target == "Linear":
                rules.append(TargetRule("any", "", variant, source))
            elif target.startswith("re:"):
                rules.append(TargetRule("regex", target[3:], variant, source))
            elif "." in target or target.startswith("lm_head"):
                rules.append(TargetRule("name", canonical_module(target), variant, source))
            else:
                raise ValueError(f"quantization_config.config_groups.{name}.targets: {target!r} is a module class "
                                 f"we cannot resolve without the model (supported: Linear, re:..., module names)")
    variants = {r.variant for r in rules}
    label = quant.get("format") or "compressed-tensors"
    if len(variants) == 1 and all(r.kind == "any" for r in rules):
        return uniform(variants.pop(), f"compressed-tensors {label}")
    return QuantScheme(f"compressed-tensors {label}", tuple(rules))


def _quark(quant: dict) -> QuantScheme:
    weight = (quant.get("global_quant_config") or {}).get("weight") or {}
    if isinstance(weight, list):  # Quark allows a list of weight specs (e.g. double quantization)
        weight = weight[0] if len(weight) == 1 else {}
    dtype, scheme = weight.get("dtype"), weight.get("qscheme")
    table = {("int8", "per_channel"): "int8_quark", ("fp8_e4m3", "per_channel"): "fp8_channel",
             ("fp8_e4m3", "per_tensor"): "fp8_tensor"}
    if (dtype, scheme) not in table or not weight.get("symmetric", True):
        raise ValueError(f"quantization_config.global_quant_config.weight unsupported: dtype={dtype} "
                         f"qscheme={scheme} (supported: int8 per_channel symmetric, fp8_e4m3 per_tensor or "
                         f"per_channel)")
    return uniform(table[(dtype, scheme)], "quark")
