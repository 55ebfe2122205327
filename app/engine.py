"""The engine loop: one background thread drives scheduler.schedule() -> executor.execute() ->
scheduler.complete() and streams each request's text to its asyncio queue.

Threading contract: the scheduler, the allocator and the executor are touched ONLY by the
engine thread. HTTP handlers talk to it through a command queue (submit, abort, resize) and
read a pools snapshot that the thread republishes after every iteration. Events reach a
handler's event loop through ``loop.call_soon_threadsafe``.

Collaborators: ``app.streams`` (the live table, text events, outbox), ``app.resize_coordinator``
(live resize) and ``app.pool_snapshot`` (the pools snapshot and per-step statistics).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from app.pool_snapshot import PoolPublisher, StepRecord
from app.reasoning import ThinkingPlan
from app.resize_coordinator import ResizeCoordinator, ResizeOutcome, plan_live_resize
from app.self_check import first_failure
from app.stats import ServingStats
from app.streams import LiveStream, RequestStreams
from domain.arrival_window import ArrivalWindow
from domain.budget import GpuBudget, PlanRefusal, PoolPlan
from domain.kv_pages import PageAllocator
from domain.model_spec import ModelSpec
from domain.ports import ModelExecutor, RoutingReplayControl, SampledToken, Tokenizer
from domain.request import Request, RequestEvent, SamplingParams
from domain.resize import ResizePlan
from domain.scheduler import Scheduler

log = logging.getLogger("fluxtide.engine")
SHUTTING_DOWN = "server shutting down"


class RequestRejected(ValueError):
    """The scheduler can never admit this request (e.g. it needs more KV than the pool holds)."""


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
        routing_replay: RoutingReplayControl | None = None,
        arrival_window: ArrivalWindow | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.spec = spec
        self.budget = budget
        self.plan = plan
        self.stats = stats
        self.debug = debug
        self.routing_replay = routing_replay  # --routing-replay (benchmark-only); None: natural routing
        # --arrival-window-ms: an idle engine's first step waits for the rest of a burst (domain/arrival_window.py)
        self.arrival_window = arrival_window or ArrivalWindow(0.0)
        self.eos_token_ids = frozenset(eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        self._allocator = allocator
        self._clock = clock
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # NOTE: _command and the shutdown's last drain take this lock: a command sent once the engine thread has
        # answered its last ones (`_closed`) is answered where it is sent, never left in a queue nobody reads
        self._command_lock = threading.Lock()
        self._closed = False
        self._wake = threading.Event()
        self._streams = RequestStreams(scheduler=scheduler, stats=stats, eos_token_ids=self.eos_token_ids, clock=clock)
        self._resizer = ResizeCoordinator(
            scheduler=scheduler, executor=executor, clock=clock, send=self._command, admit=self._admit,
            install=self._install_pools, report_error=self._report_error, republish=self._republish,
            verify=self.verify)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._last_call_end: float | None = None  # engine thread: when the last model call returned
        self._stopping = False
        self.last_error: str | None = None
        # Set when a self-check failed: the engine cannot serve (health 503, generation 503).
        self.broken: str | None = None
        self._publisher = PoolPublisher(stats, executor)
        # ModelExecutor's optional launch hook: the previous step's text work (detokenization, stream
        # events, statistics, the pools snapshot) runs and its events go to the HTTP side while the device
        # computes the next step (see domain.ports.ModelExecutor and docs/adr/0019-deferred-step-work.md).
        self._launch_hook = hasattr(executor, "on_launched")
        self._hook_called = False
        self._hook_error: Exception | None = None  # raised by _step once execute() has returned
        self._deferred: list[RequestEvent] = []  # the last step's events of streams that do not steer
        self._step_record: StepRecord | None = None  # the last step's statistics, recorded with its events
        self._stale_pools = False  # a step ran since the pools snapshot was last published
        if self._launch_hook:
            executor.on_launched = self._launched
        # ModelExecutor's optional release: what the executor keeps of a request between steps (a layered prefill
        # chunk part-way, ADR 0024) goes as soon as the engine ends that request early, not when its slot is reused
        self._executor_release: Callable[[str], None] | None = getattr(executor, "release", None)
        self._publish_pools()

    @property
    def phase(self) -> str:
        """"ready" | "draining" | "rebuilding" | "error" (the live-resize phase, or "error" once a
        self-check after a failure found the engine unable to serve)."""
        return "error" if self.broken is not None else self._resizer.phase

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

    def executor_info(self) -> dict:
        """Which executor serves and the modes that change its numbers (in /v1/stats, so every `ft bench` record
        carries them): its class, whether the Triton prefill runs (`prefill_kernels`: --prefill-kernels triton, or
        auto resolved to it), e4m3 prefill activations (--prefill-fp8-activations, ADR 0018) and the short steps'
        MoE graphs (--prefill-graphs). Read by
        attribute: an executor without them has them off. Where the container attached its prefill choice
        (domain.prefill_choice.PrefillChoice), also the setting asked for and the reason for what it resolved to
        (`prefill_kernels_setting`, `prefill_kernels_reason`; ADR 0020), and where the fast path measured it on a
        CUDA device, how fast misses land from the host bank (`expert_gather`: DeviceExpertPool.gather_rate); on the
        fast path, the longest prompt chunk a step runs as decode replays (`short_prompt_replays`,
        FLUXTIDE_SHORT_PROMPT_REPLAYS; 0: none; ADR 0026), and the per mille of decode misses its host lane computes
        on the CPU (`host_experts`: --host-experts, "auto" resolved; 0: off, or turned off after a failure; ADR 0030)."""
        inner = getattr(self.executor, "executor", self.executor)  # StepLeader (expert parallelism) wraps rank 0's
        info = {"kind": type(inner).__name__, "prefill_kernels": bool(getattr(inner, "prefill_kernels", False)),
                "prefill_fp8_activations": bool(getattr(inner, "fp8_activations", False)),
                "prefill_graphs": bool(getattr(inner, "prefill_graphs", False))}
        choice = getattr(inner, "prefill_choice", None)
        if choice is not None:
            info.update(prefill_kernels_setting=choice.requested, prefill_kernels_reason=choice.reason)
        limit = getattr(inner, "short_prompt_limit", None)  # the fast path: short prompt chunks as decode replays
        if limit is not None:
            info["short_prompt_replays"] = limit()
        share = getattr(inner, "host_share", None)  # the fast path: its host lane's share (ADR 0030)
        if share is not None:
            info["host_experts"] = share
        gather = getattr(inner, "expert_gather", None)  # the fast path on CUDA: how fast misses land (GB/s)
        if gather is not None:
            info["expert_gather"] = dict(gather)
        return info

    def routing(self) -> dict:
        """How tokens are routed: {"mode": "natural"}, or the replay's description with "active"."""
        return {"mode": "natural"} if self.routing_replay is None else self.routing_replay.describe()

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
        """Read-only probe for resize: the plan it would apply, or why it would refuse (state slots past the
        running limit set at start-up included: they could never be used)."""
        return plan_live_resize(self.spec, self.budget, self.plan, kv_tokens=kv_tokens, expert_slots=expert_slots,
                                state_slots=state_slots, max_running=self.scheduler.config.max_running)

    def submit(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
               stop: Sequence[str] = (), thinking: ThinkingPlan | None = None,
               relabel_stop: bool = False) -> asyncio.Queue:
        """Queue a request; its StreamEvents arrive on the returned queue (last one has finish_reason).
        ``thinking``: count the output's reasoning tokens and enforce its budget (app.reasoning).
        ``relabel_stop``: the caller parses tool calls, so a "stop" may be "tool_calls" to its client; such a last
        event carries a tally the caller settles with the reason it gave (StreamEvent.settle, ft_requests_total)."""
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=sampling,
                          arrival_time=self._clock())
        reason = self.scheduler.check_request(request)
        if reason is not None:
            raise RequestRejected(reason)
        live = LiveStream.start(request, self.tokenizer, stop, thinking, relabel_stop)
        self._command(("submit", live))
        return live.events

    def abort(self, request_id: str) -> None:
        """Abort a request (client went away); its pages and state slot are freed next iteration."""
        self._command(("abort", request_id))

    def resize(self, *, kv_tokens: int | str | None = None, expert_slots: int | str | None = None,
               state_slots: int | None = None, wait_s: float = 60.0) -> ResizeOutcome:
        """Blocking (call from a worker thread). Validates the plan BEFORE anything is freed,
        holds new admissions, waits up to wait_s for in-flight requests, then swaps pools."""
        return self._resizer.resize(
            lambda: self.can_resize(kv_tokens=kv_tokens, expert_slots=expert_slots, state_slots=state_slots),
            wait_s,
        )

    def pools(self) -> dict:
        """Latest pool snapshot (published by the engine thread)."""
        return self._publisher.latest

    # -- engine thread -------------------------------------------------------------------------
    def _command(self, command: tuple) -> None:
        with self._command_lock:
            if self._closed:
                self._answer_closed(command)
                return
            self._commands.put(command)
        self._wake.set()

    def _answer_closed(self, command: tuple) -> None:
        """A command for an engine whose thread has ended (the server shutting down): a submission ends at once
        with the shutdown's abort, a resize is answered not applied. Under _command_lock (the thread is gone, so
        the streams are this caller's alone)."""
        kind, payload = command
        if kind == "submit":
            self._streams.finish(payload, "abort", SHUTTING_DOWN)
            self._streams.flush()
        elif kind == "resize":
            payload.future.set_result(ResizeOutcome(False, SHUTTING_DOWN))

    def _run(self) -> None:
        was_idle = False
        while not self._stopping:
            self._wake.clear()
            batch = None
            try:
                if was_idle and not self._commands.empty():
                    self.stats.record_burst(self._await_burst())  # the rest of a burst joins the first step
                if not self._commands.empty():  # an abort or a resize acts on what the last step's events say
                    self._deliver()
                self._drain_commands()
                if self._resizer.active:  # a rebuild may take seconds: the last step's events go out first
                    self._deliver()
                self._resizer.step()
                batch = self.scheduler.schedule()
                if batch is None:
                    self._last_call_end = None  # an idle pause is not host overhead
                    self._republish()  # the last step's work first: the idle self-check sees no finished stream
                    if not was_idle:
                        self._on_idle()
                        was_idle = True
                    self._wake.wait(0.05 if self._resizer.active else 1.0)
                    continue
                was_idle = False
                self._step(batch)
                # NOTE: the step's text work and events wait until the next step is launched (or the loop
                # idles): doing them now would put them, and the HTTP thread they wake, between this
                # step's result and the next launch (docs/adr/0019-deferred-step-work.md).
            except Exception as exc:  # NOTE: the loop must survive anything; requests get the error
                self._deliver_after_failure()
                self._fail_everything(exc)
                self._release_in_flight(batch)
                self.verify()
                self._republish()
        self._deliver_after_failure()
        self._shutdown()

    def _await_burst(self) -> int:
        """After idling: wait while submissions keep arriving (ArrivalWindow: until they are quiet for its quiet_s,
        at most its max_s after the first), so a burst that lands over a few milliseconds is admitted to one step.
        Returns the commands queued when the window closed.
        NOTE: only the engine thread takes from the command queue, so its size only grows here."""
        # NOTE: time.monotonic, not the injected clock: the wait below is in real time (a test's frozen clock
        # would never let the window end)
        first = last = time.monotonic()
        seen = self._commands.qsize()
        while not self._stopping and (left := self.arrival_window.remaining(time.monotonic(), first, last)) > 0:
            self._wake.clear()
            if self._commands.qsize() == seen:  # NOTE: after clear(): a submission now sets the event again
                self._wake.wait(left)
            if (size := self._commands.qsize()) != seen:
                seen, last = size, time.monotonic()
        return seen

    def _drain_commands(self) -> None:
        # NOTE: empty() first: the engine thread is the only consumer, and an exception per step is not free.
        while not self._commands.empty():
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                if self._resizer.active:
                    self._resizer.hold(payload)
                else:
                    self._admit(payload)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "resize":
                self._resizer.begin(payload)

    def _admit(self, live: LiveStream) -> None:
        if self.phase == "error":  # a self-check failed: nothing may run on these pools
            self._streams.reject(live, f"engine is not running: {self.last_error}", status=503)
            return
        try:
            self.scheduler.add(live.request)
        except ValueError as exc:  # pools shrank (live resize) since the handler's probe
            self._streams.reject(live, f"request can not be served on the resized pools: {exc}")
            return
        self._streams.open(live)
        self.stats.record_admitted(len(live.request.prompt_token_ids))

    def _abort(self, request_id: str) -> None:
        if not self._resizer.drop_held(request_id):
            self._streams.abort(request_id)
            self._released((request_id,))

    def _step(self, batch) -> None:
        if not self._launch_hook:
            self._deliver()  # the executor has no launch hook: the last step's work is done before this one
        self._hook_called = False
        started = self._clock()
        host = None if self._last_call_end is None else started - self._last_call_end
        self._last_call_end = None
        try:
            sampled: dict[str, SampledToken] = self.executor.execute(batch)
        except Exception as exc:  # NOTE: fail this batch's requests, keep serving the rest
            self._deliver()  # the hook may not have run: the last step's events before this one's failures
            self._raise_hook_error()
            self._fail_batch(batch, exc)
            self.verify()
            return
        # An executor with the hook that did not call it (it failed before launching... or broke the
        # contract, below) must not keep the previous step's events back for another step.
        self._deliver()
        self._raise_hook_error()
        self._last_call_end = ended = self._clock()
        if self._launch_hook and not self._hook_called:
            # NOTE: against the port's contract (e.g. a wrapper that took the hook for itself): every token
            # would reach its client a step late. Hand events over before each step from now on.
            log.warning("executor %s declares on_launched but did not call it; stream events now go out "
                        "before each step", type(self.executor).__name__)
            self._launch_hook = False
        # the counters are read now (host values after the step's read-back); they are recorded later
        self._step_record = self._publisher.measure_step(batch, ended - started, host)
        self._stale_pools = True
        faulty = {rid: token.error for rid, token in sampled.items() if getattr(token, "error", None)}
        for request_id, error in faulty.items():  # NOTE: confined to that request: abort it alone
            self._streams.fail_request(request_id, self._record_failure(f"request {request_id}: {error}"))
        if faulty:
            self._released(faulty)
            sampled = {rid: token for rid, token in sampled.items() if rid not in faulty}
        for event in self.scheduler.complete(batch, sampled):
            # NOTE: a stream whose text can change what is scheduled next (a stop string ends it, a thinking
            # budget forces tokens) is handled now; every other stream's text work waits for the next launch.
            if self._streams.steers(event.request_id):
                self._streams.on_event(event)
            else:
                self._deferred.append(event)

    # -- resize hooks (engine thread) ----------------------------------------------------------
    def _install_pools(self, target: PoolPlan) -> str:
        """The executor already rebuilt its pools for `target`; adopt them on this side. The prefix cache
        survives only when the KV and snapshot pools kept their sizes (the executor kept them and their
        contents); otherwise it is cleared. Returns what happened to it, for the resize's message."""
        kept = (target.kv_pages, target.page_size, target.snapshot_slots) == (
            self.plan.kv_pages, self.plan.page_size, self.plan.snapshot_slots)
        allocator = self._allocator if kept else PageAllocator(target.kv_pages)
        dropped = self.scheduler.replace_pools(allocator, target.state_slots, target.snapshot_slots)
        # NOTE: the expert slots may have crossed the model's experts: short prompts beside decodes are layered where
        # the plan leaves experts out (--layer-short-prompts auto, ADR 0024)
        self.scheduler.set_partial_residency(target.partial_residency)
        self._allocator = allocator
        self.plan = target
        self._publisher.reset_expert_counters()
        if kept:
            return f"prefix cache kept ({self.scheduler.num_cached_pages} cached pages)"
        # NOTE: logged within the resize's own line (app.resize_coordinator), not on a line of its own
        return f"prefix cache cleared ({dropped} cached pages dropped: the KV or snapshot pool was rebuilt)"

    def _report_error(self, message: str) -> None:
        self.last_error = message

    def verify(self) -> str | None:
        """Engine-thread only. Self-check after a failed step or resize: every manager's check_valid
        and the executor's (its pools against the plan). A failure marks the engine broken (it
        answers 503 and /health says why) and is returned; None when it can serve."""
        problem = first_failure([
            ("scheduler", self.scheduler.check_valid),
            ("KV page allocator", self._allocator.check_valid),
            ("executor", getattr(self.executor, "check_valid", None)),
            ("request streams", self._streams.check_valid),
            ("resize coordinator", self._resizer.check_valid),
        ])
        if problem is None and self._allocator.num_pages != self.plan.kv_pages:
            problem = f"KV allocator has {self._allocator.num_pages} pages, the plan {self.plan.kv_pages}"
        if problem is not None:
            log.error("engine cannot serve: %s", problem)
            self.broken = self.last_error = problem
        return problem

    def _release_in_flight(self, batch) -> None:
        """After a failure inside the loop: every request was aborted, so completing the batch
        with nothing only clears it (else the next schedule() refuses forever)."""
        if batch is None:
            return
        try:
            self.scheduler.complete(batch, {})
        except ValueError:  # it was no longer in flight
            pass

    # -- housekeeping ------------------------------------------------------------------------
    def _on_idle(self) -> None:
        if self.debug:
            self.check_valid()

    def check_valid(self) -> None:
        """Engine-thread only (or when the thread is stopped)."""
        self.scheduler.check_valid()
        self._allocator.check_valid()
        self.stats.check_valid()
        self._streams.check_valid()
        self._resizer.check_valid()
        self._publisher.check_valid()
        if self.scheduler.is_idle():  # every used page is the prefix cache's
            assert self._allocator.num_free + self.scheduler.num_cached_pages == self._allocator.num_pages, (
                "idle engine holds KV pages outside the prefix cache")

    def _republish(self) -> None:
        self._stale_pools = True
        self._deliver()

    def _launched(self) -> None:
        """The executor's on_launched hook (engine thread, inside execute(), while the device computes)."""
        self._hook_called = True
        try:
            self._deliver()
        except Exception as exc:  # NOTE: the port's hook must not raise: our own failure, re-raised after the step
            self._hook_error = exc

    def _raise_hook_error(self) -> None:
        error, self._hook_error = self._hook_error, None
        if error is not None:
            raise error

    def _deliver(self) -> None:
        """Engine thread (also the executor's ``on_launched`` hook, inside execute()): the last step's
        deferred work, in order: its stream events (detokenization, stop strings, text events), its
        statistics, then the pools snapshot (when a step ran or events were emitted since it was last
        published: a client that sees its finish sees its pages freed in /v1/stats) and the outbox
        handed to the handlers' loops."""
        events, self._deferred = self._deferred, []
        for event in events:
            self._streams.on_event(event)
        record, self._step_record = self._step_record, None
        if record is not None:
            self._publisher.record(record)
        if self._stale_pools or self._streams.has_unpublished():
            self._stale_pools = False
            self._publish_pools()
        self._streams.flush()

    def _deliver_after_failure(self) -> None:
        """Before the loop fails every stream or shuts down: finishes already decided still reach their
        clients as themselves; a failure doing so is logged, not raised (the caller is handling one)."""
        try:
            self._deliver()
        except Exception:
            log.exception("handing over the last step's events failed")

    def _publish_pools(self) -> None:
        self._streams.mark_published()
        self._publisher.publish(
            scheduler=self.scheduler,
            allocator=self._allocator,
            plan=self.plan,
            state_slots_used=self._streams.state_slots_used(),
            held=len(self._resizer.held),
            phase=self.phase,
        )

    def _fail_batch(self, batch, exc: Exception) -> None:
        self._streams.fail_batch(batch, self._record_failure(f"model step failed: {exc!r}"))
        self._released([w.request_id for w in batch.works])

    def _fail_everything(self, exc: Exception) -> None:
        failed = list(self._streams.live)
        self._streams.fail_all(self._record_failure(f"engine step failed: {exc!r}"))
        self._released(failed)

    def _released(self, request_ids) -> None:
        """The executor drops what it keeps of requests the engine ended early (ModelExecutor.release, optional).
        NOTE: called on failure paths: a release that raises is logged, and the self-check that follows a failure
        (verify) decides whether the executor can still serve."""
        release = self._executor_release
        if release is None:
            return
        for request_id in request_ids:
            try:
                release(request_id)
            except Exception:
                log.exception("the executor failed to release request %s", request_id)

    def _record_failure(self, message: str) -> str:
        log.error("%s\n%s", message, traceback.format_exc())
        self.last_error = message
        return message

    def _shutdown(self) -> None:
        # NOTE: commands still queued are answered too: a submission the loop never drained (sent while it was
        # stopping, or waiting out the arrival window) would leave its stream open until uvicorn cancels it; and
        # from here on _command answers new ones itself (_closed, under the same lock)
        with self._command_lock:
            self._closed = True
            queued = []
            while not self._commands.empty():
                command = self._commands.get_nowait()
                if command[0] == "submit":  # ended with the live and held streams, in one outbox
                    queued.append(command[1])
                else:
                    self._answer_closed(command)
            self._streams.close_all(held=[*self._resizer.take_held(), *queued], error=SHUTTING_DOWN)
            self._resizer.cancel(SHUTTING_DOWN)
            self._streams.flush()
