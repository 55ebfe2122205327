"""Token-gap figures: the one definition `ft bench mixed` measures and `python -m simulator mixed` predicts (so a
prediction and a record are read alike), and the percentile the server's /v1/stats window uses.

Units: gaps in seconds in, milliseconds out.
"""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of values, interpolated linearly between ranks (numpy's default 'linear');
    None for no values. Raises ValueError for q outside [0, 100]."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def gap_figures(gaps_s: list[float]) -> dict:
    """count, p50, p99 and max of gaps given in seconds, in milliseconds (None without gaps)."""
    ms = [g * 1e3 for g in gaps_s]
    return {"count": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "max_ms": max(ms) if ms else None}


def gaps_between(times: list[float], start: float, end: float, *, overlapping: bool) -> list[float]:
    """Gaps of consecutive arrivals (times ascending, seconds): overlapping=True those that overlap [start, end]
    (later token after start, earlier one before end); False those wholly inside it."""
    pairs = zip(times, times[1:], strict=False)
    if overlapping:
        return [b - a for a, b in pairs if b > start and a < end]
    return [b - a for a, b in pairs if a >= start and b <= end]
