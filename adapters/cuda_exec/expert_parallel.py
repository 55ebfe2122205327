"""Expert parallelism on the fast path (docs/adr/0008-expert-parallel.md): one process per rank, each a
CudaGraphExecutor whose DeviceExpertPool looks up, copies and computes only the (layer, expert) keys its
rank owns, and whose MoE layers all-reduce exact fp32 partials (adapters/cuda_exec/expert_shard.py), inside
the captured decode graphs on CUDA (NCCL) and eagerly on the CPU (gloo, Triton's interpreter).

Rank 0 drives and the others follow with the reference path's machinery (StepLeader / follow in
adapters/torch_exec/expert_parallel.py): every rank executes the same StepBatches and resizes in the same
order, so the collectives pair up, and the same decode bucket is replayed on every rank. A layered prefill's
group (SequenceWork.layers) runs after the step's decode rows on every rank alike (CudaGraphExecutor.execute), its
eager exchanges in layer order: it needs nothing of its own here.

Shape legend: B decode rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from adapters.checkpoint.loader import LoadedCheckpoint
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.cuda_exec.expert_shard import ExpertShard
from adapters.torch_exec.expert_parallel import check_replicas, group_rank
from domain.expert_parallel import ExpertPartition

if TYPE_CHECKING:
    from domain.budget import PoolPlan


class FastExpertParallelExecutor(CudaGraphExecutor):
    """CudaGraphExecutor of one rank: the whole dense model, a device expert pool over its own keys (slots
    at most the keys it owns, the per-rank plan of plan_expert_parallel), MoE partials exchanged."""

    # NOTE: ProcessGroupNCCL's watchdog thread polls its events while this thread captures; "thread_local"
    # confines the capture's checks to the capturing thread (what NCCL-in-graph users of torch do)
    capture_error_mode = "thread_local"

    def __init__(self, checkpoint: LoadedCheckpoint, plan: PoolPlan, partition: ExpertPartition,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, sampler_seed: int = 0, max_decode_rows: int = 4,
                 max_context: int | None = None, use_graphs: bool | None = None,
                 on_phase: Callable[[str], None] | None = None, prefill_kernels: bool = False,
                 max_step_tokens: int = 2048, warm_prefill: bool = False, fp8_activations: bool = False):
        """Raises RuntimeError without an initialised torch.distributed, ValueError when the partition does
        not fit the group or the checkpoint. Routing replay is not offered here (each rank would rewrite
        its ids from its own replay state; not proven to stay in lockstep)."""
        self.rank = group_rank(checkpoint, partition, group)
        self.partition, self.group = partition, group
        self.shard = ExpertShard(partition, self.rank, group, device)
        # the decode step's MoE layers, one all-reduce each: what a graph replay issues
        self._layer_exchanges = checkpoint.spec.num_layers
        # NOTE: the prefill warm-up (warm_prefill) tunes kernels on scratch inputs through a read-only view
        # of the pool: no exchange, so it needs no lockstep beyond the one every rank's start-up has
        super().__init__(checkpoint, plan, device=device, dtype=dtype, sampler_seed=sampler_seed,
                         max_decode_rows=max_decode_rows, max_context=max_context, use_graphs=use_graphs,
                         on_phase=on_phase, prefill_kernels=prefill_kernels, max_step_tokens=max_step_tokens,
                         warm_prefill=warm_prefill, fp8_activations=fp8_activations)

    # ---- pools -------------------------------------------------------------------------------------
    def _expert_slots(self, plan: PoolPlan) -> int:
        return max(1, min(plan.expert_slots, self.partition.keys_of(self.rank)))

    def _new_experts(self, plan: PoolPlan) -> DeviceExpertPool:
        return DeviceExpertPool(self.bank, self._expert_slots(plan), self.device, self.shared_rows,
                                grouped=self.prefill_kernels, staging_slots=self._staging_slots(plan),
                                shard=self.shard, fp8_activations=self.fp8_activations)

    def _decode_rows(self, plan: PoolPlan) -> int:
        """The smallest of every rank's own bound (MIN-reduce): ranks own different key counts, and all
        must capture and replay the same buckets (their collectives pair up)."""
        rows = torch.tensor([super()._decode_rows(plan)], dtype=torch.int64, device=self.device)
        dist.all_reduce(rows, op=dist.ReduceOp.MIN, group=self.group)
        return int(rows.item())

    def resize_pools(self, plan: PoolPlan) -> None:
        """As CudaGraphExecutor.resize_pools, on every rank at once (StepLeader broadcasts the plans): the
        static partials buffers go with the graphs that captured them."""
        self.graphs = {}
        self.shard.release_buffers()
        super().resize_pools(plan)

    # ---- one tile choice on every rank ---------------------------------------------------------------
    def _before_capture(self) -> None:
        """The warm-up steps tuned the decode kernels on each rank alone; the graphs capture rank 0's tiles."""
        sync_autotune(self.rank, self.group)

    def _warm_prefill(self) -> None:
        super()._warm_prefill()
        sync_autotune(self.rank, self.group)

    # ---- execution ---------------------------------------------------------------------------------
    def _decode(self, works):
        before = self.shard.exchanges
        out = super()._decode(works)
        if self.shard.exchanges == before:  # a graph replay: its captured all-reduces ran again
            self.shard.exchanges += self._layer_exchanges
        return out

    @property
    def exchanges(self) -> int:
        """All-reduces of MoE partials issued so far (eager ones and those of graph replays)."""
        return self.shard.exchanges

    def check_replicas(self, tensor: torch.Tensor) -> None:
        check_replicas(tensor, self.rank, self.group)

    def check_valid(self) -> None:
        super().check_valid()  # the residency's check_valid also proves every resident key is this rank's
        assert self.experts.num_slots <= self.partition.keys_of(self.rank), "more expert slots than owned keys"


