"""How a burst of requests sent together reaches the simulated engine (issue 10; docs/simulator.md, "Held out on an
H100: session 33, refitted").

The k-th request (k = 0, 1, ...) of a burst sent at t0 reaches the engine at t0 + request_overhead_s + k x
request_spacing_s (CostParams; seconds): the server parses, renders and tokenizes one request at a time. An idle
engine holds its first step by the server's own policy, domain/arrival_window.py (`ft serve --arrival-window-ms`):
until the arrivals have been quiet for its quiet_s (QUIET_S, 2 ms), at most max_s after the first. Requests that
arrive later join the running engine's next step (predict.run_workload).
"""

from __future__ import annotations

from collections.abc import Sequence

from domain.arrival_window import ArrivalWindow


def arrival_times(sent_s: float, overhead_s: float, spacing_s: float, count: int) -> list[float]:
    """When each of `count` requests sent together at `sent_s` reaches the engine (s, ascending)."""
    if overhead_s < 0 or spacing_s < 0 or count < 0:
        raise ValueError(f"negative overhead {overhead_s}, spacing {spacing_s} or count {count}")
    return [sent_s + overhead_s + k * spacing_s for k in range(count)]


def window_close(arrivals: Sequence[float], window: ArrivalWindow) -> float:
    """When an engine that wakes from idle at the first of `arrivals` (ascending, s) starts its first step: it waits
    while arrivals keep coming (window.remaining, re-read at each arrival), as app/engine.py `_await_burst` does.
    A request that lands exactly as the wait ends is left for the next step. ValueError for no arrivals or an
    unsorted list."""
    if not arrivals:
        raise ValueError("no arrivals")
    if any(b < a for a, b in zip(arrivals, arrivals[1:], strict=False)):
        raise ValueError("arrivals must be ascending")
    first = last = now = arrivals[0]
    nxt = 1
    while (left := window.remaining(now, first, last)) > 0:
        if nxt < len(arrivals) and arrivals[nxt] < now + left:
            now = last = arrivals[nxt]
            nxt += 1
        else:
            return now + left
    return now
