"""What the engine thread publishes after every iteration: the pools snapshot (read by /v1/stats,
/metrics and the admin endpoints) and each step's numbers, expert cache hits and misses included."""

from __future__ import annotations

import time
from dataclasses import dataclass

from app.stats import ServingStats
from domain.budget import PoolPlan
from domain.kv_pages import PageAllocator
from domain.ports import ModelExecutor
from domain.scheduler import Scheduler


def pool_snapshot(
    *,
    scheduler: Scheduler,
    allocator: PageAllocator,
    plan: PoolPlan,
    state_slots_used: int,
    held: int,
    phase: str,
    expert_pins: int | None = None,
) -> dict:
    """A fresh dict each time: handler threads keep reading the previous one while it is built."""
    return {
        "running": scheduler.num_running,
        "waiting": scheduler.num_waiting + held,
        "held": held,
        "preemptions": getattr(scheduler, "num_preemptions", 0),
        "page_size": plan.page_size,
        "kv_pages_total": allocator.num_pages,
        "kv_pages_used": allocator.num_used,
        "kv_pages_free": allocator.num_free,
        "kv_tokens": plan.kv_tokens,
        "state_slots_total": plan.state_slots,
        "state_slots_used": state_slots_used,
        "state_slots_free": plan.state_slots - state_slots_used,
        "expert_slots": plan.expert_slots,
        "residency": plan.residency,
        "phase": phase,
        "expert_pins": expert_pins,  # None: the executor keeps no pins (fakes)
        "prefix_cache": prefix_cache_snapshot(scheduler),
    }


def prefix_cache_snapshot(scheduler: Scheduler) -> dict:
    """The prefix cache's share of the pools: cached / evictable KV pages, snapshot slots used."""
    store = getattr(scheduler, "prefix", None)
    if store is None:
        return {"enabled": False, "cached_pages": 0, "evictable_pages": 0, "evicted_pages": 0,
                "snapshot_slots_total": 0, "snapshot_slots_used": 0, "snapshot_interval": 0}
    return {
        "enabled": store.enabled,
        "cached_pages": store.num_cached_pages,
        "evictable_pages": store.evictable_pages(),
        "evicted_pages": store.evicted_pages,
        "snapshot_slots_total": store.snapshots.num_slots,
        "snapshot_slots_used": store.snapshots.num_used,
        "snapshot_interval": store.interval,
    }


def expert_pins(executor: ModelExecutor) -> int | None:
    """Experts pinned by lookups still in progress (0 between steps), where the executor has a
    residency policy (TorchExecutor's expert slot cache); None otherwise."""
    residency = getattr(getattr(executor, "experts", None), "residency", None)
    # NOTE: only a host-side count; reading a device-side pin table would sync every iteration.
    pins = getattr(residency, "num_pinned", None)
    return pins if isinstance(pins, int) else None


def expert_counters(executor: ModelExecutor) -> tuple[int, int]:
    """Cumulative (expert_hits, expert_misses) of the executor."""
    # NOTE: the ModelExecutor port has no expert statistics; TorchExecutor exposes
    # cumulative expert_hits / expert_misses, fakes expose nothing (counted as 0).
    try:
        both = getattr(executor, "expert_counters", None)
        if both is not None:  # one read (the fast path's counters live on the device)
            hits, misses = both()
            return int(hits), int(misses)
        return int(getattr(executor, "expert_hits", 0) or 0), int(getattr(executor, "expert_misses", 0) or 0)
    except Exception:  # a half-built executor (pools being replaced) has no counters
        return 0, 0


def prefill_streaming(executor: ModelExecutor) -> dict | None:
    """The streamed prefill's cumulative counts and PCIe bound (docs/adr/0010-streamed-prefill.md) where the
    executor streams prefill (the fast path's prefill_stats); None otherwise."""
    stats = getattr(executor, "prefill_stats", None)
    if stats is None:
        return None
    try:
        return stats()
    except Exception:  # a half-built executor (pools being replaced) has no counters
        return None


