"""Time to first token through HTTP: what a profile needs beyond its step terms for `ft sim predict`'s
benchmark to end where `ft bench` ends (issue 10; docs/simulator.md, "Before the first token").

    python -m simulator.fit_ttft [--base h200_records_v4] [--records A.json B.json ...] [--out FILE] [--check]

It copies a base profile (its step terms, routing seed and deployment untouched) and sets, each from a named
source:

- `cost.streamed_prefill` = true, `cost.lookup_max_keys` = 256: the engine's streamed prefill (ADR 0010) and
  the most keys its device lookup takes without streaming (MAX_KEYS, adapters/kernels/residency_lookup.py).
  Constants of the engine's code, not fitted.
- `deployment.simulate_prefix_cache` = true: every record's server ran the radix prefix cache
  (`server_after.stats.prefix_cache.enabled`), and the simulated scheduler now runs the domain's.
- `workload.prompt_tokens`: the prompt the records' servers counted, `server_after.stats.prefix_cache.
  prompt_tokens / requests` (it must be a whole number and the same in every record): 18 tokens for
  "Count from 1 to 100." in Qwen3.6's chat template, where the simulator assumed 24.
- `workload.max_step_tokens`: the records' servers' step budget, `server_after.stats.scheduler.max_step_tokens`
  (`--max-prefill-length`, 8,192; the same in every record), where the workload said 2,048: a longer prompt
  (`--ttft-prompt`) is then prefilled, and streamed, in the server's chunks. It does not touch the fitted points.
- `cost.request_overhead_s`: the median over the records' points of measured minus simulated median time to
  first token, the points simulated with everything above and the overhead at 0 (it shifts a simulated TTFT
  by exactly its value, so this is the value that makes the median point's TTFT right). The median, not a
  mean: the model has no arrival spread within a burst (ADR 0021's window), so the points whose bursts
  outgrow one step (ladder c8/c16: TTFT twice c4's) sit far above the rest and would pull a mean.

Each point is simulated as its record ran: the record's budget (`budget.total_bytes` as the card cap,
`budget.memory_ratio`), KV size, running requests (`pool_plan.state_slots`), prefill kernels
(`server_after.stats.executor.prefill_kernels`: the Triton prefill plans the auto staging rows), warm-up and
measured rounds and their tokens (`settings`), uniform routing (random-weight checkpoints) with the base
profile's seed. The simulated plan must be the record's (expert slots, staging rows), or the fit stops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from domain.model_spec import ModelSpec, qwen36_35b_a3b
from simulator.hardware import HardwareProfile, get_profile
from simulator.params import run_fit
from simulator.predict import Deployment, Workload, predict_point
from simulator.records import _get, _number
from simulator.routing import make_routing
from simulator.short_prompts import served_replays
from simulator.sweep import CALIBRATION_DIR, Calibration

REPO = Path(__file__).resolve().parents[1]
BASE = "h200_records_v4"
# session 17's records, the ones h200_records_v4's step terms were fitted on (never session 20's held-out ones)
RECORDS = (REPO / "docs/bench/2026-12-04-http-sweep-24gib-h200-prefill-graphs.json",
           REPO / "docs/bench/2026-12-04-http-ladder-resident-h200-prefill-graphs.json")
OUT = CALIBRATION_DIR / "h200_records_v5.json"
LOOKUP_MAX_KEYS = 256  # adapters/kernels/residency_lookup.py MAX_KEYS (the simulator may not import adapters)


@dataclass(frozen=True)
class TtftPoint:
    source: str
    label: str
    kv_tokens: int
    batch: int
    expert_slots: int
    measured_ttft_s: float
    measured_aggregate_tok_s: float
    simulated_ttft_s: float  # request_overhead_s = 0
    simulated_aggregate_tok_s: float  # request_overhead_s = 0


def _server_stats(record: dict, where: str) -> dict:
    return _get(record, "server_after.stats", where)


def prompt_tokens(records: list[tuple[str, dict]]) -> int:
    """The prompt length every record's server counted (prefix_cache.prompt_tokens / requests); ValueError
    unless it is a whole number and the same in every record."""
    lengths = {}
    for name, record in records:
        cache = _get(_server_stats(record, name), "prefix_cache", name)
        tokens, requests = _number(cache, "prompt_tokens", name), _number(cache, "requests", name)
        if tokens % requests:
            raise ValueError(f"{name}: prefix_cache.prompt_tokens {tokens:.0f} over {requests:.0f} requests is not "
                             "a whole prompt length (other prompts were served too)")
        lengths[name] = int(tokens // requests)
    if len(set(lengths.values())) != 1:
        raise ValueError(f"the records counted different prompt lengths: {lengths}")
    return next(iter(lengths.values()))


def step_tokens(records: list[tuple[str, dict]]) -> int:
    """The step budget every record's server ran with (scheduler.max_step_tokens); ValueError unless the same."""
    budgets = {name: int(_number(_server_stats(record, name), "scheduler.max_step_tokens", name))
               for name, record in records}
    if len(set(budgets.values())) != 1:
        raise ValueError(f"the records' servers ran different step budgets: {budgets}")
    return next(iter(budgets.values()))


