"""Which server step made each large gap of `ft bench mixed`: the server's step trace (GET /v1/stats/steps, fluxtide
only) beside the gaps the bench measured.

Clocks. The server stamps each step with its wall clock (time.time()) when the step's model call returned; the bench
times tokens on perf_counter. At each repeat's long-prompt send the bench reads both clocks once
(`wall_minus_perf_s`) and moves its gaps to the wall clock with that offset: exact on the server's host (one system
clock), off by the two hosts' clock difference elsewhere (the record keeps the offset it used).

What a gap's step is. A token reaches its client after its step's model call returned (the engine hands a step's
tokens over when it launches the next step, then HTTP carries them), so a gap between two tokens of a stream is the
time of the step that produced the later one, plus the host's time before it: that step ended within the gap. The
steps that ended within a gap are its steps; every step whose token a client has seen is in the trace (the engine
records a step's numbers before it hands its tokens over).
"""

from __future__ import annotations

import time

import httpx

from domain.gap_stats import percentile

MARGIN_S = 1.0  # the trace is fetched from this long before the window's first gap began (the step in flight then)


def read_clocks() -> tuple[float, float]:
    """(wall clock, perf_counter) read together: the perf_counter read is the midpoint of two around the wall read."""
    before = time.perf_counter()
    wall = time.time()
    return wall, (before + time.perf_counter()) / 2


def gap_spans(times: list[float], start: float, end: float) -> list[tuple[float, float]]:
    """(earlier, later) arrival of the gaps that overlap [start, end]: the gaps gaps_between(overlapping=True) gives,
    with their ends."""
    return [(a, b) for a, b in zip(times, times[1:], strict=False) if b > start and a < end]


async def fetch(client: httpx.AsyncClient, since: float) -> list[dict] | None:
    """The server's steps that ended after `since` (epoch seconds), oldest first; a data-parallel front's are every
    worker's, each row naming its `worker`. None where the server has no step trace (another server, an older
    fluxtide) or it did not answer."""
    try:
        r = await client.get("/v1/stats/steps", params={"since": repr(since)})
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    if isinstance(body.get("steps"), list):
        return body["steps"]
    if isinstance(body.get("workers"), list):
        rows = [{**row, "worker": w["worker"]} for w in body["workers"] if isinstance(w.get("steps"), list)
                for row in w["steps"]]
        return sorted(rows, key=lambda row: row["end"])
    return None


def describe(row: dict) -> tuple[str, str]:
    """(kind, label) of one step: "decode", "layer group", "prefill chunk" (prefill alone) or "mixed" (prefill beside
    decodes), and what it ran in words ("prefill chunk of 4 tokens beside 3 decodes")."""
    decodes = row["decode_rows"]
    beside = f" beside {decodes} decode{'s' * (decodes != 1)}" if decodes else ""
    tokens, works = row["prefill_tokens"], row["prefill_works"]
    if row.get("layers") is not None:
        first, end = row["layers"]
        # the chunk's own tokens (a step may run other prefill works beside the group: prefill_tokens sums them)
        chunk = row.get("layer_tokens", tokens)
        return "layer group", f"layer group [{first}, {end}) of a {chunk}-token chunk{beside}"
    if works:
        chunks = f"prefill chunk of {tokens} token{'s' * (tokens != 1)}" if works == 1 else \
            f"{works} prefill chunks of {tokens} tokens"
        return ("mixed" if decodes else "prefill chunk"), chunks + beside
    return "decode", f"decode step of {decodes} row{'s' * (decodes != 1)}"


def _compact(row: dict, send_wall: float) -> dict:
    """A window step for the record: times in ms, its end from the long prompt's send."""
    host = row.get("host_seconds")
    out = {"end_ms": round((row["end"] - send_wall) * 1e3, 3), "ms": round(row["seconds"] * 1e3, 3),
           "host_ms": None if host is None else round(host * 1e3, 3), "decode_rows": row["decode_rows"],
           "prefill_tokens": row["prefill_tokens"], "prefill_works": row["prefill_works"], "layers": row.get("layers"),
           "layer_tokens": row.get("layer_tokens"),
           "expert_misses": row.get("expert_misses")}
    if "worker" in row:
        out["worker"] = row["worker"]
    return out


