"""Routing passes of `ft bench`: a server started with `--routing-replay` is measured under its replay and,
beside it, under natural routing (the issue's rule: the natural routing is always measured beside a replay).

`--routing both` (the default): the run as asked, then the server is switched to natural routing
(POST /v1/routing {"replay": false}), the same run again into OUT-natural.json, and the replay switched back
on. The two records name each other in `linked_records`. `--routing server`: one pass in the server's mode;
`--routing natural`: one pass with the replay switched off. A server without a replay (or not fluxtide)
gets one pass whatever is asked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx

from app.bench.record import Record
from app.bench.target import BenchError

CHOICES = ("both", "server", "natural")
OnePass = Callable[[str], tuple[int, Record, str]]  # out path -> (exit code, record, written path)


def switch_replay(base_url: str, api_key: str | None, on: bool, timeout: float = 30.0) -> dict:
    """POST /v1/routing; the server's routing description after it. BenchError when it refuses."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(base_url.rstrip("/") + "/v1/routing", json={"replay": on}, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot switch the routing replay {'on' if on else 'off'}: {exc}") from None
    if r.status_code != 200:
        raise BenchError(f"POST /v1/routing {{'replay': {json.dumps(on)}}} answered HTTP {r.status_code}: "
                         f"{r.text[:300]}")
    return r.json()


def natural_path(path: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}-natural{p.suffix}"))


def run_passes(mode: str, base_url: str, api_key: str | None, out: str, one_pass: OnePass,
               replay: dict | None) -> tuple[int, list[dict]]:
    """(exit code, records) of the passes `mode` asks for; `replay` is the server's routing description
    when it has a replay (GET /health's "routing"), else None. The replay is left as it was found."""
    if replay is None or mode == "server":
        code, record, _ = one_pass(out)
        return code, [record.data]
    was_on = bool(replay.get("active"))
    if mode == "natural":
        switch_replay(base_url, api_key, False)
        try:
            code, record, _ = one_pass(out)
        finally:
            switch_replay(base_url, api_key, was_on)
        return code, [record.data]
    switch_replay(base_url, api_key, True)
    code, first, first_path = one_pass(out)
    switch_replay(base_url, api_key, False)
    try:
        code2, second, second_path = one_pass(natural_path(first_path))
    finally:
        switch_replay(base_url, api_key, was_on)
    first.link("natural", second_path)
    second.link("replay", first_path)
    return max(code, code2), [first.data, second.data]


def server_replay(base_url: str, api_key: str | None, timeout: float = 30.0) -> dict | None:
    """The server's routing replay description, or None (natural-only, unreachable, or not fluxtide)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        routing = httpx.get(base_url.rstrip("/") + "/health", headers=headers, timeout=timeout).json().get("routing")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return routing if isinstance(routing, dict) and routing.get("mode", "natural") != "natural" else None
