"""`ft bench turns`: an agent's second turn after a long shared prefix, resumed from the server's prefix cache
(issue 14's criterion: turn 2's time to first token at most 15 % of turn 1's, at a 16k-token prefix on the H200).

One repeat is a fresh conversation (/v1/chat/completions, greedy, streamed, usage in the last chunk). Turn 1: a
system message of `prefix_tokens` tokens (a fresh nonce leading it, as `ft bench prefill` sizes and marks its
prompts: turn 1 never hits the cache, not even a page of another run's prefix) and a short question. Turn 2:
the same messages, turn 1's answer and a new question of about `follow_up_tokens` tokens: it should resume the
prefix from the cache. Both turns generate `max_tokens` tokens (ignore_eos). TTFT is the client's, to the first
streamed token (reasoning and tool-call tokens count: a thinking model's first token is reasoning), HTTP
included; prompt and cached tokens are the server's (usage.prompt_tokens_details.cached_tokens).

The ratio is turn 2's TTFT over turn 1's, per repeat; the summary's `ratio_median` is judged against
`max_ratio` (`meets_max_ratio`, a verdict, not a failure). Failures: a turn that failed or reported no usage,
and a turn 2 that reported no cached tokens. `warmup` unrecorded conversations go first (the first long prefill
can tune kernels); they are kept as `warmup_runs`. The server's /v1/stats `prefix_cache` section before and after
the measured repeats is kept (null for a server that is not fluxtide).

Supersedes scripts/bench_prefix_cache.py for new records (the same scenario; its records stay reproducible with it).
"""

from __future__ import annotations

from app.bench import target
from app.bench.client import RequestResult, chat_body, stream_request
from app.bench.context import Ctx
from app.bench.figures import median
from app.bench.prefill import FILLER, calibrate, make_prompt, units_at_least

QUESTION = "Summarise the text above in one word."
FOLLOW_UP = "And now in two words? "


async def _turn(ctx: Ctx, messages: list[dict], max_tokens: int) -> RequestResult:
    return await stream_request(ctx.client, *chat_body(ctx.model, messages, max_tokens), ctx.timeout)


async def conversation(ctx: Ctx, *, prefix_units: int, follow_up_units: int,
                       max_tokens: int) -> tuple[RequestResult, RequestResult | None]:
    """(turn 1, turn 2) of one fresh conversation; turn 2 is None when turn 1 failed."""
    messages = [{"role": "system", "content": make_prompt(prefix_units)}, {"role": "user", "content": QUESTION}]
    first = await _turn(ctx, messages, max_tokens)
    if not first.ok:
        return first, None
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": FOLLOW_UP + FILLER * follow_up_units}]
    return first, await _turn(ctx, messages, max_tokens)


def problems(first: RequestResult, second: RequestResult | None) -> list[str]:
    """Why a conversation does not measure a resumed turn 2 (empty: it does). second: None when turn 1 failed (its
    error says why)."""
    found = []
    for name, res in (("turn 1", first), ("turn 2", second)):
        if res is not None and not res.ok:
            found.append(f"{name}: {res.error}")
        elif res is not None and res.prompt_tokens is None:
            found.append(f"{name}: no usage reported (stream_options.include_usage)")
    if found or second is None:
        return found
    if second.cached_tokens is None:
        found.append("turn 2: no cached_tokens reported (usage.prompt_tokens_details)")
    elif second.cached_tokens <= 0:
        found.append(f"turn 2: no prefix-cache hit (0 of {second.prompt_tokens} prompt tokens cached)")
    return found


