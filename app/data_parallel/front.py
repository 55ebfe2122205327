"""The HTTP front of `ft serve --data-parallel N` ([adr/0005](../../docs/adr/0005-data-parallel.md)):
one Litestar app on the usual port that proxies every API route to the least-loaded worker
(streams pass through chunk by chunk) and answers the operations routes for all workers:
/health, /v1/stats, /v1/cache/status and /metrics aggregated with a per-worker breakdown,
/v1/stats/steps with each worker's step trace, /v1/cache/rebuild applied to every worker or to none
(see ``cache_rebuild``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated
from urllib.parse import urlencode

import anyio
import httpx
import msgspec
from litestar import HttpMethod, Litestar, Request, Response, Router, post, route
from litestar.datastructures import State
from litestar.logging.config import LoggingConfig
from litestar.response import Stream
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from app.api.admin import SINCE, check_since
from app.api.auth import require_api_key
from app.api.errors import EXCEPTION_HANDLERS, OpenAIError, service_unavailable
from app.api.routing import get_or_head
from app.api.schemas import read_body
from app.data_parallel.aggregate import (
    common,
    front_status,
    merge,
    merge_arrivals,
    merge_gc,
    merge_metrics,
    plan_totals,
)
from app.data_parallel.workers import WorkerPool, WorkerProcess
from app.gc_pauses import GC_PAUSES
from app.server import cors_config

# NOTE: hop-by-hop headers and the ones the front sets itself never cross it.
_DROP_REQUEST = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                           "trailer", "upgrade", "authorization", "x-api-key", "proxy-authorization"})
_DROP_RESPONSE = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-type",
                            "date", "server"})


class Front:
    """What the front's handlers share: the pool, the client key (``api_key``, read by the
    API-key guard as on a single server) and one httpx client on the server's event loop."""

    def __init__(self, pool: WorkerPool, api_key: str | None = None) -> None:
        self.pool = pool
        self.api_key = api_key or None
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # NOTE: created on the server's loop, the only loop that uses it
            self._client = httpx.AsyncClient(
                headers=self.pool.headers, timeout=httpx.Timeout(10.0, read=None, write=60.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._client

    async def fan_out(self, method: str, path: str, content: bytes | None = None) -> list[tuple[WorkerProcess, int, object]]:
        """The same request to every worker that has a port: (worker, status, JSON body or text);
        status 0 and the error text when the worker could not be reached."""
        workers = [w for w in self.pool.workers if w.url is not None and w.status != "exited"]

        async def one(worker: WorkerProcess):
            try:
                r = await self.client().request(method, worker.url + path, content=content)
            except httpx.HTTPError as exc:
                return worker, 0, f"worker {worker.index} did not answer {path}: {exc!r}"
            if r.headers.get("content-type", "").startswith("application/json"):
                return worker, r.status_code, r.json()
            return worker, r.status_code, r.text

        return list(await asyncio.gather(*(one(w) for w in workers)))


def front_of(request: Request) -> Front:
    return request.app.state.runtime


# -- /health -----------------------------------------------------------------------------------
@get_or_head("/health", sync_to_thread=False)
def health(request: Request) -> Response:
    pool = front_of(request).pool
    workers = pool.snapshot()
    status = front_status([w["status"] for w in workers])
    ready = sum(w["status"] == "ok" for w in workers)
    failed = [w["error"] or f"worker {w['worker']} is {w['status']}" for w in workers
              if w["status"] in ("error", "exited", "unreachable")]
    engines = {w["engine"] for w in workers if w["status"] == "ok"}
    body = {
        "status": status,
        "phase": "ready" if ready == len(workers) else f"{ready}/{len(workers)} workers ready",
        "bytes_done": sum(w["bytes_done"] or 0 for w in workers),
        "bytes_total": sum(w["bytes_total"] or 0 for w in workers),
        "error": "; ".join(failed) or None,
        "engine": engines.pop() if len(engines) == 1 else sorted(engines) or None,
        "model": next((w.health.get("model") for w in pool.workers if w.health.get("model")), None),
        # every worker runs the same --routing-replay (switched together by POST /v1/routing): the first's
        "routing": next((w.health.get("routing") for w in pool.workers if w.health.get("routing")), None),
        "data_parallel": len(workers),
        "workers": workers,
    }
    return Response(content=body, status_code=200 if status in ("ok", "degraded") else 503)


# -- aggregated operations routes ----------------------------------------------------------------
def _answers(results, path: str) -> tuple[list[tuple[WorkerProcess, dict]], list[dict]]:
    ok = [(w, body) for w, status, body in results if status == 200 and isinstance(body, dict)]
    failed = [{"worker": w.index, "status": status, "error": body} for w, status, body in results
              if not (status == 200 and isinstance(body, dict))]
    if not ok:
        raise OpenAIError(503, f"no worker answered {path}: {failed}", type="server_error", code="worker_down")
    return ok, failed


@get_or_head("/v1/stats")
async def stats(request: Request) -> dict:
    front = front_of(request)
    ok, failed = _answers(await front.fan_out("GET", "/v1/stats"), "/v1/stats")
    bodies = [body for _, body in ok]
    plans = [body["plan"] for body in bodies]
    return {
        "model": bodies[0].get("model"),
        "engine": merge([{"engine": b.get("engine")} for b in bodies])["engine"],
        "pools": merge([b["pools"] for b in bodies]),
        "window": merge([b["window"] for b in bodies]),
        "prefix_cache": merge([b.get("prefix_cache") or {} for b in bodies]),  # counts add, rates are means
        "plan": common(plans),  # one worker's plan (all alike); the sums are under totals
        "routing": bodies[0].get("routing"),
        "executor": bodies[0].get("executor"),  # every worker runs the same flags
        # the step budgets and layered prefill (ADR 0011, 0024) every worker runs; max_running and layer_groups add
        "scheduler": merge([b.get("scheduler") or {} for b in bodies]),
        # idle wakes add, each worker's burst sizes under its index; collections and pauses add, the longest wins
        "arrivals": merge_arrivals([(w.index, body.get("arrivals")) for w, body in ok]),
        "gc": {**merge_gc([b.get("gc") for b in bodies]), "front": GC_PAUSES.snapshot()},
        "totals": plan_totals(plans),
        "data_parallel": len(front.pool.workers),
        "workers": [{"worker": w.index, "device": w.label, "in_flight": w.in_flight, "dispatched": w.dispatched,
                     **body} for w, body in ok] + failed,
    }


@post("/v1/stats/reset_peaks", status_code=200)
async def reset_peaks(request: Request) -> dict:
    """Every worker's high-water marks read and restarted; the front's are their sums (each worker's own peak, so an
    upper bound of the front's). A worker that does not answer fails the call (503): partial marks would under-count,
    and `ft bench ladder` then falls back to its stats polls."""
    front = front_of(request)
    ok, failed = _answers(await front.fan_out("POST", "/v1/stats/reset_peaks"), "/v1/stats/reset_peaks")
    if failed:
        raise OpenAIError(503, f"not every worker answered /v1/stats/reset_peaks: {failed}", type="server_error",
                          code="worker_down")
    bodies = [body for _, body in ok]
    return {"running_peak": sum(b["running_peak"] for b in bodies),
            "waiting_peak": sum(b["waiting_peak"] for b in bodies),
            "since_s": max(b["since_s"] for b in bodies), "data_parallel": len(front.pool.workers),
            "workers": [{"worker": w.index, **body} for w, body in ok]}


@get_or_head("/v1/stats/steps")
async def stats_steps(request: Request, since: Annotated[str | None, SINCE] = None) -> dict:
    """Each worker's step trace under `workers` (its own steps, in its own order: steps of different workers ran
    side by side on different devices, so one merged list would say nothing a step's worker does not)."""
    front = front_of(request)
    after = check_since(since)  # NOTE: refused here, in the same shape as a worker would, before any fan-out
    path = "/v1/stats/steps" + ("" if after is None else "?" + urlencode({"since": repr(after)}))
    ok, failed = _answers(await front.fan_out("GET", path), "/v1/stats/steps")
    return {"clock": "unix", "window_s": ok[0][1].get("window_s"), "data_parallel": len(front.pool.workers),
            "workers": [{"worker": w.index, "device": w.label, **body} for w, body in ok] + failed}


@get_or_head("/v1/cache/status")
async def cache_status(request: Request) -> dict:
    front = front_of(request)
    ok, failed = _answers(await front.fan_out("GET", "/v1/cache/status"), "/v1/cache/status")
    bodies = [body for _, body in ok]
    return {
        "engine": merge([{"engine": b.get("engine")} for b in bodies])["engine"],
        "pools": merge([b["pools"] for b in bodies]),
        "plan": common([b["plan"] for b in bodies]),
        "budget": common([b["budget"] for b in bodies]),
        "expert_bytes": bodies[0].get("expert_bytes"),
        "total_experts": bodies[0].get("total_experts"),
        "totals": plan_totals([b["plan"] for b in bodies]),
        "workers": [{"worker": w.index, **body} for w, body in ok] + failed,
    }


@get_or_head("/metrics")
async def metrics(request: Request) -> Response:
    front = front_of(request)
    results = await front.fan_out("GET", "/metrics")
    texts = {w.index: body for w, status, body in results if status == 200 and isinstance(body, str)}
    up = GaugeMetricFamily("ft_dp_worker_up", "1 while the worker serves (front's view)", labels=["worker"])
    in_flight = GaugeMetricFamily("ft_dp_worker_in_flight", "Requests the front has in flight on the worker",
                                  labels=["worker"])
    dispatched = CounterMetricFamily("ft_dp_worker_dispatched", "Requests the front sent to the worker",
                                     labels=["worker"])
    for w in front.pool.snapshot():
        up.add_metric([str(w["worker"])], 1.0 if w["status"] == "ok" else 0.0)
        in_flight.add_metric([str(w["worker"])], w["in_flight"])
        dispatched.add_metric([str(w["worker"])], w["dispatched"])
    families = merge_metrics(texts, [up, in_flight, dispatched])

    class _Collected:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected())
    return Response(content=generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")


@post("/v1/routing", status_code=200)
async def routing(request: Request) -> Response:
    """--routing-replay on or off on every worker (each answers as one server does; the first refusal wins)."""
    results = await front_of(request).fan_out("POST", "/v1/routing", content=await read_body(request))
    refused = [(status, b) for _, status, b in results if status != 200 or not isinstance(b, dict)]
    if not results:
        raise OpenAIError(503, "no worker has a port yet", type="server_error", code="worker_down")
    if refused:
        return Response(content=refused[0][1], status_code=refused[0][0] or 503)
    return Response(content={**results[0][2], "workers": [{"worker": w.index, **b} for w, _, b in results]})


@post("/v1/cache/rebuild", status_code=200)
async def cache_rebuild(request: Request) -> Response:
    """Live resize on every worker, all or nothing. Refused before anything is touched when a
    worker is not serving. The workers resize side by side; if some apply and another refuses,
    the ones that applied are resized back to their previous plan (409 ``resize_partial_reverted``),
    and if that fails too the 409 says so (``resize_partial``) with every worker's plan."""
    front = front_of(request)
    body = await read_body(request)
    down = [w for w in front.pool.workers if w.status != "ok"]
    if down:
        names = ", ".join(f"worker {w.index} ({w.status}{': ' + w.error if w.error else ''})" for w in down)
        raise OpenAIError(409, f"resize refused, nothing changed: not every worker is serving: {names}",
                          type="resize_refused", code="worker_not_serving")
    results = await front.fan_out("POST", "/v1/cache/rebuild", content=body)
    applied = [(w, b) for w, status, b in results if status == 200 and isinstance(b, dict)]
    refused = [(w, status, b) for w, status, b in results if not (status == 200 and isinstance(b, dict))]
    if not refused:
        return Response(content=_applied(applied))
    first_worker, first_status, first_body = refused[0]
    reason = _message(first_body)
    per_worker = [{"worker": w.index, "status": 200, "after": b["after"]} for w, b in applied] + [
        {"worker": w.index, "status": status, "error": b} for w, status, b in refused]
    if not applied:  # nobody changed anything: the workers' own refusal, as one server gives it
        content = dict(first_body) if isinstance(first_body, dict) else {"error": {"message": reason}}
        content["workers"] = per_worker
        return Response(content=content, status_code=first_status or 503)
    reverted = await _revert(front, applied, body)
    failed_back = [w.index for w, ok in reverted if not ok]
    ids = ", ".join(str(w.index) for w, _, _ in refused)
    if failed_back:
        message = (f"resize refused by worker {ids} ({reason}); resizing worker {failed_back} back failed too: "
                   "the workers' pools now differ (see workers)")
        code = "resize_partial"
    else:
        message = (f"resize refused by worker {ids} ({reason}); the workers that had applied it "
                   f"({', '.join(str(w.index) for w, _ in applied)}) were resized back: nothing changed")
        code = "resize_partial_reverted"
    raise OpenAIError(409, message, type="resize_refused", code=code,
                      extra={"workers": per_worker, "reverted": [{"worker": w.index, "ok": ok} for w, ok in reverted]})


def _message(body) -> str:
    if isinstance(body, dict):
        return str((body.get("error") or {}).get("message") or body)
    return str(body)


def _resize_message(applied: list[tuple[WorkerProcess, dict]]) -> str:
    """One message for the workers' resizes: their words once when they agree, else each worker's note (worker
    0's message alone once said "0 cached pages dropped" when worker 1 had dropped 1)."""
    messages = [b["message"] for _, b in applied]
    n = len(messages)
    if len(set(messages)) == 1:
        return f"{messages[0]} (on all {n} workers)"
    split = [m.split("; ", 1) for m in messages]
    if all(len(parts) == 2 for parts in split) and len({head for head, _ in split}) == 1:
        notes = "; ".join(f"worker {w.index}: {note}" for (w, _), (_, note) in zip(applied, split, strict=True))
        return f"{split[0][0]} on all {n} workers; {notes}"
    return f"on all {n} workers: " + "; ".join(f"worker {w.index}: {m}" for (w, _), m in zip(applied, messages, strict=True))


def _applied(applied: list[tuple[WorkerProcess, dict]]) -> dict:
    bodies = [b for _, b in applied]
    first = bodies[0]
    return {
        "status": "ok",
        "message": _resize_message(applied),
        "experts_kept": all(b["experts_kept"] for b in bodies),
        "kept": first["kept"] if len({b["kept"] for b in bodies}) == 1 else [b["kept"] for b in bodies],
        # NOTE: each the slowest worker's (the workers resize at once): waiting for in-flight requests, the swap, both
        "waited_s": max(b["waited_s"] for b in bodies),
        "swap_s": max(b["swap_s"] for b in bodies),
        "total_s": max(b["total_s"] for b in bodies),
        "max_running": min(b["max_running"] for b in bodies),  # per worker, as /v1/stats' scheduler
        "peak_bytes": max(b["peak_bytes"] for b in bodies),
        "steps": first["steps"],
        "before": first["before"],
        "after": first["after"],
        "workers": [{"worker": w.index, **b} for w, b in applied],
    }


async def _revert(front: Front, applied: list[tuple[WorkerProcess, dict]], body: bytes) -> list[tuple[WorkerProcess, bool]]:
    try:
        wait_s = float(json.loads(body).get("wait_s", 60.0))
    except (ValueError, AttributeError, TypeError):
        wait_s = 60.0

    async def one(worker: WorkerProcess, before: dict) -> tuple[WorkerProcess, bool]:
        payload = {"kv_tokens": before["kv_tokens"], "moe_slots": before["expert_slots"],
                   "mamba_slots": before["state_slots"], "wait_s": wait_s}
        try:
            r = await front.client().post(worker.url + "/v1/cache/rebuild", json=payload)
        except httpx.HTTPError:
            return worker, False
        return worker, r.status_code == 200

    return list(await asyncio.gather(*(one(w, b["before"]) for w, b in applied)))


# -- everything else: proxied to one worker ---------------------------------------------------------
def _error_response(path: str, error: OpenAIError) -> Response:
    if path.startswith("/v1/messages"):  # Anthropic's clients read Anthropic's shape
        kind = {503: "overloaded_error", 408: "invalid_request_error"}.get(error.status_code, "api_error")
        content = {"type": "error", "error": {"type": kind, "message": error.message}}
    else:
        content = error.body()
    return Response(content=content, status_code=error.status_code, headers=error.headers)


def _stream_error(path: str, message: str) -> bytes:
    """The SSE error event of the route's dialect (as the worker itself would end a failed stream)."""
    if path.startswith("/v1/messages"):
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + msgspec.json.encode(data) + b"\n\n"
    if path.startswith("/v1/responses"):
        data = {"type": "error", "code": "worker_down", "message": message, "param": None}
        return b"event: error\ndata: " + msgspec.json.encode(data) + b"\n\n"
    data = {"error": {"message": message, "type": "server_error", "param": None, "code": "worker_down"}}
    return b"data: " + msgspec.json.encode(data) + b"\n\ndata: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _send(front: Front, request: Request, worker: WorkerProcess, body: bytes) -> httpx.Response:
    """Send to the worker; the client leaving before the answer starts cancels it (the worker
    then sees its client go and aborts the request)."""
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST]
    client = front.client()
    upstream = client.build_request(request.method, worker.url + request.url.path, params=request.url.query,
                                    headers=headers, content=body)
    upstream.headers.update(front.pool.headers)
    sending = asyncio.ensure_future(client.send(upstream, stream=True))
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if sending not in done:
        sending.cancel()
        raise OpenAIError(499, "client disconnected", code="client_closed")
    return sending.result()


@route("/{path:path}", http_method=[HttpMethod.GET, HttpMethod.HEAD, HttpMethod.POST, HttpMethod.PUT,
                                    HttpMethod.PATCH, HttpMethod.DELETE], include_in_schema=False)
async def proxy(request: Request) -> Response:
    front, path = front_of(request), request.url.path
    pool = front.pool
    status = front_status(pool.statuses())
    if status == "loading":
        ready = sum(s == "ok" for s in pool.statuses())
        return _error_response(path, service_unavailable(f"workers are loading ({ready}/{len(pool.workers)} ready)"))
    try:
        body = await read_body(request)
    except OpenAIError as exc:
        return _error_response(path, exc)
    for _ in range(len(pool.workers)):
        worker = pool.acquire()
        if worker is None:
            break
        try:
            upstream = await _send(front, request, worker, body)
        except httpx.ConnectError as exc:  # NOTE: nothing reached it: safe to try another worker
            pool.release(worker)
            pool.mark_unreachable(worker, f"worker {worker.index}: {exc!r}")
            continue
        except httpx.HTTPError as exc:
            pool.release(worker)
            return _error_response(path, OpenAIError(
                503, f"worker {worker.index} (pid {worker.pid}) failed while serving this request: {exc!r}",
                type="server_error", code="worker_down", headers={"Retry-After": "1"}))
        except BaseException:
            pool.release(worker)
            raise
        return await _relay(worker, upstream, path, pool)
    errors = "; ".join(w.error or f"worker {w.index} is {w.status}" for w in pool.workers)
    return _error_response(path, OpenAIError(503, f"no worker can serve: {errors}", type="server_error",
                                             code="worker_down", headers={"Retry-After": "1"}))


async def _relay(worker: WorkerProcess, upstream: httpx.Response, path: str, pool: WorkerPool) -> Response:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
    media_type = upstream.headers.get("content-type", "application/json")
    if not media_type.startswith("text/event-stream"):
        try:  # NOTE: a whole answer (the worker sends it at once): no stream to keep open
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            return _error_response(path, OpenAIError(
                503, f"worker {worker.index} (pid {worker.pid}) failed while answering: {exc!r}",
                type="server_error", code="worker_down", headers={"Retry-After": "1"}))
        finally:
            await upstream.aclose()
            pool.release(worker)
        return Response(content=content, status_code=upstream.status_code, headers=headers, media_type=media_type)

    async def chunks():
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            yield _stream_error(path, f"worker {worker.index} (pid {worker.pid}) failed mid-stream: {exc!r}")
        finally:
            pool.release(worker)
            with anyio.CancelScope(shield=True):
                await upstream.aclose()

    return Stream(chunks(), status_code=upstream.status_code, headers=headers, media_type=media_type)


def create_front_app(front: Front, allowed_origins: tuple[str, ...] = ()) -> Litestar:
    protected = Router(path="/", guards=[require_api_key],
                       route_handlers=[stats, reset_peaks, stats_steps, metrics, cache_status, cache_rebuild,
                                       routing, proxy])
    return Litestar(
        # NOTE: Litestar configures the root logger by default (its own handler, format and INFO level), which
        # replaced `ft serve`'s format and, in tests, printed "Logging error" from threads logging after pytest
        # closed the stream it held; it keeps its own "litestar" logger only
        logging_config=LoggingConfig(configure_root_logger=False),
        route_handlers=[health, protected],
        state=State({"runtime": front}),
        exception_handlers=EXCEPTION_HANDLERS,
        cors_config=cors_config(allowed_origins),
        openapi_config=None,
        request_max_body_size=64 * 1024 * 1024,
    )
