"""Expert parallelism on the reference path: one process per rank, every rank runs the dense layers on the
same tokens and computes only the routed experts it owns (domain.expert_parallel.ExpertPartition) from its
own slot cache; the MoE partials are summed across ranks with torch.distributed (gloo on CPU, NCCL on CUDA).

Exactness (docs/adr/0008-expert-parallel.md): each rank writes the weighted output of the (token, k) pairs it
owns into a zeroed [T, K, H] tensor and the ranks all-reduce it. Every entry has exactly one non-zero writer,
and x + 0 = x exactly in IEEE arithmetic, so every rank holds the same bits whatever order or algorithm the
collective uses. Each rank then adds the pairs in the reference order (ascending expert id, index_add_ of
the model dtype), which makes the output bitwise the single-process reference's for any N.

A layered prefill (SequenceWork.layers) needs nothing of its own here: every rank keeps the chunk and runs the
group's forward after the step's other works, as one process does, so the exchanges still pair up in order.

Shape legend: T tokens of the step, K top-k, H hidden.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from adapters.checkpoint.expert_layout import ExpertWeights
from adapters.checkpoint.host_bank import HostExpertBank
from adapters.checkpoint.loader import LoadedCheckpoint
from adapters.torch_exec.executor import TorchExecutor
from adapters.torch_exec.expert_cache import ExpertSlotCache
from adapters.torch_exec.moe import swiglu
from domain.expert_parallel import ExpertPartition

if TYPE_CHECKING:
    from domain.budget import PoolPlan


class PartitionedSlotCache(ExpertSlotCache):
    """An ExpertSlotCache that only ever holds its rank's keys: asking for a foreign key is an error
    (nothing is looked up or copied), and check_valid proves every resident key is owned."""

    def __init__(self, bank: HostExpertBank, num_slots: int, device: torch.device | str,
                 partition: ExpertPartition, rank: int):
        if num_slots > partition.keys_of(rank):
            raise ValueError(f"rank {rank}: {num_slots} expert slots for the {partition.keys_of(rank)} keys it owns")
        super().__init__(bank, num_slots, device)
        self.partition, self.rank = partition, rank

    def resident_groups(self, layer: int, experts: Sequence[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        foreign = [e for e in experts if not self.partition.owns(self.rank, (layer, e))]
        if foreign:
            raise ValueError(f"rank {self.rank}: layer {layer} experts {foreign} belong to other ranks")
        yield from super().resident_groups(layer, experts)

    def own_keys(self) -> list[tuple[int, int]]:
        return [k for k in super().own_keys() if self.partition.owns(self.rank, k)]

    def check_valid(self) -> None:
        super().check_valid()
        foreign = [k for k in self.residency.lru_order() if not self.partition.owns(self.rank, k)]
        assert not foreign, f"rank {self.rank} holds keys it does not own: {foreign}"


class ExpertParallelMoe:
    """The routed experts of one layer on one rank, summed over the group (MoeDecoder.routed's contract)."""

    def __init__(self, partition: ExpertPartition, rank: int, group: dist.ProcessGroup | None = None):
        self.partition, self.rank, self.group = partition, rank, group
        self.exchanges = 0  # collectives issued (one per MoE layer per step)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: int,
                 cache: PartitionedSlotCache) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], weights fp32 [T, K], ids [T, K]: [T, H],
        bitwise the reference routed_experts' on every rank."""
        tokens_, k = ids.shape
        # NOTE: fp32 on the wire: every value is already rounded to x's dtype, so the cast is exact, and
        # gloo reduces fp32 everywhere (NCCL could carry bf16: half the bytes, same bits).
        partials = torch.zeros((tokens_, k, x.shape[1]), dtype=torch.float32, device=x.device)  # [T, K, H]
        distinct = torch.unique(ids).tolist()  # ascending; one host sync per layer (the reference's too)
        owner = self.partition.owner[layer]
        mine = [e for e in distinct if owner[e] == self.rank]
        for group in cache.resident_groups(layer, mine):
            for expert, w in group:
                k_pos, rows = torch.where((ids == expert).transpose(0, 1))  # [n], [n]
                y = swiglu(x[rows], w.gate, w.up, w.down) * weights[rows, k_pos, None]  # [n, H] fp32
                partials[rows, k_pos] = y.to(x.dtype).float()
        dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=self.group)
        self.exchanges += 1
        out = torch.zeros_like(x)  # [T, H]
        for expert in distinct:  # the reference's order: ascending id, rows in (k, token) order
            k_pos, rows = torch.where((ids == expert).transpose(0, 1))
            out.index_add_(0, rows, partials[rows, k_pos].to(out.dtype))
        return out


def group_rank(checkpoint: LoadedCheckpoint, partition: ExpertPartition, group: dist.ProcessGroup | None) -> int:
    """This process's rank in `group`, once the group and the partition are checked against each other and
    the checkpoint. Raises RuntimeError without torch.distributed, ValueError on a mismatch."""
    if not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed initialised (init_process_group)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != partition.num_ranks:
        raise ValueError(f"the partition is over {partition.num_ranks} ranks, the process group has {world}")
    spec = checkpoint.spec
    if (partition.num_layers, partition.num_experts) != (spec.num_layers, spec.num_experts):
        raise ValueError(f"the partition is [{partition.num_layers}][{partition.num_experts}], the checkpoint "
                         f"[{spec.num_layers}][{spec.num_experts}]")
    return rank


