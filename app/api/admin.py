"""Operations routes: /health (open), /v1/stats, /v1/stats/reset_peaks, /v1/stats/steps, /metrics,
/v1/cache/status, /v1/cache/rebuild, /v1/routing."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Annotated

from litestar import MediaType, Request, Response, post
from litestar.params import Parameter

from app.api.errors import OpenAIError, bad_value
from app.api.generation import require_engine, runtime_of
from app.api.routing import get_or_head
from app.api.schemas import CacheRebuildRequest, RoutingRequest, decode_body, read_body
from app.engine import Engine
from app.gc_pauses import GC_PAUSES
from app.resize_coordinator import ResizeOutcome, experts_note
from app.units import parse_count


@get_or_head("/health", sync_to_thread=False)
def health(request: Request) -> Response:
    runtime = runtime_of(request)
    p = runtime.progress
    engine = runtime.engine
    body = {
        "status": runtime.status,
        "phase": p.phase,
        "bytes_done": p.bytes_done,
        "bytes_total": p.bytes_total,
        "error": runtime.error,
        "engine": engine.phase if engine else None,
        "model": runtime.model.served_name,
        "uptime_s": round(time.monotonic() - runtime.started_at, 3),
        "routing": engine.routing() if engine else None,  # null while loading
    }
    if engine is not None and not engine.alive:
        body["status"], body["error"] = "error", engine.last_error or "engine thread stopped"
    elif engine is not None and engine.phase == "error":
        body["status"], body["error"] = "error", engine.last_error
    return Response(content=body, status_code=200 if body["status"] == "ok" else 503)


def _engine(request: Request) -> Engine:
    runtime = runtime_of(request)
    if runtime.engine is None:
        require_engine(runtime)  # raises the 503 that explains why
    return runtime.engine


def _plan(plan) -> dict:
    return dataclasses.asdict(plan)


@get_or_head("/v1/stats", sync_to_thread=False)
def stats(request: Request) -> dict:
    engine = _engine(request)
    return {
        "model": runtime_of(request).model.served_name,
        "engine": engine.phase,
        # NOTE: the high-water marks beside the snapshot: polls miss a request that runs between two of them
        "pools": {**engine.pools(), **engine.stats.peaks()},
        "window": engine.stats.window(),
        "prefix_cache": {**engine.stats.prefix_cache(), **(engine.pools().get("prefix_cache") or {})},
        "plan": _plan(engine.plan),
        "routing": engine.routing(),
        "executor": engine.executor_info(),
        "scheduler": _step_budgets(engine),
        "arrivals": engine.stats.bursts(),
        "gc": GC_PAUSES.snapshot(),
    }


@post("/v1/stats/reset_peaks", status_code=200, sync_to_thread=False)
def reset_peaks(request: Request) -> dict:
    """The most requests running and waiting at once since start or the previous reset (`running_peak`,
    `waiting_peak`, over `since_s` seconds), and restart them from the requests running and waiting now: what
    `ft bench ladder` reads around each rung (a poll of /v1/stats can miss a short request; this cannot)."""
    return _engine(request).stats.reset_peaks()


def check_since(since: str | float | None) -> float | None:
    """/v1/stats/steps' `since` (epoch seconds) as a number: a 400 `invalid_value` naming it unless it is a finite
    number (nan would select nothing, silently). NOTE: the route takes it as text and parses it here: typed as a
    float, a non-number ("abc") was refused by the framework's validation before this ran, with a generic
    "Validation failed" and no code or param, unlike "inf"."""
    if since is None:
        return None
    try:
        value = float(since)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise bad_value("since", f"since must be a finite number of seconds since the epoch, got {since!r}")
    return value


# NOTE: documented as a number (what it is); the handlers take the text and check_since parses it
SINCE = Parameter(description="only the steps that ended after this time (epoch seconds, the server's wall clock)",
                  schema_extra={"oneOf": [{"type": "number"}, {"type": "null"}]})


# NOTE: in a worker thread: a full window is thousands of rows; each is encoded once, by the first read that returns
# it (~1 us a row on a 2-core CPU host: ~8 ms for 8,000 new rows), which on the event loop would stall every
# stream's token delivery. The body is the stats' own bytes, joined from the rows' (~0.4 ms for 8,000 encoded rows):
# a dict of rows built and encoded on every call cost ~14 ms there.
@get_or_head("/v1/stats/steps", sync_to_thread=True)
def stats_steps(request: Request, since: Annotated[str | None, SINCE] = None) -> Response:
    """The step trace: each step of the /v1/stats window (its last `window_s` seconds), oldest first, or those that
    ended after `since` (epoch seconds): when its model call returned on the server's wall clock (`clock` "unix"),
    the call's and the host's seconds before it, decode rows, prefill tokens and works, the layer group of a layered
    chunk (null otherwise) and expert hits and misses. `ft bench mixed` reads it to say which step made a gap."""
    return Response(content=_engine(request).stats.steps_json(check_since(since)), media_type=MediaType.JSON)


def _step_budgets(engine: Engine) -> dict:
    """The scheduler's step budgets (docs/adr/0011-mixed-step-budget.md): what `ft bench mixed` records; and the
    arrival window an idle engine's first step waits for a burst (ADR 0021), which moves time to first token."""
    config = engine.scheduler.config
    # NOTE: the running requests the pools admit now: a live resize to fewer state slots lowers it below the setting
    running = min(config.max_running, engine.scheduler.num_state_slots)
    return {"max_running": running, "max_step_tokens": config.max_step_tokens,
            "mixed_step_tokens": config.mixed_step_tokens, "layer_group_tokens": config.layer_group_tokens,
            # ADR 0024: on/off, and the layer-group works run so far (a chunk beside decodes takes several)
            "layered_prefill": config.layered_prefill, "layer_groups": engine.scheduler.num_layer_groups,
            # ADR 0024 "A0" (--layer-short-prompts auto): every chunk beside decodes is layered when both are true
            "layer_short_prompts": config.layer_short_prompts,
            "partial_residency": engine.scheduler.partial_residency,
            "arrival_window_ms": round(engine.arrival_window.max_s * 1000, 3)}


