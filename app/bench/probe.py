"""`ft bench probe`: warmed single streams (127, 255 and 1,023 output tokens by default).

Per length: one warm-up request, then ``repeats`` requests one after another; medians of steady
decode (tokens after the first over the time after the first), end-to-end tok/s and TTFT.
"""

from __future__ import annotations

from app.bench.context import Ctx
from app.bench.figures import failures_of, request_figures, short_outputs


async def run(ctx: Ctx, *, lengths: list[int], repeats: int, warmup_tokens: int) -> None:
    record = ctx.record
    task = ctx.progress.add_task("probe", total=len(lengths) * repeats)
    for n in lengths:
        where = f"tokens={n}"
        ctx.progress.update(task, description=where)
        warm = await ctx.warm_up(1, 1, warmup_tokens, where)
        results = []
        for _ in range(repeats):
            results += (await ctx.chat_round(1, n)).results
            ctx.progress.advance(task)
        short_outputs(results, n)
        point = {"max_tokens": n, "repeats": repeats, "warmup": warm, **request_figures(results)}
        point["runs"] = [r.as_dict(keep_times=ctx.logprobs) for r in results]  # per-token times with --logprobs
        failures = failures_of(results, where)
        for f in failures:
            record.fail(**f)
        point["ok"] = not failures
        record.points.append(point)
