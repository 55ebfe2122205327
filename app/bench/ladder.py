"""`ft bench ladder`: the concurrency ladder (c1, c2, c4, c8, c16 by default).

Each rung: warm-up rounds, then measured rounds of ``c`` simultaneous requests with fixed-length
outputs. Figures: aggregate output tok/s, median steady decode per request, median TTFT, and how many
requests the server admitted at once and how many waited: on fluxtide its high-water marks over the
measured rounds (POST /v1/stats/reset_peaks before and after them; no poll disturbs the measured rounds),
elsewhere the peaks of the load a poll saw (llama.cpp's /metrics), null with the reason where no poll saw the
rung's requests.
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


async def _peaks(ctx: Ctx, workers: int | None) -> dict | None:
    """fluxtide's high-water marks since the last call, restarted (None where the server has no such route). Behind
    a data-parallel front (`workers`) only the front's own answer, every worker's summed, counts: a front without
    the route forwards the call to one worker, whose peaks are not the server's."""
    peaks = await target.reset_peaks(ctx.client)
    if peaks is not None and workers and peaks.get("data_parallel") != workers:
        return None
    return peaks


def load_figures(peaks: dict | None, sampler: PoolSampler, completed: int, fluxtide: bool) -> dict:
    """admitted / queued of a rung: the server's high-water marks where it keeps them (they cannot miss a request),
    else the peaks its stats polls saw; null with the reason when no poll saw the rung's requests running (a poll
    between two requests sees none: `admitted 0` for a rung whose requests ran was a confident wrong figure)."""
    if peaks is not None and peaks.get("data_parallel"):
        # NOTE: each worker's own peak, summed: an upper bound of the front's (the workers peak at different times)
        return {"admitted": peaks["running_peak"], "queued": peaks["waiting_peak"],
                "admitted_source": "sum of the workers' high-water marks",
                "admitted_note": "an upper bound: each worker's peak, at its own moment"}
    if peaks is not None:
        return {"admitted": peaks["running_peak"], "queued": peaks["waiting_peak"],
                "admitted_source": "high-water mark", "admitted_note": None}
    if sampler.max_running is None or (completed and not sampler.max_running):
        note = f"not observed: {sampler.samples} stats samples"
        if not sampler.samples and not fluxtide:
            note += " (the server publishes neither fluxtide's /v1/stats nor llama.cpp's /metrics gauges)"
        return {"admitted": None, "queued": None, "admitted_source": None, "admitted_note": note}
    return {"admitted": sampler.max_running, "queued": sampler.max_waiting, "admitted_source": "stats polls",
            "admitted_note": None}


async def run(ctx: Ctx, *, levels: list[int], tokens: int, rounds: int, warmup: int, warmup_tokens: int,
              sample_s: float) -> None:
    record = ctx.record
    fluxtide = record.data["target"]["fluxtide"]
    workers = ((record.data.get("server") or {}).get("stats") or {}).get("data_parallel")
    props = (record.data.get("server") or {}).get("props") or {}
    # fluxtide: its GDN state slots; llama.cpp: its server slots (/props)
    capacity = (record.data["pool_plan"] or {}).get("state_slots") or props.get("total_slots")
    task = ctx.progress.add_task("ladder", total=len(levels))
    for c in levels:
        where = f"c={c}"
        ctx.progress.update(task, description=where)
        point = {"concurrency": c, "warmup": await ctx.warm_up(c, warmup, warmup_tokens, where)}
        # NOTE: the marks restart after the warm-up, so they span the measured rounds only
        started = await _peaks(ctx, workers) if fluxtide else None
        sampler = PoolSampler(ctx, sample_s, fluxtide)
        # NOTE: a server that keeps high-water marks is not polled while it is measured: every poll is work in the
        # server's process beside the streams (a /v1/stats that walked the frozen heap once cost bs1 a third)
        async with sampler if started is None else contextlib.nullcontext():
            measured = [await ctx.chat_round(c, tokens) for _ in range(rounds)]
        peaks = await _peaks(ctx, workers) if started is not None else None
        results = [r for rnd in measured for r in rnd.results]
        short_outputs(results, tokens)
        point.update(rounds_figures(measured, c))
        completed = sum(1 for r in results if r.ok)
        # NOTE: measured, not inferred: the most requests running (admitted) and waiting (queued) at once during
        # the measured rounds, as the server counted them
        point.update(load_figures(peaks, sampler, completed, fluxtide))
        point.update({"stats_samples": sampler.samples, "running_capacity": capacity})
        failures = failures_of(results, where)
        for f in failures:
            record.fail(**f)
        point["ok"] = not failures and point["aggregate_tok_s"] is not None
        record.points.append(point)
        ctx.progress.advance(task)
