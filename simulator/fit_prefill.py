"""The uncaptured prefill step's cost: what a profile needs for a long prefill chunk (and a mixed step or a layer
group beside decodes) to cost what the engine measured (issue 10; docs/simulator.md, "Prefill compute").

    python -m simulator.fit_prefill [--base h200_records_v5] [--record R.json] [--http H.json] [--out FILE] [--check]

It copies a base profile (every other term untouched: the captured decode steps, the copies, the streamed prefill,
the request overhead) and fits two terms of CostParams on `bench_prefill`'s resident scenario only (every expert
preloaded, nothing copied, so the time is the prefill's compute and fixed cost alone):

- `eager_layer_s`: per layer an uncaptured pass of more than `lookup_max_keys` pairs computes (the eager forward's
  fixed cost: launches, host work, the grouped path's lookup and alignment; ADR 0011's c, pro rata per layer);
- `eager_compute_efficiency`: the share of dense bf16 throughput its compute-bound kernels achieve (the roofline's
  FLOPs; it also carries what the roofline does not count, such as the GDN recurrence).

Each resident prompt is simulated as `scripts/bench_prefill.py` runs it: one fresh sequence, `--chunk`-token steps
through `SimExecutor.execute` (no scheduler, no HTTP), the pool preloaded evenly over the layers (the first
slots / L experts of each, bench_prefill's `preload`). Two prompts (8k: one step; 32k: four steps whose attention
grows with the context) give two equations; the fit is their exact solution (secant on the efficiency, the fixed
cost from the 8k point), and stops unless both terms come out in range.

Held out (no refit), in `validation.prefill_fit.held_out`: the record's streamed scenario (`budget`: 54 % of the
experts preloaded, the rest staged per layer through the staging rows, copies overlapping compute in the existing
copy model), and the HTTP prefill TTFTs of an `ft bench prefill` record (resident, request_overhead_s in front).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from domain.model_spec import ModelSpec, qwen36_35b_a3b
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams
from simulator.cost_model import CostModel, CostParams
from simulator.hardware import HardwareProfile, get_profile
from simulator.host import SimHost
from simulator.params import run_fit
from simulator.records import _get, _number
from simulator.routing import make_routing
from simulator.sim_executor import SimExecutor
from simulator.sweep import CALIBRATION_DIR, Calibration

REPO = Path(__file__).resolve().parents[1]
BASE = "h200_records_v5"
# session 19's bench_prefill (resident and 24 GiB, 8k and 32k in 8,192-token chunks; the code of 2026-12-04)
RECORD = REPO / "docs/bench/2026-12-04-bench-prefill-h200-8k-32k-resident-budget.json"
# session 20's ft bench prefill through HTTP (resident server, 1k-32k, two fresh prompts each): held out
HTTP = REPO / "docs/bench/2026-12-04-sbs-prefill-fluxtide-h200.json"
OUT = CALIBRATION_DIR / "h200_records_v6.json"
FIT_SCENARIO, HELD_SCENARIO = "resident", "budget"


def simulate_prefill(spec: ModelSpec, hardware: HardwareProfile, cost: CostParams, seed: int, length: int,
                     chunk: int, expert_slots: int, staging_experts: int = 0, via_server: bool = False) -> SimExecutor:
    """One fresh prompt of `length` tokens prefilled in `chunk`-token steps on a pool of `expert_slots` preloaded
    evenly over the layers (bench_prefill's preload), uniform routing; the executor after it (host.now() is the
    prefill's time, its counters the steps' copies)."""
    routing = make_routing("uniform", spec.num_layers, spec.num_experts, spec.top_k, seed)
    ex = SimExecutor(SimHost(), CostModel(spec, hardware, cost), routing, expert_slots, via_server=via_server,
                     staging_experts=staging_experts)
    layers, experts = spec.num_layers, spec.num_experts
    each, extra = min(experts, expert_slots // layers), expert_slots - min(experts, expert_slots // layers) * layers
    for layer in range(layers):
        n = min(experts, each + (1 if layer < extra else 0))
        ex.residency.lookup([(layer, e) for e in range(n)])
        ex.residency.release()
    filled = ex.residency.hits, ex.residency.misses
    ex.residency.hits = ex.residency.misses = 0  # the preload is not the prompt's
    ex.counters.expert_misses = ex.counters.bytes_moved = 0
    assert filled[1] == ex.residency.num_resident, "the preload evicted"
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [(7919 * (i + 1) + 104729 * length) % spec.vocab_size for i in range(length)]
    pages = tuple(range(-(-length // 16) + 1))
    for start in range(0, length, chunk):
        part = tuple(prompt[start:start + chunk])
        ex.execute(StepBatch((SequenceWork("prefill", part, start, pages, 0, start + len(part) == length, greedy, 0),)))
    return ex


def _scenario(record: dict, name: str, where: str) -> tuple[int, int, dict]:
    scen = _get(record, f"scenarios.{name}", where)
    plan = _get(scen, "plan", where)
    slots, staging = int(_number(plan, "expert_slots", where)), int(_number(plan, "staging_experts", where, False))
    return slots, staging, _get(scen, "prompts", where)


def _point(spec, hardware, cost, seed, record, scenario, length, chunk, where, role) -> dict:
    slots, staging, prompts = _scenario(record, scenario, where)
    measured = _get(prompts, str(length), where)
    ex = simulate_prefill(spec, hardware, cost, seed, length, chunk, slots, staging)
    staged = ex.counters.streamed_staged * spec.expert_bytes()
    if staged != measured["bytes_staged"]:
        raise ValueError(f"{where} {scenario} {length}: simulated {staged} bytes staged, the record "
                         f"{measured['bytes_staged']}")
    t = ex.host.now()
    return {"label": f"bench_prefill {scenario} {length}", "role": role, "scenario": scenario, "prompt_tokens": length,
            "chunk": chunk, "expert_slots": slots, "staging_experts": staging, "steps": ex.counters.steps,
            "measured_s": measured["ttft_s"], "predicted_s": t, "error": t / measured["ttft_s"] - 1,
            "bytes_staged": staged}


def fit(spec: ModelSpec, hardware: HardwareProfile, base: CostParams, seed: int, record: dict, chunk: int,
        where: str) -> tuple[float, float]:
    """(eager_layer_s, eager_compute_efficiency) that put the resident scenario's two prompts on their measured
    times: with F = 0 the time at efficiency e is t_i(e); with F, t_i(e) + steps_i x L x F. The 8k (one step) and
    32k (four steps) equations are solved by secant on e. ValueError unless there are two prompts, e is in (0, 1]
    and F >= 0."""
    _, _, prompts = _scenario(record, FIT_SCENARIO, where)
    lengths = sorted(int(k) for k in prompts)
    if len(lengths) != 2:
        raise ValueError(f"{where}: the {FIT_SCENARIO} scenario has {len(lengths)} prompts; the fit needs two")
    slots = _scenario(record, FIT_SCENARIO, where)[0]
    steps = [-(-n // chunk) for n in lengths]
    measured = [float(prompts[str(n)]["ttft_s"]) for n in lengths]
    layers = spec.num_layers

    def times(e: float) -> list[float]:
        cost = _with(base, 1e-12, e)  # eager terms on (F ~ 0), so the pass runs at e
        return [simulate_prefill(spec, hardware, cost, seed, n, chunk, slots).host.now() for n in lengths]

    def residual(e: float) -> float:  # the fixed cost per step each point implies; equal at the solution
        t = times(e)
        fixed = [(m - s) / k for m, s, k in zip(measured, t, steps, strict=True)]
        return fixed[1] - fixed[0]

    a, b = 0.5, 0.25
    ra, rb = residual(a), residual(b)
    for _ in range(30):
        if rb == ra:
            break
        a, b, ra = b, min(1.0, max(1e-3, b - rb * (b - a) / (rb - ra))), rb
        rb = residual(b)
        if abs(b - a) < 1e-12:
            break
    e = b
    t = times(e)
    per_layer = (measured[0] - t[0]) / (steps[0] * layers)
    if not 0 < e <= 1 or per_layer < 0:
        raise ValueError(f"{where}: no fit in range (efficiency {e:.4f}, fixed {per_layer * 1e3:.3f} ms a layer)")
    return per_layer, e


def _with(base: CostParams, eager_layer_s: float, efficiency: float) -> CostParams:
    return CostParams.from_dict({**base.to_dict(), "eager_layer_s": eager_layer_s,
                                 "eager_compute_efficiency": efficiency})


def http_points(spec, hardware, cost: CostParams, seed: int, record: dict, where: str) -> list[dict]:
    """ft bench prefill's points (held out): request_overhead_s + the prompt's chunks on the record's pool, the
    server's step budget as chunk. Measured: the median of the repeats, and the last repeat (warm: the first
    request of each length pays first calls, docs/prefill-kernels.md "First requests after start-up")."""
    plan = _get(record, "pool_plan", where)
    slots, staging = int(_number(plan, "expert_slots", where)), int(_number(plan, "staging_experts", where, False))
    chunk = int(_number(record, "server_after.stats.scheduler.max_step_tokens", where))
    rows = []
    for i, p in enumerate(_get(record, "points", where)):
        if not p.get("ok"):
            continue
        n = int(_number(p, "prompt_tokens", f"{where} points[{i}]"))
        ex = simulate_prefill(spec, hardware, cost, seed, n, chunk, slots, staging, via_server=True)
        t = cost.request_overhead_s + ex.host.now()
        last = p["runs"][-1]["ttft_s"]
        rows.append({"label": f"ft bench prefill {n}", "role": "held_out", "prompt_tokens": n, "chunk": chunk,
                     "expert_slots": slots, "steps": ex.counters.steps, "measured_median_s": p["ttft_s_median"],
                     "measured_last_s": last, "runs_s": [r["ttft_s"] for r in p["runs"]], "predicted_s": t,
                     "error_median": t / p["ttft_s_median"] - 1, "error_last": t / last - 1})
    return rows


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_absolute() else str(path)


def build(base_name: str = BASE, record_path: Path = RECORD, http_path: Path | None = HTTP,
          name: str | None = None) -> dict:
    spec, hardware = qwen36_35b_a3b(), get_profile("h200")
    base = Calibration.resolve(base_name)
    record = json.loads(Path(record_path).read_text())
    where = Path(record_path).name
    if record.get("kind") != "bench_prefill":
        raise ValueError(f"{where}: a {record.get('kind')!r} record, not bench_prefill")
    chunk = int(_number(record, "args.chunk", where))
    cost = base.cost_params()
    per_layer, efficiency = fit(spec, hardware, cost, base.seed, record, chunk, where)
    fitted = _with(cost, per_layer, efficiency)
    profile = json.loads(json.dumps(base.to_dict()))
    profile["name"] = name or OUT.stem
    profile["cost"].update(eager_layer_s=per_layer, eager_compute_efficiency=efficiency)
    points = []
    for scenario, role in ((FIT_SCENARIO, "fit"), (HELD_SCENARIO, "held_out")):
        _, _, prompts = _scenario(record, scenario, where)
        for n in sorted(int(k) for k in prompts):
            points.append(_point(spec, hardware, fitted, base.seed, record, scenario, n, chunk, where, role))
    http = []
    if http_path is not None:
        http_record = json.loads(Path(http_path).read_text())
        if http_record.get("kind") != "prefill":
            raise ValueError(f"{Path(http_path).name}: a {http_record.get('kind')!r} record, not ft bench prefill")
        http = http_points(spec, hardware, fitted, base.seed, http_record, Path(http_path).name)
    profile["procedure"] = (f"python -m simulator.fit_prefill --base {base_name} (simulator/fit_prefill.py docstring) "
                            f"over {base_name} ({base.procedure})")
    profile["reading"] = {**base.reading, "prefill": (
        "an uncaptured step whose layer calls route more than lookup_max_keys pairs pays eager_layer_s per layer it "
        "computes and runs its compute-bound kernels at eager_compute_efficiency of dense bf16 throughput; shorter "
        "steps (the prefill graphs) and captured decode steps keep the base's terms")}
    profile["provenance"] = {**base.provenance, "prefill_fit": {
        "base": base_name, "record": _rel(Path(record_path)),
        "fitted_on": f"scenarios.{FIT_SCENARIO}.prompts[*].ttft_s (every expert preloaded; nothing copied)",
        "fields": ["scenarios.<name>.plan.expert_slots, staging_experts", "scenarios.<name>.prompts[*].ttft_s, "
                   "bytes_staged", "args.chunk"],
        "held_out": [f"{_rel(Path(record_path))} scenarios.{HELD_SCENARIO}"]
        + ([f"{_rel(Path(http_path))} points[*].ttft_s_median, runs[-1].ttft_s"] if http_path else []),
        "solve": "exact: two prompts, two terms (secant on the efficiency; the fixed cost from the one-step prompt)",
    }}
    errors = [abs(p["error"]) for p in points if p["role"] == "held_out"] + [abs(p["error_last"]) for p in http]
    profile["validation"] = {**base.validation, "prefill_fit": {
        "eager_layer_s": per_layer, "eager_step_s_equivalent": per_layer * spec.num_layers,
        "eager_compute_efficiency": efficiency, "points": points, "http_held_out": http,
        "max_abs_held_out_error": max(errors) if errors else None}}
    return profile


def print_table(profile: dict, log=print) -> None:
    fit_ = profile["validation"]["prefill_fit"]
    log(f"eager_layer_s = {fit_['eager_layer_s'] * 1e3:.4f} ms ({fit_['eager_step_s_equivalent'] * 1e3:.1f} ms a "
        f"40-layer step), eager_compute_efficiency = {fit_['eager_compute_efficiency']:.4f}")
    log(f"{'point':34} {'role':9} {'measured':>9} {'predicted':>10} {'error':>7}")
    for p in fit_["points"]:
        log(f"{p['label']:34} {p['role']:9} {p['measured_s']:8.3f}s {p['predicted_s']:9.3f}s {p['error']:+7.1%}")
    for p in fit_["http_held_out"]:
        log(f"{p['label']:34} {p['role']:9} {p['measured_last_s']:8.3f}s {p['predicted_s']:9.3f}s "
            f"{p['error_last']:+7.1%}  (median of repeats {p['measured_median_s']:.3f}s: {p['error_median']:+.1%})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulator.fit_prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help="profile whose terms are kept (name or file)")
    p.add_argument("--record", type=Path, default=RECORD, help="bench_prefill record with a resident scenario")
    p.add_argument("--http", type=Path, default=HTTP, help="ft bench prefill record, held out ('' : none)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="compare a fresh build with --out instead of writing it")
    args = p.parse_args(argv)
    http = args.http if str(args.http) else None
    return run_fit(lambda: build(args.base, args.record, http, args.out.stem), print_table, args.out, args.check)


if __name__ == "__main__":
    sys.exit(main())
