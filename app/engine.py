"""The engine loop: one background thread drives scheduler.schedule() -> executor.execute() ->
scheduler.complete() and streams each request's text to its asyncio queue.

Threading contract: the scheduler, the allocator and the executor are touched ONLY by the
engine thread. HTTP handlers talk to it through a command queue (submit, abort, resize) and
read a pools snapshot that the thread republishes after every iteration. Events reach a
handler's event loop through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from app.detokenize import IncrementalDetokenizer, StopStringMatcher
from app.stats import ServingStats
from domain.budget import GpuBudget, PlanRefusal, PoolPlan, PoolRequest, plan_pools
from domain.kv_pages import PageAllocator
from domain.model_spec import ModelSpec
from domain.ports import ModelExecutor, SampledToken, Tokenizer
from domain.request import Request, RequestEvent, SamplingParams
from domain.resize import ResizePlan, plan_resize
from domain.scheduler import Scheduler

log = logging.getLogger("fluxtide.engine")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StreamEvent:
    """What a handler receives: text released since the last event, and the finish when done."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" on the last event
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    error_status: int = 500  # HTTP status a non-streamed answer should carry for this error


@dataclass(frozen=True)
class ResizeOutcome:
    ok: bool
    message: str
    plan: ResizePlan | None = None
    refusal: PlanRefusal | None = None
    rolled_back: bool = False
    waited_s: float = 0.0


class RequestRejected(ValueError):
    """The scheduler can never admit this request (e.g. it needs more KV than the pool holds)."""


@dataclass
class _Live:
    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    arrival: float
    first_token_at: float | None = None
    generated: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _PendingResize:
    plan: ResizePlan
    deadline: float
    started: float
    future: concurrent.futures.Future


