"""The server under test, over HTTP only: its model id, what it says about itself, and (when it is
fluxtide) its admin API: live pool rebuild (/v1/cache/rebuild) and cumulative expert counters
(/metrics). Any other OpenAI-compatible server works too; fluxtide-only facts are then null."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


class BenchError(RuntimeError):
    """A run cannot go on (unreachable server, no model); the message says why."""


@dataclass
class RebuildOutcome:
    ok: bool
    status: int | None
    body: dict  # the server's answer (the plan after, or its refusal)
    error: str | None = None


def client_for(base_url: str, api_key: str | None, concurrency: int, timeout: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(8, concurrency + 4), max_keepalive_connections=max(8, concurrency + 4))
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, limits=limits)


async def _get_json(client: httpx.AsyncClient, path: str) -> dict | None:
    try:
        r = await client.get(path)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def model_id(client: httpx.AsyncClient, wanted: str | None) -> str:
    """The model to ask for: ``wanted`` if given, else the first one /v1/models lists."""
    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {client.base_url}: {exc}") from None
    if r.status_code != 200:
        raise BenchError(f"GET /v1/models answered HTTP {r.status_code}: {r.text[:300]}")
    ids = [m["id"] for m in r.json().get("data", [])]
    if wanted:
        return wanted
    if not ids:
        raise BenchError("the server lists no model; pass --model")
    return ids[0]


async def describe(client: httpx.AsyncClient) -> dict:
    """Everything the server reports about itself (None where it has no such route). ``props`` is
    llama.cpp's ``/props`` (its build, context size, slot count, model path); fluxtide has none."""
    return {
        "health": await _get_json(client, "/health"),
        "models": await _get_json(client, "/v1/models"),
        "stats": await _get_json(client, "/v1/stats"),
        "cache_status": await _get_json(client, "/v1/cache/status"),
        "props": await _get_json(client, "/props"),
    }


def is_fluxtide(server: dict) -> bool:
    """fluxtide answers /v1/cache/status with a pool plan; other servers have no such route."""
    return bool(server.get("cache_status") and "plan" in server["cache_status"])


async def _metric_samples(client: httpx.AsyncClient, names: dict[str, str]) -> dict | None:
    """{names[sample]: int value} for the named samples of the server's /metrics, or None when the route,
    the text format or any of the samples is missing."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    found = {}
    try:
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name in names:
                    found[names[sample.name]] = int(sample.value)
    except ValueError:  # not Prometheus text
        return None
    return found if len(found) == len(names) else None


async def expert_counters(client: httpx.AsyncClient) -> dict | None:
    """Cumulative expert cache hits and misses from /metrics (None if the server does not count them)."""
    return await _metric_samples(client, {"ft_expert_hits_total": "hits", "ft_expert_misses_total": "misses"})


# llama.cpp's llama-server (--metrics): requests being decoded and requests waiting for a free slot
LLAMA_CPP_LOAD = {"llamacpp:requests_processing": "running", "llamacpp:requests_deferred": "waiting"}


async def llama_cpp_load(client: httpx.AsyncClient) -> dict | None:
    """{'running', 'waiting'} from llama-server's /metrics gauges, or None (no such route or gauges:
    another server, or llama-server started without --metrics)."""
    return await _metric_samples(client, LLAMA_CPP_LOAD)


async def reset_peaks(client: httpx.AsyncClient) -> dict | None:
    """fluxtide's high-water marks (POST /v1/stats/reset_peaks: `running_peak`, `waiting_peak` since the previous
    call, which it restarts), or None where the server has no such route (another server, an older fluxtide)."""
    try:
        r = await client.post("/v1/stats/reset_peaks")
        body = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(body, dict) or not all(isinstance(body.get(k), int) for k in ("running_peak", "waiting_peak")):
        return None
    return body


async def pool_plan(client: httpx.AsyncClient) -> dict | None:
    """fluxtide's pool plan in force (GET /v1/cache/status `plan`: kv_tokens, expert_slots, state_slots, ...), or
    None where the server has no such route."""
    status = await _get_json(client, "/v1/cache/status")
    plan = status.get("plan") if isinstance(status, dict) else None
    return plan if isinstance(plan, dict) else None


async def pools(client: httpx.AsyncClient) -> dict | None:
    stats = await _get_json(client, "/v1/stats")
    return stats.get("pools") if stats else None


async def scheduler(client: httpx.AsyncClient) -> dict | None:
    """fluxtide's /v1/stats `scheduler` section (step budgets, max running, `layer_groups` run since start), or None
    where the server has no such section (another server)."""
    stats = await _get_json(client, "/v1/stats")
    return stats.get("scheduler") if stats else None


async def prefix_cache(client: httpx.AsyncClient) -> dict | None:
    """fluxtide's /v1/stats `prefix_cache` section (lookups, hits and cached tokens since start, the cache's
    pages), or None where the server has no such section (another server)."""
    stats = await _get_json(client, "/v1/stats")
    return stats.get("prefix_cache") if stats else None


async def rebuild(client: httpx.AsyncClient, kv_tokens: int | str | None, moe_slots: int | str | None,
                  wait_s: float = 120.0, mamba_slots: int | None = None) -> RebuildOutcome:
    """Live pool resize through fluxtide's admin API; a refusal (409) comes back as ok=False."""
    payload = {"kv_tokens": kv_tokens, "moe_slots": moe_slots, "wait_s": wait_s}
    if mamba_slots is not None:
        payload["mamba_slots"] = mamba_slots
    try:
        r = await client.post("/v1/cache/rebuild", json=payload, timeout=wait_s + 60)
    except httpx.HTTPError as exc:
        return RebuildOutcome(False, None, {}, f"{type(exc).__name__}: {exc}")
    try:
        body = r.json()
    except ValueError:
        body = {"raw": r.text[:500]}
    if r.status_code == 200:
        return RebuildOutcome(True, 200, body)
    message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else None
    return RebuildOutcome(False, r.status_code, body, f"HTTP {r.status_code}: {message or str(body)[:300]}")