def check_replicas(tensor: torch.Tensor, rank: int, group: dist.ProcessGroup | None = None) -> None:
    """Raise unless `tensor` is bitwise the same on every rank (the replicated dense compute must be:
    ranks that drift apart would route differently). Two all-reduces; for tests and debug checks."""
    hi, lo = tensor.detach().float().clone(), tensor.detach().float().clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    if not (torch.equal(hi, lo) or torch.equal(torch.nan_to_num(hi), torch.nan_to_num(lo))):
        raise RuntimeError(f"rank {rank}: replicas diverged (max |diff| {(hi - lo).abs().max().item():.3g})")


class ExpertParallelExecutor(TorchExecutor):
    """TorchExecutor of one rank: the whole dense model, a slot cache over its own keys, and the MoE layers
    exchanging partials with the other ranks. Every rank must execute the same StepBatches in the same order
    (the collectives pair up by order): rank 0 drives, the others follow (StepFollower)."""

    def __init__(self, checkpoint: LoadedCheckpoint, plan: PoolPlan, partition: ExpertPartition,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, sampler_seed: int = 0):
        rank = group_rank(checkpoint, partition, group)
        self.partition, self.rank, self.group = partition, rank, group
        super().__init__(checkpoint, plan, device, dtype, sampler_seed)
        self.moe = ExpertParallelMoe(partition, rank, group)
        self.model.routed = self.moe

    def _expert_slots(self, plan: PoolPlan) -> int:
        return max(1, min(plan.expert_slots, self.partition.keys_of(self.rank)))

    def _new_experts(self, plan: PoolPlan) -> PartitionedSlotCache:
        return PartitionedSlotCache(self.bank, self._expert_slots(plan), self.device, self.partition, self.rank)

    def check_replicas(self, tensor: torch.Tensor) -> None:
        check_replicas(tensor, self.rank, self.group)


STEP, RESIZE, RELEASE, STOP = "step", "resize", "release", "stop"


class StepLeader:
    """Rank 0's side of the step broadcast: a ModelExecutor that sends every StepBatch (and every pool
    resize) to the followers before running it itself, so all ranks issue the same collectives in the same
    order. The executor is any rank-0 expert-parallel executor with `rank`, `group`, `partition` and the
    ModelExecutor surface: this reference one, or the fast path's (adapters/cuda_exec/expert_parallel.py). NOTE: the batch goes as a pickled object over the group (broadcast_object_list); a StepBatch is a
    few hundred bytes, the cost is one small collective per step."""

    def __init__(self, executor):
        if executor.rank != 0:
            raise ValueError(f"the leader is rank 0, this executor is rank {executor.rank}")
        self.executor = executor

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self.executor.group)

    def execute(self, batch):
        # NOTE: probe before sending: a batch every rank would refuse (the pools are alike) must not reach
        # the followers, or they would raise while rank 0 waits in the step's first collective.
        reason = self.executor.can_execute(batch)
        if reason is not None:
            raise ValueError(f"cannot execute step: {reason}")
        self._send((STEP, batch))
        return self.executor.execute(batch)

    def can_execute(self, batch):
        return self.executor.can_execute(batch)

    def resize_pools(self, plan) -> None:
        """plan: a domain ExpertParallelPlan (each rank takes its own PoolPlan) or one PoolPlan for all."""
        plans = tuple(plan.ranks) if hasattr(plan, "ranks") else (plan,) * self.executor.partition.num_ranks
        self._send((RESIZE, plans))
        self.executor.resize_pools(plans[0])

    def release(self, request_id: str) -> None:
        """ModelExecutor.release on every rank. Every rank runs the same steps, so every rank keeps the chunk rank 0
        keeps: the followers are told only when rank 0 keeps one of `request_id` (an abort otherwise costs no
        collective)."""
        if getattr(self.executor, "kept_request", None) != request_id:
            return
        self._send((RELEASE, request_id))
        self.executor.release(request_id)

    def stop(self) -> None:
        """Release the followers (their follow() returns)."""
        self._send((STOP, None))

    # NOTE: the launch hook (domain.ports.ModelExecutor.on_launched) is the local executor's, read AND set:
    # set on the leader alone, it would never be called. Absent (AttributeError) where that executor has none.
    @property
    def on_launched(self):
        return self.executor.on_launched

    @on_launched.setter
    def on_launched(self, hook) -> None:
        self.executor.on_launched = hook

    def __getattr__(self, name: str):  # pools, counters, check_valid: the local executor's
        return getattr(self.executor, name)


def follow(executor, after_step=None) -> int:
    """A follower rank's loop: run every StepBatch, resize and release rank 0 broadcasts, until STOP; returns the
    number of steps run. executor: this rank's expert-parallel executor (reference or fast path). after_step(executor) runs after each step (tests: check_valid)."""
    if executor.rank == 0:
        raise ValueError("rank 0 leads; follow() is for ranks 1..N-1")
    steps = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=executor.group)
        kind, payload = box[0]
        if kind == STOP:
            return steps
        if kind == RESIZE:
            executor.resize_pools(payload[executor.rank])
        elif kind == STEP:
            executor.execute(payload)
            steps += 1
        elif kind == RELEASE:
            executor.release(payload)
        else:  # pragma: no cover - only StepLeader sends
            raise RuntimeError(f"unknown message {kind!r} from rank 0")
        if after_step is not None:
            after_step(executor)