def _deployment(base: Deployment, record: dict, where: str, replays: int | None = None) -> Deployment:
    stats = _server_stats(record, where)
    prefix = bool(_get(stats, "prefix_cache.enabled", where))
    triton = bool(_get(stats, "executor.prefill_kernels", where))
    return base.replace(gpu_budget_bytes=int(_number(record, "budget.total_bytes", where)), pool_bytes=None,
                        memory_ratio=_number(record, "budget.memory_ratio", where),
                        state_slots=int(_number(record, "pool_plan.state_slots", where)),
                        # the record's staging rows, not today's default (66 rows before ADR 0010's 8 ms cover)
                        staging_experts=int(_number(record, "pool_plan.staging_experts", where, positive=False)),
                        cache_type="radix" if prefix else "none", simulate_prefix_cache=True,
                        prefill_kernels="triton" if triton else "reference",
                        # NOTE: the server's short-prompt replays (ADR 0026): off in every record this fit has read;
                        # `replays` names them for a record that does not state them (session 32's A/B pairs)
                        short_prompt_replays=_replays(record, where) if replays is None else replays)


def _replays(record: dict, where: str) -> int | None:
    try:
        return served_replays(record)
    except ValueError as exc:
        raise ValueError(f"{where}: the record does not say its server's short-prompt replays: {exc}") from None


def _workload(base: Workload, record: dict, prompt: int, where: str) -> Workload:
    settings = _get(record, "settings", where)
    rounds = "iterations" if record["kind"] == "sweep" else "rounds"
    return base.replace(prompt_tokens=prompt, warmup_iterations=int(_number(settings, "warmup", where, False)),
                        warmup_tokens=int(_number(settings, "warmup_tokens", where)),
                        measure_iterations=int(_number(settings, rounds, where)),
                        measure_tokens=int(_number(settings, "tokens", where)))


