"""Everything checked before a checkpoint is loaded, from the config, the safetensors headers and the
scales (nothing allocated): the format of every module, every tensor's name, dtype and shape against
the format and config.json's geometry, finite scales; `check_checkpoint` runs all of it (`ft check`).

Shape legend: L layers, E experts per layer, H hidden, I expert intermediate.
Errors are CheckpointFormatError naming the file and tensor (or the config field).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.checkpoint.formats import (
    IGNORED_SUFFIXES,
    CheckpointFormatError,
    OnDiskFormat,
    check_weight,
    detect_scheme,
    on_disk_format,
)
from adapters.checkpoint.geometry import expected_dense_shapes, tie_word_embeddings
from adapters.checkpoint.names import canonical_name, ignored_kind, parse_expert
from adapters.checkpoint.quant import FLOAT_DTYPES, NVFP4_GROUP
from adapters.checkpoint.safetensors_files import SafetensorsFiles, TensorEntry, read_json_object
from adapters.checkpoint.validate import check_scales, scan_weights
from domain.model_spec import ModelSpec
from domain.quant_scheme import QuantScheme

log = logging.getLogger(__name__)

MATRICES = ("gate", "up", "down")


# ---- config --------------------------------------------------------------------------------

def read_config(model_dir: Path) -> tuple[dict, Path]:
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{model_dir}: no config.json")
    config = read_json_object(config_file)
    hf_quant = model_dir / "hf_quant_config.json"
    if not config.get("quantization_config") and hf_quant.exists():
        # Older ModelOpt exports keep the quantization settings in a side file.
        config["quantization_config"] = {"quant_method": "modelopt", **read_json_object(hf_quant)}
        config_file = hf_quant
    return config, config_file


def spec_from_config(config: dict, config_file: Path) -> ModelSpec:
    """The geometry and formats, from the domain's parser and its one format detector."""
    try:
        return ModelSpec.from_hf_config(config)
    except ValueError as e:
        raise CheckpointFormatError(f"{config_file}: {e}") from e


def with_layer_types(text_config: dict, spec: ModelSpec) -> dict:
    """text_config with `layer_types` as the spec derived them (a config may give only
    `full_attention_interval`); the executor reads this copy, so kinds are derived once."""
    if spec.architecture != "qwen3_5_moe":
        return text_config
    return {**text_config, "layer_types": [k.value for k in spec.layer_kinds]}


# ---- tensor inventory ------------------------------------------------------------------------

@dataclass
class Inventory:
    canon: dict[str, TensorEntry]  # canonical name -> entry (ignored tensors left out)
    per_expert: set[tuple[int, int, str]]  # (layer, expert, matrix) seen
    fused: set[tuple[int, str]]  # (layer, "gate_up" | "down") seen
    ignored: dict[str, int]  # kind -> tensor count

    def meta(self, name: str) -> TensorEntry | None:
        return self.canon.get(name)


def take_inventory(files: SafetensorsFiles) -> Inventory:
    inv = Inventory({}, set(), set(), {})
    for name, entry in files.entries.items():
        kind = ignored_kind(name)
        if kind is not None:
            inv.ignored[kind] = inv.ignored.get(kind, 0) + 1
            continue
        canon = canonical_name(name)
        if canon in inv.canon:
            raise CheckpointFormatError(f"{entry.file.name}: {name} and {inv.canon[canon].name} both map to {canon}")
        inv.canon[canon] = dataclasses.replace(entry, name=name)
        parsed = parse_expert(canon)
        if parsed is None:
            continue
        if parsed.expert < 0:
            inv.fused.add((parsed.layer, parsed.matrix))
        else:
            inv.per_expert.add((parsed.layer, parsed.expert, parsed.matrix))
    return inv


def expert_base(layer: int, expert: int, matrix: str) -> str:
    return f"layers.{layer}.mlp.experts.{expert}.{matrix}_proj"


