"""One rank's share of the routed experts on the fast path (expert parallelism, docs/adr/0008-expert-parallel.md):
which flat keys this rank owns (a device table for the lookup kernels) and the exchange of the MoE partials.

Exactness: each rank's MoE writes the weighted fp32 partial of the (token, k) pairs it owns (and rank 0 the
shared expert's column K) into a zeroed [T, K(+1), H] tensor; the ranks all-reduce it (SUM). Every entry
has one non-zero writer and x + 0 = x exactly, so every rank holds the same bits whatever algorithm the
collective uses, and `moe_sum` over them (fixed k order, fp32) is bitwise the one-GPU fast path's output.

Inside a captured decode graph (CUDA, NCCL): the partials live in static buffers, one per decode shape
(allocated on the first, eager, warm-up step, so the capture reuses them and the warm-up's all-reduce of
that size has created NCCL's buffers before the capture); nothing here syncs with the host.

Shape legend: T tokens, K top-k (K+1 with the shared expert's column), H hidden, L layers, E experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from domain.expert_parallel import ExpertPartition

# NOTE: decode shapes (T*K <= residency_lookup.MAX_KEYS) get a static buffer; prefill chunks (any T) a
# fresh one, so the cache never grows with the chunk sizes a server happens to see.
STATIC_MAX_ROWS = 256


class ExpertShard:
    """partition + rank + process group: what a DeviceExpertPool needs to compute only its rank's experts."""

    def __init__(self, partition: ExpertPartition, rank: int, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu"):
        if not 0 <= rank < partition.num_ranks:
            raise ValueError(f"rank {rank} outside 0..{partition.num_ranks - 1}")
        self.partition, self.rank, self.group = partition, rank, group
        self.device = torch.device(device)
        self.owner_of_key = torch.tensor([r for row in partition.owner for r in row], dtype=torch.int32)  # [L*E]
        self.computes_shared = rank == 0  # the shared expert's column is rank 0's; zero elsewhere
        self.exchanges = 0  # all-reduces issued eagerly (a graph replay issues its captured ones again)
        self._static: dict[tuple, torch.Tensor] = {}

    def owned_experts(self, layer: int) -> set[int]:
        return set(self.partition.experts_of(self.rank, layer))

    def shared_slot(self, slot: int) -> int:
        """The slot id of the shared expert's column on this rank: `slot` on rank 0, -1 (skip) elsewhere."""
        return slot if self.computes_shared else -1

    def partials(self, x: torch.Tensor, columns: int) -> torch.Tensor:
        """A zeroed fp32 [T, columns, H] for x [T, H] (static per shape for decode-sized T)."""
        shape = (x.shape[0], columns, x.shape[1])
        if x.shape[0] > STATIC_MAX_ROWS:
            return torch.zeros(shape, dtype=torch.float32, device=x.device)
        buf = self._static.get(shape)
        if buf is None:
            buf = self._static[shape] = torch.zeros(shape, dtype=torch.float32, device=x.device)
        else:
            buf.zero_()  # NOTE: a memset kernel: captured with the graph, so every replay starts from zero
        return buf

    def all_reduce(self, partials: torch.Tensor) -> None:
        """SUM over the group, in place (exact: one non-zero writer per entry)."""
        dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=self.group)
        self.exchanges += 1

    def release_buffers(self) -> None:
        """Drop the static buffers (a resize: the graphs that captured them are gone too)."""
        self._static.clear()
