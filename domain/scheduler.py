"""Continuous-batching scheduler with chunked prefill and preempt-and-recompute.

Each step: one decode token for every running request that has finished prefill, then
prefill chunks (oldest admitted first) in the token budget the decodes left, then FIFO
admission of waiting requests while slots, pages and budget allow. The budget has two sizes
(docs/adr/0011-mixed-step-budget.md): `max_step_tokens` for a step with no decode in it (a long
chunk: the fixed cost of a step is paid fewer times, so time to first token is short) and
`mixed_step_tokens` for a step that carries decodes (a short chunk: the running streams wait one
step between tokens, so that step must stay short). KV pages are allocated
lazily as sequences grow. When a decode cannot get a page, the newest running request is
preempted (pages + state slot freed, put back at the head of the queue; it re-prefills
prompt + output later). docs/adr/0002-pool-exhaustion.md says why.

With the prefix cache on (``SchedulerConfig.prefix_cache``, domain/prefix_store.py), admission
matches everything the request has against the radix cache: the matched pages are shared
(locked, never evicted while referenced), the linear-attention state is restored from the
snapshot at the match end, and only the rest is prefilled. A request that finishes (or is
preempted) gives its computed tokens, pages and snapshots to the cache; unreferenced cached
prefixes are evicted LRU whenever pages or snapshot slots are short.
docs/adr/0004-prefix-cache.md says why it is built this way.

The scheduler owns its PageAllocator exclusively (check_valid counts every used page).
Call order: schedule() -> executor -> complete(); abort() may come at any time.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from domain.kv_pages import PageAllocator
from domain.ports import SampledToken, SequenceWork, StepBatch
from domain.prefix_store import PrefixStore
from domain.request import Request, RequestEvent, RequestState

_RUNNING_STATES = (RequestState.PREFILLING, RequestState.DECODING)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 4
    max_step_tokens: int = 2048  # token budget of a step with no decodes (chunked prefill alone)
    # token budget of a step that carries decodes, decodes included; None = max_step_tokens (one budget)
    mixed_step_tokens: int | None = None
    page_size: int = 16
    max_context: int = 262144
    eos_token_ids: tuple[int, ...] = ()
    prefix_cache: bool = False  # radix prefix cache (ft serve --cache-type radix)
    snapshot_interval: int = 0  # tokens between kept state snapshots; a multiple of page_size (0 = none)
    linear_state: bool = True  # the model has linear-attention state: a cache hit needs a snapshot

    def __post_init__(self) -> None:
        for name in ("max_running", "max_step_tokens", "page_size", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.snapshot_interval < 0 or self.snapshot_interval % self.page_size:
            raise ValueError(f"snapshot_interval ({self.snapshot_interval}) must be a non-negative multiple "
                             f"of page_size ({self.page_size})")
        if self.max_step_tokens < self.max_running:
            # NOTE: every running request must be able to decode in the same step.
            raise ValueError(
                f"max_step_tokens ({self.max_step_tokens}) must be >= max_running ({self.max_running})"
            )
        if self.mixed_step_tokens is None:
            object.__setattr__(self, "mixed_step_tokens", self.max_step_tokens)
        if not self.max_running <= self.mixed_step_tokens <= self.max_step_tokens:
            # NOTE: the lower bound as above; a mixed step larger than a step alone would make the
            # running streams wait longer than a prefill alone does, which no setting wants.
            raise ValueError(
                f"mixed_step_tokens ({self.mixed_step_tokens}) must be in [max_running ({self.max_running}), "
                f"max_step_tokens ({self.max_step_tokens})]"
            )
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, num_state_slots: int,
                 num_snapshot_slots: int = 0) -> None:
        self.config = config
        self.num_preemptions = 0
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order, oldest first
        self._live: dict[str, Request] = {}
        self._in_flight: StepBatch | None = None
        self._in_flight_owners: dict[str, Request] = {}
        self.prefix: PrefixStore | None = None
        self._set_pools(allocator, num_state_slots, num_snapshot_slots)

    # ---- pools ---------------------------------------------------------------------------

    def _set_pools(self, allocator: PageAllocator, num_state_slots: int, num_snapshot_slots: int) -> None:
        if num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {num_state_slots}")
        if num_snapshot_slots < 0:
            raise ValueError(f"num_snapshot_slots must be >= 0, got {num_snapshot_slots}")
        self.allocator = allocator
        self.num_state_slots = num_state_slots
        self._free_slots = list(range(num_state_slots))  # min-heap: lowest slot first
        if self.prefix is not None and self.prefix.allocator is allocator \
                and self.prefix.num_snapshot_slots == num_snapshot_slots:
            return  # same KV pages and snapshot slots: the cached prefixes stay valid
        self.prefix = PrefixStore(
            allocator, self.config.page_size, enabled=self.config.prefix_cache,
            num_snapshot_slots=num_snapshot_slots, interval=self.config.snapshot_interval,
            needs_snapshots=self.config.linear_state)

    def can_replace_pools(self) -> bool:
        return self.is_idle()

    def replace_pools(self, allocator: PageAllocator, num_state_slots: int, num_snapshot_slots: int = 0) -> int:
        """New pools (idle only). The prefix cache survives only when `allocator` is the current one and
        the snapshot slot count is unchanged (the executor kept those pools and their contents);
        otherwise it is cleared. Returns the cached pages dropped (0 when kept)."""
        if not self.can_replace_pools():
            raise RuntimeError(
                f"replace_pools needs an idle scheduler ({self.num_running} running, "
                f"{self.num_waiting} waiting, batch in flight: {self._in_flight is not None})"
            )
        before = self.prefix
        self._set_pools(allocator, num_state_slots, num_snapshot_slots)
        if self.prefix is before:
            return 0
        return before.clear()

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix (idle only: their pages and snapshots may no longer hold what the
        cache says, e.g. after a failed resize rebuilt a pool); returns the cached pages dropped."""
        if not self.is_idle():
            raise RuntimeError("clear_prefix_cache needs an idle scheduler")
        return self.prefix.clear()

    @property
    def num_cached_pages(self) -> int:
        return self.prefix.num_cached_pages

    # ---- requests --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def is_idle(self) -> bool:
        return not self._running and not self._waiting and self._in_flight is None

    def get(self, request_id: str) -> Request | None:
        return self._live.get(request_id)

    @property
    def pool_tokens(self) -> int:
        """The whole KV pool, in tokens."""
        return self.allocator.num_pages * self.config.page_size

    def room(self, n_prompt: int) -> int:
        """The most tokens a request with an n_prompt-token prompt may generate on these pools: the
        model's context or the whole KV pool, whichever is smaller (< 1: the prompt alone fills it)."""
        return min(self.config.max_context, self.pool_tokens) - n_prompt

    def _max_tokens(self, request: Request) -> int:
        """The request's completion cap on these pools: a default one (max_tokens_is_default) is what fits."""
        if request.sampling.max_tokens_is_default:
            return self.room(len(request.prompt_token_ids))
        return request.sampling.max_tokens

    def check_request(self, request: Request) -> str | None:
        """None if the request can ever run on these pools; otherwise why it never can."""
        n_prompt, max_tokens = len(request.prompt_token_ids), self._max_tokens(request)
        if (
            request.state is not RequestState.WAITING
            or request.num_computed_tokens
            or request.output_token_ids
        ):
            return f"request {request.request_id} has already started ({request.state.value})"
        if n_prompt == 0:
            return "empty prompt"
        pool_tokens = self.pool_tokens
        if request.sampling.max_tokens_is_default and max_tokens < 1:
            limit, what = min(
                (self.config.max_context, "the model's maximum context"),
                (pool_tokens, f"the KV cache pool ({self.allocator.num_pages} pages)"))
            return f"prompt ({n_prompt} tokens) leaves no room for a completion in {what} of {limit} tokens"
        if n_prompt + max_tokens > self.config.max_context:
            return (
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the maximum "
                f"context of {self.config.max_context} tokens"
            )
        pages = _ceil_div(n_prompt + max_tokens, self.config.page_size)
        if pages > self.allocator.num_pages:
            return (
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs {pages} KV pages "
                f"but the whole KV cache pool has {self.allocator.num_pages} ({pool_tokens} tokens)"
            )
        if self.num_state_slots == 0:
            return "the state pool has no slots"
        return None

    def add(self, request: Request) -> None:
        """Admit a waiting request. A default max_tokens becomes what fits these pools."""
        reason = self.check_request(request)
        if reason is not None:
            raise ValueError(reason)
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already live")
        if request.sampling.max_tokens_is_default:
            request.sampling = replace(request.sampling, max_tokens=self._max_tokens(request))
        self._live[request.request_id] = request
        self._waiting.append(request)

    def abort(self, request_id: str, *, keep_prefix: bool = False) -> RequestEvent | None:
        """Ends a live request at once, freeing its pages and state slot; None if not live.
        keep_prefix=True (a stop string, a client gone) gives its computed tokens to the prefix cache
        like a finish; never for a request in the batch in flight (its step may not have run) and
        never after a failed step (default False)."""
        request = self._live.pop(request_id, None)
        if request is None:
            return None
        if request.state is RequestState.WAITING:
            self._waiting.remove(request)
        else:
            in_flight = self._in_flight_owners.get(request_id) is request
            self._running.remove(request)
            self._release(request, keep=keep_prefix and not in_flight)
        request.finish_reason = "abort"
        request.transition(RequestState.ABORTED)
        return RequestEvent(request_id, None, finished=True, finish_reason="abort")

    def force_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The live request's next ``len(token_ids)`` output tokens are these, whatever the executor
        samples (a thinking budget closing the reasoning). Each still takes one decode step like a
        sampled token: it is appended when the step that sampled in its place completes, then computed
        into the KV pages as the pending token of the next step; it counts against max_tokens (which
        may end the request mid-sequence, "length") and the stop checks apply to it. Raises ValueError
        if the request is not live, tokens are already being forced, or an id is not an int >= 0."""
        request = self._live.get(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} is not live")
        if request.forced_token_ids:
            raise ValueError(f"request {request_id!r} already has forced tokens pending")
        if not token_ids or not all(isinstance(t, int) and t >= 0 for t in token_ids):
            raise ValueError(f"forced token ids must be a non-empty list of ints >= 0, got {list(token_ids)!r}")
        request.forced_token_ids = list(token_ids)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> StepBatch | None:
        """The next step's work, or None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("complete() the batch in flight before scheduling another")
        preemptions_before = self.num_preemptions
        while True:
            decodes = self._schedule_decodes()
            budget = self.step_budget(bool(decodes)) - len(decodes)
            prefills, starved = self._schedule_prefills(budget)
            budget -= sum(len(w.token_ids) for w in prefills)
            # NOTE: no admission while a running request is short of pages or was just
            # preempted: the newcomer would take the pages they need and thrash.
            pressure = starved or self.num_preemptions != preemptions_before
            if not pressure or not self._running:
                prefills += self._admit(budget)
            if decodes or prefills or not self._running:
                break
            # Every running request is prefilling and none can get a page: deadlock. Preempting
            # the newest frees its pages for the older ones; alone, a request always fits.
            self._preempt(self._running[-1])
        if not decodes and not prefills:
            return None
        batch = StepBatch(tuple(prefills + decodes))
        self._in_flight = batch
        self._in_flight_owners = {w.request_id: self._live[w.request_id] for w in batch.works}
        return batch

    def step_budget(self, with_decodes: bool) -> int:
        """Tokens one step may hold, decodes included: mixed_step_tokens when it carries decodes,
        else max_step_tokens."""
        return self.config.mixed_step_tokens if with_decodes else self.config.max_step_tokens

    def _schedule_decodes(self) -> list[SequenceWork]:
        works = []
        for request in list(self._running):  # oldest first; preemption takes the newest
            if request.state is not RequestState.DECODING:
                continue  # prefilling, or preempted earlier in this loop
            if self._grow_or_preempt(request):
                works.append(self._work(request, 1))
        return works

    def _grow_or_preempt(self, request: Request) -> bool:
        """Pages for one more token of `request`, preempting the newest until they fit."""
        need = _ceil_div(request.num_tokens, self.config.page_size) - len(request.pages)
        if need == 0:  # NOTE: most decode steps: the last page has room (nothing to probe or allocate)
            return True
        while need > self.prefix.available_pages():
            victim = self._running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        request.pages += self.prefix.allocate(need)
        return True

    def _schedule_prefills(self, budget: int) -> tuple[list[SequenceWork], bool]:
        works, starved = [], False
        for request in self._running:
            if budget == 0:
                break
            if request.state is not RequestState.PREFILLING:
                continue
            wanted = min(request.num_pending_tokens, budget)
            coverable = (len(request.pages) + self.prefix.available_pages()) * self.config.page_size
            chunk = min(wanted, coverable - request.num_computed_tokens)
            starved |= chunk < wanted
            if chunk <= 0:
                continue
            self._grow_to(request, request.num_computed_tokens + chunk)
            works.append(self._work(request, chunk))
            budget -= chunk
        return works, starved

    def _admit(self, budget: int) -> list[SequenceWork]:
        if not self._waiting:  # NOTE: every step of a steady decode: skip the headroom count below
            return []
        works = []
        # NOTE: leave one page of headroom per decoding request, so a newcomer does not take
        # the page a decode needs next step and get preempted straight away.
        headroom = sum(1 for r in self._running if r.state is RequestState.DECODING)
        while self._waiting and budget > 0 and self.can_admit_more():
            request = self._waiting[0]
            match = self.prefix.match(request)
            start = match.num_tokens if match is not None else 0
            chunk = min(request.num_tokens - start, budget)
            need = _ceil_div(start + chunk, self.config.page_size) - (len(match.pages) if match else 0)
            if need + headroom > self.prefix.available_pages() - self.prefix.pages_locked_by(match):
                break  # FIFO: the head is never skipped
            self._waiting.popleft()
            self.prefix.attach(request, match)
            if not request.output_token_ids and not request.num_preemptions:
                request.num_cached_tokens = start
            request.state_slot = heapq.heappop(self._free_slots)
            request.transition(RequestState.PREFILLING)
            self._running.append(request)
            self._grow_to(request, start + chunk)
            works.append(self._work(request, chunk))
            budget -= chunk
        return works

    def can_admit_more(self) -> bool:
        return len(self._running) < self.config.max_running and bool(self._free_slots)

    def _grow_to(self, request: Request, num_tokens: int) -> None:
        need = _ceil_div(num_tokens, self.config.page_size) - len(request.pages)
        if need > 0:
            request.pages += self.prefix.allocate(need)

    def _work(self, request: Request, num_tokens: int) -> SequenceWork:
        start = request.num_computed_tokens
        sample = start + num_tokens == request.num_tokens
        restore, request.restore_snapshot = request.restore_snapshot, None
        return SequenceWork(
            request_id=request.request_id,
            token_ids=request.token_ids_between(start, start + num_tokens),
            start_position=start,
            page_ids=tuple(request.pages),
            state_slot=request.state_slot,
            sample=sample,
            sampling=request.sampling,
            output_index=len(request.output_token_ids),
            restore_from=restore,
            snapshots=self.prefix.take_snapshots(request, start, start + num_tokens),
        )

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        # NOTE: what it computed goes to the cache (evictable, so the pressure is relieved all the
        # same); re-admitted, it resumes from there unless the pages were needed meanwhile.
        self._release(request, keep=True)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.transition(RequestState.WAITING)
        self._waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request, *, keep: bool) -> None:
        self.prefix.release(request, keep=keep)
        heapq.heappush(self._free_slots, request.state_slot)
        request.state_slot = None

    # ---- results ---------------------------------------------------------------------------

    def complete(self, batch: StepBatch, sampled: Mapping[str, SampledToken]) -> list[RequestEvent]:
        """Applies the executor's results; requests aborted while it ran are skipped."""
        if batch is not self._in_flight:
            raise ValueError("complete() got a batch that is not the one in flight")
        current = [
            w for w in batch.works if self._live.get(w.request_id) is self._in_flight_owners[w.request_id]
        ]
        missing = [w.request_id for w in current if w.sample and w.request_id not in sampled]
        if missing:
            raise ValueError(f"executor returned no sampled token for {missing}")
        self._in_flight, self._in_flight_owners = None, {}
        events = []
        for work in current:
            request = self._live[work.request_id]
            request.num_computed_tokens = work.end_position
            self.prefix.commit(request)
            if work.sample:
                events.append(self._append_token(request, sampled[work.request_id]))
        return events

    def _append_token(self, request: Request, token: SampledToken) -> RequestEvent:
        forced = None
        if request.forced_token_ids:  # NOTE: the model's sample is dropped; the forced token is "certain"
            forced = request.forced_token_ids.pop(0)
            token = SampledToken(token.request_id, forced, 0.0 if token.logprob is not None else None)
        request.output_token_ids.append(token.token_id)
        if request.state is RequestState.PREFILLING:
            request.transition(RequestState.DECODING)
        reason = self._finish_reason(request, token.token_id)
        if reason is not None:
            self._running.remove(request)
            self._release(request, keep=True)
            del self._live[request.request_id]
            request.finish_reason = reason
            request.transition(RequestState.FINISHED)
        return RequestEvent(
            request.request_id,
            token.token_id,
            finished=reason is not None,
            finish_reason=reason,
            logprob=token.logprob,
            top_logprobs=token.top_logprobs,
            forced=forced is not None,
        )

    def _finish_reason(self, request: Request, token_id: int) -> str | None:
        sampling = request.sampling
        if token_id in sampling.stop_token_ids:
            return "stop"
        if not sampling.ignore_eos and token_id in self.config.eos_token_ids:
            return "stop"
        if len(request.output_token_ids) >= sampling.max_tokens:
            return "length"
        return None

    # ---- invariants ----------------------------------------------------------------------

    def check_valid(self) -> None:
        page_size = self.config.page_size
        assert len(self._running) <= self.config.max_running, "more running than max_running"
        ids = [r.request_id for r in self._running] + [r.request_id for r in self._waiting]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert set(ids) == set(self._live), "live requests and queues disagree"
        in_flight_end = {
            w.request_id: w.end_position for w in (self._in_flight.works if self._in_flight else ())
        }
        for request in self._waiting:
            assert request.state is RequestState.WAITING, request
            request.check_valid()
        owned_pages: list[int] = []
        owned_slots: list[int] = []
        for request in self._running:
            assert request.state in _RUNNING_STATES, request
            request.check_valid()
            target = in_flight_end.get(request.request_id, request.num_computed_tokens)
            assert len(request.pages) == _ceil_div(target, page_size), f"{request.request_id}: pages not lazy"
            if request.request_id not in in_flight_end:
                if request.state is RequestState.DECODING:
                    assert request.num_computed_tokens == request.num_tokens - 1, request
                else:
                    assert request.num_computed_tokens < request.num_tokens, request
            owned_pages += request.pages
            owned_slots.append(request.state_slot)
        assert all(0 <= p < self.allocator.num_pages for p in owned_pages), "page out of range"
        # NOTE: shared (cached) pages may appear in several requests; PrefixStore checks ownership:
        # own pages distinct, own + cached == allocator used, snapshot slots likewise.
        self.prefix.check_valid(self._running)
        assert len(owned_slots) == len(set(owned_slots)), "a state slot is owned twice"
        assert not set(owned_slots) & set(self._free_slots), "a state slot is both free and owned"
        assert sorted(owned_slots + self._free_slots) == list(range(self.num_state_slots)), (
            "state slot leaked"
        )
