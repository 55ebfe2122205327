"""How a burst of concurrent requests lands on an idle server: a real server on 127.0.0.1 with the tests' fake model
at `--step-ms` a step, `--rounds` rounds of c concurrent streamed requests from the async openai client, with the
arrival window (ADR 0021) at each `--windows` setting. For each idle wake it records how many submissions were
queued when the engine started waiting and when its first step launched; per round, the median time to the first
content token.

Why: whether the requests of a burst share the first prefill step decides their time to first token on a host-bound
prefill (the ladder's c4 TTFT was twice c1's on the H200). CPU only; a fake model, so the seconds are the fake's.

Usage: python scripts/diag/probe_arrival_bursts.py [--step-ms 70] [--rounds 4] [--concurrency 1,4,16]
       [--windows 0,30:2,30:10]   (MAX_MS[:QUIET_MS]; run from the root of the checkout). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())


def run(step_ms: float, rounds: int, concurrency: list[int], window: str) -> dict:
    import openai

    from domain.arrival_window import QUIET_S, ArrivalWindow
    from tests.app.conftest import MODEL, make_container, start_server

    max_ms, _, quiet_ms = window.partition(":")
    server = start_server(make_container(delay=step_ms / 1000), kv_tokens=4096, max_running_requests=max(concurrency),
                          max_prefill_length=2048)
    engine = server.runtime.engine
    engine.arrival_window = ArrivalWindow(float(max_ms) / 1000, quiet_s=float(quiet_ms) / 1000 if quiet_ms else QUIET_S)
    wakes: list[dict] = []
    real = engine._await_burst

    def recorded() -> None:
        queued = engine._commands.qsize()
        started = time.monotonic()
        real()
        wakes.append({"waited_ms": round(1000 * (time.monotonic() - started), 2), "queued_at_wake": queued,
                      "queued_at_step": engine._commands.qsize()})

    engine._await_burst = recorded
    engine_idle = engine.arrival_window.max_s == 0  # _await_burst is not called without a window: count the queue
    if engine_idle:
        drain = engine._drain_commands

        def counted() -> None:
            if engine._commands.qsize():
                wakes.append({"queued_at_step": engine._commands.qsize()})
            drain()

        engine._drain_commands = counted

    async def one(client, i: int) -> float | None:
        started = time.monotonic()
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from 1 to 100 {i}"}], max_tokens=4, stream=True,
            extra_body={"ignore_eos": True})
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - started
        return first

    async def main() -> dict:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        out = {}
        for c in concurrency:
            medians = []
            for _ in range(rounds):
                ttfts = [t for t in await asyncio.gather(*(one(client, i) for i in range(c))) if t is not None]
                medians.append(round(statistics.median(ttfts), 4))
                await asyncio.sleep(0.2)  # idle again before the next round
            out[f"c{c}"] = {"median_ttft_s_per_round": medians}
        await client.close()
        return out

    try:
        result = asyncio.run(main())
    finally:
        server.stop()
    return {"window": window, "ttft": result, "wakes": wakes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, default=70.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    p.add_argument("--windows", type=lambda s: s.split(","), default=["0", "30:2", "30:10"])
    args = p.parse_args(argv)
    print(json.dumps({"step_ms": args.step_ms, "runs": [run(args.step_ms, args.rounds, args.concurrency, w)
                                                       for w in args.windows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
