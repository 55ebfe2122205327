"""Request lifecycle: sampling parameters, the request record and the events it emits.

A request moves WAITING -> PREFILLING -> DECODING -> FINISHED; any live state may move to
ABORTED; a running request may be preempted back to WAITING (it keeps its output and later
re-prefills prompt + output). The scheduler is the only writer of a request's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class RequestState(StrEnum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"


# NOTE: the only legal moves; preemption is PREFILLING/DECODING -> WAITING.
_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.PREFILLING, RequestState.ABORTED}),
    RequestState.PREFILLING: frozenset(
        {RequestState.DECODING, RequestState.WAITING, RequestState.FINISHED, RequestState.ABORTED}
    ),
    RequestState.DECODING: frozenset({RequestState.WAITING, RequestState.FINISHED, RequestState.ABORTED}),
    RequestState.FINISHED: frozenset(),
    RequestState.ABORTED: frozenset(),
}

FINISH_REASONS = ("stop", "length", "abort")

# Temperatures below this sample greedily: dividing fp32 logits by a smaller temperature
# overflows to inf (1e-40, 5e-324 ...) and softmax turns that into NaN. At 1e-5 the distribution
# is already one-hot for any logit gap above ~1e-3, so greedy is what the client asked for.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # always stop, even with ignore_eos
    logprobs: bool = False
    top_logprobs: int = 0
    # The client gave no max_tokens: it is "the rest of the context", and the scheduler re-derives it from
    # the pools the request is admitted into (a live resize may have changed them since it was computed).
    max_tokens_is_default: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # NOTE: also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # degenerate: greedy (see MIN_TEMPERATURE)
        if self.temperature == float("inf"):
            raise ValueError("temperature must be finite")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens of all_token_ids already in the KV cache / state
    pages: list[int] = field(default_factory=list)  # KV pages, position p lives in pages[p // page_size]
    state_slot: int | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival_time: float = 0.0
    num_preemptions: int = 0
    # Output tokens decided by the caller, not the model (``Scheduler.force_tokens``): each replaces the
    # next sampled token, in order. They survive preemption (they are not yet part of the sequence).
    forced_token_ids: list[int] = field(default_factory=list)
    # ---- prefix cache (scheduler-owned; all empty while WAITING and once done) ----
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    prefix: object | None = None  # the locked domain.prefix_cache.PrefixMatch whose pages lead `pages`
    num_shared_pages: int = 0  # pages[:num_shared_pages] belong to the cache (shared, read-only)
    restore_snapshot: int | None = None  # snapshot slot the next work restores the state from
    branch_point: int = 0  # cached KV reaches here but no snapshot does: snapshot it on the way (0 = none)
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # kept (position, slot), taken
    rolling_snapshot: tuple[int, int] | None = None  # latest decode page boundary (replaced as it moves)
    pending_snapshots: list[tuple[int, int, bool]] = field(default_factory=list)  # in flight: (pos, slot, rolling)
    # ---- layered prefill (scheduler-owned; docs/adr/0024-layered-prefill.md) ----
    # The chunk being computed layer group by layer group (its first group's work, sample as the chunk's) and
    # the layers its completed groups reached; None / 0 when no chunk is part-way.
    layer_chunk: object | None = None  # domain.ports.SequenceWork
    layers_done: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not all(isinstance(t, int) and t >= 0 for t in self.prompt_token_ids):
            raise ValueError(f"request {self.request_id}: prompt token ids must be ints >= 0")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> tuple[int, ...]:
        """``tuple(all_token_ids[start:end])`` for 0 <= start <= end, without building the whole
        sequence: a decode step reads one token of a context that may be 100k long."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if end <= n:
            return tuple(prompt[start:end])
        if start >= n:
            return tuple(self.output_token_ids[start - n : end - n])
        return tuple(prompt[start:]) + tuple(self.output_token_ids[: end - n])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute before the next sample (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    def can_transition(self, to: RequestState) -> bool:
        return to in _TRANSITIONS[self.state]

    def transition(self, to: RequestState) -> None:
        if not self.can_transition(to):
            raise ValueError(f"request {self.request_id}: illegal move {self.state.value} -> {to.value}")
        self.state = to

    def check_valid(self) -> None:
        assert 0 <= self.num_computed_tokens <= self.num_tokens, self
        assert len(self.output_token_ids) <= self.sampling.max_tokens, self
        assert len(set(self.pages)) == len(self.pages), f"{self.request_id}: page owned twice"
        assert all(isinstance(t, int) and t >= 0 for t in self.forced_token_ids), self
        assert 0 <= self.num_shared_pages <= len(self.pages), self
        assert (self.prefix is None) == (self.num_shared_pages == 0), self
        held = [s for _, s in self.snapshots] + [s for _, s, _ in self.pending_snapshots]
        if self.rolling_snapshot is not None:
            held.append(self.rolling_snapshot[1])
        assert len(held) == len(set(held)), f"{self.request_id}: snapshot slot held twice"
        if self.state is RequestState.WAITING or self.is_done:
            assert self.prefix is None and not held and self.restore_snapshot is None and not self.branch_point, self
        if self.state is RequestState.WAITING:
            assert not self.pages and self.state_slot is None and self.num_computed_tokens == 0, self
        if self.layer_chunk is None:
            assert self.layers_done == 0, self
        else:
            assert self.state is RequestState.PREFILLING and self.layers_done > 0, self
            assert self.layer_chunk.start_position == self.num_computed_tokens, self
        if self.state in (RequestState.PREFILLING, RequestState.DECODING):
            assert self.state_slot is not None, self
        if self.state is RequestState.DECODING:
            assert self.output_token_ids, self
        if self.is_done:
            assert not self.pages and self.state_slot is None, self
            assert self.finish_reason in FINISH_REASONS, self


@dataclass(frozen=True)
class RequestEvent:
    """One thing that happened to a request in a step: a new token, a finish, or both.

    An abort yields token_id=None, finished=True, finish_reason="abort". ``forced``: the token was
    one of ``Scheduler.force_tokens``' (the model's sample was replaced; logprob 0.0, no top list).
    """

    request_id: str
    token_id: int | None
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" when finished
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    forced: bool = False
