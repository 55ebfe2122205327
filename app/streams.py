"""Per-request stream bookkeeping for the engine thread: the live table (request id -> its
stream), the translation of scheduler events into text events, and the outbox that hands those
events to each handler's asyncio loop.

Threading contract: everything here except the dataclasses is touched ONLY by the engine thread;
events cross to a handler's event loop in ``flush`` through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from app.detokenize import IncrementalDetokenizer, StopStringMatcher
from app.reasoning import ReasoningTokens, ThinkingPlan
from app.stats import ServingStats
from domain.ports import Tokenizer
from domain.request import Request, RequestEvent
from domain.scheduler import Scheduler

log = logging.getLogger("fluxtide.engine")  # the engine's log: these are engine-thread events


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class FinishTally:
    """One finished request's count on ``ft_requests_total``, left to the handler that knows its real finish reason.
    A "stop" whose text may hold tool calls is "tool_calls" to its client, which only the handler's parser can tell
    (it reads the text after the engine thread has let the request go): the handler settles it with that reason. One
    never settled (the client left before reading its last event, the formatting failed, the server is stopping) is
    counted under the engine's own reason when the last event is dropped, so every finished request is counted
    exactly once and a counter never goes back (a relabel after the fact would have taken one off "stop")."""

    __slots__ = ("_stats", "_default", "_settled")

    def __init__(self, stats: ServingStats, default: str) -> None:
        self._stats = stats
        self._default = default
        self._settled = False

    def settle(self, reason: str) -> None:
        if not self._settled:
            self._settled = True
            self._stats.record_finished(reason)

    def __del__(self) -> None:
        self.settle(self._default)


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
    stop_string: str | None = None  # on the last event: the stop string that ended the text, if one did
    reasoning_tokens: int = 0  # generated tokens inside the reasoning so far (final on the last event)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (known once the request started)
    tally: FinishTally | None = None  # on a last event whose count the handler settles (see settle)

    def settle(self, reason: str | None) -> None:
        """The handler's finish reason for this last event (a "stop" may be "tool_calls"): what ft_requests_total
        counts it under. A no-op on any other event, whose finish the engine thread has counted itself."""
        if self.tally is not None and reason is not None:
            self.tally.settle(reason)


@dataclass
class LiveStream:
    """One submitted request and the handler-side queue its events go to."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    arrival: float
    first_token_at: float | None = None
    generated: int = 0
    # Logprobs travel with the text of their token: a token's logprob is released with the delta
    # that releases the end of its text (stop-string matching may hold text back). NOTE: a token whose
    # push produced no text (a special token the decode skips, or the start of a character a later token
    # completes) ends where the text before it ends, so it goes out at once with an empty delta, not with
    # the next token that has text: with logprobs every token has its own event, sent when it is sampled
    # (a client times each token by it, as on vLLM), unless text a stop string holds back comes before it.
    produced_chars: int = 0  # text the detokenizer has produced so far
    released_chars: int = 0  # text handed to the client so far
    pending_logprobs: list[tuple[int, TokenLogprob]] = field(default_factory=list)  # (text end, logprob)
    reasoning: ReasoningTokens | None = None  # set when the output's reasoning is split (and maybe bounded)
    # NOTE: its handler parses tool calls: a "stop" is counted by the handler, which knows whether it was one
    relabel_stop: bool = False

    def add_token_text(self, logprob: TokenLogprob | None, text: str) -> None:
        """Record a token's logprob and the detokenized text its push produced (may be "": a special
        token, or part of a character whose text comes with the token that completes it)."""
        self.produced_chars += len(text)
        if logprob is not None:
            self.pending_logprobs.append((self.produced_chars, logprob))

    def take_logprobs(self, released_text: str, everything: bool) -> tuple[TokenLogprob, ...]:
        """The logprobs of exactly the tokens whose text is out once `released_text` is sent
        (every one left, on the last event)."""
        self.released_chars += len(released_text)
        if not self.pending_logprobs:  # no logprobs asked for (the common case), or all sent
            return ()
        if everything:
            out = [lp for _, lp in self.pending_logprobs]
            self.pending_logprobs = []
            return tuple(out)
        ready = [lp for end, lp in self.pending_logprobs if end <= self.released_chars]
        self.pending_logprobs = [(end, lp) for end, lp in self.pending_logprobs if end > self.released_chars]
        return tuple(ready)

    @property
    def steers(self) -> bool:
        """Its text can change what the scheduler does next: a stop string may end it, a thinking budget
        may force tokens. The engine handles such a stream's events at once, the others' after the next
        launch (docs/adr/0019-deferred-step-work.md)."""
        return self.matcher.active or (self.reasoning is not None and self.reasoning.bounded)

    def has_ready_logprobs(self) -> bool:
        return any(end <= self.released_chars for end, _ in self.pending_logprobs)

    @classmethod
    def start(cls, request: Request, tokenizer: Tokenizer, stop: Sequence[str],
              thinking: ThinkingPlan | None = None, relabel_stop: bool = False) -> LiveStream:
        """Call inside the handler's event loop: the stream's events are delivered to that loop."""
        return cls(
            request=request,
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            detok=IncrementalDetokenizer(tokenizer),
            matcher=StopStringMatcher(stop),
            arrival=request.arrival_time,
            reasoning=ReasoningTokens(thinking) if thinking is not None else None,
            relabel_stop=relabel_stop,
        )


