"""Device expert-slot pool: uint8 [S, row_bytes] filled from the HostExpertBank on the decisions of the
domain ExpertResidency (the LRU specification). The same code runs with a CPU pool in CI.

Shape legend: S slots, R row bytes (one packed expert: gate, up, down with scales).
"""

from collections.abc import Iterator, Sequence

import torch

from adapters.checkpoint.expert_layout import ExpertWeights
from adapters.checkpoint.host_bank import HostExpertBank
from domain.residency import ExpertResidency


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