@get_or_head("/metrics", sync_to_thread=False)
def metrics(request: Request) -> Response:
    engine = _engine(request)
    engine.stats.record_routing(engine.routing())
    return Response(content=engine.stats.prometheus_text(), media_type="text/plain; version=0.0.4; charset=utf-8")


@get_or_head("/v1/cache/status", sync_to_thread=False)
def cache_status(request: Request) -> dict:
    engine = _engine(request)
    budget = engine.budget
    return {
        "engine": engine.phase,
        "pools": engine.pools(),
        "plan": _plan(engine.plan),
        "budget": dataclasses.asdict(budget),
        "expert_bytes": engine.spec.expert_bytes(),
        "total_experts": engine.spec.total_experts,
    }


@post("/v1/routing", status_code=200)
async def routing(request: Request) -> dict:
    """Switch a server started with --routing-replay between its replay and the natural routing (from the
    next step on; `ft bench` measures both). 409 on a server that routes naturally only."""
    engine = _engine(request)
    body = decode_body(await read_body(request), RoutingRequest)
    if engine.routing_replay is None:
        raise OpenAIError(409, "this server routes naturally only; start it with --routing-replay SPEC to replay",
                          type="invalid_request_error", param="replay", code="no_routing_replay")
    engine.routing_replay.set_active(body.replay)
    return engine.routing()


def _count(param: str, value: int | float | str | None, auto: bool = False) -> int | str | None:
    """A pool size from the body: an integer, a JSON number written as a float that is one (1e4, 65536.0) or a
    string (8k, 1.5m, 1e4). NOTE: every spelling takes one path (app.units.parse_count), so the same number gets
    the same answer: a 400 naming the field when it is not a whole number in [0, 2^50], else it goes to the plan."""
    if value is None:
        return None
    if auto and value == "auto":
        return "auto"
    if isinstance(value, float):
        if not value.is_integer():  # NOTE: also inf and nan
            raise bad_value(param, f"{param} must be a whole number, got {value!r}")
        value = int(value)
    try:
        return parse_count(str(value))
    except ValueError as exc:
        raise bad_value(param, f"{param}: {exc}") from None


# The body field that sizes each pool a refusal can name (`param` is the client's spelling); the other
# pools (snapshot, staging, the budget itself) are not sized by this body.
_POOL_FIELDS = {"kv": "kv_tokens", "moe": "moe_slots", "state": "mamba_slots"}


def _timings(outcome: ResizeOutcome) -> dict:
    """A resize's seconds, apart: waiting for in-flight requests, swapping the pools, and both (the whole resize)."""
    return {"waited_s": round(outcome.waited_s, 4), "swap_s": round(outcome.swap_s, 4),
            "total_s": round(outcome.total_s, 4)}


@post("/v1/cache/rebuild", status_code=200)
async def cache_rebuild(request: Request) -> Response:
    engine = _engine(request)
    body = decode_body(await read_body(request), CacheRebuildRequest)
    kv = _count("kv_tokens", body.kv_tokens, auto=True)
    moe = _count("moe_slots", body.moe_slots, auto=True)
    mamba = _count("mamba_slots", body.mamba_slots)
    if kv is None and moe is None and mamba is None:
        # param null: no one field is at fault (it named kv_tokens, also for a body of only unknown fields)
        raise OpenAIError(400, "give at least one of kv_tokens, moe_slots, mamba_slots", code="invalid_value")
    if kv == "auto" and moe == "auto":
        raise bad_value("moe_slots", "only one of kv_tokens and moe_slots can be 'auto' (it takes what the other leaves)")
    if not 0 <= body.wait_s <= 3600:
        raise bad_value("wait_s", f"wait_s must be between 0 and 3600, got {body.wait_s}")
    before = engine.plan
    outcome = await asyncio.to_thread(
        engine.resize, kv_tokens=kv, expert_slots=moe, state_slots=mamba, wait_s=body.wait_s
    )
    if outcome.refusal is not None:
        refusal = outcome.refusal
        raise OpenAIError(
            409,
            f"resize refused, old pools kept and serving continues: {refusal.message}",
            type="resize_refused",
            param=_POOL_FIELDS.get(refusal.pool),
            code="plan_refused",
            extra={"refusal": dataclasses.asdict(refusal), "current": _plan(before)},
        )
    if not outcome.ok:
        raise OpenAIError(
            409,
            f"resize not applied, serving continues: {outcome.message}",
            type="resize_refused",
            code="resize_rolled_back" if outcome.rolled_back else "resize_not_applied",
            extra={"rolled_back": outcome.rolled_back, **_timings(outcome), "current": _plan(engine.plan)},
        )
    plan = outcome.plan
    return Response(
        content={
            "status": "ok",
            "message": outcome.message,
            "experts_kept": plan.experts_kept,
            "kept": experts_note(plan),
            **_timings(outcome),
            # NOTE: the running limit the new pools leave (state slots never exceed the start-up limit: refused above)
            "max_running": min(engine.scheduler.config.max_running, plan.target.state_slots),
            "peak_bytes": plan.peak_bytes,
            "steps": [dataclasses.asdict(s) for s in plan.steps],
            "before": _plan(plan.current),
            "after": _plan(plan.target),
        }
    )
