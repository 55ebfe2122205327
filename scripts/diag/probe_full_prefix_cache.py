"""Does a full prefix cache make the engine's host work slower? A real server on 127.0.0.1 with the tests' fake model
(`--step-ms` a step) and a KV pool of `--pages` pages of 16 tokens: the resident ladder's requests (an 18-token
prompt, 128 streamed tokens, every request after the first resuming from the cache) in rounds of 1 and 4, first on
the fresh server, then after filling its prefix cache with long prompts of distinct nonces (as `ft bench prefill`
does) until the cached pages reach the pool and the snapshot slots are all held; the same rounds again.

Per phase: client time to first token (p50/p90 per concurrency); each request's time from its submission to the
launch of its first step (`submit_to_launch`: the arrival window's quiet gap, the command drain, the admission's
schedule() and the executor call; an idle engine's first step has no `host_s`, so this is its host time); the engine's
host time between two model calls (`host_s`, as /v1/stats computes it) of the decode steps; the time spent in the
scheduler / prefix store / radix cache calls that may depend on the cache's size (calls, mean, max); garbage collector
pauses by generation. The client runs in the server's process (one GIL): its own time is in the client's TTFT.

Why: on the H200 the ladder's c1-c4 median TTFT was 0.033-0.037 s on a fresh server and 0.067-0.084 s on one that had
just served the probe and prefill benchmarks (4,095 of 4,096 pages cached). CPU only; a fake model, so the step
seconds are the fake's: the host-side numbers are the point.

Usage: python scripts/diag/probe_full_prefix_cache.py [--pages 4096] [--step-ms 5] [--rounds 10]
       [--fill-tokens 1024,2048,4096,8192,16384,32768] [--short-tokens 256] [--short-per-long 12]
       [--snapshot-slots N] [--debug]   (run from the root of the checkout).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.getcwd())

from domain.gap_stats import percentile  # noqa: E402  (the repository root first)

PROMPT = "Count from 1 to 10"  # 18 byte tokens with the fake tokenizer: the ladder's 18-token prompt


class Timings:
    """Wall time of wrapped calls (engine thread), by name."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.steps: list[dict] = []  # per model call: host_s, step_s, prefill tokens

    def wrap(self, obj, name: str, label: str) -> None:
        real = getattr(obj, name)

        @functools.wraps(real)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.calls[label].append(time.perf_counter() - started)

        setattr(obj, name, timed)

        self.launch_s: list[float] = []  # per request: from its submission to the launch of its first step
        self.gc: dict[int, list[float]] = defaultdict(list)  # generation -> pause seconds (any thread)
        self._gc_started = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc[info["generation"]].append(time.perf_counter() - self._gc_started)

    def reset(self) -> None:
        self.calls.clear()
        self.steps.clear()
        self.launch_s.clear()
        self.gc.clear()

    def gc_summary(self) -> dict:
        return {f"gen{g}": {"collections": len(v), "total_ms": round(1000 * sum(v), 3), "max_ms": round(1000 * max(v), 3)}
                for g, v in sorted(self.gc.items())}

    def summary(self) -> dict:
        out = {}
        for label, values in sorted(self.calls.items()):
            out[label] = {"calls": len(values), "total_ms": round(1000 * sum(values), 3),
                          "mean_us": round(1e6 * statistics.fmean(values), 1), "max_ms": round(1000 * max(values), 3)}
        return out


def _steps_summary(steps: list[dict]) -> dict:
    out = {}
    for kind, chosen in (("admitting", [s for s in steps if s["prefill"]]),
                         ("decode", [s for s in steps if not s["prefill"]])):
        host = [s["host_s"] for s in chosen if s["host_s"] is not None]
        out[kind] = {"steps": len(chosen), "host_ms_p50": _r(percentile(host, 50)), "host_ms_p90": _r(percentile(host, 90)),
                     "host_ms_max": _r(max(host) if host else None),
                     "step_ms_p50": _r(percentile([s["step_s"] for s in chosen], 50))}
    return out


