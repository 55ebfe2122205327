"""How the data-parallel front folds its workers' answers into one: /health, /v1/stats,
/v1/cache/status and /metrics. Pure functions over the workers' JSON bodies and Prometheus text,
so every rule is tested without a process.

Merge rule for numbers (``merge``): counts, bytes and rates in tokens per second add up over the
workers; a key that is the same on every worker by construction (``page_size``, ``window_s``) keeps
that value; fractions (``*_rate``, ``*_fraction``, ``residency``) are the mean over the workers that
report one; latency percentiles (``p50``, ``p90``, ``p99``) and maxima (``*_max``) are the worst worker's (for
percentiles an upper bound, not the percentile of the union: each worker's exact value is in its own entry).
/v1/stats ``arrivals`` and ``gc`` have rules of their own (``merge_arrivals``, ``merge_gc``).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

SAME_KEYS = frozenset({"page_size", "window_s", "snapshot_interval",
                       "max_step_tokens", "mixed_step_tokens", "layer_group_tokens", "arrival_window_ms"})  # /v1/stats scheduler
MEAN_KEYS = frozenset({"residency"})
MAX_KEYS = frozenset({"p50", "p90", "p99"})


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _merge_numbers(key: str, values: list[float]):
    if key in SAME_KEYS and len(set(values)) == 1:
        return values[0]
    if key in MEAN_KEYS or key in SAME_KEYS or key.endswith(("_rate", "_fraction")):
        return sum(values) / len(values)
    if key in MAX_KEYS or key.endswith("_max"):
        return max(values)
    return sum(values)


def merge(bodies: Sequence[dict]) -> dict:
    """One dict from the workers' dicts (same shape), key by key, by the module's rule. Values
    that are not numbers are kept when every worker agrees, else listed in worker order."""
    out: dict = {}
    keys = list(dict.fromkeys(k for body in bodies for k in body))
    for key in keys:
        values = [body[key] for body in bodies if key in body]
        present = [v for v in values if v is not None]
        if not present:
            out[key] = None
        elif all(isinstance(v, dict) for v in present):
            out[key] = merge(present)
        elif all(_is_number(v) for v in present):
            out[key] = _merge_numbers(key, present)
        elif all(v == present[0] for v in present):
            out[key] = present[0]
        else:
            out[key] = values
    return out


def common(values: Sequence[dict | None]) -> dict | None:
    """The value every worker has (their plans after a resize that covered all of them), else None."""
    if not values or any(v is None or v != values[0] for v in values):
        return None
    return values[0]


def plan_totals(plans: Sequence[dict]) -> dict:
    """What the workers hold together: KV tokens, expert slots, state slots (running capacity), bytes."""
    keys = ("kv_tokens", "kv_pages", "expert_slots", "state_slots", "pool_bytes", "used_bytes", "free_bytes")
    return {key: sum(plan[key] for plan in plans) for key in keys if all(key in plan for plan in plans)}


def merge_arrivals(workers: Sequence[tuple[int, dict | None]]) -> dict:
    """/v1/stats ``arrivals`` of the front from its workers' (worker index, their ``arrivals``): ``idle_wakes``
    summed (the times an idle worker woke to queued commands), and each worker's own ``last_burst_sizes`` under
    its index. NOTE: not one list: the front spreads a round of N concurrent requests over its workers, so a worker
    sees a burst of about N / workers, and the workers' bursts carry no time that would order them into one."""
    present = [(index, body) for index, body in workers if body]
    return {"idle_wakes": sum(body.get("idle_wakes", 0) for _, body in present),
            "last_burst_sizes_by_worker": {str(index): list(body.get("last_burst_sizes") or [])
                                           for index, body in present}}


def merge_gc(bodies: Sequence[dict | None]) -> dict:
    """/v1/stats ``gc`` of the front from its workers' (each process collects on its own): full collections,
    their total pause and the frozen objects summed over the workers; ``full_pause_s_max`` the longest pause of
    any worker (the longest stall a stream of any worker waited out)."""
    merged = merge([body for body in bodies if body])
    if isinstance(merged.get("full_pause_s_total"), float):
        merged["full_pause_s_total"] = round(merged["full_pause_s_total"], 6)
    return merged


def front_status(statuses: Sequence[str]) -> str:
    """The front's status from its workers' ("starting" | "loading" | "ok" | "error" | "exited" |
    "unreachable"): loading while any worker still loads; ok when all serve; degraded when some
    serve and the rest failed; error when none can serve."""
    if any(s in ("starting", "loading") for s in statuses):
        return "loading"
    serving = sum(s == "ok" for s in statuses)
    if serving == len(statuses):
        return "ok"
    return "degraded" if serving else "error"


def merge_metrics(texts: dict[int, str], extra: Sequence[Metric] = ()) -> list[Metric]:
    """The workers' Prometheus families, each sample labelled ``worker="i"`` (sum without (worker)
    gives the total), followed by ``extra`` (the front's own families)."""
    families: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {"worker": str(index), **sample.labels}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
    return [*families.values(), *extra]
