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

Every request of a size has a different prompt length: a server that builds something per prompt length (e.g.
torch's cuDNN attention graphs, ~90 ms per new length) pays it on every request of real traffic, whose lengths
vary, so repeats of one length would make it look faster than it is. The measured requests' lengths are centred on
the target (their median is the target's own size); the warm-ups take lengths beside them (units_of).

A size whose longest request cannot fit the server's context (target.context_tokens) is refused before any of its
requests is sent: a failed point that says why (its warm-up once fitted where a measured request did not, and the
table showed a TTFT beside "failed 1").
"""

from __future__ import annotations

import itertools
import math
import secrets

from app.bench import target
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


def units_of(size: int, a: float, b: float, repeats: int, warmup: int = 0) -> tuple[list[int], list[int]]:
    """Filler units of the requests sent at ``size``: (warm-up, measured), each in sending order, all different. With
    c the size's own units, the measured ones are centred on c: c-k .. c+k for an odd count, c-k .. c-1 and
    c+1 .. c+k for an even one (so their median is c's length; an odd count measures c itself); the warm-ups take c
    where the measured skip it, then the lengths above the longest measured. NOTE: the warm-ups once took the
    shortest lengths and the measured the rest, so the measured sat half a unit or more above the target (256 was
    measured at 293 tokens on the demo's 42-token unit). Never below 1 unit (all moved up together)."""
    c = round((size - a) / b)
    half = repeats // 2
    measured = [c + d for d in range(-half, half + 1) if repeats % 2 or d]
    spare = ([] if repeats % 2 else [c]) + [c + half + 1 + i for i in range(warmup)]
    warm = spare[:warmup]
    shift = max(0, 1 - min(measured + warm))
    return [u + shift for u in warm], [u + shift for u in measured]


def over_context(size: int, units: list[int], a: float, b: float, context: int | None, source: str | None) -> str | None:
    """Why the requests of ``size`` (``units``: every one of them) cannot fit the server's context, or None. A
    request holds its prompt and its one output token."""
    if context is None:
        return None
    longest = max(units)
    need = round(a + b * longest) + 1
    if need <= context:
        return None
    c = round((size - a) / b)
    fits = math.floor((context - 1 - a) / b) - (longest - c)  # the largest size's own units whose requests all fit
    largest = (f"; the largest size whose requests all fit is about {round(a + b * fits)} tokens" if fits >= 1
               else "")
    return (f"not sent: its longest request needs {need} tokens (a {need - 1}-token prompt and 1 output token), past "
            f"the server's context of {context} tokens ({source}){largest}")


async def run(ctx: Ctx, *, sizes: list[int], repeats: int, warmup: int = 1) -> None:
    record = ctx.record
    a, b = await calibrate(ctx)
    record.data["settings"]["calibration"] = {"tokens_fixed": a, "tokens_per_filler_unit": b, "filler": FILLER}
    context, source = target.context_tokens(record.data.get("server") or {}, ctx.model)
    record.data["settings"]["context"] = {"tokens": context, "source": source}
    task = ctx.progress.add_task("prefill", total=len(sizes) * (warmup + repeats))
    for size in sizes:
        where = f"prompt={size}"
        warm_units, units = units_of(size, a, b, repeats, warmup)
        if (why := over_context(size, warm_units + units, a, b, context, source)) is not None:
            record.fail(where, why)
            record.points.append({"prompt_tokens_target": size, "prompt_tokens": None, "repeats": repeats,
                                  "requests": 0, "warmup_requests": 0, "not_sent": "over the context", "ok": False,
                                  "error": why})
            ctx.progress.advance(task, warmup + repeats)
            continue
        sent = []
        for i, n in enumerate(warm_units + units):
            ctx.progress.update(task, description=where + (" warm-up" if i < warmup else ""))
            body = completion_body(ctx.model, make_prompt(n), 1)
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
