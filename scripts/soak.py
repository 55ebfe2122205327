"""Soak a running fluxtide server: N requests at concurrency C, a share of clients that disconnect
mid-stream or time out early, live resizes while it runs; then assert that nothing is held.

    ft serve &                                  # or any server: --base-url
    python scripts/soak.py --requests 1000 --concurrency 16 --resizes 14

Pass/fail (exit 0/1), printed as one JSON record: 0 responses with a 5xx status or a streamed
error (a 503 with Retry-After while pools are swapped is retried, as the openai client does, and
counted as ``retried_503``), and once idle 0 running, 0 waiting/held, no KV page outside the prefix cache, 0 state slots, 0 expert pins (where
the executor has them), and the metrics consistent (requests admitted == requests finished).
CI runs a brief one against the fake model (tests/app/test_soak.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("count", "from", "one", "to", "ten", "what", "is", "19", "+", "23", "?", "the", "sum", "of")


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)  # outcome -> count
    server_errors: list[str] = field(default_factory=list)  # every 5xx / streamed error, described

    def note(self, outcome: str, detail: str = "") -> None:
        self.statuses[outcome] += 1
        if (outcome.isdigit() and outcome.startswith("5")) or outcome == "stream_error":
            self.server_errors.append(f"{outcome} {detail[:200]}")


def _metric(text: str, name: str) -> float:
    """Sum of every sample of one Prometheus metric (all label sets)."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def _one(client: httpx.AsyncClient, model: str, i: int, rng: random.Random, tally: Tally,
               disconnect_share: float, timeout_share: float) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, 48), "ignore_eos": rng.random() < 0.5,
                  "temperature": rng.choice([0, 0.7, 1e-40]), "seed": i}
    chat = rng.random() < 0.7
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.2:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = prompt
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    roll = rng.random()
    if roll < disconnect_share:  # a streaming client that goes away after a few chunks
        body["stream"] = True
        try:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code == 503 and "retry-after" in r.headers:
                    tally.note("503_retryable")  # pools being swapped; this client gives up anyway
                    return
                if r.status_code != 200:
                    tally.note(str(r.status_code), (await r.aread()).decode(errors="replace"))
                    return
                keep = rng.randint(1, 4)
                async for line in r.aiter_lines():
                    keep -= line.startswith("data: ")
                    if keep <= 0:
                        break
            tally.note("disconnected")
        except httpx.HTTPError as exc:
            tally.note("transport_error", repr(exc))
        return
    if roll < disconnect_share + timeout_share:  # a client with a deadline shorter than the answer
        try:
            r = await client.post(path, json=body, timeout=rng.uniform(0.001, 0.05))
            retryable = r.status_code == 503 and "retry-after" in r.headers
            tally.note("503_retryable" if retryable else str(r.status_code), r.text)
        except httpx.TimeoutException:
            tally.note("timed_out")
        return
    body["stream"] = rng.random() < 0.5
    for _ in range(5):  # NOTE: a 503 with Retry-After (pools being swapped) is retried, as the openai client does
        r = await _complete(client, path, body, tally)
        if r is None:
            return
        tally.note("retried_503")
        await asyncio.sleep(float(r))
    tally.note("503", "still 503 after 5 tries")


async def _complete(client: httpx.AsyncClient, path: str, body: dict, tally: Tally) -> str | None:
    """One whole request; its Retry-After when the answer was a retryable 503, else None (noted)."""
    if body["stream"]:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code == 503 and "retry-after" in r.headers:
                return r.headers["retry-after"]
            if r.status_code != 200:
                tally.note(str(r.status_code), (await r.aread()).decode(errors="replace"))
                return None
            async for line in r.aiter_lines():
                if line.startswith('data: {"error"'):
                    tally.note("stream_error", line)
                    return None
        tally.note("200")
        return None
    r = await client.post(path, json=body)
    if r.status_code == 503 and "retry-after" in r.headers:
        return r.headers["retry-after"]
    tally.note(str(r.status_code), r.text)
    return None