def simulate_points(calibration: Calibration, records: list[tuple[str, dict]], spec: ModelSpec,
                    hardware: HardwareProfile, replays: dict[str, int] | None = None) -> list[TtftPoint]:
    """Every ok point of the ft bench records, measured and simulated with `calibration` (its cost as given).
    `replays`: record name -> its server's FLUXTIDE_SHORT_PROMPT_REPLAYS, for records that do not state it (else
    short_prompts.served_replays reads it)."""
    cost = calibration.cost_params()
    routing = make_routing("uniform", spec.num_layers, spec.num_experts, spec.top_k, calibration.seed,
                           calibration.locality_params())
    prompt = calibration.workload["prompt_tokens"]
    out = []
    for name, record in records:
        if record.get("kind") not in ("sweep", "ladder"):
            raise ValueError(f"{name}: a {record.get('kind')!r} record has no HTTP time to first token")
        deployment = _deployment(calibration.deployment_params(), record, name, (replays or {}).get(name))
        workload = _workload(Workload.from_dict(calibration.workload), record, prompt, name)
        plan = _get(record, "pool_plan", name)
        for i, p in enumerate(_get(record, "points", name)):
            where = f"{name} points[{i}]"
            if not _get(p, "ok", where):
                continue
            if record["kind"] == "sweep":
                batch, kv = int(_number(p, "batch_size", where)), int(_number(p, "kv_tokens", where))
                slots = int(_number(p, "expert_slots", where))
            else:
                batch, kv = int(_number(p, "concurrency", where)), int(_number(plan, "kv_tokens", where))
                slots = int(_number(plan, "expert_slots", where))
            result = predict_point(spec, calibration.model, hardware, deployment, cost, routing, kv, batch, workload,
                                   calibration=calibration.name)
            if not result.fits or result.expert_slots != slots:
                raise ValueError(f"{where}: the simulated plan ({result.expert_slots} expert slots, "
                                 f"{result.reason or 'fits'}) is not the record's ({slots} slots)")
            staging = int(_number(plan, "staging_experts", name, positive=False))
            if result.extra["plan"]["staging_experts"] != staging:
                raise ValueError(f"{where}: the simulated plan stages {result.extra['plan']['staging_experts']} "
                                 f"experts, the record {staging}")
            out.append(TtftPoint(name, f"{record['kind']} kv={kv} bs={batch}", kv, batch, slots,
                                 _number(p, "ttft_s_median", where), _number(p, "aggregate_tok_s", where),
                                 result.ttft_s, result.decode_tok_s))
    if not out:
        raise ValueError("no ok points in the records")
    return out


def _load(paths) -> list[tuple[str, dict]]:
    return [(Path(p).name, json.loads(Path(p).read_text())) for p in paths]


