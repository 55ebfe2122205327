"""Load a Hugging Face MoE checkpoint directory: dense weights by canonical name, routed
experts packed into a host bank.

Shape legend: L layers, E experts per layer, H hidden, I expert intermediate, R row bytes.
Order of work: read config + every safetensors header (offsets checked against the file sizes),
check every tensor against the detected per-module format and the config's geometry (shapes,
dtypes, finite scales; with `verify_weights` every value), check host memory, and only then allocate.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.checkpoint.checks import (  # noqa: F401  (re-exported: callers check without loading)
    MATRICES,
    CheckedCheckpoint,
    Inventory,
    check_checkpoint,
    expert_base,
    fused_name,
    read_config,
    spec_from_config,
    with_layer_types,
)
from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.formats import ON_DISK_FORMATS, OnDiskFormat, read_weight
from adapters.checkpoint.host_bank import (
    HostExpertBank,
    LazyHostExpertBank,
    PartialHostExpertBank,
    allocate_rows,
    mem_available_bytes,
    pin_in_place,
)
from adapters.checkpoint.names import parse_expert
from adapters.checkpoint.quant import QTensor
from adapters.checkpoint.safetensors_files import SafetensorsFiles, TensorEntry, read_json_object
from domain.model_spec import ModelSpec, WeightFormat
from domain.serve_plan import gathers_embedding_rows

log = logging.getLogger(__name__)

GiB = 1024**3
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
    # NOTE: disable=None: a bar on a terminal only; in a log file (a service, a benchmark's capture) its carriage
    # returns are noise beside the per-phase lines the server already writes
    return tqdm(total=total, desc="expert bank", unit="expert", leave=False, disable=None)


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
    bar = _progress(bank.rows.shape[0], progress)
    counter = PhaseCounter(PHASE_BANK, bank.nbytes, on_progress)

    def fill_layer(layer: int) -> int:
        held = [e for e in range(bank.num_experts) if bank.holds(layer, e)]  # a partial bank: its keys only
        for expert in held:
            build_row(layer, expert, bank.rows[bank.index(layer, expert)])
            counter.add(bank.layout.row_bytes)
        return len(held)

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
    verify_weights: bool = False,
    expert_keys: Sequence[int] | Callable[[ModelSpec], Sequence[int]] | None = None,
) -> LoadedCheckpoint:
    """Read a checkpoint directory. Experts go to a host bank (pinned on CUDA hosts unless
    `pin=False`; built lazily from the mapped files when `mmap=True`); dense weights go to
    `device`. `host_memory_bytes` overrides MemAvailable for the up-front memory check.
    `on_progress(phase, bytes_done, bytes_total)` follows "expert banks" (packed row bytes; no
    such phase with mmap=True, where rows are built on demand) then "dense weights" (bytes of
    the stored tensors read), per row and per tensor, from any thread but one call at a time.
    `verify_weights` scans every stored value for NaN/Inf before allocating (scales always are).
    `expert_keys`: flat keys (layer * E + expert) to load, or a function of the checkpoint's ModelSpec
    giving them; the others are left out (an expert-parallel rank's own: a PartialHostExpertBank). Ignored
    with mmap=True, whose rows are built only when asked for.
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
    host_embed = hosts_embedding(device, plan, spec.hidden_size)
    dense_bytes = sum(  # the dense weights host memory holds: all of them on the CPU, the embedding (or none) on CUDA
        e.end - e.begin for c, e in inv.canon.items()
        if parse_expert(c) is None and (torch.device(device).type == "cpu" or host_embed and c == EMBEDDING))
    partial = expert_keys is not None and not mmap
    if partial and callable(expert_keys):
        expert_keys = expert_keys(spec)
    bank_rows = len(set(expert_keys)) if partial else spec.num_layers * spec.num_experts
    bank_bytes = 0 if mmap else bank_rows * layout.row_bytes
    available = host_memory_bytes if host_memory_bytes is not None else mem_available_bytes()
    check_host_memory(bank_bytes + dense_bytes, available,
                      f"the expert bank ({bank_bytes / GiB:.2f} GiB) plus dense weights")

    def build_row(layer: int, expert: int, out: torch.Tensor) -> None:
        layout.pack(*_expert_qtensors(files, inv, fmt, spec, layer, expert), out=out)

    if mmap:
        bank: HostExpertBank = LazyHostExpertBank(layout, spec.num_layers, spec.num_experts, build_row)
    else:
        rows = allocate_rows(bank_rows, layout.row_bytes, pin)  # [L*E (or the keys), R]
        bank = (PartialHostExpertBank(layout, spec.num_layers, spec.num_experts, expert_keys, rows) if partial
                else HostExpertBank(layout, spec.num_layers, spec.num_experts, rows))
        fill_bank(bank, build_row, workers or min(8, os.cpu_count() or 1), progress, on_progress)

    sources = {name: dense_sources(inv, disk, name) for name, disk in plan.items()}
    counter = PhaseCounter(PHASE_DENSE, sum(stored_bytes(e) for es in sources.values() for e in es), on_progress)
    dense: dict[str, torch.Tensor | QTensor] = {}
    for name, disk in plan.items():
        if disk is None:
            stored = files.get(inv.canon[name].name)
            dense[name] = pinned(stored) if host_embed and name == EMBEDDING else stored.to(device, copy=True)
        else:
            base = name[: -len(".weight")]
            q = read_weight(disk, base, lambda n: files.get(inv.canon[n].name))
            dense[name] = q.to(device) if torch.device(device).type != "cpu" else _own(q)
        counter.add(sum(stored_bytes(e) for e in sources[name]))
    counter.check_valid()
    gen_file = model_dir / "generation_config.json"
    generation_config = read_json_object(gen_file) if gen_file.exists() else {}
    if not mmap:
        files.close()
    ckpt = LoadedCheckpoint(spec, text_config, dense, bank, generation_config, model_dir, checked.format_name)
    ckpt.check_valid()
    return ckpt


EMBEDDING = "embed_tokens.weight"


def host_embedding_enabled() -> bool:
    """FLUXTIDE_HOST_EMBEDDING: "1" (or unset: the default) keeps the input embedding in host memory on CUDA
    (hosts_embedding), "0" puts it on the GPU as before ADR 0029 (the A/B's control, a Triton-free reference path);
    anything else is refused, not read as either. Read at each call: the plan (app/containers.py) and the loader
    ask it in one process, so they agree."""
    value = os.environ.get("FLUXTIDE_HOST_EMBEDDING", "1")
    if value not in ("0", "1"):
        raise ValueError(f"FLUXTIDE_HOST_EMBEDDING must be 0 or 1, got {value!r}")
    return value == "1"


def hosts_embedding(device: torch.device | str, dense, hidden: int) -> bool:
    """Whether a deployment on `device` keeps the input embedding in pinned host memory instead of on the GPU
    (the loader leaves it there, MoeDecoder reads it with adapters.kernels.embedding_gather.gather_embedding_rows): on
    CUDA, for an untied checkpoint (`dense`, the dense tensors' names, holds lm_head.weight: a tied table is the
    head's weight, read whole every step) whose rows the gather kernel copies (`hidden`, H: the plan's rule,
    domain.serve_plan.gathers_embedding_rows). Why: a step reads one row per
    token (4 KiB at H = 2048), while the table (V x H, 1.02 GB for Qwen3.6's 248k x 2048 in bf16) would take the
    VRAM of ~320 expert slots; llama.cpp keeps its token embeddings in host memory too. The pool plan leaves the
    table out of the GPU budget on CUDA (domain.serve_plan.serve_budget, host_embedding)."""
    return (torch.device(device).type == "cuda" and "lm_head.weight" in dense and gathers_embedding_rows(hidden)
            and host_embedding_enabled())


def pinned(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t in `dtype` (default its own) in page-locked host memory of exactly its size (host_bank.pin_in_place: torch's
    pinned allocator rounds up to a power of two, 1.07 GB locked for Qwen3.6's 1.02 GB table): t itself when it is
    pinned in that dtype already, else one copy, converted on the way: the memory a kernel reads over PCIe."""
    dtype = dtype or t.dtype
    if t.is_pinned() and t.dtype == dtype:
        return t
    out = pin_in_place(torch.empty(t.shape, dtype=dtype))
    out.copy_(t)  # NOTE: after pinning: pin_in_place's fallback hands back a fresh (uninitialised) tensor
    return out


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