def _autotuners() -> Iterator[tuple[str, object]]:
    """Every triton.autotune'd kernel of adapters.kernels imported so far, by module and attribute name."""
    from triton.runtime.autotuner import Autotuner

    for mod_name, mod in sorted(sys.modules.items()):
        if mod_name.startswith("adapters.kernels.") and mod is not None:
            for attr, value in sorted(vars(mod).items()):
                if isinstance(value, Autotuner):
                    yield f"{mod_name}.{attr}", value


def _describe(config) -> tuple:
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages, config.num_ctas


def sync_autotune(rank: int, group: dist.ProcessGroup | None = None) -> int:
    """Make every rank use rank 0's measured tile for every kernel key rank 0 has tuned (one broadcast;
    call on all ranks at the same point). Returns how many of this rank's choices changed.

    Why: each process times the autotuner's tiles itself, and near-equal tiles can win on one rank and lose
    on another; a different tile is a different summation order, so the replicated dense compute (and the
    MoE partials) would differ in the last bits between ranks, which then route differently (ADR 0008,
    decision 5). Keys only this rank has tuned are kept."""
    tuners = dict(_autotuners())
    table = {name: {key: _describe(cfg) for key, cfg in t.cache.items()} for name, t in tuners.items()}
    box = [table if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    changed = 0
    for name, chosen in box[0].items():
        tuner = tuners.get(name)
        if tuner is None:  # a kernel module rank 0 imported and this rank did not: nothing tuned here
            continue
        for key, desc in chosen.items():
            current = tuner.cache.get(key)
            if current is not None and _describe(current) == desc:
                continue
            match = next((c for c in tuner.configs if _describe(c) == desc), None)
            if match is None:
                import triton

                kwargs, warps, stages, ctas = desc
                match = triton.Config(dict(kwargs), num_warps=warps, num_stages=stages, num_ctas=ctas)
            tuner.cache[key] = match
            changed += 1
    return changed
