"""`ft bench ladder`: the concurrency ladder (c1, c2, c4, c8, c16 by default).

Each rung: warm-up rounds, then measured rounds of ``c`` simultaneous requests with fixed-length
outputs. Figures: aggregate output tok/s, median steady decode per request, median TTFT, and (on
fluxtide) how many requests the server admitted at once and how many waited, from /v1/stats
sampled while the rung runs.
"""

from __future__ import annotations

import asyncio
import contextlib

from app.bench import target
from app.bench.context import Ctx
from app.bench.figures import failures_of, rounds_figures, short_outputs


class PoolSampler:
    """Polls /v1/stats' pools (fluxtide) or /metrics' request gauges (llama.cpp's llama-server with
    --metrics) while a rung runs; keeps the peaks of running and waiting requests."""

    def __init__(self, ctx: Ctx, interval_s: float, fluxtide: bool = True) -> None:
        self.ctx, self.interval_s = ctx, interval_s
        self.read = target.pools if fluxtide else target.llama_cpp_load
        self.max_running: int | None = None
        self.max_waiting: int | None = None
        self.samples = 0
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while True:
            pools = await self.read(self.ctx.client)
            if pools is not None:
                self.samples += 1
                self.max_running = max(self.max_running or 0, pools["running"])
                self.max_waiting = max(self.max_waiting or 0, pools["waiting"])
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> PoolSampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def run(ctx: Ctx, *, levels: list[int], tokens: int, rounds: int, warmup: int, warmup_tokens: int,
              sample_s: float) -> None:
    record = ctx.record
    fluxtide = record.data["target"]["fluxtide"]
    props = (record.data.get("server") or {}).get("props") or {}
    # fluxtide: its GDN state slots; llama.cpp: its server slots (/props)
    capacity = (record.data["pool_plan"] or {}).get("state_slots") or props.get("total_slots")
    task = ctx.progress.add_task("ladder", total=len(levels))
    for c in levels:
        where = f"c={c}"
        ctx.progress.update(task, description=where)
        point = {"concurrency": c, "warmup": await ctx.warm_up(c, warmup, warmup_tokens, where)}
        async with PoolSampler(ctx, sample_s, fluxtide) as sampler:
            measured = [await ctx.chat_round(c, tokens) for _ in range(rounds)]
        results = [r for rnd in measured for r in rnd.results]
        short_outputs(results, tokens)
        point.update(rounds_figures(measured, c))
        point.update({
            # NOTE: measured, not inferred: the peaks of running (admitted) and waiting (queued)
            # requests that /v1/stats (llama.cpp: /metrics) showed during the measured rounds; null
            # on a server that publishes neither
            "admitted": sampler.max_running,
            "queued": sampler.max_waiting,
            "stats_samples": sampler.samples,
            "running_capacity": capacity,
        })
        failures = failures_of(results, where)
        for f in failures:
            record.fail(**f)
        point["ok"] = not failures and point["aggregate_tok_s"] is not None
        record.points.append(point)
        ctx.progress.advance(task)
