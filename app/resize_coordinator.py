"""Live resize of the engine's pools: planning ("auto" sizes, checked against the budget before
anything is freed), the handler-side blocking call, and the engine-thread side that holds new
admissions, waits for in-flight requests to drain, swaps the pools and rolls back on failure.

Threading contract: ``resize`` runs on a handler's worker thread and only talks to the engine
thread through the engine's command queue; everything else runs on the engine thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from domain.budget import GpuBudget, PlanRefusal, PoolPlan, PoolRequest, format_bytes, plan_pools
from domain.model_spec import ModelSpec
from domain.ports import ModelExecutor
from domain.resize import ResizePlan, plan_resize, unusable_size
from domain.scheduler import Scheduler

log = logging.getLogger("fluxtide.engine")  # the engine's log: a resize is an engine event

PHASES = ("ready", "draining", "rebuilding", "error")


@dataclass(frozen=True)
class ResizeOutcome:
    ok: bool
    message: str
    plan: ResizePlan | None = None
    refusal: PlanRefusal | None = None
    rolled_back: bool = False
    # NOTE: the two parts of a resize's time, apart: a slow swap once read as requests that blocked the resize
    waited_s: float = 0.0  # waiting for the in-flight requests to finish (from the request to the drained engine)
    swap_s: float = 0.0  # swapping the pools once drained: rebuild, install, self-check (and a rollback's, if any)

    @property
    def total_s(self) -> float:
        return self.waited_s + self.swap_s


@dataclass
class _PendingResize:
    plan: ResizePlan
    deadline: float
    started: float
    future: concurrent.futures.Future


def fill_auto(
    spec: ModelSpec, budget: GpuBudget, current: PoolPlan, kv_tokens, expert_slots, state_slots
) -> tuple[int | None, int | None] | PlanRefusal:
    """"auto" for one pool = whatever the budget leaves once the other pools are sized
    (the benchmark's `cache --kv N --moe auto`), KV capped as at start-up (domain.serve_plan.plan_serve_pools) at
    state slots x the model's context: KV past every running sequence at full context is never used, and a resize
    that took it left no room for a later `--mamba` growth. Pure planning: nothing is touched."""
    if kv_tokens == "auto" and expert_slots == "auto":
        raise ValueError("only one of kv_tokens and expert_slots can be 'auto'")
    if "auto" not in (kv_tokens, expert_slots):
        return kv_tokens, expert_slots
    unusable = unusable_size(None if kv_tokens == "auto" else kv_tokens,
                             None if expert_slots == "auto" else expert_slots, state_slots)
    if unusable is not None:
        return unusable
    request = PoolRequest(
        kv_tokens=None if kv_tokens == "auto" else (current.kv_tokens if kv_tokens is None else kv_tokens),
        expert_slots=None if expert_slots == "auto" else (
            current.expert_slots if expert_slots is None else expert_slots),
        state_slots=current.state_slots if state_slots is None else state_slots,
        snapshot_slots=current.snapshot_slots,
        staging_experts=current.staging_experts,
        kv_reserve_tokens=current.page_size,
        page_size=current.page_size,
    )
    filled = plan_pools(spec, budget, request)
    if isinstance(filled, PlanRefusal):
        return filled
    if kv_tokens == "auto":
        return min(filled.kv_tokens, request.state_slots * spec.max_context), expert_slots
    return kv_tokens, filled.expert_slots


def state_slots_past_running_limit(state_slots: int | None, max_running: int | None) -> PlanRefusal | None:
    """More state slots than the running limit fixed at start-up (--max-running-requests): refused. NOTE: the limit
    is not raised live (the CUDA fast path captures its decode graphs for batch buckets up to it), so a slot past
    it would hold its GDN state's memory for no sequence; fewer slots than the limit lower it (and free memory)."""
    if state_slots is None or max_running is None or state_slots <= max_running:
        return None
    return PlanRefusal("state", 0, f"state_slots {state_slots} is above --max-running-requests {max_running}, the "
                                   f"running limit fixed at start-up (one state slot per running sequence): slots "
                                   f"past it would hold memory no sequence can use; at most {max_running} here, or "
                                   f"restart with --max-running-requests {state_slots} to run more sequences at once")


def plan_live_resize(
    spec: ModelSpec, budget: GpuBudget, current: PoolPlan, *, kv_tokens, expert_slots, state_slots,
    max_running: int | None = None,
) -> PlanRefusal | ResizePlan:
    """The plan a resize would apply from `current`, or why it would refuse. Pure planning.
    max_running: the running limit set at start-up; state slots above it are refused (None: not checked)."""
    past = state_slots_past_running_limit(state_slots, max_running)
    if past is not None:
        return past
    filled = fill_auto(spec, budget, current, kv_tokens, expert_slots, state_slots)
    if isinstance(filled, PlanRefusal):
        return filled
    kv_tokens, expert_slots = filled
    return plan_resize(spec, budget, current, kv_tokens=kv_tokens, expert_slots=expert_slots,
                       state_slots=state_slots)


_SIZES = (("KV tokens", "kv_tokens"), ("expert slots", "expert_slots"), ("state slots", "state_slots"),
          ("snapshot slots", "snapshot_slots"), ("staging experts", "staging_experts"))


def pool_sizes(plan: PoolPlan) -> str:
    return ", ".join(f"{name} {getattr(plan, field)}" for name, field in _SIZES) + f", {format_bytes(plan.used_bytes)}"


def experts_note(plan: Any) -> str:
    """What a resize (ResizePlan, or an expert-parallel one: every rank's) did to the expert slots. A rebuilt pool
    that holds every expert its GPU may hold is filled from the host bank before the resize returns (the executors'
    ExecutorPools._preload_experts); a partial one starts cold and fills by use."""
    if plan.experts_kept:
        return "expert slots kept warm"
    targets = plan.target if isinstance(plan.target, tuple) else (plan.target,)
    if not any(t.partial_residency for t in targets):
        return "expert pool rebuilt: every expert made resident"
    return "expert pool rebuilt: expert slots start cold"


def pool_changes(before: PoolPlan, after: PoolPlan) -> str:
    """Every pool's size before -> after, and the bytes the pools hold ("KV tokens 16384 -> 2048, ...")."""
    sizes = [f"{name} {getattr(before, field)} -> {getattr(after, field)}" for name, field in _SIZES]
    return ", ".join(sizes) + f", {format_bytes(before.used_bytes)} -> {format_bytes(after.used_bytes)}"


class ResizeCoordinator:
    """Owns the resize phase, the pending resize and the submissions held while it drains."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        executor: ModelExecutor,
        clock: Callable[[], float],
        send: Callable[[tuple], None],  # puts a command on the engine thread's queue
        admit: Callable[[Any], None],  # admits a held submission (engine thread)
        install: Callable[[PoolPlan], str | None],  # adopts the rebuilt pools' plan and allocator; a note
        report_error: Callable[[str], None],
        republish: Callable[[], None],  # republishes the pools snapshot, then flushes events
        verify: Callable[[], str | None] = lambda: None,  # engine self-check: None, or why it cannot serve
    ) -> None:
        self._scheduler = scheduler
        self._executor = executor
        self._clock = clock
        self._send = send
        self._admit = admit
        self._install = install
        self._report_error = report_error
        self._republish = republish
        self._verify = verify
        self._lock = threading.Lock()  # one resize at a time, across handler threads
        self._pending: _PendingResize | None = None
        self.held: list = []  # submissions parked while a resize drains the engine
        self.phase = "ready"  # "ready" | "draining" | "rebuilding" | "error"

    @property
    def active(self) -> bool:
        return self._pending is not None

    # -- handler side (a worker thread) ----------------------------------------------------------
    def resize(self, probe: Callable[[], PlanRefusal | ResizePlan], wait_s: float) -> ResizeOutcome:
        """Blocking. `probe` plans under the lock, so two resizes never plan from the same pools."""
        if not self._lock.acquire(blocking=False):
            return ResizeOutcome(ok=False, message="another resize is in progress")
        try:
            planned = probe()
            if isinstance(planned, PlanRefusal):
                return ResizeOutcome(ok=False, message=planned.message, refusal=planned)
            started = self._clock()
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._send(("resize", _PendingResize(planned, started + max(0.0, wait_s), started, future)))
            return future.result()
        finally:
            self._lock.release()

    # -- engine thread ---------------------------------------------------------------------------
    def begin(self, pending: _PendingResize) -> None:
        self._pending = pending
        self.phase = "draining"

    def hold(self, live) -> None:
        """Park a submission until the pending resize ends (it is admitted on the new pools)."""
        self.held.append(live)

    def drop_held(self, request_id: str) -> bool:
        """Forget a held submission (aborted before it was admitted); False if none had that id."""
        for i, held in enumerate(self.held):
            if held.request.request_id == request_id:
                del self.held[i]
                return True
        return False

    def take_held(self) -> list:
        held, self.held = self.held, []
        return held

    def step(self) -> None:
        """Called once per engine iteration: swap the pools once the engine has drained."""
        pending = self._pending
        if pending is None:
            return
        now = self._clock()
        if not self._scheduler.is_idle():
            if now < pending.deadline:
                return
            busy = self._scheduler.num_running + self._scheduler.num_waiting
            log.warning("resize not applied: %d in-flight request(s) did not finish within the %.1f s wait; "
                        "old pools kept (%s)", busy, now - pending.started, pool_sizes(pending.plan.current))
            self._end(
                ResizeOutcome(
                    ok=False,
                    message=f"{busy} in-flight request(s) did not finish within the wait; old pools kept",
                    plan=pending.plan,
                    waited_s=now - pending.started,
                )
            )
            return
        self.phase = "rebuilding"
        target, current = pending.plan.target, pending.plan.current
        waited = now - pending.started
        try:
            self._executor.resize_pools(target)
        except Exception as exc:
            log.exception("resize to %s failed; rolling back", target)
            try:
                self._executor.resize_pools(current)
            except Exception as rollback_exc:
                self._fail(pending, f"resize failed ({exc}) and rollback failed ({rollback_exc})")
                return
            # NOTE: the failed attempt may have rebuilt the KV or snapshot pool: what the prefix cache points
            # at is gone, so it is cleared (idle here: the engine drained before the swap).
            dropped = self._scheduler.clear_prefix_cache()
            problem = self._verify()  # NOTE: a rollback is proven by the self-check, not assumed
            if problem is not None:
                self._fail(pending, f"resize failed ({exc}); the rollback left an engine that cannot serve: "
                                    f"{problem}")
                return
            self._end(
                ResizeOutcome(False, f"resize failed, old pools restored: {exc}; prefix cache cleared "
                                     f"({dropped} cached pages dropped)", pending.plan, rolled_back=True,
                              waited_s=waited, swap_s=self._clock() - now)
            )
            return
        note = self._install(target)
        problem = self._verify()
        if problem is not None:
            self._fail(pending, f"pools rebuilt but the engine cannot serve on them: {problem}")
            return
        message = "pools rebuilt" + (f"; {note}" if note else "")
        done = self._clock()
        # NOTE: the one line a live resize leaves in the log (the rebuild route's answer has the rest)
        log.info("pools resized: %s; waited %.3f s for in-flight requests, swapped in %.3f s; %s%s",
                 pool_changes(pending.plan.current, target), waited, done - now,
                 experts_note(pending.plan),
                 f"; {note}" if note else "")
        self._end(ResizeOutcome(True, message, pending.plan, waited_s=waited, swap_s=done - now))

    def _fail(self, pending: _PendingResize, message: str) -> None:
        """The engine cannot serve after this resize: phase "error", held submissions get the error."""
        log.error("%s", message)
        self.phase = "error"
        self._report_error(message)
        self._pending = None
        self._release_held()
        self._republish()
        pending.future.set_result(ResizeOutcome(False, message, pending.plan))

    def cancel(self, message: str) -> None:
        """Answer a pending resize without applying it (server shutting down)."""
        if self._pending is not None:
            self._pending.future.set_result(ResizeOutcome(False, message))
            self._pending = None

    def _end(self, outcome: ResizeOutcome) -> None:
        pending = self._pending
        self._pending = None
        self.phase = "ready"
        self._release_held()
        self._republish()
        if pending is not None:
            pending.future.set_result(outcome)

    def _release_held(self) -> None:
        for live in self.take_held():
            self._admit(live)

    def check_valid(self) -> None:
        """Engine-thread only (or when the thread is stopped)."""
        assert self.phase in PHASES, f"unknown phase {self.phase!r}"
        assert self._pending is not None or not self.held, "submissions held with no resize pending"