def context_tokens(server: dict, model: str) -> tuple[int | None, str | None]:
    """The most tokens (prompt and output) one request may hold on the server, and where that was read; (None, None)
    where the server does not say. ``server``: the record's server section (/v1/models, /props as the run found them).
    fluxtide, vLLM and SGLang list it with the model (/v1/models `max_model_len`), llama.cpp per slot in /props."""
    for card in (server.get("models") or {}).get("data") or []:
        if isinstance(card, dict) and card.get("id") == model and isinstance(card.get("max_model_len"), int):
            return card["max_model_len"], "from /v1/models max_model_len"
    n_ctx = ((server.get("props") or {}).get("default_generation_settings") or {}).get("n_ctx")
    if isinstance(n_ctx, int):
        return n_ctx, "from /props default_generation_settings.n_ctx"
    return None, None


def model_facts(server: dict, model_dir: str | None) -> dict:
    """Model geometry and format: from the server where it says, else from ``--model-dir``'s
    config.json (read locally; the server's API does not publish its geometry)."""
    cache = server.get("cache_status") or {}
    facts = {
        "name": (server.get("stats") or {}).get("model") or _first_model(server),
        "total_experts": cache.get("total_experts"),
        "expert_bytes": cache.get("expert_bytes"),
        "geometry": None,
        "format": None,
        "source": "server",
    }
    if model_dir:
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"--model-dir {model_dir}: cannot read config.json ({exc})") from None
        text = config.get("text_config", config)
        keys = ("model_type", "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings")
        facts["geometry"] = {k: text.get(k) for k in keys if k in text}
        facts["format"] = _format(config, text)
        facts["source"] = f"server + {model_dir}/config.json"
    model_path = (server.get("props") or {}).get("model_path")
    if model_path:  # llama.cpp serves the GGUF converted from --model-dir, in its own format
        facts["checkpoint_format"] = facts["format"]
        facts["format"] = f"gguf {Path(model_path).name}"
    return facts


def _format(config: dict, text: dict) -> str:
    """'fp8 e4m3 block 128x128', 'compressed-tensors', ... or the dtype of an unquantised checkpoint."""
    quant = config.get("quantization_config") or text.get("quantization_config")
    if quant:
        parts = [str(quant.get("quant_method", "quantized"))]
        if quant.get("fmt"):
            parts.append(str(quant["fmt"]))
        if quant.get("weight_block_size"):
            parts.append("block " + "x".join(str(n) for n in quant["weight_block_size"]))
        return " ".join(parts)
    for source in (text, config):
        dtype = source.get("dtype") or source.get("torch_dtype")
        if dtype:
            return str(dtype)
    return "unknown"


def _first_model(server: dict) -> str | None:
    data = (server.get("models") or {}).get("data") or []
    return data[0]["id"] if data else None


def _routing(server: dict):
    for part in ("health", "stats"):
        mode = (server.get(part) or {}).get("routing")
        if mode:
            return mode
    return None


def routing_mode(server: dict) -> str:
    """How the server routed tokens to experts for this record's figures: 'natural' unless it says
    otherwise; under fluxtide's --routing-replay, the replay's canonical spec while it is active."""
    mode = _routing(server)
    if isinstance(mode, dict):
        if mode.get("mode", "natural") == "natural" or not mode.get("active", True):
            return "natural"
        return str(mode.get("spec") or mode["mode"])
    return mode if isinstance(mode, str) else ("natural" if mode is None else json.dumps(mode))


def routing_replay(server: dict) -> dict | None:
    """The server's routing replay (fluxtide --routing-replay: mode, parameters, active), or None."""
    mode = _routing(server)
    return mode if isinstance(mode, dict) and mode.get("mode", "natural") != "natural" else None
