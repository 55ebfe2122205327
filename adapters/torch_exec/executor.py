"""TorchExecutor: runs a StepBatch of a loaded checkpoint on CPU or CUDA through the expert-slot cache,
the paged KV cache and the linear-attention state slots, all sized by the domain's PoolPlan.

Shape legend: T tokens of the step, H hidden, V vocab, n rows.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from adapters.checkpoint.loader import LoadedCheckpoint
from adapters.torch_exec import qwen3_5_moe, qwen3_moe
from adapters.torch_exec.executor_pools import ExecutorPools
from adapters.torch_exec.expert_cache import ExpertSlotCache
from adapters.torch_exec.gated_deltanet import LinearStatePool
from adapters.torch_exec.paged_attention import PagedKVCache
from adapters.torch_exec.routing_replay import RoutingReplayer
from adapters.torch_exec.routing_trace import RoutingTraceRecorder
from adapters.torch_exec.sampler import Sampler
from adapters.torch_exec.step_inputs import check_batch, flatten
from domain.ports import SampledToken, StepBatch

if TYPE_CHECKING:
    from domain.budget import PoolPlan

BUILDERS = {qwen3_5_moe.ARCHITECTURE: qwen3_5_moe.build, qwen3_moe.ARCHITECTURE: qwen3_moe.build}


class TorchExecutor(ExecutorPools):
    """Implements domain.ports.ModelExecutor."""

    def __init__(self, checkpoint: LoadedCheckpoint, plan: "PoolPlan", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, sampler_seed: int = 0,
                 routing_recorder: RoutingTraceRecorder | None = None,
                 routing_replay: RoutingReplayer | None = None, on_phase: Callable[[str], None] | None = None):
        """routing_recorder records the ids the routers use (the replayed ones under routing_replay);
        routing_replay replaces the routers' top-k choice (benchmark-only, `--routing-replay`);
        on_phase(name): told when the start-up fill of an expert cache holding every expert starts and ends
        (start-up milestones; ExecutorPools._preload_experts)."""
        arch = checkpoint.spec.architecture
        if arch not in BUILDERS:
            raise ValueError(f"architecture {arch!r} is not supported (known: {sorted(BUILDERS)})")
        self.spec = checkpoint.spec
        self.device = torch.device(device)
        self.dtype = dtype
        self._checked_pages: dict = {}  # check_batch's memo of the page tables it found in range
        self.model = BUILDERS[arch](checkpoint.dense, checkpoint.text_config, dtype, self.device)
        self.bank = checkpoint.experts
        self.sampler = Sampler(sampler_seed)
        self.routing_recorder = routing_recorder
        if routing_recorder is not None:
            if routing_recorder.num_layers != len(self.model.mixers):
                raise ValueError(f"routing recorder expects {routing_recorder.num_layers} layers, "
                                 f"the model routes in {len(self.model.mixers)}")
            self.model.on_route = routing_recorder.record_layer
        if routing_replay is not None and (routing_replay.num_layers, routing_replay.top_k) != (
                len(self.model.mixers), self.model.opts.top_k):
            raise ValueError(f"routing replay for L={routing_replay.num_layers} K={routing_replay.top_k}, the model "
                             f"routes top-{self.model.opts.top_k} in {len(self.model.mixers)} layers")
        self.routing_replay = routing_replay
        self.kv: PagedKVCache | None = None
        self.state: LinearStatePool | None = None
        self.experts: ExpertSlotCache | None = None
        self.plan: PoolPlan | None = None
        self._on_phase = on_phase
        self.resize_pools(plan)
        self._on_phase = None  # a later resize's fill is not a start-up phase (it is logged)

    # ---- pools -------------------------------------------------------------------------------------
    def resize_pools(self, plan: "PoolPlan") -> None:
        """Replace the pools with the plan's sizes (ExecutorPools._swap_pools: frees before it allocates).
        Only while no sequence is in flight: KV pages and state slots are dropped."""
        self._swap_pools(plan)

    def _new_kv(self, plan: "PoolPlan") -> PagedKVCache:
        attn = self.model.opts.attention
        return PagedKVCache(len(self.model.full_layers), plan.kv_pages, plan.page_size, attn.num_kv_heads,
                            attn.head_dim, self.dtype, self.device)

    def _new_state(self, plan: "PoolPlan") -> LinearStatePool:
        return LinearStatePool(len(self.model.linear_layers), plan.state_slots, self.model.opts.gdn, self.dtype,
                               self.device)

    def _new_experts(self, plan: "PoolPlan") -> ExpertSlotCache:
        return ExpertSlotCache(self.bank, self._expert_slots(plan), self.device)

    # ---- execution ---------------------------------------------------------------------------------
    def can_execute(self, batch: StepBatch) -> str | None:
        """None when `batch` fits the current pools (and its layered work continues the chunk kept, if it
        continues one), else the reason (read-only probe)."""
        slots = self.state.num_slots if self.state is not None else None
        reason = check_batch(batch, self.kv.page_size, self.kv.num_pages, slots, self._snapshot_slots(),
                             self._checked_pages, num_layers=len(self.model.mixers))
        return reason if reason is not None else self._chunk_reason(batch)

    @torch.inference_mode()
    def compute_logits(self, batch: StepBatch, all_positions: bool = False) -> dict[str, torch.Tensor]:
        """fp32 logits per request: [1, V] for the last token of each work with sample=True, or with
        all_positions=True [len(token_ids), V] for every token of every work (a layered chunk's only at its
        last group). A layered work runs as a forward of its own over its layer group, after the others'."""
        reason = self.can_execute(batch)
        if reason is not None:
            raise ValueError(f"cannot execute step: {reason}")
        group, works = self._split_layered(batch)
        out = self._compute(works, all_positions) if works else {}
        if group is not None:
            hidden = self._run_group(group)  # [T, H] once the chunk's last group has run
            if hidden is not None and (all_positions or group.sample):
                out[group.request_id] = self.model.logits(hidden if all_positions else hidden[-1:])
        return out

    def _compute(self, works: tuple, all_positions: bool) -> dict[str, torch.Tensor]:
        """compute_logits for works without a layer group: one forward over every layer."""
        inp = flatten(StepBatch(works), self.device)
        self._prepare_states(works)
        self.model.replay_ids = self._replay_ids(works)
        try:
            hidden = self._forward(inp)  # [T, H]
        finally:
            self.model.replay_ids = None
        self._take_end_snapshots(works)
        if all_positions:
            return {s.work.request_id: self.model.logits(hidden[s.rows]) for s in inp.spans}
        wanted = [s for s in inp.spans if s.work.sample]
        if not wanted:
            return {}
        rows = torch.tensor([s.offset + s.length - 1 for s in wanted], device=self.device)
        logits = self.model.logits(hidden[rows])  # [n, V]
        return {s.work.request_id: logits[i:i + 1] for i, s in enumerate(wanted)}

    def _forward(self, inp) -> torch.Tensor:
        recorder = self.routing_recorder
        if recorder is None:
            return self.model.forward(inp, self.kv, self.state, self.experts, self.snapshots)  # [T, H]
        recorder.begin_pass([(s.work.request_id, s.start_position, s.length) for s in inp.spans])
        try:
            hidden = self.model.forward(inp, self.kv, self.state, self.experts, self.snapshots)  # [T, H]
        except BaseException:
            recorder.abort_pass()
            raise
        recorder.end_pass()
        return hidden

    # ---- layered prefill: the routing trace of a chunk computed in layer groups --------------------------
    def _group_forward(self, chunk, layers: tuple[int, int]) -> torch.Tensor:
        """ExecutorPools._group_forward; while recording a routing trace, the group's routing is kept with the
        chunk (the recorder takes whole passes: every layer of every token), and written when it ends."""
        recorder = self.routing_recorder
        if recorder is None:
            return super()._group_forward(chunk, layers)
        self.model.on_route = lambda layer, ids: chunk.routes.__setitem__(layer, ids.detach().clone())  # [T, K]
        try:
            return super()._group_forward(chunk, layers)
        finally:
            self.model.on_route = recorder.record_layer

    def _chunk_done(self, chunk) -> None:
        recorder = self.routing_recorder
        if recorder is None:
            return
        w = chunk.work
        recorder.begin_pass([(w.request_id, w.start_position, len(w.token_ids))])
        try:
            for layer, ids in sorted(chunk.routes.items()):
                recorder.record_layer(layer, ids)
        except BaseException:
            recorder.abort_pass()
            raise
        recorder.end_pass()

    def execute(self, batch: StepBatch) -> dict[str, SampledToken]:
        logits = self.compute_logits(batch)
        works = {w.request_id: w for w in batch.works}
        return {rid: self._sample(rid, row[0], works[rid]) for rid, row in logits.items()}

    def check_valid(self) -> None:
        self._check_pools()
        if self.routing_recorder is not None:
            self.routing_recorder.check_valid()
        if self.routing_replay is not None:
            self.routing_replay.check_valid()