def _r(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def run(args) -> dict:
    import httpx
    from dependency_injector import providers

    from tests.app.conftest import TINY_SPEC, make_container, start_server

    spec = dataclasses.replace(TINY_SPEC, max_context=max(65536, 2 * max(args.fill_tokens)))
    container = make_container(delay=args.step_ms / 1000)
    container.model_spec.override(providers.Object(spec))
    server = start_server(container, kv_tokens=16 * args.pages, max_running_requests=16, max_prefill_length=8192,
                          gpu_budget_gib=4.0, debug=args.debug, snapshot_slots=args.snapshot_slots)
    engine = server.runtime.engine
    scheduler = engine.scheduler
    store = scheduler.prefix
    timings = Timings()
    for obj, names, prefix in ((scheduler, ("schedule", "complete"), "scheduler."),
                               (store, ("match", "attach", "allocate", "take_snapshots", "_free_slot", "commit",
                                        "release"), "prefix_store."),
                               (store.cache, ("match", "insert", "evict", "lock", "unlock"), "radix."),
                               (engine, ("_deliver", "_publish_pools", "_on_idle"), "engine.")):
        for name in names:
            timings.wrap(obj, name, prefix + name)
    record_step = engine.stats.record_step

    def recorded(**kw):
        timings.steps.append({"host_s": kw.get("host_seconds"), "step_s": kw["seconds"],
                              "prefill": kw["prefill_tokens"]})
        return record_step(**kw)

    engine.stats.record_step = recorded
    submitted: dict[str, float] = {}
    real_submit = engine.submit

    def submit(request_id, *a, **kw):
        submitted[request_id] = time.perf_counter()
        return real_submit(request_id, *a, **kw)

    engine.submit = submit
    executor = container.executor()
    real_execute = executor.execute

    def execute(batch):
        now = time.perf_counter()
        for work in batch.works:
            if work.request_id in submitted:
                timings.launch_s.append(now - submitted.pop(work.request_id))
        return real_execute(batch)

    executor.execute = execute
    gc.callbacks.append(timings.on_gc)
    base = server.base_url

    async def one(client, prompt: str, max_tokens: int) -> float | None:
        body = {"model": "tiny-fake", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        started = time.perf_counter()
        first = None
        async with client.stream("POST", "/v1/completions", json=body, timeout=600) as resp:
            async for line in resp.aiter_lines():
                if first is None and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                    first = time.perf_counter() - started
        return first

    def pools() -> dict:
        return httpx.get(base + "/v1/stats").json()["pools"]

    async def ladder(client) -> dict:
        out = {}
        for c in (1, 4):
            await asyncio.gather(*(one(client, PROMPT, 64) for _ in range(c)))  # the ladder's warm-up round
            await asyncio.sleep(0.2)
            timings.reset()
            ttfts = []
            for _ in range(args.rounds):
                ttfts += [t for t in await asyncio.gather(*(one(client, PROMPT, 128) for _ in range(c))) if t]
                await asyncio.sleep(0.2)  # idle again before the next round
            out[f"c{c}"] = {"ttft_ms_p50": _r(percentile(ttfts, 50)), "ttft_ms_p90": _r(percentile(ttfts, 90)),
                            "requests": len(ttfts),
                            "submit_to_launch_ms_p50": _r(percentile(timings.launch_s, 50)),
                            "submit_to_launch_ms_p90": _r(percentile(timings.launch_s, 90)),
                            "steps": _steps_summary(timings.steps), "gc": timings.gc_summary(),
                            "calls": timings.summary(), "pools_after": _cache(pools())}
        return out

    def _cache(p: dict) -> dict:
        c = p["prefix_cache"]
        return {"kv_pages_used": p["kv_pages_used"], "kv_pages_total": p["kv_pages_total"],
                "cached_pages": c["cached_pages"], "evicted_pages": c["evicted_pages"],
                "snapshot_slots_used": c["snapshot_slots_used"], "snapshot_slots_total": c["snapshot_slots_total"]}

    def full(p: dict) -> bool:
        c = p["prefix_cache"]
        return c["cached_pages"] >= 0.99 * p["kv_pages_total"] and c["snapshot_slots_used"] == c["snapshot_slots_total"]

    async def fill(client) -> dict:
        timings.reset()
        started, sent = time.perf_counter(), 0
        # NOTE: each long prompt is followed by short ones: a prompt leaves one snapshot (its last page boundary)
        # plus one per 4,096 tokens, so long prompts alone fill the pages long before the slots
        lengths = [n for tokens in args.fill_tokens for n in (tokens, *[args.short_tokens] * args.short_per_long)]
        while not full(pools()):
            if sent > 4 * len(lengths):
                break  # NOTE: the snapshot slots can bound the cache below the pool (a slot taken evicts pages)
            length = lengths[sent % len(lengths)]
            prompt = f"{sent:08d}-{time.time_ns() % 10**8:08d}. " + "x" * (length - 19)
            await one(client, prompt, 1)
            sent += 1
        return {"requests": sent, "seconds": round(time.perf_counter() - started, 1), "pools": _cache(pools()),
                "calls": timings.summary()}

    async def main() -> dict:
        async with httpx.AsyncClient(base_url=base) as client:
            fresh = await ladder(client)
            filled = await fill(client)
            full = await ladder(client)
        return {"fresh": fresh, "fill": filled, "full": full}

    try:
        return asyncio.run(main())
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=4096)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--fill-tokens", type=lambda s: [int(v) for v in s.split(",")],
                   default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--short-tokens", type=int, default=256, help="the short prompts sent after each long one")
    p.add_argument("--short-per-long", type=int, default=12)
    p.add_argument("--snapshot-slots", type=int, default=None,
                   help="the server's --snapshot-slots (default: 4 per running request, 64 here as on the H200)")
    p.add_argument("--debug", action="store_true", help="the server's --debug (check_valid at every idle)")
    args = p.parse_args(argv)
    print(json.dumps({"pages": args.pages, "step_ms": args.step_ms, "rounds": args.rounds, "debug": args.debug,
                      "snapshot_slots": args.snapshot_slots,
                      **run(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