def point_of(repeat: int, first: RequestResult, second: RequestResult | None) -> dict:
    """One conversation's record: both turns (TTFT, total time `end_s`, prompt, cached and completion tokens) and
    the ratio of their TTFTs (None unless both turns streamed a token)."""
    measured = first.ok and second is not None and second.ok and bool(first.ttft_s) and second.ttft_s is not None
    found = problems(first, second)
    new = (second.prompt_tokens - second.cached_tokens if second is not None and second.prompt_tokens is not None
           and second.cached_tokens is not None else None)
    return {
        "repeat": repeat,
        "turn1": first.as_dict(),
        "turn2": second.as_dict() if second is not None else None,
        "turn2_new_tokens": new,  # the prompt tokens turn 2 prefilled (not from the cache)
        "ratio": second.ttft_s / first.ttft_s if measured else None,
        "ok": not found,
        "error": found[0] if found else None,
        "errors": found,
    }


def _hit(point: dict) -> bool:
    """Turn 2 resumed from the cache (cached_tokens > 0); False when it failed, was not sent or did not say."""
    return ((point["turn2"] or {}).get("cached_tokens") or 0) > 0


def summary(points: list[dict], max_ratio: float) -> dict:
    """Medians over the repeats that have a ratio; `every_turn2_hit_the_cache` over all repeats (False for none);
    `meets_max_ratio`: ratio_median <= max_ratio (None without a ratio)."""
    timed = [p for p in points if p["ratio"] is not None]
    ratio = median(p["ratio"] for p in timed)
    return {
        "repeats": len(points),
        "measured_repeats": len(timed),
        "turn1_ttft_s_median": median(p["turn1"]["ttft_s"] for p in timed),
        "turn2_ttft_s_median": median(p["turn2"]["ttft_s"] for p in timed),
        "turn1_prompt_tokens_median": median(p["turn1"]["prompt_tokens"] for p in timed),
        "turn2_prompt_tokens_median": median(p["turn2"]["prompt_tokens"] for p in timed),
        "turn2_cached_tokens_median": median(p["turn2"]["cached_tokens"] for p in timed),
        "ratio_median": ratio,
        "max_ratio": max_ratio,
        "meets_max_ratio": ratio <= max_ratio if ratio is not None else None,
        "every_turn2_hit_the_cache": bool(points) and all(_hit(p) for p in points),
    }


async def run(ctx: Ctx, *, prefix_tokens: int, follow_up_tokens: int, max_tokens: int, repeats: int,
              warmup: int = 1, max_ratio: float = 0.15) -> None:
    record = ctx.record
    a, b = await calibrate(ctx)
    # NOTE: rounded up, as `ft bench mixed` sizes its prompt: the prefix is at least --prefix-tokens
    units = {"prefix_units": units_at_least(prefix_tokens, a, b),
             "follow_up_units": max(1, round(follow_up_tokens / b))}
    record.data["settings"]["calibration"] = {"tokens_fixed": a, "tokens_per_filler_unit": b, "filler": FILLER,
                                             **units}
    task = ctx.progress.add_task("turns", total=warmup + repeats)
    warm = []
    for i in range(warmup):
        ctx.progress.update(task, description=f"warm-up {i}")
        first, second = await conversation(ctx, max_tokens=max_tokens, **units)
        ctx.fail_warmups([r for r in (first, second) if r is not None], f"conversation {i}")
        warm.append(point_of(i, first, second))
        ctx.progress.advance(task)
    before = await target.prefix_cache(ctx.client)
    for i in range(repeats):
        where = f"repeat {i}"
        ctx.progress.update(task, description=where)
        first, second = await conversation(ctx, max_tokens=max_tokens, **units)
        point = {**point_of(i, first, second), "prefix_tokens_target": prefix_tokens}
        for error in point["errors"]:
            turn = second if error.startswith("turn 2") else first
            record.fail(where, error, status=turn.status)
        record.points.append(point)
        ctx.progress.advance(task)
    record.data["summary"] = {**summary(record.points, max_ratio), "warmup_runs": warm,
                              "prefix_cache_before": before, "prefix_cache_after": await target.prefix_cache(ctx.client)}
    if not record.data["summary"]["measured_repeats"]:
        # NOTE: a failure of the run, not a run that could not be done: exit 3, as every subcommand whose points
        # all failed (it was exit 1 here, through BenchError)
        record.fail("run", "no repeat could be measured (see failures)")
