"""Device expert-slot pool: uint8 [S, row_bytes] filled from the HostExpertBank on the decisions of the
domain ExpertResidency (the LRU specification). The same code runs with a CPU pool in CI.

A pool whose slots hold every key it may hold (`holds_every_key`) is filled before serving (`preload`), so the
first requests find every expert resident; a partial pool fills by use. `ExpertPreload` reports the fill for
both executors' pools (this one and the fast path's DeviceExpertPool).

Shape legend: S slots, R row bytes (one packed expert: gate, up, down with scales).
"""

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from adapters.checkpoint.expert_layout import ExpertWeights
from adapters.checkpoint.host_bank import HostExpertBank
from domain.budget import format_bytes
from domain.residency import ExpertKey, ExpertResidency


@dataclass(frozen=True)
class ExpertPreload:
    """A pool's start-up fill: every key it may hold copied from the host bank, in ascending (layer, expert)
    order, through its residency (the LRU then holds them least recently used first in that order).
    NOTE: not counted as misses or in bytes_copied (those count the workload's lookups: /v1/stats' hit rate
    and the PCIe bytes a benchmark derives from misses); `bytes` says what the fill moved."""

    copied: int  # experts copied from the host bank (keys not resident before)
    resident: int  # keys resident after the fill
    keys: int  # keys the pool may hold: the bank's L*E, or an expert-parallel rank's own
    bytes: int  # copied * row bytes
    seconds: float  # wall time of the fill, copies landed

    def describe(self) -> str:
        rate = f", {self.bytes / self.seconds / 1e9:.1f} GB/s" if self.seconds > 0 and self.bytes else ""
        return (f"experts resident: {self.resident}/{self.keys} in {self.seconds:.1f} s "
                f"({self.copied} copied, {format_bytes(self.bytes)}{rate})")


class ExpertSlotCache:
    def __init__(self, bank: HostExpertBank, num_slots: int, device: torch.device | str):
        if num_slots <= 0:
            raise ValueError(f"the expert cache needs at least one slot, got {num_slots}")
        self.bank = bank
        self.layout = bank.layout
        self.device = torch.device(device)
        self.slots = torch.empty((num_slots, self.layout.row_bytes), dtype=torch.uint8, device=device)  # [S, R]
        self.residency = ExpertResidency(num_slots)
        self.bytes_copied = 0

    @property
    def num_slots(self) -> int:
        return int(self.slots.shape[0])

    def nbytes(self) -> int:
        return self.slots.nbytes

    def resident_groups(self, layer: int, experts: Sequence[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Yield the experts of `layer` in order, in groups of at most S, each group resident and pinned
        while the caller computes with it; misses are copied into their victim slots first.

        NOTE: the caller must finish the group's GEMMs before asking for the next group: the slots of this
        group may be refilled by the next. On CUDA the copies and the GEMMs share one stream, so stream
        order is enough.
        """
        if len(set(experts)) != len(experts):
            raise ValueError(f"layer {layer}: experts must be distinct, got {list(experts)}")
        for start in range(0, len(experts), self.num_slots):
            chunk = list(experts[start:start + self.num_slots])
            keys = [(layer, e) for e in chunk]
            if not self.residency.can_lookup(keys):
                raise RuntimeError(f"layer {layer}: {len(keys)} experts cannot be pinned in {self.num_slots} slots")
            found = self.residency.lookup(keys)
            try:
                self.copy_experts(found.fills)
                yield [(e, self.layout.view(self.slots[s])) for e, s in zip(chunk, found.slots, strict=True)]
            finally:
                self.residency.release(keys)

    def copy_experts(self, fills: Sequence[tuple[tuple[int, int], int]]) -> None:
        """domain.ports.ExpertTransfer: copy each (layer, expert) bank row into its slot. Pinned rows go
        asynchronously on the current stream, which is the stream that later reads the slot."""
        for (layer, expert), slot in fills:
            src = self.bank.row(layer, expert)  # uint8 [R], pinned on CUDA hosts
            self.slots[slot].copy_(src, non_blocking=src.is_pinned())
            self.bytes_copied += self.layout.row_bytes

    def wait(self) -> None:
        """domain.ports.ExpertTransfer: block until every issued copy has landed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- every expert resident from the start --------------------------------------------------------
    def own_keys(self) -> list[ExpertKey]:
        """Every key this cache may hold, ascending (the preload's order)."""
        return [(layer, e) for layer in range(self.bank.num_layers) for e in range(self.bank.num_experts)]

    @property
    def num_keys(self) -> int:
        """Keys this cache may ever hold."""
        return len(self.own_keys())

    def holds_every_key(self) -> bool:
        return self.num_slots >= self.num_keys

    def preload(self) -> ExpertPreload | None:
        """When the slots hold every key (`holds_every_key`): look them all up once, ascending, and copy the
        misses in (the decisions of the domain LRU fed those keys in that order), without counting them as
        hits, misses or bytes_copied (ExpertPreload). None, and nothing done, for a partial cache."""
        keys = self.own_keys()
        if self.num_slots < len(keys):
            return None
        start = time.perf_counter()
        r = self.residency
        counted, copied_before = (r.hits, r.misses, r.evictions), self.bytes_copied
        found = r.lookup(keys)
        try:
            self.copy_experts(found.fills)
        finally:
            r.release(keys)
            # NOTE: the domain's counters are plain cumulative ints: the fill is reported on its own instead
            r.hits, r.misses, r.evictions = counted
            self.bytes_copied = copied_before
        self.wait()
        copied = len(found.fills)
        return ExpertPreload(copied, r.num_resident, len(keys), copied * self.layout.row_bytes,
                             time.perf_counter() - start)

    def counters(self) -> tuple[int, int]:
        return self.residency.hits, self.residency.misses

    @property
    def hits(self) -> int:
        return self.residency.hits

    @property
    def misses(self) -> int:
        return self.residency.misses

    def check_valid(self) -> None:
        self.residency.check_valid()
        assert self.residency.num_slots == self.num_slots, "residency and slot pool disagree on size"
        assert self.slots.dtype == torch.uint8 and self.slots.shape[1] == self.layout.row_bytes
