"""The JSON record every `ft bench` run writes: what was measured, on what, with which settings,
every figure, and every failure (a failed point stays in the record with its error)."""

from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from app.bench import target
from app.bench.hardware import hardware_profile

SCHEMA = "fluxtide.bench/1"


def redacted(command: list[str]) -> list[str]:
    """A command line as a record keeps it: an --api-key's value replaced (records are shared; keys are not)."""
    out = list(command)
    for i, arg in enumerate(out):
        if arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "<redacted>"
        elif arg.startswith("--api-key="):
            out[i] = "--api-key=<redacted>"
    return out


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Record:
    kind: str
    settings: dict
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    data: dict = field(default_factory=dict)
    _t0: float = field(default_factory=time.monotonic)
    _path: Path | None = None

    def __post_init__(self) -> None:
        self.data = {
            "schema": SCHEMA,
            "kind": self.kind,
            "started_at": _now(),
            "finished_at": None,
            "duration_s": None,
            "command": redacted(self.argv),
            "settings": self.settings,
            "target": None,
            "hardware": None,
            "model": None,
            "budget": None,
            "pool_plan": None,
            "routing": None,
            "routing_replay": None,
            "linked_records": {},
            "server": None,
            "points": [],
            "failures": [],
            "ok": None,
        }

    @property
    def points(self) -> list[dict]:
        return self.data["points"]

    def fail(self, where: str, error: str, **extra) -> None:
        self.data["failures"].append({"where": where, "error": error, **extra})

    async def describe_target(self, client: httpx.AsyncClient, base_url: str, model: str | None,
                              model_dir: str | None) -> dict:
        """Fill target, model, budget, pool plan, routing and the server's self-description."""
        server = await target.describe(client)
        plan = (server.get("stats") or {}).get("plan") or (server.get("cache_status") or {}).get("plan")
        self.data.update({
            "target": {"base_url": base_url, "model": model, "fluxtide": target.is_fluxtide(server)},
            "model": target.model_facts(server, model_dir),
            "budget": (server.get("cache_status") or {}).get("budget"),
            "pool_plan": plan,
            "routing": target.routing_mode(server),
            "routing_replay": target.routing_replay(server),
            "server": server,
        })
        return server

    def profile_hardware(self, measure_bandwidth: bool = True) -> None:
        self.data["hardware"] = copy.deepcopy(hardware_profile(measure_bandwidth))

    def finish(self, out: str | Path) -> Path:
        """Write the record (also after an interrupted run); ok = no failure anywhere."""
        self.data["finished_at"] = _now()
        self.data["duration_s"] = round(time.monotonic() - self._t0, 3)
        self.data["ok"] = not self.data["failures"]
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        self._path = path
        return path

    def link(self, name: str, path: str | Path) -> None:
        """Name a related record (the natural-routing pass beside a replay); rewrites a written record."""
        self.data["linked_records"][name] = str(path)
        if self._path is not None:
            self._path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def default_out(kind: str) -> str:
    return f"ft-bench-{kind}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
