"""`ft bench sweep`: the customer's KV-pool sweep (SPEC.md, Benchmark methodology).

For each KV size: live-rebuild the pools (fluxtide's /v1/cache/rebuild, expert slots 'auto' by
default: whatever the budget leaves), then for each batch size: warm-up rounds of short outputs
(fill the expert cache), then measured rounds; a round is ``batch`` concurrent requests of the
prompt "Count from 1 to 100." with temperature 0 and ignore_eos. Per point: aggregate tok/s (all
measured tokens over all measured round time), per-request tok/s (aggregate / batch), median steady
decode and TTFT, the expert hit rate and PCIe bytes over the measured rounds.

A sweep that resizes leaves the server as it found it: the pool plan in force before the first rebuild (KV
tokens, expert slots, state slots) is rebuilt at the end, also after a failure or Ctrl-C (the record's
``restored``; a restore that fails is a failure of the run).
"""

from __future__ import annotations

from app.bench import target
from app.bench.context import Ctx
from app.bench.figures import failures_of, rounds_figures, short_outputs
from app.bench.target import BenchError

RESTORED = ("kv_tokens", "expert_slots", "state_slots")  # the plan's sizes a sweep restores (the pools it resizes)


async def run(ctx: Ctx, *, kv_sizes: list, moe: int | str, batch_sizes: list[int], warmup: int,
              warmup_tokens: int, iterations: int, tokens: int, rebuild_wait: float) -> None:
    record = ctx.record
    if kv_sizes != ["current"] and not record.data["target"]["fluxtide"]:
        raise BenchError("this server has no rebuild API (/v1/cache/rebuild); sweep it with --kv current")
    start = None
    if any(kv != "current" for kv in kv_sizes):
        start = await target.pool_plan(ctx.client)
        if start is None or not all(isinstance(start.get(k), int) for k in RESTORED):
            raise BenchError("cannot read the server's pool plan (/v1/cache/status) to restore it after the sweep")
    try:
        await _sweep(ctx, kv_sizes=kv_sizes, moe=moe, batch_sizes=batch_sizes, warmup=warmup,
                     warmup_tokens=warmup_tokens, iterations=iterations, tokens=tokens, rebuild_wait=rebuild_wait)
    finally:  # NOTE: also on a BenchError or Ctrl-C (asyncio.run cancels this task, so the await below still runs)
        if start is not None:
            await _restore(ctx, start, rebuild_wait)


async def _restore(ctx: Ctx, start: dict, wait_s: float) -> None:
    """Rebuild the pools the sweep found; the record's ``restored`` says how it went."""
    sizes = {k: start[k] for k in RESTORED}
    outcome = await target.rebuild(ctx.client, sizes["kv_tokens"], sizes["expert_slots"], wait_s,
                                   mamba_slots=sizes["state_slots"])
    ctx.record.data["restored"] = {**sizes, "ok": outcome.ok, "status": outcome.status, "error": outcome.error}
    if not outcome.ok:
        ctx.record.fail(f"restore kv={sizes['kv_tokens']} moe={sizes['expert_slots']} "
                        f"mamba={sizes['state_slots']}", outcome.error, status=outcome.status, answer=outcome.body)


async def _sweep(ctx: Ctx, *, kv_sizes: list, moe: int | str, batch_sizes: list[int], warmup: int,
                 warmup_tokens: int, iterations: int, tokens: int, rebuild_wait: float) -> None:
    record = ctx.record
    expert_bytes = record.data["model"]["expert_bytes"]
    task = ctx.progress.add_task("sweep", total=len(kv_sizes) * len(batch_sizes))
    for kv in kv_sizes:
        rebuilt = None
        if kv != "current":
            ctx.progress.update(task, description=f"rebuild kv={kv}")
            outcome = await target.rebuild(ctx.client, kv, moe, rebuild_wait)
            # NOTE: waited_s is the wait for in-flight requests only; swap_s the swap, total_s both (the server's)
            rebuilt = {"ok": outcome.ok, "status": outcome.status, "waited_s": outcome.body.get("waited_s"),
                       "swap_s": outcome.body.get("swap_s"), "total_s": outcome.body.get("total_s"),
                       "kept": outcome.body.get("kept")}
            if not outcome.ok:
                record.fail(f"rebuild kv={kv} moe={moe}", outcome.error, status=outcome.status,
                            answer=outcome.body)
                for bs in batch_sizes:
                    record.points.append({"kv_tokens_requested": kv, "batch_size": bs, "ok": False,
                                          "error": outcome.error, "rebuild": rebuilt})
                    ctx.progress.advance(task)
                continue
        for bs in batch_sizes:
            where = f"kv={kv} bs={bs}"
            ctx.progress.update(task, description=where)
            point = {"kv_tokens_requested": kv, "batch_size": bs, "rebuild": rebuilt}
            point.update(_pools(await target.pools(ctx.client)))
            point["warmup"] = await ctx.warm_up(bs, warmup, warmup_tokens, where)
            before = await target.expert_counters(ctx.client)
            rounds = [await ctx.chat_round(bs, tokens) for _ in range(iterations)]
            after = await target.expert_counters(ctx.client)
            results = [r for rnd in rounds for r in rnd.results]
            short_outputs(results, tokens)
            point.update(rounds_figures(rounds, bs))
            point.update(_experts(before, after, expert_bytes))
            failures = failures_of(results, where)
            for f in failures:
                record.fail(**f)
            point["ok"] = not failures and point["aggregate_tok_s"] is not None
            point["error"] = failures[0]["error"] if failures else None
            record.points.append(point)
            ctx.progress.advance(task)


def _pools(pools: dict | None) -> dict:
    keys = ("kv_tokens", "expert_slots", "residency", "state_slots_total")
    return {k: (pools or {}).get(k) for k in keys}


def _experts(before: dict | None, after: dict | None, expert_bytes: int | None) -> dict:
    """Hits and misses over the measured rounds (from /metrics' cumulative counters). Every miss
    copies one expert from host memory: PCIe bytes = misses x bytes per expert."""
    if not before or not after:
        return {"expert_hits": None, "expert_misses": None, "hit_rate": None, "pcie_bytes": None, "pcie_mib": None}
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    pcie = misses * expert_bytes if expert_bytes is not None else None
    return {
        "expert_hits": hits,
        "expert_misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "pcie_bytes": pcie,
        "pcie_mib": pcie / 2**20 if pcie is not None else None,
    }