@dataclass(frozen=True)
class StepRecord:
    """One step's numbers for ServingStats.record_step (seconds: the model call; host_seconds: the host time
    before it, None after an idle pause)."""

    prefill_tokens: int
    decode_tokens: int
    seconds: float
    expert_hits: int
    expert_misses: int
    host_seconds: float | None
    # the step ran a layer group of a layered prefill chunk (ADR 0024); its later groups count no prefill tokens
    # (StepBatch.num_prefill_tokens counts a chunk once) but the step is a prefill step all the same
    layer_group: bool = False
    # the step trace (/v1/stats/steps): the wall-clock time the model call returned (read in measure_step: recording
    # waits for the next launch), the prefill works beside the decodes, the layer group (first, end) and its chunk's
    # tokens
    ended: float | None = None
    prefill_works: int = 0
    layers: tuple[int, int] | None = None
    layer_tokens: int = 0


class PoolPublisher:
    """Engine-thread side of the pools snapshot and of the per-step statistics."""

    def __init__(self, stats: ServingStats, executor: ModelExecutor) -> None:
        self._stats = stats
        self._executor = executor
        self.latest: dict = {}  # replaced, never mutated: handler threads read it without a lock
        self._hits_misses = expert_counters(executor)
        self._prefill = prefill_streaming(executor)
        self._scheduler: Scheduler | None = None  # the engine's (the first publish names it)

    def publish(self, **parts) -> None:
        """`parts` are pool_snapshot's arguments."""
        self._scheduler = parts["scheduler"]
        pools = pool_snapshot(**parts, expert_pins=expert_pins(self._executor))
        pools["prefill_streaming"] = self._prefill  # read after prefill steps only (one device read)
        self.latest = pools
        self._stats.record_pools(pools)

    def reset_expert_counters(self) -> None:
        """After the executor rebuilt its pools (its counters may have restarted)."""
        self._hits_misses = expert_counters(self._executor)
        self._prefill = prefill_streaming(self._executor)

    def record_step(self, batch, seconds: float, host_seconds: float | None = None) -> None:
        self.record(self.measure_step(batch, seconds, host_seconds))

    def measure_step(self, batch, seconds: float, host_seconds: float | None = None) -> StepRecord:
        """Right after a step: its numbers, the executor's counters read now (before the next step moves
        them). Recording them (`record`) may wait: the engine does it while the next step runs."""
        # NOTE: first (the counters may be a device read): the wall clock when the model call returned, for the step
        # trace, whose clients line it up with their own
        ended = time.time()
        before = self._hits_misses
        self._hits_misses = expert_counters(self._executor)
        if self._scheduler is not None:
            # NOTE: the running count only grows inside schedule(), and every batch it admits to is measured here
            # before complete() lets any go: the high-water mark of /v1/stats (running_peak) cannot miss one
            self._stats.note_load(self._scheduler.num_running, self._scheduler.num_waiting)
        prefill_tokens = batch.num_prefill_tokens  # a property that walks the works: once
        decode_tokens = batch.num_decode_tokens  # (walks them too)
        # NOTE: a layered chunk's later groups stage their layers' experts too (the fast path's streamed step)
        layered = getattr(batch, "layered", None)
        if prefill_tokens or layered is not None:
            self._prefill = prefill_streaming(self._executor)
        return StepRecord(prefill_tokens, decode_tokens, seconds, self._hits_misses[0] - before[0],
                          self._hits_misses[1] - before[1], host_seconds, layered is not None, ended,
                          len(batch.works) - decode_tokens, None if layered is None else layered.layers,
                          0 if layered is None else len(layered.token_ids))

    def record(self, step: StepRecord) -> None:
        self._stats.record_step(
            prefill_tokens=step.prefill_tokens,
            decode_tokens=step.decode_tokens,
            seconds=step.seconds,
            expert_hits=step.expert_hits,
            expert_misses=step.expert_misses,
            host_seconds=step.host_seconds,
            prefill_work=bool(step.prefill_tokens) or step.layer_group,
            ended=step.ended,
            prefill_works=step.prefill_works,
            layers=step.layers,
            layer_tokens=step.layer_tokens,
        )

    def check_valid(self) -> None:
        hits, misses = self._hits_misses
        assert hits >= 0 and misses >= 0, "negative expert counters"
