"""`ft bench prefill`: TTFT and prefill tok/s for long prompts (1k, 4k, 8k, 16k, 32k tokens).

Over HTTP the tokenizer is the server's, so prompt sizes are found by measurement: two
calibration requests give tokens = a + b x filler units (from the server's usage counts), and each
prompt is then sized to its target; the record keeps the prompt size the server actually counted.
Every prompt starts with a fresh nonce so a server's prefix cache cannot serve it. One output token
per request (/v1/completions, no chat template): TTFT is the prefill, prefill tok/s = prompt
tokens / TTFT (HTTP and queueing included, as a user sees it).
"""

from __future__ import annotations

import itertools

from app.bench.client import completion_body, stream_request
from app.bench.context import Ctx
from app.bench.figures import failures_of, median, request_figures
from app.bench.target import BenchError

FILLER = "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat. "
_nonce = itertools.count(1)


def make_prompt(units: int) -> str:
    return f"Request {next(_nonce):06d}. " + FILLER * units


async def _prompt_tokens(ctx: Ctx, units: int) -> int:
    res = await stream_request(ctx.client, *completion_body(ctx.model, make_prompt(units), 1), ctx.timeout)
    if not res.ok or res.prompt_tokens is None:
        raise BenchError(f"prefill calibration failed ({units} filler units): {res.error or 'no usage reported'}")
    return res.prompt_tokens


async def calibrate(ctx: Ctx, low: int = 2, high: int = 8) -> tuple[float, float]:
    """(a, b): prompt tokens = a + b x units, measured on the server's own tokenizer."""
    t_low, t_high = await _prompt_tokens(ctx, low), await _prompt_tokens(ctx, high)
    b = (t_high - t_low) / (high - low)
    if b <= 0:
        raise BenchError(f"prefill calibration: {high - low} more filler units added {t_high - t_low} tokens")
    return t_low - b * low, b


async def run(ctx: Ctx, *, sizes: list[int], repeats: int) -> None:
    record = ctx.record
    a, b = await calibrate(ctx)
    record.data["settings"]["calibration"] = {"tokens_fixed": a, "tokens_per_filler_unit": b, "filler": FILLER}
    task = ctx.progress.add_task("prefill", total=len(sizes) * repeats)
    for size in sizes:
        where = f"prompt={size}"
        ctx.progress.update(task, description=where)
        units = max(1, round((size - a) / b))
        results = []
        for _ in range(repeats):
            body = completion_body(ctx.model, make_prompt(units), 1)
            results.append(await stream_request(ctx.client, *body, ctx.timeout))
            ctx.progress.advance(task)
        ok = [r for r in results if r.ok]
        point = {
            "prompt_tokens_target": size,
            "prompt_tokens": median(r.prompt_tokens for r in ok),
            "repeats": repeats,
            **request_figures(results),
            "prefill_tok_s_median": median(r.prompt_tokens / r.ttft_s for r in ok if r.prompt_tokens and r.ttft_s),
            "runs": [r.as_dict() for r in results],
        }
        failures = failures_of(results, where)
        for f in failures:
            record.fail(**f)
        point["ok"] = not failures
        point["error"] = failures[0]["error"] if failures else None
        record.points.append(point)
