"""Figures from timed requests: medians over requests, sums over rounds. No maximum is reported
as a rate: every rate is tokens over the time they took, or a median of such."""

from __future__ import annotations

import statistics

from app.bench.client import RequestResult, Round


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def request_figures(results: list[RequestResult]) -> dict:
    """Medians over the requests that succeeded, and the count of those that failed."""
    ok = [r for r in results if r.ok]
    return {
        "requests": len(results),
        "failed_requests": len(results) - len(ok),
        "completion_tokens": sum(r.completion_tokens or 0 for r in ok),
        "ttft_s_median": median(r.ttft_s for r in ok),
        "steady_decode_tok_s_median": median(r.steady_tok_s for r in ok),
        "e2e_tok_s_median": median(r.e2e_tok_s for r in ok),
    }


def rounds_figures(rounds: list[Round], concurrency: int) -> dict:
    """Aggregate over rounds: all tokens over all round time (each round timed from its first
    send to its last token); per-request = aggregate / concurrency (the customer's table)."""
    results = [r for rnd in rounds for r in rnd.results]
    figures = request_figures(results)
    wall = sum(rnd.wall_s for rnd in rounds)
    tokens = sum(rnd.tokens for rnd in rounds)
    aggregate = tokens / wall if wall > 0 and tokens else None
    figures.update({
        "rounds": len(rounds),
        "wall_s": wall,
        "aggregate_tok_s": aggregate,
        "per_request_tok_s": aggregate / concurrency if aggregate else None,
        "round_aggregate_tok_s": [rnd.aggregate_tok_s for rnd in rounds],
    })
    return figures


def failures_of(results: list[RequestResult], where: str) -> list[dict]:
    return [{"where": where, "error": r.error, "status": r.status} for r in results if not r.ok]


def short_outputs(results: list[RequestResult], expected: int) -> None:
    """Mark requests that stopped before ``expected`` tokens (server ignored ignore_eos or the
    context ran out) as failed: their rates are not the rates of the asked-for length."""
    for r in results:
        if r.ok and (r.completion_tokens or 0) < expected:
            r.error = (f"short output: {r.completion_tokens} of {expected} tokens "
                       f"(finish_reason {r.finish_reason!r}; does the server honour ignore_eos?)")
