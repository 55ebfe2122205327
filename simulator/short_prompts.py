"""Short prompt chunks as replays of the captured decode step (ADR 0026) in the simulator: the setting a record's
server ran with, and how a Deployment's setting resolves.

`ft serve` on CUDA runs a step whose prompt chunks are all at most FLUXTIDE_SHORT_PROMPT_REPLAYS tokens (8 by
default, at every pool plan; 0 off) as replays of the decode graph: replay r holds token r of every chunk longer than
r, the step's decodes ride in replay 0, so a chunk of n tokens costs n replays instead of one eager prefill step
(~40-48 ms on an H100, host-bound). The rule itself is the domain's (domain/short_prompt_replays.py `unroll`), which
the server's executor and SimExecutor both apply.
"""

from __future__ import annotations

from datetime import UTC, datetime

from domain.short_prompt_replays import DEFAULT_TOKENS, unroll

__all__ = ["DEFAULT_TOKENS", "REPLAYS_DEFAULT_SINCE", "resolve", "served_replays", "unroll"]

# every record served before this was served with replays off (the variable came in session 31, off by default);
# session 32's A/B records set it by hand (named replays0 / replays8): name the value for those
REPLAYS_DEFAULT_SINCE = datetime(2026, 12, 6, 8, 10, tzinfo=UTC)


def resolve(setting: int | None) -> int:
    """The chunk length (tokens) a Deployment's `short_prompt_replays` means: the server's default where None."""
    return DEFAULT_TOKENS if setting is None else setting


def served_replays(record: dict) -> int | None:
    """FLUXTIDE_SHORT_PROMPT_REPLAYS of the server an `ft bench` record (schema fluxtide.bench/1) measured: its /v1/stats
    `server.stats.executor.short_prompt_replays` where the server states it (none does yet); else 0 for a record
    started before REPLAYS_DEFAULT_SINCE and None (the server's default) after. Raises ValueError for a record
    without a zone-aware `started_at`."""
    stated = (((record.get("server") or {}).get("stats") or {}).get("executor") or {}).get("short_prompt_replays")
    if isinstance(stated, int) and not isinstance(stated, bool) and stated >= 0:
        return stated
    try:
        started = datetime.fromisoformat(record.get("started_at"))
    except (TypeError, ValueError):
        raise ValueError(f"started_at is {record.get('started_at')!r}, not an ISO time") from None
    if started.tzinfo is None:
        raise ValueError(f"started_at {record.get('started_at')!r} has no time zone")
    return 0 if started < REPLAYS_DEFAULT_SINCE else None