class Engine:
    """Owns the scheduler/executor pair and the thread that runs them."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        allocator: PageAllocator,
        executor: ModelExecutor,
        tokenizer: Tokenizer,
        spec: ModelSpec,
        budget: GpuBudget,
        plan: PoolPlan,
        stats: ServingStats,
        eos_token_ids: Sequence[int] = (),
        debug: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.spec = spec
        self.budget = budget
        self.plan = plan
        self.stats = stats
        self.debug = debug
        self.eos_token_ids = frozenset(eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        self._allocator = allocator
        self._clock = clock
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}
        self._held: list[_Live] = []  # submissions parked while a resize drains the engine
        self._resize: _PendingResize | None = None
        self._resize_lock = threading.Lock()  # one resize at a time, across handler threads
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.phase = "ready"  # "ready" | "draining" | "rebuilding" | "error"
        self.last_error: str | None = None
        self._pools: dict = {}
        self._outbox: list[tuple[_Live, StreamEvent]] = []
        self._hits_misses = self._expert_counters()
        self._publish_pools()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="fluxtide-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- handler-side API (any thread; submit from inside an event loop) -------------------
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns() % 10**9:09d}"

    def can_submit(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> str | None:
        """Read-only probe for submit: None when the request could ever run on these pools."""
        return self.scheduler.check_request(Request("probe", list(prompt_token_ids), sampling))

    def can_resize(self, *, kv_tokens=None, expert_slots=None, state_slots=None) -> PlanRefusal | ResizePlan:
        """Read-only probe for resize: the plan it would apply, or why it would refuse."""
        filled = self._fill_auto(kv_tokens, expert_slots, state_slots)
        if isinstance(filled, PlanRefusal):
            return filled
        kv_tokens, expert_slots = filled
        return plan_resize(self.spec, self.budget, self.plan, kv_tokens=kv_tokens, expert_slots=expert_slots,
                           state_slots=state_slots)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        stop: Sequence[str] = (),
    ) -> asyncio.Queue:
        """Queue a request; its StreamEvents arrive on the returned queue (last one has finish_reason)."""
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            arrival_time=self._clock(),
        )
        reason = self.scheduler.check_request(request)
        if reason is not None:
            raise RequestRejected(reason)
        live = _Live(
            request=request,
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            detok=IncrementalDetokenizer(self.tokenizer),
            matcher=StopStringMatcher(stop),
            arrival=request.arrival_time,
        )
        self._command(("submit", live))
        return live.events

    def abort(self, request_id: str) -> None:
        """Abort a request (client went away); its pages and state slot are freed next iteration."""
        self._command(("abort", request_id))

    def resize(
        self,
        *,
        kv_tokens: int | str | None = None,
        expert_slots: int | str | None = None,
        state_slots: int | None = None,
        wait_s: float = 60.0,
    ) -> ResizeOutcome:
        """Blocking (call from a worker thread). Validates the plan BEFORE anything is freed,
        holds new admissions, waits up to wait_s for in-flight requests, then swaps pools."""
        if not self._resize_lock.acquire(blocking=False):
            return ResizeOutcome(ok=False, message="another resize is in progress")
        try:
            planned = self.can_resize(kv_tokens=kv_tokens, expert_slots=expert_slots, state_slots=state_slots)
            if isinstance(planned, PlanRefusal):
                return ResizeOutcome(ok=False, message=planned.message, refusal=planned)
            started = self._clock()
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._command(("resize", _PendingResize(planned, started + max(0.0, wait_s), started, future)))
            return future.result()
        finally:
            self._resize_lock.release()

    def _fill_auto(self, kv_tokens, expert_slots, state_slots) -> tuple[int | None, int | None] | PlanRefusal:
        """"auto" for one pool = whatever the budget leaves once the other pools are sized
        (the benchmark's `cache --kv N --moe auto`). Pure planning: nothing is touched."""
        if kv_tokens == "auto" and expert_slots == "auto":
            raise ValueError("only one of kv_tokens and expert_slots can be 'auto'")
        if "auto" not in (kv_tokens, expert_slots):
            return kv_tokens, expert_slots
        current = self.plan
        request = PoolRequest(
            kv_tokens=None if kv_tokens == "auto" else (current.kv_tokens if kv_tokens is None else kv_tokens),
            expert_slots=None if expert_slots == "auto" else (
                current.expert_slots if expert_slots is None else expert_slots),
            state_slots=current.state_slots if state_slots is None else state_slots,
            kv_reserve_tokens=current.page_size,
            page_size=current.page_size,
        )
        filled = plan_pools(self.spec, self.budget, request)
        if isinstance(filled, PlanRefusal):
            return filled
        if kv_tokens == "auto":
            return filled.kv_tokens, expert_slots
        return kv_tokens, filled.expert_slots

    def pools(self) -> dict:
        """Latest pool snapshot (published by the engine thread)."""
        return self._pools

    # -- engine thread -------------------------------------------------------------------------
    def _command(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        was_idle = False
        while not self._stopping:
            self._wake.clear()
            try:
                self._drain_commands()
                self._maybe_resize()
                batch = self.scheduler.schedule()
                if batch is None:
                    if not was_idle:
                        self._on_idle()
                        was_idle = True
                    self._publish_pools()
                    self._flush()
                    self._wake.wait(0.05 if self._resize else 1.0)
                    continue
                was_idle = False
                self._step(batch)
                self._publish_pools()
                self._flush()
            except Exception as exc:  # NOTE: the loop must survive anything; requests get the error
                self._fail_everything(exc)
                self._flush()
        self._shutdown()
        self._flush()

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                if self._resize is not None:
                    self._held.append(payload)
                else:
                    self._admit(payload)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "resize":
                self._resize = payload
                self.phase = "draining"

    def _admit(self, live: _Live) -> None:
        try:
            self.scheduler.add(live.request)
        except ValueError as exc:  # pools shrank (live resize) since the handler's probe
            message = f"request can not be served on the resized pools: {exc}"
            self._emit(live, StreamEvent("", (), (), "error", len(live.request.prompt_token_ids), 0, message, 400))
            return
        self._live[live.request.request_id] = live
        self.stats.record_admitted(len(live.request.prompt_token_ids))

    def _abort(self, request_id: str) -> None:
        for i, held in enumerate(self._held):
            if held.request.request_id == request_id:
                del self._held[i]
                return
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.scheduler.abort(request_id)
        self.stats.record_finished("abort")
        self._emit(live, self._finish_event(live, "abort"))

    def _step(self, batch) -> None:
        before = self._hits_misses
        started = self._clock()
        try:
            sampled: dict[str, SampledToken] = self.executor.execute(batch)
        except Exception as exc:  # NOTE: fail this batch's requests, keep serving the rest
            self._fail_batch(batch, exc)
            return
        seconds = self._clock() - started
        self._hits_misses = self._expert_counters()
        self.stats.record_step(
            prefill_tokens=batch.num_prefill_tokens,
            decode_tokens=batch.num_decode_tokens,
            seconds=seconds,
            expert_hits=self._hits_misses[0] - before[0],
            expert_misses=self._hits_misses[1] - before[1],
        )
        for event in self.scheduler.complete(batch, sampled):
            self._on_event(event)

    def _on_event(self, event: RequestEvent) -> None:
        live = self._live.get(event.request_id)
        if live is None:
            return
        now = self._clock()
        text = ""
        if event.token_id is not None:
            live.generated += 1
            if live.first_token_at is None:
                live.first_token_at = now
                self.stats.record_ttft(now - live.arrival)
            if event.logprob is not None:
                live.pending_logprobs.append(TokenLogprob(event.token_id, event.logprob, event.top_logprobs))
            finishing_eos = event.finished and event.finish_reason == "stop" and event.token_id in self.eos_token_ids
            if not finishing_eos:
                text = live.matcher.feed(live.detok.push(event.token_id))
        if live.matcher.stopped and not event.finished:
            # A stop string ended the text: free the pages and state slot now.
            self.scheduler.abort(event.request_id)
            self._live.pop(event.request_id, None)
            self.stats.record_finished("stop")
            self._emit(live, self._event(live, text, "stop"))
            return
        if event.finished:
            self._live.pop(event.request_id, None)
            reason = "stop" if live.matcher.stopped else (event.finish_reason or "stop")
            if not live.matcher.stopped:
                text += live.matcher.feed(live.detok.flush())
                text += live.matcher.flush()
            self.stats.record_finished(reason)
            self._emit(live, self._event(live, text, reason))
            return
        if text or live.pending_logprobs:
            self._emit(live, self._event(live, text, None))

    def _event(self, live: _Live, text: str, finish_reason: str | None) -> StreamEvent:
        logprobs = tuple(live.pending_logprobs)
        live.pending_logprobs.clear()
        return StreamEvent(
            text=text,
            token_ids=(),
            logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_tokens=len(live.request.prompt_token_ids),
            completion_tokens=live.generated,
        )

    def _finish_event(self, live: _Live, reason: str, error: str | None = None) -> StreamEvent:
        event = self._event(live, "", reason)
        return StreamEvent(**{**event.__dict__, "error": error})

    def _emit(self, live: _Live, event: StreamEvent) -> None:
        # NOTE: events wait in the outbox until the pools snapshot is republished, so a client
        # that sees its finish and then asks /v1/stats already sees its pages and slot freed.
        self._outbox.append((live, event))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for live, event in outbox:
            try:
                live.loop.call_soon_threadsafe(live.events.put_nowait, event)
            except RuntimeError:  # the handler's loop is gone (server shutting down)
                pass

    # -- resize ----------------------------------------------------------------------------------
    def _maybe_resize(self) -> None:
        pending = self._resize
        if pending is None:
            return
        now = self._clock()
        if not self.scheduler.is_idle():
            if now < pending.deadline:
                return
            busy = self.scheduler.num_running + self.scheduler.num_waiting
            self._end_resize(
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
        try:
            self.executor.resize_pools(target)
        except Exception as exc:
            log.exception("resize to %s failed; rolling back", target)
            try:
                self.executor.resize_pools(current)
            except Exception as rollback_exc:
                self.phase = "error"
                self.last_error = f"resize failed ({exc}) and rollback failed ({rollback_exc})"
                pending.future.set_result(ResizeOutcome(False, self.last_error, pending.plan))
                self._resize = None
                self._release_held()
                return
            self._end_resize(
                ResizeOutcome(False, f"resize failed, old pools restored: {exc}", pending.plan, rolled_back=True)
            )
            return
        allocator = PageAllocator(target.kv_pages)
        self.scheduler.replace_pools(allocator, target.state_slots)
        self._allocator = allocator
        self.plan = target
        self._hits_misses = self._expert_counters()
        self._end_resize(
            ResizeOutcome(True, "pools rebuilt", pending.plan, waited_s=self._clock() - pending.started)
        )

    def _end_resize(self, outcome: ResizeOutcome) -> None:
        pending = self._resize
        self._resize = None
        self.phase = "ready"
        self._release_held()
        self._publish_pools()
        self._flush()
        if pending is not None:
            pending.future.set_result(outcome)

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for live in held:
            self._admit(live)

    # -- housekeeping ------------------------------------------------------------------------
    def _on_idle(self) -> None:
        if self.debug:
            self.check_valid()

    def check_valid(self) -> None:
        """Engine-thread only (or when the thread is stopped)."""
        self.scheduler.check_valid()
        self._allocator.check_valid()
        self.stats.check_valid()
        for request_id, live in self._live.items():
            assert live.request.request_id == request_id, "live table keyed by the wrong id"
            assert not live.request.is_done, f"{request_id} finished but still live"
            live.detok.check_valid()
            live.matcher.check_valid()
        if self.scheduler.is_idle():
            assert self._allocator.num_free == self._allocator.num_pages, "idle engine holds KV pages"

    def _publish_pools(self) -> None:
        alloc = self._allocator
        state_used = sum(
            1 for live in self._live.values() if live.request.state_slot is not None and not live.request.is_done
        )
        pools = {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting + len(self._held),
            "held": len(self._held),
            "preemptions": getattr(self.scheduler, "num_preemptions", 0),
            "page_size": self.plan.page_size,
            "kv_pages_total": alloc.num_pages,
            "kv_pages_used": alloc.num_used,
            "kv_pages_free": alloc.num_free,
            "kv_tokens": self.plan.kv_tokens,
            "state_slots_total": self.plan.state_slots,
            "state_slots_used": state_used,
            "state_slots_free": self.plan.state_slots - state_used,
            "expert_slots": self.plan.expert_slots,
            "residency": self.plan.residency,
            "phase": self.phase,
        }
        self._pools = pools
        self.stats.record_pools(pools)

    def _expert_counters(self) -> tuple[int, int]:
        # NOTE: the ModelExecutor port has no expert statistics; TorchExecutor exposes
        # cumulative expert_hits / expert_misses, fakes expose nothing (counted as 0).
        try:
            return int(getattr(self.executor, "expert_hits", 0) or 0), int(getattr(self.executor, "expert_misses", 0) or 0)
        except Exception:  # a half-built executor (pools being replaced) has no counters
            return 0, 0

    def _fail_batch(self, batch, exc: Exception) -> None:
        message = f"model step failed: {exc!r}"
        log.error("%s\n%s", message, traceback.format_exc())
        self.last_error = message
        for work in batch.works:
            live = self._live.pop(work.request_id, None)
            self.scheduler.abort(work.request_id)
            if live is not None:
                self.stats.record_finished("error")
                self._emit(live, self._finish_event(live, "error", message))
        # Every request of the batch is aborted, so this only clears the in-flight batch.
        self.scheduler.complete(batch, {})

    def _fail_everything(self, exc: Exception) -> None:
        message = f"engine step failed: {exc!r}"
        log.error("%s\n%s", message, traceback.format_exc())
        self.last_error = message
        for request_id, live in list(self._live.items()):
            try:
                self.scheduler.abort(request_id)
            except Exception:  # the scheduler may be the thing that broke
                log.exception("abort of %s failed", request_id)
            self._live.pop(request_id, None)
            self.stats.record_finished("error")
            self._emit(live, self._finish_event(live, "error", message))

    def _shutdown(self) -> None:
        for live in [*self._live.values(), *self._held]:
            self._emit(live, self._finish_event(live, "abort", "server shutting down"))
        self._live.clear()
        self._held.clear()
        if self._resize is not None:
            self._resize.future.set_result(ResizeOutcome(False, "server shutting down"))
            self._resize = None