def _named(index: int, row: dict) -> dict:
    kind, label = describe(row)
    return {"step": index, "ms": round(row["seconds"] * 1e3, 3), "kind": kind, "label": label}


def attribute(rows: list[dict], *, send_wall: float, first_wall: float,
              gaps: list[tuple[float, float, int]]) -> dict:
    """The point's `window_steps` and `step_attribution` from the server's steps (`rows`, wall clock) and the window's
    gaps ((earlier, later) arrival and stream, wall clock).

    window_steps: the steps whose model call overlaps the prefill window [send, first token] stretched to the gaps
    that overlap it (those straddling either end are measured gaps too), oldest first. step_attribution: the longest
    step that overlaps the window itself (`largest_step`), and each gap of at least the repeat's gap p90
    (`large_gaps`, in time order) with the steps that ended within it (indices into window_steps) and the longest of
    them named."""
    if len({row.get("worker") for row in rows}) > 1:
        # NOTE: a data-parallel front's workers step independently and the record does not know which served a
        # stream, so a gap cannot be laid on a step: listed, not attributed
        low, high = min([send_wall, *(a for a, _, _ in gaps)]), max([first_wall, *(b for _, b, _ in gaps)])
        window = [row for row in rows if row["end"] > low and row["end"] - row["seconds"] < high]
        return {"window_steps": [_compact(row, send_wall) for row in window],
                "step_attribution": {"largest_step": None, "gap_p90_ms": None, "large_gaps": [],
                                     "not_attributed": "steps of several data-parallel workers; which worker "
                                                       "served each stream is not known"}}
    low = min([send_wall, *(a for a, _, _ in gaps)])
    high = max([first_wall, *(b for _, b, _ in gaps)])
    window = [row for row in rows if row["end"] > low and row["end"] - row["seconds"] < high]
    inside = [i for i, row in enumerate(window) if row["end"] > send_wall and row["end"] - row["seconds"] < first_wall]
    largest = max(inside, key=lambda i: window[i]["seconds"], default=None)
    p90 = percentile([b - a for a, b, _ in gaps], 90)
    large = []
    for a, b, stream in sorted(gaps, key=lambda gap: gap[1]):
        if p90 is None or b - a < p90:
            continue
        ended = [i for i, row in enumerate(window) if a < row["end"] <= b]
        longest = max(ended, key=lambda i: window[i]["seconds"], default=None)
        large.append({"gap_ms": round((b - a) * 1e3, 3), "stream": stream, "end_ms": round((b - send_wall) * 1e3, 3),
                      "steps": ended, "longest": None if longest is None else _named(longest, window[longest])})
    return {
        "window_steps": [_compact(row, send_wall) for row in window],
        "step_attribution": {
            "largest_step": None if largest is None else _named(largest, window[largest]),
            "gap_p90_ms": None if p90 is None else round(p90 * 1e3, 3),
            "large_gaps": large,
        },
    }


NO_TRACE = {"trace_clock": None, "window_steps": None, "step_attribution": None}


async def for_repeat(client: httpx.AsyncClient, *, wall_minus_perf_s: float, send: float, first: float,
                     gaps: list[tuple[float, float, int]]) -> dict:
    """The point's trace keys for one measured repeat (send, first token and the gaps on perf_counter), fetched right
    after it; NO_TRACE where the server has no step trace."""
    to_wall = wall_minus_perf_s
    send_wall, first_wall = send + to_wall, first + to_wall
    walled = [(a + to_wall, b + to_wall, k) for a, b, k in gaps]
    since = min([send_wall, *(a for a, _, _ in walled)]) - MARGIN_S
    rows = await fetch(client, since)
    if rows is None:
        return dict(NO_TRACE)
    clock = {"send_wall_s": send_wall, "wall_minus_perf_s": to_wall, "since_s": since}
    return {"trace_clock": clock, **attribute(rows, send_wall=send_wall, first_wall=first_wall, gaps=walled)}


def largest_of(points: list[dict]) -> dict | None:
    """The summary's `largest_window_step`: the longest window step of any measured repeat (its repeat named)."""
    named = [{"repeat": p["repeat"], **p["step_attribution"]["largest_step"]} for p in points
             if (p.get("step_attribution") or {}).get("largest_step")]
    return max(named, key=lambda s: s["ms"], default=None)
