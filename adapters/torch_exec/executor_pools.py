"""What both executors (the reference TorchExecutor and the fast CudaGraphExecutor) do alike with their
pools: swap them to a new plan freeing before allocating, check them against the plan, report their
bytes and expert counters, reset / restore / snapshot linear-attention state slots for the prefix cache,
keep a layered prefill chunk between its layer groups (dropped when the engine releases its request), and
sample one sequence with its failure confined to it.

The snapshot pool (prefix cache) is a LinearStatePool of plan.snapshot_slots slots built here for both
executors (None when the model has no linear-attention layers or the plan no snapshot slots).

Each executor builds its own pools (`_new_kv`, `_new_state`, `_new_experts`) and says how many KV pages
its pool holds for a plan (`_kv_pool_pages`: the fast path adds a scratch page for padded rows).

Layered prefill (SequenceWork.layers, docs/adr/0024-layered-prefill.md): a step's layered work runs as a forward
of its own over its layer group (`_run_group`), the other works as always; between groups the executor keeps the
chunk (`KeptChunk`: its residual stream, its flattened inputs, its routing-replay ids) until its next group, or
until the engine releases its request (`release`: aborted or failed part-way). Each executor runs the
group's forward (`_group_forward`: the reference records its routing, the fast path streams the experts).

Every expert resident from the start: a rebuilt expert pool whose slots hold every key it may hold is filled
from the host bank (`_preload_experts`) before the resize returns, so before the fast path captures its graphs and
before the server says it is ready; a partial pool fills by use.

Shape legend: T tokens of a chunk, H hidden, L layers, K top-k.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from adapters.torch_exec.expert_cache import ExpertPreload
from adapters.torch_exec.gated_deltanet import LinearStatePool
from adapters.torch_exec.step_inputs import StepInputs, flatten
from domain.ports import SampledToken, SequenceWork, StepBatch

if TYPE_CHECKING:
    from domain.budget import PoolPlan

log = logging.getLogger(__name__)


@dataclass
class KeptChunk:
    """A layered prefill chunk part-way: what its next layer group continues from."""

    work: SequenceWork  # its latest group (tokens, positions, pages, state slot, snapshots: the chunk's)
    inp: StepInputs  # the chunk flattened alone: one upload for all its groups
    replay: torch.Tensor | None  # int [T, L, K] routing-replay ids, taken at its first group; None: natural
    reached: int = 0  # layers [0, reached) computed
    x: torch.Tensor | None = None  # [T, H] the residual stream after layer reached - 1
    routes: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> ids [T, K] (the routing trace)


def same_chunk(a: SequenceWork, b: SequenceWork) -> bool:
    """Whether two layer groups are of one chunk (SequenceWork: same request, tokens, positions, pages, state
    slot and snapshots)."""
    return (a.request_id == b.request_id and a.start_position == b.start_position and a.state_slot == b.state_slot
            and (a.token_ids is b.token_ids or a.token_ids == b.token_ids)
            and (a.page_ids is b.page_ids or a.page_ids == b.page_ids) and a.snapshots == b.snapshots)


class ExecutorPools:
    """Mixin for an executor with `kv`, `state` (None without linear-attention layers), `experts`,
    `plan`, `bank`, `model`, `device`, `dtype`, `sampler` and `routing_replay` (None: off); it owns
    `snapshots` and the kept layered chunk."""

    snapshots: LinearStatePool | None = None
    _kept: KeptChunk | None = None  # the layered prefill chunk part-way, if any
    # the fill of the last expert pool built whole (every key resident before serving); None: that pool is partial
    expert_preload: ExpertPreload | None = None
    # the gather rate of the last expert pool built on a CUDA device (DeviceExpertPool.gather_rate); None elsewhere
    expert_gather: dict | None = None
    _on_phase: Callable[[str], None] | None = None  # start-up milestones (None after start-up)

    def _new_snapshots(self, plan: PoolPlan) -> LinearStatePool | None:
        if not self.model.linear_layers or plan.snapshot_slots == 0:
            return None
        return LinearStatePool(len(self.model.linear_layers), plan.snapshot_slots, self.model.opts.gdn, self.dtype,
                               self.device)

    def _snapshot_slots(self) -> int:
        return self.snapshots.num_slots if self.snapshots is not None else 0

    def _kv_pool_pages(self, plan: PoolPlan) -> int:
        return plan.kv_pages

    def _expert_slots(self, plan: PoolPlan) -> int:
        return max(1, min(plan.expert_slots, self.bank.num_layers * self.bank.num_experts))

    def _staging_slots(self, plan: PoolPlan) -> int:
        """Streamed-prefill staging rows the expert pool holds for a plan: none here (the reference path
        prefills through its LRU); the fast path holds plan.staging_experts."""
        return 0

    def _experts_fit(self, plan: PoolPlan) -> bool:
        return (self.experts is not None and self.experts.num_slots == self._expert_slots(plan)
                and getattr(self.experts, "staging_slots", 0) == self._staging_slots(plan))

    def _swap_pools(self, plan: PoolPlan) -> None:
        """Replace the pools with the plan's sizes; pools whose size is unchanged are kept (a warm expert
        cache stays warm). KV and state contents are dropped.

        NOTE: every pool that changes is freed before any new one is allocated, so old and new pools never
        coexist in device memory. A pool is kept only if it EXISTS at the wanted size: after a failed
        resize self.plan still names the old sizes while a pool may already be freed, and trusting the
        plan made a rollback "keep" a KV pool that was gone.
        """
        plan.check_valid()
        self._kept = None  # no request is live: a chunk part-way is never continued
        old = self.plan
        keep_kv = (self.kv is not None and old is not None
                   and (self.kv.num_pages, self.kv.page_size) == (self._kv_pool_pages(plan), plan.page_size))
        keep_state = (self.state is not None or not self.model.linear_layers) and old is not None \
            and old.state_slots == plan.state_slots
        keep_experts = self._experts_fit(plan)
        want_snapshots = plan.snapshot_slots if self.model.linear_layers else 0
        keep_snapshots = old is not None and self._snapshot_slots() == want_snapshots
        if not keep_kv:
            self.kv = None
        if not keep_snapshots:
            self.snapshots = None
        if not keep_state:
            self.state = None
        if not keep_experts:
            self.experts = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not keep_kv:
            self.kv = self._new_kv(plan)
        if not keep_state and self.model.linear_layers:
            self.state = self._new_state(plan)
        if not keep_experts:
            self.experts = self._new_experts(plan)
        if not keep_snapshots:
            self.snapshots = self._new_snapshots(plan)
        if not keep_experts:
            self._measure_expert_gather()
            self._preload_experts()
        self.plan = plan

    def _measure_expert_gather(self) -> None:
        """A fresh expert pool of the fast path on CUDA: how fast misses land from the host bank, by the gather
        kernel and by the copy engine (DeviceExpertPool.gather_rate, ~0.2 GB moved), logged and kept for
        /v1/stats (`executor.expert_gather`). Elsewhere (the CPU, the reference executor's cache): nothing."""
        measure = getattr(self.experts, "gather_rate", None)
        if measure is None or torch.device(self.device).type != "cuda":
            return
        self.expert_gather = rate = measure()
        log.info("expert gather from the host bank: %d experts, %.1f GB/s by the gather kernel (the decode step's "
                 "misses), %.1f GB/s by the copy engine", rate["rows"], rate["kernel_gb_s"], rate["copy_engine_gb_s"])

    def _preload_experts(self) -> None:
        """A freshly built expert pool that holds every key it may hold: every expert copied in now, after every
        pool is allocated (no new pool; the fill's temporaries are a few [L*E] index tensors), reported as a
        start-up milestone and logged. A partial pool: nothing (it fills by use)."""
        self.expert_preload = None
        if not self.experts.holds_every_key():
            return
        if self._on_phase is not None:
            self._on_phase(f"making experts resident: {self.experts.num_keys} experts from the host bank")
        self.expert_preload = report = self.experts.preload()
        log.info("%s (before serving; not counted as expert misses)", report.describe())
        if self._on_phase is not None:
            self._on_phase(report.describe())

    def _check_pools(self) -> None:
        """Every pool exists at the size of the plan last applied (a failed resize that left a pool
        missing or mis-sized fails here), and each pool's own invariants hold."""
        plan = self.plan
        assert plan is not None and self.kv is not None and self.experts is not None, "a pool is missing"
        assert (self.kv.num_pages, self.kv.page_size) == (self._kv_pool_pages(plan), plan.page_size), \
            "KV pool != plan"
        assert self._experts_fit(plan), "expert pool != plan"
        if self.model.linear_layers:
            assert self.state is not None and self.state.num_slots == plan.state_slots, "state pool != plan"
            assert self._snapshot_slots() == plan.snapshot_slots, "snapshot pool != plan"
            if self.snapshots is not None:
                self.snapshots.check_valid()
        self.kv.check_valid()
        self.experts.check_valid()
        if self.state is not None:
            self.state.check_valid()
        kept = self._kept
        if kept is not None:
            layers, tokens = len(self.model.mixers), len(kept.work.token_ids)
            assert 0 < kept.reached < layers, f"kept chunk at layer {kept.reached} of {layers}"
            assert kept.x is not None and tuple(kept.x.shape) == (tokens, self.model.opts.hidden), "kept chunk's x"

    # ---- linear-attention state around a step (prefix cache) ---------------------------------------------
    def _prepare_states(self, works) -> None:
        """Before a step: a sequence starting at 0 gets a zeroed slot; one resuming from the prefix cache
        gets its snapshot copied in (SequenceWork contract). A layered chunk's later groups are skipped: its
        first group did it."""
        if self.state is None:
            return
        for w in works:
            if not w.starts_chunk:
                continue
            if w.start_position == 0:
                self.state.reset(w.state_slot)
            elif w.restore_from is not None:
                if self.snapshots is None:
                    raise ValueError(f"{w.request_id}: restore from snapshot {w.restore_from} without a snapshot pool")
                self.snapshots.copy_slot(w.restore_from, self.state, w.state_slot)

    def _take_end_snapshots(self, works) -> None:
        """After a step: the snapshots works asked for at their end (the decoder took the inner ones); a
        layered chunk's only after its last group (the state of every layer is then at its end)."""
        if self.state is None:
            return
        layers = len(self.model.mixers)
        for w in works:
            if not w.ends_chunk(layers):
                continue
            for position, slot in w.snapshots:
                if position == w.end_position:
                    if self.snapshots is None:
                        raise ValueError(f"{w.request_id}: snapshot {slot} asked without a snapshot pool")
                    self.state.copy_slot(w.state_slot, self.snapshots, slot)

    # ---- layered prefill: one chunk's layer groups over several steps ----------------------------------
    def _chunk_reason(self, batch: StepBatch) -> str | None:
        """Why the batch's layered work cannot continue the kept chunk (read-only), or None."""
        w = batch.layered
        if w is None or w.layers[0] == 0:
            return None
        kept = self._kept
        if kept is not None and kept.reached == w.layers[0] and same_chunk(kept.work, w):
            return None
        held = "none" if kept is None else f"{kept.work.request_id}'s chunk at position {kept.work.start_position} " \
            f"with layers [0, {kept.reached}) done"
        return f"{w.request_id}: layer group {w.layers} at position {w.start_position} continues a chunk this " \
               f"executor does not keep (it keeps {held}); the groups of a chunk come in consecutive steps, in " \
               "layer order, with the same tokens, positions, pages, state slot and snapshots (a scheduler bug)"

    @property
    def kept_request(self) -> str | None:
        """The request whose layered prefill chunk this executor keeps part-way (between two of its layer groups),
        or None (read-only)."""
        kept = self._kept
        return None if kept is None else kept.work.request_id

    def release(self, request_id: str) -> None:
        """ModelExecutor.release: the engine ended `request_id` early (aborted, failed); a chunk of it kept part-way
        is dropped now (its residual stream [T, H], inputs and replay ids), not when a new chunk starts or another
        work takes its request id or state slot. Any other request's chunk stays; nothing kept: a no-op."""
        if self.kept_request == request_id:
            self._kept = None

    def _split_layered(self, batch: StepBatch) -> tuple[SequenceWork | None, tuple[SequenceWork, ...]]:
        """(the layered work or None, the other works). A kept chunk whose request or state slot another work
        of this step uses is dropped: its request was preempted or finished, and its slot is being rewritten."""
        group = batch.layered
        kept = self._kept
        if kept is not None and any(w is not group and (w.request_id == kept.work.request_id
                                                        or w.state_slot == kept.work.state_slot)
                                    for w in batch.works):
            self._kept = None
        if group is None:
            return None, batch.works
        return group, tuple(w for w in batch.works if w is not group)

    def _run_group(self, work: SequenceWork) -> torch.Tensor | None:
        """Compute one layer group of a layered chunk (the batch passed `_chunk_reason`): its first group resets
        or restores the state and starts a new chunk (dropping any kept one); its last returns the chunk's hidden
        states [T, H] after the end snapshots are taken; the others keep it and return None. A failure drops it."""
        first, end = work.layers
        if first == 0:
            self._kept = None
            chunk = KeptChunk(work, flatten(StepBatch((work,)), self.device), self._replay_ids((work,)))
            self._prepare_states((work,))
        else:
            chunk = self._kept
        self._kept = None  # NOTE: kept again only once this group has run
        x = self._group_forward(chunk, (first, end))  # [T, H]
        chunk.work, chunk.reached, chunk.x = work, end, x
        if end < len(self.model.mixers):
            self._kept = chunk
            return None
        self._take_end_snapshots((work,))
        self._chunk_done(chunk)
        return x

    def _group_forward(self, chunk: KeptChunk, layers: tuple[int, int]) -> torch.Tensor:
        """The model's forward over one group of `chunk` (its replay ids set around it): x [T, H] after the group."""
        self.model.replay_ids = chunk.replay
        try:
            return self.model.forward(chunk.inp, self.kv, self.state, self.experts, self.snapshots, layers=layers,
                                      x=chunk.x)
        finally:
            self.model.replay_ids = None

    def _chunk_done(self, chunk: KeptChunk) -> None:
        """Hook: a layered chunk's last group has run (the reference writes its routing trace here)."""

    def _replay_ids(self, works) -> torch.Tensor | None:
        """int [T, L, K] routing-replay ids of `works` on the device, or None (no replay, or inactive)."""
        replay = self.routing_replay
        table = replay.step_table(works) if replay is not None else None
        return torch.from_numpy(table).to(self.device) if table is not None else None

    def _sample(self, rid: str, logits: torch.Tensor, work, token: int | None = None) -> SampledToken:
        """One sequence's token (token: drawn already for the whole step; log-probabilities added); a
        failure here is that sequence's alone (SampledToken.error), so one request's bad values never fail
        the other sequences of the step."""
        try:
            return self.sampler.sample(rid, logits, work.sampling, work.output_index, token=token)
        except Exception as exc:  # NOTE: confined on purpose; the engine aborts only this request
            return SampledToken(rid, -1, error=f"sampling failed: {exc!r}")

    def pool_bytes(self) -> dict[str, int]:
        return {"kv": self.kv.nbytes(), "moe": self.experts.nbytes(),
                "state": self.state.nbytes() if self.state is not None else 0,
                "snapshot": self.snapshots.nbytes() if self.snapshots is not None else 0}

    def expert_counters(self) -> tuple[int, int]:
        """Cumulative (expert hits, expert misses) in one read (one sync on the fast path, not two)."""
        return self.experts.counters()

    @property
    def expert_hits(self) -> int:
        return self.experts.hits

    @property
    def expert_misses(self) -> int:
        return self.experts.misses
