"""Load a Hugging Face MoE checkpoint directory: dense weights by canonical name, routed
experts packed into a host bank.

Shape legend: L layers, E experts per layer, H hidden, I expert intermediate, R row bytes.
Order of work: read config + every safetensors header, check every tensor against the
detected format (shapes, dtypes, scales), check host memory, and only then allocate.
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
    detect_format,
    read_weight,
)
from adapters.checkpoint.host_bank import (
    HostExpertBank,
    LazyHostExpertBank,
    allocate_rows,
    mem_available_bytes,
)
from adapters.checkpoint.names import canonical_name, ignored_kind, parse_expert
from adapters.checkpoint.quant import FLOAT_DTYPES, QTensor
from adapters.checkpoint.safetensors_files import SafetensorsFiles, TensorEntry
from domain.model_spec import ModelSpec

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
    format_name: str = "bf16"  # on-disk variant, e.g. "nvfp4_ct"

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


def spec_from_config(config: dict, config_file: Path, fmt: OnDiskFormat) -> ModelSpec:
    # The on-disk detector (formats.py) is authoritative because it must know tensor names;
    # the domain's detector only sees WeightFormat, so we hand it a config without the
    # quantization block and set the formats ourselves.
    stripped = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(stripped.get("text_config"), dict):
        stripped["text_config"] = {k: v for k, v in stripped["text_config"].items() if k != "quantization_config"}
    try:
        spec = ModelSpec.from_hf_config(stripped)
    except ValueError as e:
        raise CheckpointFormatError(f"{config_file}: {e}") from e
    return dataclasses.replace(spec, expert_format=fmt.fmt, dense_format=fmt.fmt)


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


def check_experts(inv: Inventory, spec: ModelSpec, fmt: OnDiskFormat) -> torch.dtype:
    """Validate every routed expert tensor; return the float dtype (bf16 format) of the bank."""
    h, i = spec.hidden_size, spec.expert_intermediate
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    dtypes: set[torch.dtype] = set()
    for layer in range(spec.num_layers):
        if (layer, "gate_up") in inv.fused or (layer, "down") in inv.fused:
            if fmt.is_quantized:
                raise CheckpointFormatError(f"layer {layer}: fused experts are only supported unquantized "
                                            f"(format {fmt.name})")
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
    if len(dtypes) != 1:
        raise CheckpointFormatError(f"routed experts mix dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    return dtype if not fmt.is_quantized else torch.bfloat16


def _original(inv: Inventory, base: str, fmt: OnDiskFormat) -> str:
    entry = inv.meta(f"{base}.{fmt.data_suffix}")
    return f"file {entry.file.name}, tensor {entry.name}" if entry else "tensor not in any file"


def check_zero_points(files: SafetensorsFiles, inv: Inventory) -> None:
    """We dequantize symmetrically; an asymmetric (non-zero) weight zero point would be silently wrong."""
    for canon, entry in inv.canon.items():
        if canon.endswith(".weight_zero_point") and files.get(entry.name).any():
            raise CheckpointFormatError(f"{entry.name} in {entry.file.name} is non-zero: asymmetric weight "
                                        f"quantization is not supported")


def dense_plan(inv: Inventory, fmt: OnDiskFormat) -> tuple[dict[str, str | None], list[str]]:
    """canonical dense name -> quantized base (None = plain tensor); plus ignored companions."""
    plan: dict[str, str | None] = {}
    consumed: set[str] = set()
    skipped: list[str] = []
    for canon, entry in inv.canon.items():
        if parse_expert(canon) is not None:
            continue
        if fmt.is_quantized and canon.endswith("." + fmt.data_suffix) and entry.dtype not in FLOAT_DTYPES:
            base = canon[: -len(fmt.data_suffix) - 1]
            check_weight(fmt, base, inv.meta)
            plan[base + ".weight"] = base
            consumed.update(f"{base}.{s}" for s in fmt.companion_suffixes)
    for canon, entry in inv.canon.items():
        if parse_expert(canon) is not None or canon in consumed:
            continue
        if canon.rsplit(".", 1)[-1] in IGNORED_SUFFIXES:
            skipped.append(canon)
            continue
        if entry.dtype not in FLOAT_DTYPES and canon.endswith(".weight"):
            raise CheckpointFormatError(f"{entry.name} in {entry.file.name} is {entry.dtype} but the checkpoint "
                                        f"format is {fmt.name} (no matching quantization_config)")
        plan[canon] = None
    return plan, skipped


# ---- bank filling -----------------------------------------------------------------------------

def _expert_qtensors(files: SafetensorsFiles, inv: Inventory, fmt: OnDiskFormat, spec: ModelSpec,
                     layer: int, expert: int) -> list[QTensor]:
    def get(canon: str) -> torch.Tensor:
        return files.get(inv.canon[canon].name)

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
) -> LoadedCheckpoint:
    """Read a checkpoint directory. Experts go to a host bank (pinned on CUDA hosts unless
    `pin=False`; built lazily from the mapped files when `mmap=True`); dense weights go to
    `device`. `host_memory_bytes` overrides MemAvailable for the up-front memory check.
    `on_progress(phase, bytes_done, bytes_total)` follows "expert banks" (packed row bytes; no
    such phase with mmap=True, where rows are built on demand) then "dense weights" (bytes of
    the stored tensors read), per row and per tensor, from any thread but one call at a time.
    """
    model_dir = Path(path)
    config, config_file = read_config(model_dir)
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    fmt = detect_format(config, config_file)
    spec = spec_from_config(config, config_file, fmt)
    files = SafetensorsFiles.open_dir(model_dir)
    inv = take_inventory(files)
    for kind, count in sorted(inv.ignored.items()):
        log.info("%s: ignoring %d %s tensors", model_dir.name, count, kind)

    float_dtype = check_experts(inv, spec, fmt)
    check_zero_points(files, inv)
    plan, skipped = dense_plan(inv, fmt)
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

    sources = {name: dense_sources(inv, fmt, name, base) for name, base in plan.items()}
    counter = PhaseCounter(PHASE_DENSE, sum(stored_bytes(e) for es in sources.values() for e in es), on_progress)
    dense: dict[str, torch.Tensor | QTensor] = {}
    for name, base in plan.items():
        if base is None:
            dense[name] = files.get(inv.canon[name].name).to(device, copy=True)
        else:
            q = read_weight(fmt, base, lambda n: files.get(inv.canon[n].name))
            dense[name] = q.to(device) if torch.device(device).type != "cpu" else _own(q)
        counter.add(sum(stored_bytes(e) for e in sources[name]))
    counter.check_valid()
    gen_file = model_dir / "generation_config.json"
    generation_config = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    if not mmap:
        files.close()
    ckpt = LoadedCheckpoint(spec, text_config, dense, bank, generation_config, model_dir, fmt.name)
    ckpt.check_valid()
    return ckpt


def stored_bytes(entry: TensorEntry) -> int:
    return entry.end - entry.begin


def dense_sources(inv: Inventory, fmt: OnDiskFormat, name: str, base: str | None) -> list[TensorEntry]:
    """The stored tensors one dense weight is read from (data plus scales when quantized)."""
    if base is None:
        return [inv.canon[name]]
    return [inv.canon[f"{base}.{s}"] for s in fmt.companion_suffixes if f"{base}.{s}" in inv.canon]


def _own(q: QTensor) -> QTensor:
    """Copy a QTensor out of the file mapping so the mapping can be closed."""
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return QTensor(q.fmt, q.shape, clone(q.data), clone(q.scale), clone(q.global_scale))
