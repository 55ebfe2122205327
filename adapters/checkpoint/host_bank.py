"""Host-side expert bank: every expert of every layer as one packed uint8 row.

Shape legend: L layers, E experts per layer, R row bytes.
The bank is pinned on CUDA hosts because pageable memory transfers at a fraction of the
bandwidth. In mmap mode rows are built on demand from memory-mapped safetensors instead.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch

from adapters.checkpoint.expert_layout import ExpertLayout, ExpertWeights

log = logging.getLogger(__name__)


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, None where the file does not exist (non-Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def allocate_rows(num_rows: int, row_bytes: int, pin: bool | None = None) -> torch.Tensor:
    """uint8 [L*E, R]; pinned when CUDA is available unless `pin` says otherwise."""
    if pin is None:
        pin = torch.cuda.is_available()
    rows = torch.empty((num_rows, row_bytes), dtype=torch.uint8)  # [L*E, R]
    if pin:
        rows = pin_in_place(rows)
    return rows


def pin_in_place(t: torch.Tensor) -> torch.Tensor:
    """Page-lock `t`'s memory with cudaHostRegister.

    NOTE: torch's pinned allocator (pin_memory=True) rounds every request up to a power of two, so a
    17 GiB NVFP4 bank would lock 32 GiB of host RAM; registering the plain allocation locks exactly
    its size. Falls back to the pinned allocator if registration is refused.
    """
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1 = cudaHostRegisterPortable
    if err != 0:
        log.warning("cudaHostRegister of %.2f GiB failed (error %d); using the pinned allocator",
                    nbytes / 2**30, err)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, ptr)
    return t


class HostExpertBank:
    """Rows of packed experts, indexed by (layer, expert)."""

    def __init__(self, layout: ExpertLayout, num_layers: int, num_experts: int, rows: torch.Tensor | None):
        self.layout = layout
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.rows = rows  # uint8 [L*E, R]; None in mmap (lazy) mode
        self.check_valid()

    @property
    def pinned(self) -> bool:
        return self.rows is not None and self.rows.is_pinned()

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_experts * self.layout.row_bytes

    row_of_key: tuple[int, ...] | None = None  # flat key -> row; None: row = flat key (every expert held)

    def index(self, layer: int, expert: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(f"expert ({layer}, {expert}) outside bank of {self.num_layers}x{self.num_experts}")
        return layer * self.num_experts + expert

    def holds(self, layer: int, expert: int) -> bool:
        """Whether this bank has a row for (layer, expert)."""
        return 0 <= layer < self.num_layers and 0 <= expert < self.num_experts

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """uint8 [R] of expert (layer, expert); a view into the bank (a fresh tensor in mmap mode)."""
        return self.rows[self.index(layer, expert)]  # [R]

    def weights(self, layer: int, expert: int) -> ExpertWeights:
        return self.layout.view(self.row(layer, expert))

    def check_valid(self) -> None:
        self.layout.check_valid()
        if self.rows is None:
            return
        want = (self.num_layers * self.num_experts, self.layout.row_bytes)
        if self.rows.dtype != torch.uint8 or tuple(self.rows.shape) != want:
            raise AssertionError(f"bank rows are {self.rows.dtype} {tuple(self.rows.shape)}, expected uint8 {want}")


class PartialHostExpertBank(HostExpertBank):
    """One rank's share of the bank (expert parallelism, ADR 0008): rows only for `keys`, the flat keys
    (layer * E + expert) the rank owns, ascending, so N ranks hold one copy of the experts in total instead
    of N. row_of_key maps a flat key to its row (-1: another rank's); asking for another rank's expert
    raises KeyError."""

    def __init__(self, layout: ExpertLayout, num_layers: int, num_experts: int, keys, rows: torch.Tensor):
        keys = tuple(sorted(keys))
        total = num_layers * num_experts
        if not keys or len(set(keys)) != len(keys) or keys[0] < 0 or keys[-1] >= total:
            raise ValueError(f"a partial bank needs distinct flat keys in 0..{total - 1}, got {len(keys)} keys")
        self.keys = keys
        table = [-1] * total
        for row, key in enumerate(keys):
            table[key] = row
        self.row_of_key = tuple(table)
        super().__init__(layout, num_layers, num_experts, rows)

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.layout.row_bytes

    def index(self, layer: int, expert: int) -> int:
        row = self.row_of_key[super().index(layer, expert)]
        if row < 0:
            raise KeyError(f"expert ({layer}, {expert}) is not in this rank's bank")
        return row

    def holds(self, layer: int, expert: int) -> bool:
        return super().holds(layer, expert) and self.row_of_key[layer * self.num_experts + expert] >= 0

    def check_valid(self) -> None:
        self.layout.check_valid()
        want = (len(self.keys), self.layout.row_bytes)
        if self.rows is None or self.rows.dtype != torch.uint8 or tuple(self.rows.shape) != want:
            got = None if self.rows is None else (self.rows.dtype, tuple(self.rows.shape))
            raise AssertionError(f"partial bank rows are {got}, expected uint8 {want}")


class LazyHostExpertBank(HostExpertBank):
    """mmap mode: rows are packed on demand from memory-mapped checkpoint tensors.

    Costs a pack per miss instead of host RAM for the whole bank; `rows` is None, so callers
    that gather from `rows` directly must fall back to `row()`.
    """

    def __init__(
        self,
        layout: ExpertLayout,
        num_layers: int,
        num_experts: int,
        build_row: Callable[[int, int, torch.Tensor], None],
    ):
        self._build_row = build_row  # (layer, expert, out_row) -> None
        super().__init__(layout, num_layers, num_experts, rows=None)

    def row(self, layer: int, expert: int) -> torch.Tensor:
        self.index(layer, expert)
        out = torch.empty(self.layout.row_bytes, dtype=torch.uint8)  # [R]
        self._build_row(layer, expert, out)
        return out
