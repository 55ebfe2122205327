"""Load a Hugging Face MoE checkpoint directory: dense weights by canonical name, routed
experts packed into a host bank.

Shape legend: L layers, E experts per layer, H hidden, I expert intermediate, R row bytes.
Order of work: read config + every safetensors header (offsets checked against the file sizes),
check every tensor against the detected per-module format and the config's geometry (shapes,
dtypes, finite scales; with `verify_weights` every value), check host memory, and only then allocate.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.formats import (
    IGNORED_SUFFIXES,
    ON_DISK_FORMATS,
    CheckpointFormatError,
    OnDiskFormat,
    check_weight,
    detect_scheme,
    on_disk_format,
    read_weight,
)
from adapters.checkpoint.geometry import expected_dense_shapes, tie_word_embeddings
from adapters.checkpoint.host_bank import (
    HostExpertBank,
    LazyHostExpertBank,
    allocate_rows,
    mem_available_bytes,
)
from adapters.checkpoint.names import canonical_name, ignored_kind, parse_expert
from adapters.checkpoint.quant import FLOAT_DTYPES, NVFP4_GROUP, QTensor
from adapters.checkpoint.safetensors_files import SafetensorsFiles, TensorEntry
from adapters.checkpoint.validate import check_scales, scan_weights
from domain.model_spec import ModelSpec, WeightFormat
from domain.quant_scheme import QuantScheme

log = logging.getLogger(__name__)

GiB = 1024**3
MATRICES = ("gate", "up", "down")
PHASE_BANK = "expert banks"
PHASE_DENSE = "dense weights"

# (phase, bytes done, bytes total) of that phase; each phase counts from 0 up to its own total.
ProgressCallback = Callable[[str, int, int], None]


@dataclass
class LoadedCheckpoint:
    spec: ModelSpec
    text_config: dict
    dense: dict[str, torch.Tensor | QTensor]
    experts: HostExpertBank
    generation_config: dict
    model_dir: Path
    format_name: str = "bf16"  # on-disk variant, e.g. "nvfp4_ct"; "mixed: ..." for per-module schemes

    def check_valid(self) -> None:
        self.experts.check_valid()
        want = (self.spec.num_layers, self.spec.num_experts)
        if (self.experts.num_layers, self.experts.num_experts) != want:
            raise AssertionError(f"bank is {self.experts.num_layers}x{self.experts.num_experts}, spec {want}")
        for name, w in self.dense.items():
            if isinstance(w, QTensor):
                try:
                    w.check_valid()
                except ValueError as e:
                    raise AssertionError(f"dense {name}: {e}") from e


# ---- config --------------------------------------------------------------------------------

def read_config(model_dir: Path) -> tuple[dict, Path]:
    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{model_dir}: no config.json")
    config = json.loads(config_file.read_text())
    hf_quant = model_dir / "hf_quant_config.json"
    if not config.get("quantization_config") and hf_quant.exists():
        # Older ModelOpt exports keep the quantization settings in a side file.
        config["quantization_config"] = {"quant_method": "modelopt", **json.loads(hf_quant.read_text())}
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


# ---- bank filling -----------------------------------------------------------------------------

def _expert_qtensors(files: SafetensorsFiles, inv: Inventory, fmt: OnDiskFormat, spec: ModelSpec,
                     layer: int, expert: int) -> list[QTensor]:
    def get(canon: str) -> torch.Tensor:
        return files.get(inv.canon[canon].name)

    if (layer, "gate_up") in inv.fused and fmt.name == "nvfp4_ct":
        return fused_nvfp4_qtensors(get, spec, layer, expert)
    if (layer, "gate_up") in inv.fused:
        i = spec.expert_intermediate
        gate_up = get(fused_name(inv, layer, "gate_up"))[expert]  # [2I, H]
        down = get(fused_name(inv, layer, "down"))[expert]  # [H, I]
        plain = ON_DISK_FORMATS["bf16"]
        return [
            read_weight(plain, "w", lambda _n, t=t: t)
            for t in (gate_up[:i], gate_up[i:], down)
        ]
    return [read_weight(fmt, expert_base(layer, expert, m), get) for m in MATRICES]


def fused_nvfp4_qtensors(get, spec: ModelSpec, layer: int, expert: int) -> list[QTensor]:
    """gate, up, down of one expert from compressed-tensors' fused packed NVFP4 tensors; the global
    scale is a divisor there (see formats.py), canonical NVFP4 multiplies."""
    i = spec.expert_intermediate
    out = []
    # (fused tensor, rows of it, column of a [E, 2] global scale: gate and up kept apart)
    for matrix, rows, column in (("gate_up", slice(0, i), 0), ("gate_up", slice(i, 2 * i), 1),
                                 ("down", slice(None), 0)):
        base = f"layers.{layer}.mlp.experts.{matrix}_proj"
        glob = get(base + "_global_scale").reshape(spec.num_experts, -1)[expert]  # [1] or [2]
        glob = glob[column if glob.numel() == 2 else 0]
        data = get(base + "_packed")[expert, rows]  # [O, I/2]
        shape = (data.shape[0], data.shape[1] * 2)
        out.append(QTensor(WeightFormat.NVFP4, shape, data, get(base + "_scale")[expert, rows],
                           (1.0 / glob.to(torch.float32)).reshape(1)))
    return out


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with the gpu extra
        return None
    return tqdm(total=total, desc="expert bank", unit="expert", leave=False)


class PhaseCounter:
    """Thread-safe byte count of one load phase, reported through `on_progress`.

    The callback runs under the lock, so its calls arrive one at a time with counts that
    never go back even though the rows are built by several threads.
    """

    def __init__(self, phase: str, total: int, on_progress: ProgressCallback | None) -> None:
        self.phase = phase
        self.total = total
        self.done = 0
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._report()  # a phase always announces its total before the first byte

    def can_add(self, nbytes: int) -> bool:
        return nbytes >= 0 and self.done + nbytes <= self.total

    def add(self, nbytes: int) -> None:
        with self._lock:
            if not self.can_add(nbytes):
                raise ValueError(f"{self.phase}: {nbytes} more bytes would pass {self.done}/{self.total}")
            if nbytes == 0:
                return  # nothing moved; every report says more than the last
            self.done += nbytes
            self._report()

    def _report(self) -> None:
        if self._on_progress is not None:
            self._on_progress(self.phase, self.done, self.total)

    def check_valid(self) -> None:
        if not 0 <= self.done <= self.total:
            raise AssertionError(f"{self.phase}: {self.done}/{self.total} bytes")


def fill_bank(bank: HostExpertBank, build_row, workers: int, progress: bool,
              on_progress: ProgressCallback | None = None) -> None:
    """Pack every expert into the bank, one layer per task, in a thread pool; `on_progress`
    hears about every packed row (bar: per layer)."""
    bar = _progress(bank.num_layers * bank.num_experts, progress)
    counter = PhaseCounter(PHASE_BANK, bank.nbytes, on_progress)

    def fill_layer(layer: int) -> int:
        for expert in range(bank.num_experts):
            build_row(layer, expert, bank.rows[bank.index(layer, expert)])
            counter.add(bank.layout.row_bytes)
        return bank.num_experts

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(fill_layer, layer) for layer in range(bank.num_layers)]
            for fut in as_completed(futures):
                done = fut.result()
                if bar is not None:
                    bar.update(done)
    finally:
        if bar is not None:
            bar.close()


def check_host_memory(need: int, available: int | None, what: str) -> None:
    if available is not None and need > available:
        raise MemoryError(
            f"not enough host RAM: {what} needs {need / GiB:.2f} GiB, {available / GiB:.2f} GiB available "
            f"(MemAvailable in /proc/meminfo). Load with mmap=True (ft serve --mmap-experts) to keep experts memory-mapped from disk, "
            f"or free memory."
        )


# ---- checking without loading ------------------------------------------------------------------

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
        dense = sorted({d.name for d in self.plan.values() if d is not None})
        if self.scheme.is_uniform and set(dense) <= {self.fmt.name}:
            return self.fmt.name
        return f"mixed: experts {self.fmt.name}, dense {'+'.join(dense) or 'bf16'}"


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


# ---- entry point ------------------------------------------------------------------------------

def load_checkpoint(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    progress: bool = True,
    *,
    mmap: bool = False,
    pin: bool | None = None,
    workers: int | None = None,
    host_memory_bytes: int | None = None,
    on_progress: ProgressCallback | None = None,
    verify_weights: bool = False,
) -> LoadedCheckpoint:
    """Read a checkpoint directory. Experts go to a host bank (pinned on CUDA hosts unless
    `pin=False`; built lazily from the mapped files when `mmap=True`); dense weights go to
    `device`. `host_memory_bytes` overrides MemAvailable for the up-front memory check.
    `on_progress(phase, bytes_done, bytes_total)` follows "expert banks" (packed row bytes; no
    such phase with mmap=True, where rows are built on demand) then "dense weights" (bytes of
    the stored tensors read), per row and per tensor, from any thread but one call at a time.
    `verify_weights` scans every stored value for NaN/Inf before allocating (scales always are).
    Raises CheckpointFormatError naming the file and tensor (or config field) of any inconsistency.
    """
    model_dir = Path(path)
    checked = check_checkpoint(model_dir, verify_weights=verify_weights)
    config, spec, files, inv, fmt = checked.config, checked.spec, checked.files, checked.inv, checked.fmt
    float_dtype, plan, skipped = checked.float_dtype, checked.plan, checked.skipped
    text_config = with_layer_types(
        config.get("text_config") if isinstance(config.get("text_config"), dict) else config, spec)
    if skipped:
        log.info("%s: ignoring %d activation/kv scale tensors (e.g. %s)", model_dir.name, len(skipped), skipped[0])
    layout = ExpertLayout(fmt.fmt, spec.hidden_size, spec.expert_intermediate, float_dtype)
    dense_bytes = sum(
        e.end - e.begin for c, e in inv.canon.items() if parse_expert(c) is None
    ) if torch.device(device).type == "cpu" else 0
    bank_bytes = 0 if mmap else spec.num_layers * spec.num_experts * layout.row_bytes
    available = host_memory_bytes if host_memory_bytes is not None else mem_available_bytes()
    check_host_memory(bank_bytes + dense_bytes, available,
                      f"the expert bank ({bank_bytes / GiB:.2f} GiB) plus dense weights")

    def build_row(layer: int, expert: int, out: torch.Tensor) -> None:
        layout.pack(*_expert_qtensors(files, inv, fmt, spec, layer, expert), out=out)

    if mmap:
        bank: HostExpertBank = LazyHostExpertBank(layout, spec.num_layers, spec.num_experts, build_row)
    else:
        rows = allocate_rows(spec.num_layers * spec.num_experts, layout.row_bytes, pin)  # [L*E, R]
        bank = HostExpertBank(layout, spec.num_layers, spec.num_experts, rows)
        fill_bank(bank, build_row, workers or min(8, os.cpu_count() or 1), progress, on_progress)

    sources = {name: dense_sources(inv, disk, name) for name, disk in plan.items()}
    counter = PhaseCounter(PHASE_DENSE, sum(stored_bytes(e) for es in sources.values() for e in es), on_progress)
    dense: dict[str, torch.Tensor | QTensor] = {}
    for name, disk in plan.items():
        if disk is None:
            dense[name] = files.get(inv.canon[name].name).to(device, copy=True)
        else:
            base = name[: -len(".weight")]
            q = read_weight(disk, base, lambda n: files.get(inv.canon[n].name))
            dense[name] = q.to(device) if torch.device(device).type != "cpu" else _own(q)
        counter.add(sum(stored_bytes(e) for e in sources[name]))
    counter.check_valid()
    gen_file = model_dir / "generation_config.json"
    generation_config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    if not mmap:
        files.close()
    ckpt = LoadedCheckpoint(spec, text_config, dense, bank, generation_config, model_dir, checked.format_name)
    ckpt.check_valid()
    return ckpt


def stored_bytes(entry: TensorEntry) -> int:
    return entry.end - entry.begin


def dense_sources(inv: Inventory, disk: OnDiskFormat | None, name: str) -> list[TensorEntry]:
    """The stored tensors one dense weight is read from (data plus scales when quantized)."""
    if disk is None:
        return [inv.canon[name]]
    base = name[: -len(".weight")]
    return [inv.canon[f"{base}.{s}"] for s in disk.companion_suffixes if f"{base}.{s}" in inv.canon]


def _own(q: QTensor) -> QTensor:
    """Copy a QTensor out of the file mapping so the mapping can be closed."""
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return QTensor(q.fmt, q.shape, clone(q.data), clone(q.scale), clone(q.global_scale))
