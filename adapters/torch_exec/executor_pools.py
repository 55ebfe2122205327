"""What both executors (the reference TorchExecutor and the fast CudaGraphExecutor) do alike with their
pools: swap them to a new plan freeing before allocating, check them against the plan, report their
bytes and expert counters, reset / restore / snapshot linear-attention state slots for the prefix cache,
and sample one sequence with its failure confined to it.

The snapshot pool (prefix cache) is a LinearStatePool of plan.snapshot_slots slots built here for both
executors (None when the model has no linear-attention layers or the plan no snapshot slots).

Each executor builds its own pools (`_new_kv`, `_new_state`, `_new_experts`) and says how many KV pages
its pool holds for a plan (`_kv_pool_pages`: the fast path adds a scratch page for padded rows).
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from adapters.torch_exec.gated_deltanet import LinearStatePool
from domain.ports import SampledToken

if TYPE_CHECKING:
    from domain.budget import PoolPlan


class ExecutorPools:
    """Mixin for an executor with `kv`, `state` (None without linear-attention layers), `experts`,
    `plan`, `bank`, `model`, `device`, `dtype` and `sampler`; it owns `snapshots`."""

    snapshots: LinearStatePool | None = None

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
        self.plan = plan

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

    # ---- linear-attention state around a step (prefix cache) ---------------------------------------------
    def _prepare_states(self, works) -> None:
        """Before a step: a sequence starting at 0 gets a zeroed slot; one resuming from the prefix cache
        gets its snapshot copied in (SequenceWork contract)."""
        if self.state is None:
            return
        for w in works:
            if w.start_position == 0:
                self.state.reset(w.state_slot)
            elif w.restore_from is not None:
                if self.snapshots is None:
                    raise ValueError(f"{w.request_id}: restore from snapshot {w.restore_from} without a snapshot pool")
                self.snapshots.copy_slot(w.restore_from, self.state, w.state_slot)

    def _take_end_snapshots(self, works) -> None:
        """After a step: the snapshots works asked for at their end (the decoder took the inner ones)."""
        if self.state is None:
            return
        for w in works:
            for position, slot in w.snapshots:
                if position == w.end_position:
                    if self.snapshots is None:
                        raise ValueError(f"{w.request_id}: snapshot {slot} asked without a snapshot pool")
                    self.state.copy_slot(w.state_slot, self.snapshots, slot)

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
