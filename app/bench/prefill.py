"""`ft bench prefill`: TTFT and prefill tok/s for long prompts (1k, 4k, 8k, 16k, 32k tokens).

Over HTTP the tokenizer is the server's, so prompt sizes are found by measurement: two
calibration requests give tokens = a + b x filler units (from the server's usage counts), and each
prompt is then sized to its target; the record keeps the prompt size the server actually counted.
Every prompt starts with a fresh nonce so a server's prefix cache cannot serve it. One output token
per request (/v1/completions, no chat template): TTFT is the prefill, prefill tok/s = prompt
tokens / TTFT (HTTP and queueing included, as a user sees it).

Per size, `warmup` unmeasured requests go before the `repeats` measured ones: the first request of
a server's life at a new size class can pay a one-time cost (e.g. compiling or tuning kernels for the
new shapes: 2.1 s against 0.14 s warm at 1k tokens on an H200), which a median of two would average
into the headline. The cold cost is kept, not dropped: `first_ttft_s` (the first request sent at the size,
warm-up or not) and `warmup_runs`; the medians are over `runs` only.

Every request of a size has a different prompt length (request i of n gets i more filler units than
the first, the n lengths centred on the target): a server that builds something per prompt length
(e.g. torch's cuDNN attention graphs, ~90 ms per new length) pays it on every request of real traffic,
whose lengths vary, so repeats of one length would make it look faster than it is.
"""

from __future__ import annotations

import itertools
import math
import secrets

from app.bench.client import completion_body, stream_request
from app.bench.context import Ctx
from app.bench.figures import failures_of, median, request_figures
from app.bench.target import BenchError

FILLER = "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat. "
# NOTE: the nonce leads the prompt, so two prompts share no cached page: its counter comes first (after the run id,
# the 16th token, the repeats of one `ft bench mixed` run shared their first page; a branch-point snapshot there let
# some repeats resume 16 tokens and skip the prompt's 4-token tail step, H100 2026-12-05), then a run id drawn once
# per process, so a second `ft bench` run against the same server does not resend the first one's prompts (a counter
# alone restarted at 1 and the second run measured the prefix cache: 123k "prefill" tok/s on the CPU demo). Fixed
# width: the same token count for every run.
_RUN_ID = secrets.randbelow(10**8)
_nonce = itertools.count(1)


def make_prompt(units: int) -> str:
    """A prompt of a fresh nonce and ``units`` filler sentences, unlike any other this process or another sent."""
    return f"{next(_nonce):06d}-{_RUN_ID:08d}. Request. " + FILLER * units


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


def units_at_least(tokens: int, a: float, b: float) -> int:
    """Filler units of a make_prompt text of at least ``tokens`` tokens (calibrate's tokens = a + b x units), never
    below 1. NOTE: rounded up: one filler unit short of the target is not it."""
    return max(1, math.ceil((tokens - a) / b))


def units_of(size: int, a: float, b: float, count: int) -> list[int]:
    """Filler units of the ``count`` requests sent at ``size``, in sending order: all different (one more
    unit each), centred on the size's own units (so ``count`` 1 is exactly it), never below 1."""
    first = max(1, round((size - a) / b) - (count - 1) // 2)
    return [first + i for i in range(count)]


async def run(ctx: Ctx, *, sizes: list[int], repeats: int, warmup: int = 1) -> None:
    record = ctx.record
    a, b = await calibrate(ctx)
    record.data["settings"]["calibration"] = {"tokens_fixed": a, "tokens_per_filler_unit": b, "filler": FILLER}
    task = ctx.progress.add_task("prefill", total=len(sizes) * (warmup + repeats))
    for size in sizes:
        where = f"prompt={size}"
        sent = []
        for i, units in enumerate(units_of(size, a, b, warmup + repeats)):
            ctx.progress.update(task, description=where + (" warm-up" if i < warmup else ""))
            body = completion_body(ctx.model, make_prompt(units), 1)
            sent.append(await stream_request(ctx.client, *body, ctx.timeout))
            ctx.progress.advance(task)
        warm, results = sent[:warmup], sent[warmup:]
        warm_failed = ctx.fail_warmups(warm, where)  # the point's figures are the measured requests'
        ok = [r for r in results if r.ok]
        point = {
            "prompt_tokens_target": size,
            "prompt_tokens": median(r.prompt_tokens for r in ok),
            "repeats": repeats,
            **request_figures(results),
            "prefill_tok_s_median": median(r.prompt_tokens / r.ttft_s for r in ok if r.prompt_tokens and r.ttft_s),
            # NOTE: the cold cost, kept visible: the first request sent at this size (a warm-up one unless
            # --warmup 0); null if it failed
            "first_ttft_s": sent[0].ttft_s if sent and sent[0].ok else None,
            "warmup_requests": warmup,
            "warmup_failed_requests": warm_failed,
            "runs": [r.as_dict() for r in results],
            "warmup_runs": [r.as_dict() for r in warm],
        }
        failures = failures_of(results, where)
        for f in failures:
            record.fail(**f)
        point["ok"] = not failures
        point["error"] = failures[0]["error"] if failures else None
        record.points.append(point)