def fused_name(inv: Inventory, layer: int, matrix: str) -> str:
    base = f"layers.{layer}.mlp.experts.{matrix}_proj"
    return base if base in inv.canon else base + ".weight"


def check_experts(inv: Inventory, spec: ModelSpec, fmt: OnDiskFormat, scheme: QuantScheme) -> torch.dtype:
    """Validate every routed expert tensor; return the float dtype (bf16 format) of the bank.

    Every expert must resolve to `fmt`, the scheme's one expert variant: the bank has one row layout.
    """
    h, i = spec.hidden_size, spec.expert_intermediate
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    dtypes: set[torch.dtype] = set()
    for layer in range(spec.num_layers):
        if (layer, "gate_up") in inv.fused or (layer, "down") in inv.fused:
            for matrix in ("gate_up", "down"):
                _check_variant(scheme, fmt, f"layers.{layer}.mlp.experts.{matrix}_proj", inv)
            if fmt.name == "nvfp4_ct":
                check_fused_nvfp4(inv, spec, layer)
                continue
            if fmt.is_quantized:
                raise CheckpointFormatError(f"layer {layer}: fused experts are supported unquantized or as "
                                            f"compressed-tensors NVFP4 (*_proj_packed), not {fmt.name}")
            for matrix, want in (("gate_up", (spec.num_experts, 2 * i, h)), ("down", (spec.num_experts, h, i))):
                entry = inv.meta(fused_name(inv, layer, matrix))
                if entry is None:
                    raise CheckpointFormatError(f"missing tensor layers.{layer}.mlp.experts.{matrix}_proj (fused)")
                if entry.shape != want or entry.dtype not in FLOAT_DTYPES:
                    raise CheckpointFormatError(f"{entry.name} in {entry.file.name}: {entry.dtype} {entry.shape}, "
                                                f"expected a float {want}")
                dtypes.add(entry.dtype)
            continue
        for expert in range(spec.num_experts):
            for matrix in MATRICES:
                base = expert_base(layer, expert, matrix)
                _check_variant(scheme, fmt, base, inv)
                try:
                    check_weight(fmt, base, inv.meta, shapes[matrix])
                except CheckpointFormatError as e:
                    raise CheckpointFormatError(f"{e} [{_original(inv, base, fmt)}]") from None
                dtypes.add(inv.canon[f"{base}.{fmt.data_suffix}"].dtype)
    extra = {key for key in inv.per_expert if key[0] >= spec.num_layers or key[1] >= spec.num_experts}
    if extra:
        layer, expert, matrix = sorted(extra)[0]
        raise CheckpointFormatError(f"expert tensor {expert_base(layer, expert, matrix)} is outside the "
                                    f"{spec.num_layers} layers x {spec.num_experts} experts of config.json")
    if fmt.is_quantized:
        return torch.bfloat16
    if len(dtypes) != 1:
        raise CheckpointFormatError(f"routed experts mix dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _check_variant(scheme: QuantScheme, fmt: OnDiskFormat, module: str, inv: Inventory) -> None:
    variant = scheme.variant_for(module)
    if variant != fmt.name:
        rule = scheme.rule_for(module)
        raise CheckpointFormatError(
            f"{module}: {scheme.producer} gives it {variant} ({rule.source if rule else 'no rule names it'}) but the "
            f"routed experts are {fmt.name}; experts of one model must share one format [{_original(inv, module, fmt)}]"
        )


FUSED_NVFP4_SUFFIXES = ("_packed", "_scale", "_global_scale")


def check_fused_nvfp4(inv: Inventory, spec: ModelSpec, layer: int) -> None:
    """compressed-tensors NVFP4 fused experts: {gate_up,down}_proj_packed uint8 [E, O, I/2],
    _scale e4m3 [E, O, I/16], _global_scale float [E] / [E, 1] (gate_up also [E, 2]: gate, up)."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.expert_intermediate
    for matrix, rows, cols in (("gate_up", 2 * i, h), ("down", h, i)):
        if cols % NVFP4_GROUP:
            raise CheckpointFormatError(f"layer {layer}: NVFP4 needs in-features divisible by {NVFP4_GROUP}, got {cols}")
        base = f"layers.{layer}.mlp.experts.{matrix}_proj"
        globals_ok = [(e,), (e, 1)] + ([(e, 2)] if matrix == "gate_up" else [])
        want = {"_packed": ([torch.uint8], [(e, rows, cols // 2)]),
                "_scale": ([torch.float8_e4m3fn], [(e, rows, cols // NVFP4_GROUP)]),
                "_global_scale": (list(FLOAT_DTYPES), globals_ok)}
        for suffix, (dtypes, shapes) in want.items():
            entry = inv.meta(base + suffix)
            if entry is None:
                raise CheckpointFormatError(f"missing tensor {base}{suffix} (compressed-tensors NVFP4 fused experts)")
            if entry.dtype not in dtypes or tuple(entry.shape) not in shapes:
                raise CheckpointFormatError(f"{entry.name} in {entry.file.name}: {entry.dtype} {tuple(entry.shape)}, "
                                            f"expected {dtypes[0]} {' or '.join(map(str, shapes))}")


def _original(inv: Inventory, base: str, fmt: OnDiskFormat) -> str:
    entry = inv.meta(f"{base}.{fmt.data_suffix}") or next(
        (e for c, e in inv.canon.items() if c.startswith(base + ".") or c.startswith(base + "_")), None)
    return f"file {entry.file.name}, tensor {entry.name}" if entry else "tensor not in any file"


def check_zero_points(files: SafetensorsFiles, inv: Inventory) -> None:
    """We dequantize symmetrically; an asymmetric (non-zero) weight zero point would be silently wrong."""
    for canon, entry in inv.canon.items():
        if canon.endswith(".weight_zero_point") and files.get(entry.name).any():
            raise CheckpointFormatError(f"{entry.name} in {entry.file.name} is non-zero: asymmetric weight "
                                        f"quantization is not supported")


DensePlan = dict[str, "OnDiskFormat | None"]  # canonical dense name -> its quantized variant (None = plain)


def dense_plan(inv: Inventory, scheme: QuantScheme, expected: dict[str, tuple[int, ...]],
               tied: bool) -> tuple[DensePlan, list[str]]:
    """canonical dense name -> on-disk format of its quantized module (None = plain tensor), every
    shape checked against the config's geometry; plus the ignored companion tensors."""
    plan: DensePlan = {}
    consumed: set[str] = set()
    skipped: list[str] = []
    for canon, entry in inv.canon.items():
        if parse_expert(canon) is not None or entry.dtype in FLOAT_DTYPES:
            continue
        module, suffix = canon.rsplit(".", 1)
        fmt = on_disk_format(scheme.variant_for(module))
        if not fmt.is_quantized or suffix != fmt.data_suffix:
            continue
        name = module + ".weight"
        try:
            check_weight(fmt, module, inv.meta, expected.get(name))
        except CheckpointFormatError as e:
            raise CheckpointFormatError(f"{e} [{scheme.producer}: {module} is {fmt.name}]") from None
        plan[name] = fmt
        consumed.update(f"{module}.{s}" for s in fmt.companion_suffixes)
    for canon, entry in inv.canon.items():
        if parse_expert(canon) is not None or canon in consumed:
            continue
        if canon.rsplit(".", 1)[-1] in IGNORED_SUFFIXES:
            skipped.append(canon)
            continue
        if entry.dtype not in FLOAT_DTYPES:
            module = canon.rsplit(".", 1)[0]
            raise CheckpointFormatError(f"{entry.name} in {entry.file.name} is {entry.dtype} but {scheme.producer} "
                                        f"gives {module} the format {scheme.variant_for(module)} "
                                        f"(no matching quantization_config)")
        want = expected.get(canon) or _bias_shape(canon, expected)
        if want is None:
            log.warning("%s in %s: not a tensor of this architecture; ignored", entry.name, entry.file.name)
            skipped.append(canon)
            continue
        if tuple(entry.shape) != want:
            raise CheckpointFormatError(f"{entry.name} in {entry.file.name}: shape {tuple(entry.shape)}, expected "
                                        f"{want} from config.json")
        plan[canon] = None
    for name, shape in expected.items():
        if name not in plan:
            if name == "lm_head.weight":
                raise CheckpointFormatError("missing tensor lm_head.weight: config.json has tie_word_embeddings "
                                            "false (or unset), so the output projection is not the embeddings")
            raise CheckpointFormatError(f"missing tensor {name} (shape {shape} from config.json)")
    if tied and "lm_head.weight" in plan:
        log.info("tie_word_embeddings is true but lm_head.weight is stored; using the stored lm_head")
    return plan, skipped


def _bias_shape(canon: str, expected: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """A linear's bias (attention_bias=true) is one value per output row."""
    if not canon.endswith(".bias"):
        return None
    weight = expected.get(canon[: -len("bias")] + "weight")
    return (weight[0],) if weight is not None and len(weight) == 2 else None


# ---- checking without loading ------------------------------------------------------------------

FLOAT_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

@dataclass
class CheckedCheckpoint:
    """Everything learned from the headers and the cheap value checks; nothing allocated yet."""

    config: dict
    spec: ModelSpec
    scheme: QuantScheme
    files: SafetensorsFiles
    inv: Inventory
    fmt: OnDiskFormat  # the routed experts' one variant
    float_dtype: torch.dtype
    plan: DensePlan
    skipped: list[str]

    @property
    def format_name(self) -> str:
        """The on-disk variant ("bf16" is the name of the unquantized one, whatever its float dtype)."""
        return self._format(self.fmt.name)

    @property
    def format_label(self) -> str:
        """format_name for people (`ft check`): an unquantized expert bank is named by its real dtype (the demo
        model's fp32 checkpoint once read "format bf16", the name of the unquantized variant)."""
        if self.fmt.is_quantized:
            return self.format_name
        return self._format(FLOAT_DTYPE_NAMES.get(self.float_dtype, str(self.float_dtype).removeprefix("torch.")))

    def _format(self, experts: str) -> str:
        """The format line with the expert bank called `experts`: that alone when every module shares its format."""
        dense = sorted({d.name for d in self.plan.values() if d is not None})
        if self.scheme.is_uniform and set(dense) <= {self.fmt.name}:
            return experts
        return f"mixed: experts {experts}, dense {'+'.join(dense) or 'bf16'}"


def check_checkpoint(path: str | os.PathLike, verify_weights: bool = False) -> CheckedCheckpoint:
    """Every check `load_checkpoint` makes before allocating: config and format, every header's
    offsets against its file, every tensor's name, dtype and shape against the format and the
    geometry, finite scales, and with `verify_weights` finite values everywhere (`ft check DIR`).
    Raises CheckpointFormatError naming file and tensor (or config field)."""
    model_dir = Path(path)
    config, config_file = read_config(model_dir)
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    scheme = detect_scheme(config, config_file)
    spec = spec_from_config(config, config_file)
    fmt = on_disk_format(scheme.expert_variant())
    try:
        files = SafetensorsFiles.open_dir(model_dir)
    except ValueError as e:
        raise CheckpointFormatError(str(e)) from None
    inv = take_inventory(files)
    for kind, count in sorted(inv.ignored.items()):
        log.info("%s: ignoring %d %s tensors", model_dir.name, count, kind)
    float_dtype = check_experts(inv, spec, fmt, scheme)
    check_zero_points(files, inv)
    tied = tie_word_embeddings(config, text_config)
    plan, skipped = dense_plan(inv, scheme, expected_dense_shapes(spec, tied), tied)
    check_scales(files, inv.canon)
    if verify_weights:
        scan_weights(files, inv.canon)
    return CheckedCheckpoint(config, spec, scheme, files, inv, fmt, float_dtype, plan, skipped)