def build(base_name: str = BASE, paths=RECORDS, name: str | None = None) -> dict:
    """The profile: the base with the streamed prefill, the prefix cache, the counted prompt and the fitted
    request overhead; validation.ttft_fit holds every point before and after the overhead."""
    spec, hardware = qwen36_35b_a3b(), get_profile("h200")
    base = Calibration.resolve(base_name)
    records = _load(paths)
    prompt = prompt_tokens(records)
    profile = json.loads(json.dumps(base.to_dict()))
    profile["name"] = name or OUT.stem
    profile["cost"].update(streamed_prefill=True, lookup_max_keys=LOOKUP_MAX_KEYS, request_overhead_s=0.0)
    profile["deployment"]["simulate_prefix_cache"] = True
    profile["workload"].update(prompt_tokens=prompt, max_step_tokens=step_tokens(records))
    unfitted = Calibration.from_dict(profile, where=profile["name"])
    points = simulate_points(unfitted, records, spec, hardware)
    overhead = statistics.median(p.measured_ttft_s - p.simulated_ttft_s for p in points)
    if overhead < 0:
        raise ValueError(f"the median point's simulated TTFT is {-overhead * 1e3:.1f} ms longer than measured: "
                         "no overhead >= 0 fits")
    profile["cost"]["request_overhead_s"] = overhead
    fitted = Calibration.from_dict(profile, where=profile["name"])
    after = simulate_points(fitted, records, spec, hardware)
    profile["procedure"] = (f"python -m simulator.fit_ttft --base {base_name} (simulator/fit_ttft.py docstring) over "
                            f"the step terms of {base_name} ({base.procedure})")
    profile["reading"] = {**base.reading, "ttft": (
        "time to first token through HTTP = request_overhead_s (before the engine sees the request: send, parse, "
        "template, tokenize, arrival window, first token's way back) + the simulated prefill step; a repeated "
        "prompt resumes from the radix prefix cache's snapshot at its last whole page (16 of 18 tokens) and "
        "prefills the rest; steps of more than min(slots, 256) keys stream through the staging rows (ADR 0010)")}
    profile["provenance"] = {**base.provenance, "ttft_fit": {
        "base": base_name,
        "records": [str(Path(p).relative_to(REPO)) if Path(p).is_absolute() else str(p) for p in paths],
        "fields": ["points[].ttft_s_median (fitted)", "points[].aggregate_tok_s (reported)",
                   "points[].kv_tokens|concurrency, batch_size, expert_slots", "settings.warmup, warmup_tokens, "
                   "iterations|rounds, tokens", "budget.total_bytes, budget.memory_ratio",
                   "pool_plan.state_slots, kv_tokens, expert_slots, staging_experts",
                   "server_after.stats.prefix_cache.enabled, prompt_tokens, requests",
                   "server_after.stats.executor.prefill_kernels", "server_after.stats.scheduler.max_step_tokens"],
        "prompt_tokens": prompt, "max_step_tokens": profile["workload"]["max_step_tokens"],
        "request_overhead_s": "median over the points of measured - simulated median TTFT at overhead 0",
        "constants": {"streamed_prefill": "ADR 0010 (docs/adr/0010-streamed-prefill.md)",
                      "lookup_max_keys": "MAX_KEYS, adapters/kernels/residency_lookup.py"},
    }}
    rows = []
    for b, a in zip(points, after, strict=True):
        rows.append({"source": b.source, "label": b.label, "expert_slots": b.expert_slots,
                     "measured_ttft_s": b.measured_ttft_s, "simulated_ttft_s_without_overhead": b.simulated_ttft_s,
                     "simulated_ttft_s": a.simulated_ttft_s, "ttft_error": a.simulated_ttft_s / b.measured_ttft_s - 1,
                     "measured_aggregate_tok_s": b.measured_aggregate_tok_s,
                     "simulated_aggregate_tok_s": a.simulated_aggregate_tok_s,
                     "aggregate_error": a.simulated_aggregate_tok_s / b.measured_aggregate_tok_s - 1})
    profile["validation"] = {**base.validation, "ttft_fit": {
        "note": "all points fitted (one parameter, their median residual); aggregate tok/s is not fitted",
        "request_overhead_s": overhead, "points": rows,
        "max_abs_aggregate_error": max(abs(r["aggregate_error"]) for r in rows)}}
    return profile


def print_table(profile: dict, log=print) -> None:
    fit = profile["validation"]["ttft_fit"]
    log(f"request_overhead_s = {fit['request_overhead_s'] * 1e3:.2f} ms, prompt {profile['workload']['prompt_tokens']} "
        "tokens")
    log(f"{'point':22} {'TTFT meas':>10} {'sim (0)':>9} {'sim':>9} {'err':>7} {'agg meas':>9} {'agg sim':>9} {'err':>7}")
    for r in fit["points"]:
        log(f"{r['label']:22} {r['measured_ttft_s'] * 1e3:8.1f}ms {r['simulated_ttft_s_without_overhead'] * 1e3:7.1f}ms "
            f"{r['simulated_ttft_s'] * 1e3:7.1f}ms {r['ttft_error']:+7.1%} {r['measured_aggregate_tok_s']:9.1f} "
            f"{r['simulated_aggregate_tok_s']:9.1f} {r['aggregate_error']:+7.1%}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulator.fit_ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help="profile whose step terms are kept (name or file)")
    p.add_argument("--records", nargs="+", type=Path, default=list(RECORDS),
                   help="ft bench sweep/ladder records of the engine the base was fitted on")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="compare a fresh build with --out instead of writing it")
    args = p.parse_args(argv)
    return run_fit(lambda: build(args.base, args.records, args.out.stem), print_table, args.out, args.check)


if __name__ == "__main__":
    sys.exit(main())
