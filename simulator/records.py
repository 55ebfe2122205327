"""Decode-step observations read from our benchmark records (`ft bench` and `scripts/bench_decode.py`).

One `StepObservation` is one measured quantity the step model (cost_model.decode_step) predicts:
- kind "step": the seconds of one decode step of `batch` rows, measured through HTTP (`ft bench`
  sweep / ladder: 1 / the median steady decode tok/s of one request, i.e. the time between two
  tokens of a request while every row decodes) or through `execute()` (bench_decode:
  `execute_median_ms`, host clock, host work included);
- kind "host": the host work outside the graph of such a step (bench_decode `execute_minus_replay_ms`
  of an all-resident step; with misses that difference also holds the miss path, so it is not used).

Misses per step and distinct experts per layer come from the record when it has them (bench_decode
`miss_bytes_per_step` / `hit_rate`; ft bench sweep `expert_hits`, `expert_misses` over its measured
rounds, which include the rounds' prefill lookups: a bias of up to ~10 % at 24-token prompts).
Otherwise an all-resident point (pool residency 1) has no misses and the expected distinct experts
of `batch` independent uniformly routed rows (random-weight checkpoints route near-uniformly); a
point with misses and no counts is an error. Every required field that is missing raises
ValueError naming the file, the point and the field: a record that cannot be read is never skipped.
Record kinds that hold no decode step (kernel micro-benchmarks, probes, prefill, cold start) are
listed as skipped with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from domain.model_spec import ModelSpec

BENCH_DECODE_PROMPT_TOKENS = 16  # scripts/bench_decode.py prompts (docs/fast-decode.md); not in its args
HTTP_PROMPT_TOKENS = 24  # "Count from 1 to 100." in the chat template (simulator.predict.Workload)
SKIPPED_KINDS = {
    "bench_kernels": "kernel micro-benchmark: no decode step",
    "gpu_kernel_probe": "kernel probe: no decode step",
    "probe": "single-stream probe: decode mixed with its prefill",
    "prefill": "prefill only",
    "cold-start": "start-up milestones",
    "smoke": "semantic check",
}


@dataclass(frozen=True)
class StepObservation:
    source: str  # record file name
    label: str  # e.g. "sweep kv=8192 bs=4"
    kind: str  # "step" | "host"
    path: str  # "execute" (bench_decode) | "http" (ft bench)
    batch: int  # real rows
    kv_tokens: int
    expert_slots: int
    context: int  # mean KV positions of a row over the timed steps
    distinct_per_layer: float
    distinct_source: str  # "measured" | "uniform expectation"
    misses_per_step: float
    measured_s: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RecordSet:
    observations: list[StepObservation]
    skipped: list[dict]  # {"source", "reason"} for whole records or failed points
    graph_buckets: tuple[int, ...]  # from bench_decode records (() when none states them)
    fixed_bytes: int | None  # bench_decode args.fixed_gib or ft bench budget.fixed_bytes
    state_slots: int  # the largest state pool seen
    pinned_h2d_gb_s: list[float]


def expected_distinct(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts one layer reads for `rows` independent uniformly routed rows."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def _get(data: Any, path: str, where: str) -> Any:
    node = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            raise ValueError(f"{where}: missing field {path!r}")
        node = node[part]
    return node


def _number(data: Any, path: str, where: str, positive: bool = True) -> float:
    value = _get(data, path, where)
    if isinstance(value, bool) or not isinstance(value, int | float) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{where}: field {path!r} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _check_geometry(geometry: dict, expert_bytes: float, spec: ModelSpec, where: str) -> None:
    got = (int(_get(geometry, "num_hidden_layers", where)), int(_get(geometry, "num_experts", where)),
           int(_get(geometry, "num_experts_per_tok", where)), int(expert_bytes))
    want = (spec.num_layers, spec.num_experts, spec.top_k, spec.expert_bytes())
    if got != want:
        raise ValueError(f"{where}: geometry (layers, experts, top-k, expert bytes) {got} is not the model's {want}")


def _bench_decode(record: dict, name: str, spec: ModelSpec, out: RecordSet) -> None:
    where = name
    _check_geometry(_get(record, "geometry", where), _number(record, "row_bytes", where), spec, where)
    args = _get(record, "args", where)
    context = BENCH_DECODE_PROMPT_TOKENS + int(_number(args, "warmup", where)) + int(_number(args, "steps", where)) // 2
    out.fixed_bytes = int(_number(args, "fixed_gib", where, positive=False) * 2**30)
    if "h2d_pinned_gbps" in record.get("hardware", {}):
        out.pinned_h2d_gb_s.append(float(record["hardware"]["h2d_pinned_gbps"]))
    scenarios = _get(record, "scenarios", where)
    if not isinstance(scenarios, dict) or not scenarios:
        raise ValueError(f"{where}: field 'scenarios' is empty")
    for scenario_name, scenario in scenarios.items():
        w = f"{where} scenarios.{scenario_name}"
        plan = _get(scenario, "plan", w)
        kv, slots = int(_number(plan, "kv_tokens", w)), int(_number(plan, "expert_slots", w))
        out.state_slots = max(out.state_slots, int(_number(plan, "state_slots", w)))
        if "graph_buckets" in scenario:
            out.graph_buckets = tuple(sorted(set(out.graph_buckets) | {int(b) for b in scenario["graph_buckets"]}))
        for batch_key, b in _get(scenario, "batches", w).items():
            wb = f"{w}.batches.{batch_key}"
            batch = int(batch_key)
            step_s = _number(b, "execute_median_ms", wb) / 1e3
            misses = _number(b, "miss_bytes_per_step", wb, positive=False) / spec.expert_bytes()
            hit_rate = _number(b, "hit_rate", wb, positive=False)
            if misses > 0 and hit_rate < 1:
                distinct, source = misses / (1 - hit_rate) / spec.num_layers, "measured"
            else:
                distinct, source = expected_distinct(spec.num_experts, spec.top_k, batch), "uniform expectation"
            distinct = min(distinct, float(spec.num_experts))
            label = f"bench_decode {scenario_name} bs={batch}"
            common = dict(source=name, path="execute", batch=batch, kv_tokens=kv, expert_slots=slots,
                          context=context, distinct_per_layer=distinct, distinct_source=source,
                          misses_per_step=misses)
            out.observations.append(StepObservation(label=label, kind="step", measured_s=step_s, **common))
            # NOTE: with misses the lookups and gathers run between graph pieces, so execute - replay
            # is host work only on all-resident steps; run 1 lacks the field.
            if "execute_minus_replay_ms" in b and misses == 0:
                host_ms = _number(b, "execute_minus_replay_ms", wb)
                out.observations.append(StepObservation(label=label + " host", kind="host",
                                                        measured_s=host_ms / 1e3, **common))


def _ft_bench(record: dict, name: str, spec: ModelSpec, out: RecordSet) -> None:
    where = name
    kind = record["kind"]
    model = _get(record, "model", where)
    _check_geometry(_get(model, "geometry", where), _number(model, "expert_bytes", where), spec, where)
    settings = _get(record, "settings", where)
    tokens = int(_number(settings, "tokens", where))
    context = HTTP_PROMPT_TOKENS + tokens // 2
    out.fixed_bytes = int(_number(record, "budget.fixed_bytes", where, positive=False))
    h2d = record.get("hardware", {}).get("pinned_h2d_gb_s")
    if isinstance(h2d, int | float):
        out.pinned_h2d_gb_s.append(float(h2d))
    plan = _get(record, "pool_plan", where)
    out.state_slots = max(out.state_slots, int(_number(plan, "state_slots", where)))
    points = _get(record, "points", where)
    if not isinstance(points, list) or not points:
        raise ValueError(f"{where}: field 'points' is empty")
    for i, p in enumerate(points):
        w = f"{where} points[{i}]"
        if not _get(p, "ok", w):
            out.skipped.append({"source": name, "reason": f"points[{i}] failed: {p.get('error')}"})
            continue
        if kind == "sweep":
            batch = int(_number(p, "batch_size", w))
            kv, slots = int(_number(p, "kv_tokens", w)), int(_number(p, "expert_slots", w))
        else:  # ladder: one pool for the whole run
            batch = int(_number(p, "concurrency", w))
            kv, slots = int(_number(plan, "kv_tokens", where)), int(_number(plan, "expert_slots", where))
        step_s = 1.0 / _number(p, "steady_decode_tok_s_median", w)
        if "expert_misses" in p or "expert_hits" in p:
            steps = _number(p, "completion_tokens", w) / batch
            hits, misses = _number(p, "expert_hits", w, False), _number(p, "expert_misses", w, False)
            distinct, source = (hits + misses) / steps / spec.num_layers, "measured"
            misses_per_step = misses / steps
            distinct = min(distinct, float(spec.num_experts))
        elif slots >= spec.total_experts:
            distinct, source = expected_distinct(spec.num_experts, spec.top_k, batch), "uniform expectation"
            misses_per_step = 0.0
        else:
            raise ValueError(f"{w}: missing field 'expert_misses' (the pool holds {slots} of "
                             f"{spec.total_experts} experts, so the point has misses)")
        label = f"{kind} kv={kv} bs={batch}"
        out.observations.append(StepObservation(name, label, "step", "http", batch, kv, slots, context, distinct,
                                                source, misses_per_step, step_s))


def load_records(paths: list[Path], spec: ModelSpec) -> RecordSet:
    """Every decode-step observation of the given record files. ValueError on an unreadable file,
    an unknown record kind, a geometry other than `spec`'s, or a missing field."""
    if not paths:
        raise ValueError("no record files given")
    out = RecordSet([], [], (), None, 0, [])
    for path in paths:
        path = Path(path)
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable JSON record ({err})") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise ValueError(f"{path.name}: missing field 'kind'")
        kind = record["kind"]
        if kind == "bench_decode":
            _bench_decode(record, path.name, spec, out)
        elif kind in ("sweep", "ladder"):
            _ft_bench(record, path.name, spec, out)
        elif kind in SKIPPED_KINDS:
            out.skipped.append({"source": path.name, "reason": SKIPPED_KINDS[kind]})
        else:
            raise ValueError(f"{path.name}: unknown record kind {kind!r}; known: bench_decode, sweep, ladder "
                             f"(decode steps) and {sorted(SKIPPED_KINDS)} (skipped)")
    if not out.observations:
        raise ValueError(f"no decode-step observations in {[str(p) for p in paths]}")
    return out