async def _resizes(client: httpx.AsyncClient, count: int, tally: Tally, stop: asyncio.Event) -> int:
    """Live resizes while requests run: KV alternates between its size and half of it."""
    if count == 0:
        return 0
    plan = (await client.get("/v1/cache/status")).json()["plan"]
    sizes = [plan["kv_tokens"], max(plan["page_size"], plan["kv_tokens"] // 2 // plan["page_size"] * plan["page_size"])]
    done = 0
    for n in range(count):
        if stop.is_set():
            break
        r = await client.post("/v1/cache/rebuild", json={"kv_tokens": sizes[(n + 1) % 2], "wait_s": 5}, timeout=60)
        tally.note(f"resize_{r.status_code}", r.text)
        done += r.status_code == 200
        await asyncio.sleep(0.05)
    await client.post("/v1/cache/rebuild", json={"kv_tokens": sizes[0], "wait_s": 30}, timeout=60)
    return done


async def _idle(client: httpx.AsyncClient, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        pools = (await client.get("/v1/stats")).json()["pools"]
        if pools["running"] == pools["waiting"] == 0 or time.monotonic() > deadline:
            return pools
        await asyncio.sleep(0.05)


async def soak(base_url: str, *, requests: int = 100, concurrency: int = 8, disconnect_share: float = 0.15,
               timeout_share: float = 0.1, resizes: int = 2, api_key: str | None = None, seed: int = 0) -> dict:
    """Run the soak; returns the record (``ok`` and ``problems`` say whether it passed)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    tally = Tally()
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = (await client.get("/metrics")).text
        started = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                await _one(client, model, i, random.Random(rng.random()), tally, disconnect_share, timeout_share)

        stop = asyncio.Event()
        resizer = asyncio.ensure_future(_resizes(client, resizes, tally, stop))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stop.set()
        applied = await resizer
        elapsed = time.monotonic() - started
        pools = await _idle(client, 30)
        after = (await client.get("/metrics")).text
    admitted = _metric(after, "ft_requests_admitted_total") - _metric(before, "ft_requests_admitted_total")
    finished = _metric(after, "ft_requests_total") - _metric(before, "ft_requests_total")
    problems = list(tally.server_errors)
    for key in ("running", "waiting", "held", "state_slots_used"):
        if pools[key] != 0:
            problems.append(f"{key} = {pools[key]} after the soak")
    # NOTE: idle pages may only be the prefix cache's (prompts and outputs kept for later turns)
    cached = (pools.get("prefix_cache") or {}).get("cached_pages", 0)
    if pools["kv_pages_used"] != cached:
        problems.append(f"kv_pages_used = {pools['kv_pages_used']} after the soak, {cached} of them cached")
    if pools.get("expert_pins") not in (0, None):
        problems.append(f"expert_pins = {pools['expert_pins']} after the soak")
    if admitted != finished:
        problems.append(f"metrics: {admitted:.0f} requests admitted but {finished:.0f} finished")
    return {"ok": not problems, "problems": problems, "requests": requests, "concurrency": concurrency,
            "seconds": round(elapsed, 2), "resizes_applied": applied, "resizes_asked": resizes,
            "outcomes": dict(sorted(tally.statuses.items())), "admitted": admitted, "finished": finished,
            "pools_after": pools}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--disconnect-share", type=float, default=0.15)
    p.add_argument("--timeout-share", type=float, default=0.1)
    p.add_argument("--resizes", type=int, default=14)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    record = asyncio.run(soak(args.base_url, requests=args.requests, concurrency=args.concurrency,
                              disconnect_share=args.disconnect_share, timeout_share=args.timeout_share,
                              resizes=args.resizes, api_key=args.api_key, seed=args.seed))
    print(json.dumps(record, indent=2))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
