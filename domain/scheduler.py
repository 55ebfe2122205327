"""Continuous-batching scheduler with chunked prefill and preempt-and-recompute.

Each step: one decode token for every running request that has finished prefill, then
prefill chunks (oldest admitted first) in the token budget the decodes left, then FIFO
admission of waiting requests while slots, pages and budget allow. The budget has two sizes
(docs/adr/0011-mixed-step-budget.md): `max_step_tokens` for a step with no decode in it (a long
chunk: the fixed cost of a step is paid fewer times, so time to first token is short) and
`mixed_step_tokens` for a step that carries decodes (a short chunk: the running streams wait one
step between tokens, so that step must stay short). With layered prefill on (docs/adr/0024-layered-prefill.md), a step that carries
decodes takes a prompt longer than its budget as one chunk of up to `max_step_tokens` and runs it a layer
group per step (SequenceWork.layers): as many layers as the budget's token x layers allow, so every step
stays as short as a mixed one while the chunk's experts stream once, not once per short chunk; at most one
chunk is part-way at a time, and once no decode runs its remaining layers go in one step. With `layer_short_prompts` on
a plan that does not hold every expert (ADR 0024 "A0", session 28), every prompt chunk beside decodes is layered,
however short (an ordinary mixed step there copies every non-resident expert), and no other prompt takes a chunk
beside decodes while one is part-way. KV pages are allocated
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
    layered_prefill: bool = False  # steps with decodes run a long chunk a layer group at a time (ADR 0024)
    num_layers: int = 1  # the model's layers: what a layer group divides
    # the budget, decodes included, that sizes a layer group beside decodes (ADR 0024, session 25); None =
    # mixed_step_tokens. mixed_step_tokens still decides which prompts are layered (those longer than it)
    layer_group_tokens: int | None = None
    # ADR 0024 "A0" (session 28; `ft serve --layer-short-prompts auto`), with layered_prefill: where the plan does not
    # hold every expert, a step that carries decodes layers every prompt chunk, whatever its length, and runs no other
    # prompt's chunk while one is part-way. Inert on a plan that holds every expert
    layer_short_prompts: bool = False
    # the plan does not hold every expert (expert slots < the model's experts): what layer_short_prompts acts on; the
    # start's value, Scheduler.set_partial_residency changes it live (a resize)
    partial_residency: bool = False

    def __post_init__(self) -> None:
        for name in ("max_running", "max_step_tokens", "page_size", "max_context", "num_layers"):
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
        if self.layer_group_tokens is None:
            object.__setattr__(self, "layer_group_tokens", self.mixed_step_tokens)
        # NOTE: the lower bound as above (every running request decodes beside a mixed chunk or a layer group); a
        # mixed step larger than a step alone would make the running streams wait longer than a prefill alone does,
        # which no setting wants. The mixed budget first: a bad one is named even where the group took its value.
        for name in ("mixed_step_tokens", "layer_group_tokens"):
            if not self.max_running <= getattr(self, name) <= self.max_step_tokens:
                raise ValueError(f"{name} ({getattr(self, name)}) must be in [max_running ({self.max_running}), "
                                 f"max_step_tokens ({self.max_step_tokens})]")
        if self.layer_short_prompts and not self.layered_prefill:
            raise ValueError("layer_short_prompts runs prompts as layer groups: it needs layered_prefill")
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
        self._layered: Request | None = None  # the request whose chunk is part-way through its layer groups
        self.num_layer_groups = 0  # layer-group works scheduled (cumulative, for the stats)
        self._partial_residency = config.partial_residency
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
    def partial_residency(self) -> bool:
        """Whether the plan leaves experts out (expert slots < the model's experts): SchedulerConfig's at start, then
        what set_partial_residency last said."""
        return self._partial_residency

    def set_partial_residency(self, partial: bool) -> None:
        """The plan now does (True) or does not (False) leave experts out; the server says so after a live resize.
        Any time: it moves only the decisions of later steps (a chunk part-way finishes its layer groups)."""
        if not isinstance(partial, bool):
            raise ValueError(f"partial residency must be a bool, got {partial!r}")
        self._partial_residency = partial

    @property
    def layers_every_chunk(self) -> bool:
        """ADR 0024 "A0": beside decodes every prompt chunk is layered, and no other prompt takes a chunk while one
        is part-way (layer_short_prompts, on a plan that leaves experts out)."""
        return self.config.layer_short_prompts and self._partial_residency

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
            prefills = self._schedule_layered(budget, bool(decodes))
            budget -= sum(self._charge(w) for w in prefills)
            more, starved = self._schedule_prefills(budget, bool(decodes))
            prefills += more
            budget -= sum(self._charge(w) for w in more)
            # NOTE: no admission while a running request is short of pages or was just
            # preempted: the newcomer would take the pages they need and thrash.
            pressure = starved or self.num_preemptions != preemptions_before
            if not pressure or not self._running:
                prefills += self._admit(budget, bool(decodes))
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

    # ---- layered prefill (docs/adr/0024-layered-prefill.md) ------------------------------------------
    def _layered_chunk(self, pending: int, budget: int, with_decodes: bool) -> int:
        """Tokens of a layered chunk for a prompt with `pending` tokens to go, or 0 when it should take an
        ordinary chunk: layered prefill is on, the step carries decodes, the budget would cut the prompt (or
        _layers_short_chunk layers it all the same), and no other chunk is part-way. At most max_step_tokens (the
        activations reserved for one step), and at most what lets one layer of it fit the budget."""
        if not (self.config.layered_prefill and with_decodes and self._layered is None and 0 < budget):
            return 0
        if not (budget < pending or self._layers_short_chunk(min(pending, budget))):
            return 0
        # NOTE: 0 (an ordinary chunk; under A0 none: it waits) where a layer-group budget below the mixed one leaves
        # no group room
        return max(0, min(pending, self.config.max_step_tokens, self._group_budget(budget) * self.config.num_layers))

    def _layers_short_chunk(self, chunk: int) -> bool:
        """Whether a chunk beside decodes that the budget would take whole is layered all the same: under A0
        (layers_every_chunk), any. A hook: the simulator's what-if policies (simulator/layering_policy.py) layer
        only the chunks whose step would stream experts."""
        return self.layers_every_chunk

    def _only_layered_chunks(self, with_decodes: bool) -> bool:
        """A0 beside decodes: no ordinary prompt chunk runs, and none at all while a chunk is part-way.
        NOTE: an ordinary chunk there, however short, copies every non-resident expert in its one step (a 36-token
        prompt beside 3 decodes: a 262-273 ms step on the H100 at 24 GiB, 2026-12-05), and one beside a part-way
        chunk would take the leftover of a group's budget (a 200-token chunk's group charges ~20 tokens) and copy
        the whole model again; the prompt waits for the part-way chunk's last group instead."""
        return with_decodes and self.layers_every_chunk

    def _group_budget(self, budget: int, with_decodes: bool = True) -> int:
        """The token x layers budget of a layer group beside decodes, from `budget`, the step's mixed budget left:
        what layer_group_tokens adds over (or takes from) mixed_step_tokens, while mixed_step_tokens keeps deciding
        which prompts are layered. Without decodes the budget itself (a step alone takes every layer left)."""
        return budget + self.config.layer_group_tokens - self.config.mixed_step_tokens if with_decodes else budget

    def _schedule_layered(self, budget: int, with_decodes: bool) -> list[SequenceWork]:
        """The next layer group of the chunk part-way, if any (its request may have been preempted by the
        decodes above: then there is none)."""
        request = self._layered
        # NOTE: not even one layer fits beside this many decodes (a budget far smaller than the chunk's
        # tokens / layers): the chunk waits, as any prefill does on an empty budget
        group_budget = self._group_budget(budget, with_decodes)
        if request is None or group_budget * self.config.num_layers < len(request.layer_chunk.token_ids):
            return []
        return [self._group(request, group_budget, with_decodes)]

    def _first_group(self, request: Request, chunk: int, budget: int) -> SequenceWork:
        request.layer_chunk, request.layers_done = self._work(request, chunk), 0
        self._layered = request
        return self._group(request, self._group_budget(budget), True)

    def _group(self, request: Request, budget: int, with_decodes: bool) -> SequenceWork:
        """The request's next layer group: beside decodes, as many layers as the budget's token x layers
        allow for a chunk of max_step_tokens (at least one); alone, every layer left.
        NOTE: sized for the largest chunk even when this one is shorter: a layer also costs what does not
        shrink with its tokens (the copies of its non-resident experts, ~7 ms a layer at 24 GiB on the H200;
        its launches), so a short chunk's group of many layers made the longest steps (a 9,000-token
        prompt's 808-token tail: 25 layers, 259 ms gaps predicted by `simulator mixed`, against 57 ms)."""
        chunk, first, layers = request.layer_chunk, request.layers_done, self.config.num_layers
        size = max(len(chunk.token_ids), self.config.max_step_tokens)
        k = max(1, budget * layers // size) if with_decodes else layers
        end = min(layers, first + k)
        self.num_layer_groups += 1
        return replace(chunk, layers=(first, end), sample=chunk.sample and end == layers,
                       restore_from=chunk.restore_from if first == 0 else None)

    def _charge(self, work: SequenceWork) -> int:
        """The budget a work takes: its tokens, or a layer group's share of its chunk's token x layers."""
        if work.layers is None:
            return len(work.token_ids)
        first, end = work.layers
        return _ceil_div(len(work.token_ids) * (end - first), self.config.num_layers)

    # ---- prefill chunks ------------------------------------------------------------------------------
    def _schedule_prefills(self, budget: int, with_decodes: bool) -> tuple[list[SequenceWork], bool]:
        works, starved = [], False
        only_layered = self._only_layered_chunks(with_decodes)
        for request in self._running:
            if budget <= 0 or (only_layered and self._layered is not None):
                break
            if request.state is not RequestState.PREFILLING or request is self._layered:
                continue
            layered = self._layered_chunk(request.num_pending_tokens, budget, with_decodes)
            if only_layered and not layered:
                continue
            wanted = layered or min(request.num_pending_tokens, budget)
            coverable = (len(request.pages) + self.prefix.available_pages()) * self.config.page_size
            chunk = min(wanted, coverable - request.num_computed_tokens)
            starved |= chunk < min(request.num_pending_tokens, budget)
            if chunk <= 0:
                continue
            self._grow_to(request, request.num_computed_tokens + chunk)
            work = self._first_group(request, chunk, budget) if self._takes_layers(chunk, budget, layered) \
                else self._work(request, chunk)
            works.append(work)
            budget -= self._charge(work)
        return works, starved

    def _admit(self, budget: int, with_decodes: bool = False) -> list[SequenceWork]:
        if not self._waiting:  # NOTE: every step of a steady decode: skip the headroom count below
            return []
        works = []
        # NOTE: leave one page of headroom per decoding request, so a newcomer does not take
        # the page a decode needs next step and get preempted straight away.
        headroom = sum(1 for r in self._running if r.state is RequestState.DECODING)
        only_layered = self._only_layered_chunks(with_decodes)
        while self._waiting and budget > 0 and self.can_admit_more():
            if only_layered and self._layered is not None:
                break  # A0: the head waits for the part-way chunk's last group (FIFO: so does everyone behind it)
            request = self._waiting[0]
            match = self.prefix.match(request)
            start = match.num_tokens if match is not None else 0
            matched = len(match.pages) if match else 0
            room = self.prefix.available_pages() - self.prefix.pages_locked_by(match) - headroom
            chunk = layered = 0
            layered_chunk = self._layered_chunk(request.num_tokens - start, budget, with_decodes)
            # NOTE: a layered chunk when it applies and its pages fit, else the budget's ordinary chunk; under A0 beside
            # decodes never an ordinary one: the layered chunk, cut to the pages it may take
            options = ((min(layered_chunk, (room + matched) * self.config.page_size - start),) if only_layered
                       else (layered_chunk, min(request.num_tokens - start, budget)))
            for i, wanted in enumerate(options):
                need = _ceil_div(start + wanted, self.config.page_size) - matched
                if wanted > 0 and need <= room:
                    chunk, layered = wanted, wanted if i == 0 else 0  # layered: the layered chunk was taken
                    break
            if not chunk:
                break  # FIFO: the head is never skipped
            self._waiting.popleft()
            self.prefix.attach(request, match)
            if not request.output_token_ids and not request.num_preemptions:
                request.num_cached_tokens = start
            request.state_slot = heapq.heappop(self._free_slots)
            request.transition(RequestState.PREFILLING)
            self._running.append(request)
            self._grow_to(request, start + chunk)
            work = self._first_group(request, chunk, budget) if self._takes_layers(chunk, budget, layered) \
                else self._work(request, chunk)
            works.append(work)
            budget -= self._charge(work)
        return works

    def _takes_layers(self, chunk: int, budget: int, layered_chunk: int) -> bool:
        """Whether a chunk about to run starts layer groups: it is longer than the budget (then it is the layered
        chunk, layered_chunk > 0), or it is the layered chunk (possibly cut to its pages) and _layers_short_chunk
        layers it though the budget could take it whole."""
        return chunk > budget or (layered_chunk > 0 and self._layers_short_chunk(chunk))

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
        # NOTE: a chunk part-way is abandoned: its computed tokens stop where its first group started (the
        # pages past them, partly written by its groups, are freed by the prefix store like any unfinished chunk)
        if request is self._layered:
            self._layered = None
        request.layer_chunk, request.layers_done = None, 0
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
            if work.layers is not None:
                if not work.ends_chunk(self.config.num_layers):
                    request.layers_done = work.layers[1]  # the next group continues from here
                    continue
                request.layer_chunk, request.layers_done, self._layered = None, 0, None
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
        layered = [r for r in self._running if r.layer_chunk is not None]
        assert layered == ([self._layered] if self._layered is not None else []), "layered chunk bookkeeping"
        for request in layered:
            assert 0 <= request.layers_done < self.config.num_layers, request
            in_flight_end.setdefault(request.request_id, request.layer_chunk.end_position)
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
