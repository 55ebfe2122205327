"""Serving statistics: a sliding window for /v1/stats, the step trace of /v1/stats/steps (the same window's steps)
and Prometheus metrics for /metrics.

The engine thread writes, HTTP handlers read; a lock keeps each snapshot consistent.
Each server gets its own Prometheus registry so several servers (tests) can share a process.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from domain.gap_stats import percentile


class _TraceRow(msgspec.Struct, gc=False):
    """One step of /v1/stats/steps, its fields in the order the body shows them."""

    end: float
    seconds: float
    host_seconds: float | None
    decode_rows: int
    prefill_tokens: int
    prefill_works: int
    layers: tuple[int, int] | None
    layer_tokens: int
    expert_hits: int
    expert_misses: int


_encode = msgspec.json.Encoder().encode


def _round6(values: list[float]) -> list[float]:
    """[round(v, 6) for v in values], vectorised: round()'s decimal conversion was the largest part of encoding a
    step's row. NOTE: exact, the same floats: below 8,000 the double product v * 1e6 is off the exact one by under
    1e-6, so where it is not near a half (0.4999) its nearest integer k is the one round's correctly rounded decimal
    conversion finds, and k / 1e6 (both exact doubles: one IEEE division) is the double nearest k / 10**6, the float
    round parses its digits back to. The rest (near a half, negative, 8,000 or more, not finite) take round itself."""
    given = np.array(values, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # huge, infinite, nan: not exact, rounded below
        scaled = given * 1e6
        nearest = np.rint(scaled)
        exact = (np.abs(scaled - nearest) < 0.4999) & (given >= 0) & (given < 8e3)
    rounded = (nearest / 1e6).tolist()
    for i in np.flatnonzero(~exact).tolist():
        rounded[i] = round(values[i], 6)
    return rounded


@dataclass(slots=True)
class _Step:
    at: float
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    expert_hits: int
    expert_misses: int
    host_seconds: float | None = None  # engine-thread time between this model call and the previous one
    prefill_work: bool = False  # the step computed prefill (tokens, or a layered chunk's later layer group)
    # the step trace (/v1/stats/steps): when the model call returned on the wall clock (time.time(), so a client on
    # the same host can line it up with its own), the prefill works beside the decodes, the layer group a layered
    # chunk's work ran (first, end) and that chunk's tokens (a later group counts no prefill_tokens)
    ended: float = 0.0
    prefill_works: int = 0
    layers: tuple[int, int] | None = None
    layer_tokens: int = 0
    # NOTE: the only field written after construction: the step's trace row as JSON, encoded by the first reader
    # that needs it (a step's row never changes; two readers racing store equal bytes). The engine thread never
    # encodes: a full window's rows cost milliseconds, re-encoding them on every GET /v1/stats/steps was its cost.
    row: bytes | None = field(default=None, compare=False, repr=False)


def _encode_rows(steps: list[_Step]) -> None:
    """Give each step of `steps` without one its row of /v1/stats/steps, encoded (together: their rounding is one
    vectorised pass). prefill_tokens: the tokens its prefill works computed, a layered chunk's in each of its groups
    (the window's prefill_tokens count a chunk once, in its first group)."""
    fresh = [s for s in steps if s.row is None]
    if not fresh:
        return
    seconds = _round6([s.seconds for s in fresh])
    host = _round6([0.0 if s.host_seconds is None else s.host_seconds for s in fresh])
    for s, call_s, host_s in zip(fresh, seconds, host, strict=True):
        layers = s.layers
        later_group = layers is not None and layers[0] > 0
        # NOTE: `end` unrounded: a client passes it back as `since` to get the steps after this one
        s.row = _encode(_TraceRow(
            s.ended, call_s, None if s.host_seconds is None else host_s, s.decode_tokens,
            s.prefill_tokens + (s.layer_tokens if later_group else 0), s.prefill_works, layers,
            s.layer_tokens if layers is not None else 0, s.expert_hits, s.expert_misses))


_ended = attrgetter("ended")


class ServingStats:
    """Implements the domain ``MetricsSink`` port and keeps the last ``window_s`` seconds of steps."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: deque[_Step] = deque()
        # NOTE: steps of the window that ended before the step ahead of them (the wall clock stepped back): while
        # there are none, `ended` rises along the window and GET /v1/stats/steps finds `since` by bisection
        self._ended_inversions = 0
        self._ttfts: deque[tuple[float, float]] = deque()
        self._bursts: deque[int] = deque(maxlen=64)  # commands queued as each idle wake's arrival window closed
        self._idle_wakes = 0
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("ft_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("ft_generation_tokens", "Tokens generated", registry=r)
        self.prefill_tokens = Counter("ft_prefill_tokens", "Tokens computed in prefill chunks", registry=r)
        self.requests = Counter("ft_requests", "Finished requests", ["finish_reason"], registry=r)
        self.admitted = Counter("ft_requests_admitted", "Requests admitted to the scheduler", registry=r)
        self.expert_hits = Counter("ft_expert_hits", "Expert cache hits", registry=r)
        self.expert_misses = Counter("ft_expert_misses", "Expert cache misses", registry=r)
        self.step_seconds = Histogram("ft_step_seconds", "Engine step duration", registry=r)
        self.host_seconds = Histogram(
            "ft_step_host_seconds", "Engine-thread time between two consecutive model calls (finishing a step, "
            "turning its tokens into stream events, scheduling the next)",
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1), registry=r)
        self.ttft_seconds = Histogram(
            "ft_time_to_first_token_seconds",
            "Time from arrival to first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.running = Gauge("ft_running_requests", "Requests holding pool resources", registry=r)
        self.waiting = Gauge("ft_waiting_requests", "Requests waiting for admission", registry=r)
        self.kv_pages_used = Gauge("ft_kv_pages_used", "KV pages in use", registry=r)
        self.kv_pages_total = Gauge("ft_kv_pages_total", "KV pages in the pool", registry=r)
        self.state_slots_used = Gauge("ft_state_slots_used", "Linear-attention state slots in use", registry=r)
        self.state_slots_total = Gauge("ft_state_slots_total", "Linear-attention state slots", registry=r)
        self.expert_slots_total = Gauge("ft_expert_slots_total", "Expert cache slots", registry=r)
        # prefix cache: a request is a hit when part of its prompt came from the cache
        self.prefix_requests = Counter("ft_prefix_cache_requests", "Requests started (prefix-cache lookups)", registry=r)
        self.prefix_hits = Counter("ft_prefix_cache_hits", "Requests that resumed from the prefix cache", registry=r)
        self.prefix_prompt_tokens = Counter("ft_prefix_cache_prompt_tokens", "Prompt tokens of started requests",
                                            registry=r)
        self.prefix_cached_tokens = Counter("ft_prefix_cache_cached_tokens",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.prefix_cached_pages = Gauge("ft_prefix_cache_pages", "KV pages held by the prefix cache", registry=r)
        self.snapshot_slots_used = Gauge("ft_snapshot_slots_used", "GDN state snapshot slots in use", registry=r)
        self.snapshot_slots_total = Gauge("ft_snapshot_slots_total", "GDN state snapshot slots", registry=r)
        self._prefix = [0, 0, 0, 0]  # requests, hits, prompt tokens, cached tokens (cumulative)
        self.routing_mode = Gauge("ft_routing", "1 on the routing mode in force: natural, or the --routing-replay "
                                  "spec (benchmark-only)", ["mode", "spec"], registry=r)
        self.routing_replayed = Gauge("ft_routing_replay_tokens", "Tokens whose experts the routing replay chose "
                                      "(cumulative)", registry=r)
        self.routing_host_seconds = Gauge("ft_routing_replay_host_seconds", "Host seconds spent producing the "
                                          "replayed expert ids (cumulative)", registry=r)
        self.record_routing({"mode": "natural"})
        self._pools: dict = {}  # the latest pools snapshot (record_pools); the pool gauges read it
        self._bind_pool_gauges()
        # high-water marks of running and waiting requests since start or the last reset_peaks (the engine thread
        # raises them, POST /v1/stats/reset_peaks reads and restarts them)
        self._running_peak = self._waiting_peak = 0
        self._load = (0, 0)  # the last (running, waiting) the engine noted
        self._peaks_since = clock()

    # -- MetricsSink port -------------------------------------------------------------------
    def record_step(
        self, *, prefill_tokens: int, decode_tokens: int, seconds: float, expert_hits: int, expert_misses: int,
        host_seconds: float | None = None, prefill_work: bool | None = None, ended: float | None = None,
        prefill_works: int | None = None, layers: tuple[int, int] | None = None, layer_tokens: int = 0,
    ) -> None:
        """prefill_work: the step computed prefill; None = it counted prefill tokens (a layered chunk's later
        groups count none, docs/adr/0024-layered-prefill.md, yet are no decode-only step).
        The step trace's own (beyond the MetricsSink port): ended, the wall-clock time (time.time()) the model call
        returned (None: now); prefill_works, the prefill works beside the decodes (None: one if it computed
        prefill); layers, the layer group of a layered chunk's work, and layer_tokens, that chunk's tokens."""
        prefill_work = bool(prefill_tokens) if prefill_work is None else prefill_work
        step = _Step(self._clock(), prefill_tokens, decode_tokens, seconds, expert_hits, expert_misses, host_seconds,
                     prefill_work, time.time() if ended is None else ended,
                     int(prefill_work) if prefill_works is None else prefill_works, layers, layer_tokens)
        with self._lock:
            if self._steps and step.ended < self._steps[-1].ended:
                self._ended_inversions += 1
            self._steps.append(step)
            self._trim(step.at)
        # NOTE: a zero increment changes nothing; skipping it saves a lock round per counter and step.
        if prefill_tokens:
            self.prefill_tokens.inc(prefill_tokens)
        if decode_tokens:
            self.generation_tokens.inc(decode_tokens)
        if expert_hits:
            self.expert_hits.inc(expert_hits)
        if expert_misses:
            self.expert_misses.inc(expert_misses)
        self.step_seconds.observe(seconds)
        if host_seconds is not None:
            self.host_seconds.observe(host_seconds)

    # -- request lifecycle ------------------------------------------------------------------
    def record_ttft(self, seconds: float) -> None:
        with self._lock:
            now = self._clock()
            self._ttfts.append((now, seconds))
            self._trim(now)
        self.ttft_seconds.observe(seconds)

    def record_burst(self, commands: int) -> None:
        """An idle engine woke to `commands` queued (submissions, aborts, resizes) when its arrival window closed
        (ADR 0021): the burst its first step can admit. A round of N concurrent requests that records fewer than N
        split across steps (the simulator admits a round at one instant: docs/simulator.md)."""
        with self._lock:
            self._bursts.append(commands)
            self._idle_wakes += 1

    def bursts(self) -> dict:
        """/v1/stats `arrivals`: idle wakes since start and the burst sizes of the last 64."""
        with self._lock:
            return {"idle_wakes": self._idle_wakes, "last_burst_sizes": list(self._bursts)}

    def record_admitted(self, prompt_tokens: int) -> None:
        self.admitted.inc()
        self.prompt_tokens.inc(prompt_tokens)

    def record_prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One request started: `cached_tokens` of its `prompt_tokens` came from the prefix cache."""
        with self._lock:
            self._prefix[0] += 1
            self._prefix[1] += cached_tokens > 0
            self._prefix[2] += prompt_tokens
            self._prefix[3] += cached_tokens
        self.prefix_requests.inc()
        if cached_tokens:
            self.prefix_hits.inc()
        self.prefix_prompt_tokens.inc(prompt_tokens)
        self.prefix_cached_tokens.inc(cached_tokens)

    def prefix_cache(self) -> dict:
        """Cumulative prefix-cache hit rates since start."""
        with self._lock:
            requests, hits, prompt, cached = self._prefix
        return {"requests": requests, "hits": hits, "hit_rate": hits / requests if requests else None,
                "prompt_tokens": prompt, "cached_tokens": cached,
                "token_hit_rate": cached / prompt if prompt else None}

    def record_finished(self, finish_reason: str) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()

    def finished_requests(self) -> int:
        """Requests finished since start, whatever their finish reason (the ``ft_requests_total`` samples)."""
        return int(sum(sample.value for metric in self.requests.collect() for sample in metric.samples
                       if sample.name.endswith("_total")))

    def record_pools(self, pools: dict) -> None:
        """The latest pools snapshot (a dict never mutated after this call); the pool gauges read it when
        /metrics is scraped: the engine publishes after every step, and ten gauge writes a step were a
        measurable part of its host time (docs/fast-decode.md, host overhead)."""
        self._pools = pools
        self.note_load(pools.get("running", 0), pools.get("waiting", 0))

    # -- high-water marks -------------------------------------------------------------------
    def note_load(self, running: int, waiting: int) -> None:
        """Engine thread: requests running and waiting at one moment (after each step, and each pools snapshot).
        Raises the high-water marks; two comparisons while below them, the lock only to raise one."""
        self._load = (running, waiting)  # NOTE: one tuple store: reset_peaks restarts from the latest load
        if running > self._running_peak or waiting > self._waiting_peak:
            with self._lock:  # the compare again under the lock: a reset_peaks between the two would lose a raise
                self._running_peak = max(self._running_peak, running)
                self._waiting_peak = max(self._waiting_peak, waiting)

    def peaks(self) -> dict:
        """/v1/stats pools' `running_peak` and `waiting_peak`: the most requests running (holding pool resources)
        and waiting at once since start or the last reset_peaks."""
        with self._lock:
            return {"running_peak": self._running_peak, "waiting_peak": self._waiting_peak}

    def reset_peaks(self) -> dict:
        """Any thread (POST /v1/stats/reset_peaks): the high-water marks so far and the seconds they span; they
        start again from the requests running and waiting now (the latest of the engine's last noted load and the
        pools snapshot, which lags it by a step), so a request running across the reset counts on both sides."""
        with self._lock:
            now = self._clock()
            ended = {"running_peak": self._running_peak, "waiting_peak": self._waiting_peak,
                     "since_s": round(now - self._peaks_since, 6)}
            running, waiting = self._load
            self._running_peak = max(running, self._pools.get("running", 0))
            self._waiting_peak = max(waiting, self._pools.get("waiting", 0))
            self._peaks_since = now
        return ended

    def _bind_pool_gauges(self) -> None:
        def reader(key: str, in_cache: bool = False) -> Callable[[], float]:
            if in_cache:
                return lambda: (self._pools.get("prefix_cache") or {}).get(key, 0)
            return lambda: self._pools.get(key, 0)

        self.running.set_function(reader("running"))
        self.waiting.set_function(reader("waiting"))
        self.kv_pages_used.set_function(reader("kv_pages_used"))
        self.kv_pages_total.set_function(reader("kv_pages_total"))
        self.state_slots_used.set_function(reader("state_slots_used"))
        self.state_slots_total.set_function(reader("state_slots_total"))
        self.expert_slots_total.set_function(reader("expert_slots"))
        self.prefix_cached_pages.set_function(reader("cached_pages", in_cache=True))
        self.snapshot_slots_used.set_function(reader("snapshot_slots_used", in_cache=True))
        self.snapshot_slots_total.set_function(reader("snapshot_slots_total", in_cache=True))

    def record_routing(self, routing: dict) -> None:
        """The engine's routing() description into the routing gauges (the /metrics handler calls it)."""
        replay = routing.get("mode", "natural") != "natural"
        active = replay and bool(routing.get("active", True))
        if replay:
            self.routing_mode.labels(mode=routing["mode"], spec=routing.get("spec", routing["mode"])).set(int(active))
            self.routing_replayed.set(routing.get("tokens_replaced", 0))
            self.routing_host_seconds.set(routing.get("host_seconds", 0.0))
        self.routing_mode.labels(mode="natural", spec="natural").set(int(not active))

    # -- readers ----------------------------------------------------------------------------
    def window(self) -> dict:
        """Throughput, TTFT percentiles and expert hit rate over the sliding window."""
        with self._lock:
            now = self._clock()
            self._trim(now)
            steps = list(self._steps)
            ttfts = [t for _, t in self._ttfts]
        span = min(self.window_s, now - steps[0].at + steps[0].seconds) if steps else 0.0
        decode = sum(s.decode_tokens for s in steps)
        prefill = sum(s.prefill_tokens for s in steps)
        hits = sum(s.expert_hits for s in steps)
        misses = sum(s.expert_misses for s in steps)
        busy = sum(s.seconds for s in steps)
        host = [s.host_seconds for s in steps if s.host_seconds is not None]
        decode_only = [s.seconds for s in steps if s.decode_tokens and not s.prefill_work]
        return {
            "window_s": self.window_s,
            "steps": len(steps),
            "decode_tokens": decode,
            "prefill_tokens": prefill,
            "decode_tok_s": decode / span if span > 0 else 0.0,
            "prefill_tok_s": prefill / span if span > 0 else 0.0,
            "busy_fraction": min(1.0, busy / span) if span > 0 else 0.0,
            # NOTE: rates over the time the engine was stepping (what a request sees while it runs).
            "decode_tok_s_while_busy": decode / busy if busy > 0 else 0.0,
            "prefill_tok_s_while_busy": prefill / busy if busy > 0 else 0.0,
            "ttft_s": {
                "count": len(ttfts),
                "p50": percentile(ttfts, 50),
                "p90": percentile(ttfts, 90),
                "p99": percentile(ttfts, 99),
            },
            "expert_hit_rate": hits / (hits + misses) if hits + misses else None,
            # Where a token's time goes: the model call (decode-only steps) and the engine thread's work
            # between two model calls. Their sum is the step period a stream sees.
            "step_s": {"decode_p50": percentile(decode_only, 50), "decode_p90": percentile(decode_only, 90)},
            "host_s": {"count": len(host), "p50": percentile(host, 50), "p90": percentile(host, 90)},
        }

    def steps_json(self, since: float | None = None) -> bytes:
        """GET /v1/stats/steps' body: every step of the window (the last ``window_s`` seconds), oldest first, or
        those that ended after `since` (epoch seconds, the wall clock: ``clock`` "unix")."""
        with self._lock:
            self._trim(self._clock())
            steps = list(self._steps)
            ordered = not self._ended_inversions
        if since is not None:
            if ordered:
                steps = steps[bisect_right(steps, since, key=_ended):]
            else:
                steps = [s for s in steps if s.ended > since]
        # NOTE: outside the lock (the engine thread's record_step never waits for them): each row is encoded once,
        # by the first read that returns it, then joined from its bytes (the same bytes msgspec writes for the dict)
        head, tail = b'{"clock":"unix","window_s":' + _encode(self.window_s) + b',"steps":[', b"]}"
        _encode_rows(steps)
        rows = [s.row for s in steps]
        if not rows:
            return head + tail
        # NOTE: head and tail joined to the end rows, not to the body: each copy of a full window's megabyte counts
        rows[0] = head + rows[0]
        rows[-1] += tail
        return b",".join(rows)

    def steps(self, since: float | None = None) -> dict:
        """steps_json as a dict."""
        return msgspec.json.decode(self.steps_json(since))

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._steps and self._steps[0].at < horizon:
            gone = self._steps.popleft()
            if self._steps and self._steps[0].ended < gone.ended:
                self._ended_inversions -= 1
        while self._ttfts and self._ttfts[0][0] < horizon:
            self._ttfts.popleft()

    def check_valid(self) -> None:
        with self._lock:
            times = [s.at for s in self._steps]
            assert times == sorted(times), "steps out of time order"
            ends = [s.ended for s in self._steps]
            inversions = sum(b < a for a, b in zip(ends, ends[1:], strict=False))
            assert inversions == self._ended_inversions, "wall-clock inversions miscounted"
            assert all(s.seconds >= 0 and s.decode_tokens >= 0 and s.prefill_tokens >= 0 for s in self._steps)
            requests, hits, prompt, cached = self._prefix
            assert 0 <= hits <= requests and 0 <= cached <= prompt, "prefix-cache counters out of order"
            assert self._running_peak >= self._pools.get("running", 0) >= 0, "running_peak below the running count"
            assert self._waiting_peak >= self._pools.get("waiting", 0) >= 0, "waiting_peak below the waiting count"