def progress_event(live: LiveStream, text: str, finish_reason: str | None,
                   tally: FinishTally | None = None) -> StreamEvent:
    """The next event of a stream with the logprobs of the tokens whose text it completes (all
    that are left on the last event)."""
    logprobs = live.take_logprobs(text, everything=finish_reason is not None)
    return StreamEvent(
        text=text,
        token_ids=(),
        logprobs=logprobs,
        finish_reason=finish_reason,
        prompt_tokens=len(live.request.prompt_token_ids),
        completion_tokens=live.generated,
        stop_string=live.matcher.matched if finish_reason == "stop" else None,
        reasoning_tokens=live.reasoning.count if live.reasoning is not None else 0,
        cached_tokens=live.request.num_cached_tokens,
        tally=tally,
    )


def finish_event(live: LiveStream, reason: str, error: str | None = None) -> StreamEvent:
    """A last event without new text (abort, error, shutdown)."""
    event = progress_event(live, "", reason)
    return StreamEvent(**{**event.__dict__, "error": error})


class RequestStreams:
    """The live table and the outbox of the engine thread."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        stats: ServingStats,
        eos_token_ids: frozenset[int],
        clock: Callable[[], float],
    ) -> None:
        self._scheduler = scheduler
        self._stats = stats
        self._eos_token_ids = eos_token_ids
        self._clock = clock
        self.live: dict[str, LiveStream] = {}
        self._outbox: list[tuple[LiveStream, StreamEvent]] = []
        self._published = 0  # outbox entries emitted before the pools snapshot was last published

    def open(self, live: LiveStream) -> None:
        """Track an admitted request (the scheduler already holds it)."""
        self.live[live.request.request_id] = live
        self._force_if_over_budget(live)  # a budget of 0 closes the reasoning the prompt opened at once

    def state_slots_used(self) -> int:
        return sum(1 for live in self.live.values() if live.request.state_slot is not None and not live.request.is_done)

    def steers(self, request_id: str) -> bool:
        """LiveStream.steers of a live request (False when it is not live: its events are ignored)."""
        live = self.live.get(request_id)
        return live is not None and live.steers

    def on_event(self, event: RequestEvent) -> None:
        live = self.live.get(event.request_id)
        if live is None:
            return
        text = ""
        if event.token_id is not None:
            live.generated += 1
            if live.first_token_at is None:
                live.first_token_at = now = self._clock()
                self._stats.record_ttft(now - live.arrival)
                self._stats.record_prefix_cache(len(live.request.prompt_token_ids), live.request.num_cached_tokens)
            logprob = None
            if event.logprob is not None:
                logprob = TokenLogprob(event.token_id, event.logprob, event.top_logprobs)
            finishing_eos = event.finished and event.finish_reason == "stop" and event.token_id in self._eos_token_ids
            produced = "" if finishing_eos else live.detok.push(event.token_id)
            live.add_token_text(logprob, produced)
            if not finishing_eos:
                text = live.matcher.feed(produced)
                if live.reasoning is not None:
                    live.reasoning.push(produced, forced=event.forced)
        if live.matcher.stopped and not event.finished:
            # A stop string ended the text: free the pages and state slot now (what was computed goes
            # to the prefix cache, like a finish: an agent's next turn resumes from it).
            self._scheduler.abort(event.request_id, keep_prefix=True)
            self.live.pop(event.request_id, None)
            if live.reasoning is not None:
                live.reasoning.finish()
            self.emit(live, progress_event(live, text, "stop", self._count_finish(live, "stop")))
            return
        if event.finished:
            self.live.pop(event.request_id, None)
            stopped = live.matcher.stopped
            flushed = "" if stopped else live.detok.flush()
            if live.reasoning is not None:
                live.reasoning.finish(flushed)
            if not stopped:
                text += live.matcher.feed(flushed)
                text += live.matcher.flush()
            # NOTE: after the flush: the held-back bytes (U+FFFD) can complete a stop string
            reason = "stop" if live.matcher.stopped else (event.finish_reason or "stop")
            self.emit(live, progress_event(live, text, reason, self._count_finish(live, reason)))
            return
        self._force_if_over_budget(live)
        # NOTE: text held back by the stop-string matcher keeps its tokens' logprobs back with it.
        if text or live.has_ready_logprobs():
            self.emit(live, progress_event(live, text, None))

    def _count_finish(self, live: LiveStream, reason: str) -> FinishTally | None:
        """Count a request that finished normally on ft_requests_total, or hand its count to the handler (a tally on
        its last event) when the handler may call it something else: a "stop" of a stream whose tool calls it
        parses. Only "stop" can change ("tool_calls"); a length cut stays "length" whatever the text holds."""
        if reason == "stop" and live.relabel_stop:
            return FinishTally(self._stats, reason)
        self._stats.record_finished(reason)
        return None

    def _force_if_over_budget(self, live: LiveStream) -> None:
        """The thinking budget is spent and the reasoning still open: the next tokens are its close."""
        if live.reasoning is not None and live.reasoning.should_force():
            self._scheduler.force_tokens(live.request.request_id, live.reasoning.close_ids())

    def abort(self, request_id: str) -> None:
        """The client went away: free its pages and state slot (its computed prefix goes to the prefix
        cache: a client retrying the same conversation resumes from it) and end its stream."""
        live = self.live.pop(request_id, None)
        if live is None:
            return
        self._scheduler.abort(request_id, keep_prefix=True)
        self._stats.record_finished("abort")
        self.finish(live, "abort")

    def fail_batch(self, batch, message: str) -> None:
        """End every request of a batch whose model step failed; the others keep running."""
        for work in batch.works:
            live = self.live.pop(work.request_id, None)
            self._scheduler.abort(work.request_id)
            if live is not None:
                self._stats.record_finished("error")
                self.finish(live, "error", message)
        # Every request of the batch is aborted, so this only clears the in-flight batch.
        self._scheduler.complete(batch, {})

    def fail_request(self, request_id: str, message: str) -> None:
        """End one request whose own step result failed; the rest of its batch carries on."""
        live = self.live.pop(request_id, None)
        self._scheduler.abort(request_id)
        if live is not None:
            self._stats.record_finished("error")
            self.finish(live, "error", message)

    def fail_all(self, message: str) -> None:
        """End every live request with an error (the engine step itself broke)."""
        for request_id, live in list(self.live.items()):
            try:
                self._scheduler.abort(request_id)
            except Exception:  # the scheduler may be the thing that broke
                log.exception("abort of %s failed", request_id)
            self.live.pop(request_id, None)
            self._stats.record_finished("error")
            self.finish(live, "error", message)

    def finish(self, live: LiveStream, reason: str, error: str | None = None) -> None:
        self.emit(live, finish_event(live, reason, error))

    def reject(self, live: LiveStream, message: str, status: int = 400) -> None:
        """A submission refused at admission (400: the scheduler can not fit it; 503: the engine can
        not serve); nothing was generated."""
        self.emit(live, StreamEvent("", (), (), "error", len(live.request.prompt_token_ids), 0, message, status))

    def close_all(self, *, held: Iterable[LiveStream], error: str) -> None:
        """Shutdown: abort every live stream and every submission still held (never admitted)."""
        for live in [*self.live.values(), *held]:
            self.finish(live, "abort", error)
        self.live.clear()

    def emit(self, live: LiveStream, event: StreamEvent) -> None:
        # NOTE: events wait in the outbox until the pools snapshot is republished, so a client
        # that sees its finish and then asks /v1/stats already sees its pages and slot freed.
        self._outbox.append((live, event))

    @property
    def num_pending(self) -> int:
        """Events emitted and not yet handed to their loops."""
        return len(self._outbox)

    def mark_published(self) -> None:
        """The pools snapshot was just published: every event now in the outbox may go out."""
        self._published = len(self._outbox)

    def has_unpublished(self) -> bool:
        """Events were emitted after the last pools snapshot (their pool changes are not published yet)."""
        return len(self._outbox) > self._published

    def flush(self) -> None:
        """Hand the outbox to the handlers' loops: ONE ``call_soon_threadsafe`` per loop, not per event.
        Each such call writes the loop's self-pipe (a syscall, ~0.1 ms on a loaded host); per event it
        cost 16 writes a step at 16 streams. Events keep their order (per stream and overall)."""
        outbox, self._outbox = self._outbox, []
        self._published = 0
        if not outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamEvent]]] = {}
        for live, event in outbox:
            by_loop.setdefault(live.loop, []).append((live.events, event))
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, deliveries)
            except RuntimeError:  # the handler's loop is gone (server shutting down)
                pass

    def check_valid(self) -> None:
        """Engine-thread only (or when the thread is stopped)."""
        for request_id, live in self.live.items():
            assert live.request.request_id == request_id, "live table keyed by the wrong id"
            assert not live.request.is_done, f"{request_id} finished but still live"
            live.detok.check_valid()
            live.matcher.check_valid()
            ends = [end for end, _ in live.pending_logprobs]
            assert ends == sorted(ends) and all(end <= live.produced_chars for end in ends), \
                f"{request_id}: pending logprobs out of order or past the text produced"
            if live.reasoning is not None:
                assert live.reasoning.count <= live.generated, f"{request_id}: more reasoning tokens than tokens"


def _deliver(deliveries: list[tuple[asyncio.Queue, StreamEvent]]) -> None:
    """On the handlers' loop: put each event on its stream's queue (unbounded: put_nowait never blocks)."""
    for events, event in deliveries:
        events.put_nowait(event)
