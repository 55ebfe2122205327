"""h200_records_v7: v6 with the eager prefill's fixed cost split from its per-token cost, and the short step's eager
token mixers (issue 10; docs/simulator.md, "Short steps: h200_records_v7").

    python -m simulator.fit_short_steps [--out FILE] [--check] [--report]

It copies h200_records_v6 (every other term untouched: the captured decode steps, the copies, the streamed prefill,
the request overhead and eager_compute_efficiency, which v6 fitted on the H200's resident 8k and 32k prompts) and
fits three terms of CostParams, on one card's records, the H100's:

- `eager_layer_s` and `eager_token_s` (the split): v6 charged a fitted 174.8 ms to every long uncaptured step (its two
  prompts both ran 8,192-token chunks, so a cost per step and a cost per token could not be told apart). The H100's
  resident `bench_prefill` of the shipped code (`2026-12-05-h100-prefill-resident-wlhs0.json`: 4,096 tokens in one
  step, 32,768 in four of 8,192) has two chunk sizes: its two prompts give two equations, linear in the two terms
  (every expert preloaded, nothing copied), solved exactly, with v6's efficiency kept;
- `eager_mixer_layer_s` (the short step): the host time a layer of an uncaptured step of at most lookup_max_keys pairs
  takes to launch its eager token mixer and its MoE graph (adapters/cuda_exec/prefill_graphs.py), the GPU waiting for
  it (SimExecutor, "Short steps"). Fitted on the tail steps (4 prompt tokens beside 3 decodes, all 40 layers, no
  expert copied) of the H100's resident `ft bench mixed` record
  (`2026-12-05-h100-mixed-resident-1024-layered-wlhs.json`, its step trace): the replayed record's tail steps on
  their measured mean (secant; resident, the step is host-bound, so the time is affine in the term).

Held out (no refit; `validation.short_steps`): the H100's other prefill records (W_LHS tiles, the 24 GiB streamed
prompts at 66 and 132 staging rows), the H200's resident and 24 GiB prompts (resident: v6's efficiency was fitted
there, so they check the H100's split on the other card), the H200's HTTP prefills (1k-32k), and the tail steps of
the H100's three 24 GiB mixed records (about 1,050 experts copied in each). `--report` also writes the before/after
records docs/bench/2026-12-05-sim-prefill-split.json and docs/bench/2026-12-05-sim-tail-step.json (v6 beside v7 on
every point, and the mixed records' figures and window steps by kind).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

from domain.model_spec import ModelSpec, qwen36_35b_a3b
from simulator.cost_model import CostParams
from simulator.fit_prefill import HTTP as H200_HTTP
from simulator.fit_prefill import RECORD as H200_PREFILL
from simulator.fit_prefill import _point, _scenario, http_points, simulate_prefill
from simulator.hardware import HardwareProfile, get_profile
from simulator.params import run_fit
from simulator.records import _number
from simulator.sweep import CALIBRATION_DIR, Calibration

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "docs/bench"
BASE = "h200_records_v6"
OUT = CALIBRATION_DIR / "h200_records_v7.json"
SPLIT_RECORD = BENCH / "2026-12-05-h100-prefill-resident-wlhs0.json"  # the shipped code: 4k (one step) and 32k
SPLIT_CARD, SPLIT_SCENARIO = "h100", "resident"
TAIL_RECORD = BENCH / "2026-12-05-h100-mixed-resident-1024-layered-wlhs.json"  # two tail steps, nothing copied
# (record, card, scenario) of the bench_prefill points held out; the split's own record's other scenarios none
HELD_PREFILL = (
    (BENCH / "2026-12-05-h100-prefill-resident-wlhs1.json", "h100", "resident"),
    (BENCH / "2026-12-05-h100-prefill-24gib-staging66.json", "h100", "budget"),
    (BENCH / "2026-12-05-h100-prefill-24gib-staging132.json", "h100", "budget"),
    (H200_PREFILL, "h200", "resident"),
    (H200_PREFILL, "h200", "budget"),
)
HELD_MIXED = tuple(BENCH / f"2026-12-05-h100-mixed-24gib-{name}.json"
                   for name in ("512-layered", "1024-layered", "1024-layered-wlhs"))
H200_MIXED = BENCH / "2026-12-05-mixed-24gib-h200-layered.json"  # no step trace: its figures only
REPORT_SPLIT = BENCH / "2026-12-05-sim-prefill-split.json"
REPORT_TAIL = BENCH / "2026-12-05-sim-tail-step.json"
DELTA_LAYER, DELTA_TOKEN = 1e-3, 1e-6  # the probes of the split's two slopes (the times are linear in the terms)


def _rel(path: Path) -> str:
    return str(Path(path).resolve().relative_to(REPO))


def _with(base: CostParams, **terms: float) -> CostParams:
    return CostParams.from_dict({**base.to_dict(), **terms})


def _load(path: Path, kind: str) -> dict:
    record = json.loads(Path(path).read_text())
    if record.get("kind") != kind:
        raise ValueError(f"{Path(path).name}: a {record.get('kind')!r} record, not {kind}")
    return record


def fit_split(spec: ModelSpec, hardware: HardwareProfile, base: CostParams, seed: int, record: dict,
              where: str) -> tuple[float, float]:
    """(eager_layer_s, eager_token_s) that put the record's resident prompts on their measured times, every other
    term the base's. Resident, nothing is copied, so each prompt's time is t0 + a x eager_layer_s + b x eager_token_s:
    the slopes a (layers x steps) and b (layers x tokens) are read from the simulation (a probe of each), and the two
    prompts' equations solved. ValueError unless the prompts have two chunk sizes (else the system is singular) and
    both terms come out >= 0."""
    slots, _, prompts = _scenario(record, SPLIT_SCENARIO, where)
    chunk = int(_number(record, "args.chunk", where))
    lengths = sorted(int(k) for k in prompts)
    if len(lengths) != 2:
        raise ValueError(f"{where}: the {SPLIT_SCENARIO} scenario has {len(lengths)} prompts; the split needs two")

    def time(n: int, **terms: float) -> float:
        cost = _with(base, **{"eager_layer_s": 0.0, "eager_token_s": 0.0, **terms})
        return simulate_prefill(spec, hardware, cost, seed, n, chunk, slots).host.now()

    rows = []
    for n in lengths:
        t0 = time(n)
        a = (time(n, eager_layer_s=DELTA_LAYER) - t0) / DELTA_LAYER
        b = (time(n, eager_token_s=DELTA_TOKEN) - t0) / DELTA_TOKEN
        rows.append((a, b, float(prompts[str(n)]["ttft_s"]) - t0))
    (a1, b1, r1), (a2, b2, r2) = rows
    det = a1 * b2 - a2 * b1
    if abs(det) < 1e-9 * abs(a1 * b2):
        raise ValueError(f"{where}: the prompts {lengths} run steps of one size; the split needs two")
    per_layer, per_token = (r1 * b2 - r2 * b1) / det, (a1 * r2 - a2 * r1) / det
    if per_layer < 0 or per_token < 0:
        raise ValueError(f"{where}: no split in range ({per_layer * 1e3:.3f} ms a layer, {per_token * 1e9:.1f} ns a "
                         "token and layer)")
    return per_layer, per_token


def _silent_main(argv: list[str]) -> int:
    from simulator.__main__ import main

    with contextlib.redirect_stdout(io.StringIO()):
        return main(argv)


def replay(record: Path, profile: dict | str) -> dict:
    """`python -m simulator mixed --record RECORD` with a calibration (a profile dict, or a name or file): its one
    result (the prediction and its `compare`)."""
    with tempfile.TemporaryDirectory() as tmp:
        calibration = profile
        if isinstance(profile, dict):
            calibration = str(Path(tmp) / f"{profile['name']}.json")
            Path(calibration).write_text(json.dumps(profile))
        out = Path(tmp) / "out.json"
        code = _silent_main(["mixed", "--record", str(record), "--calibration", calibration, "--json", "--out",
                             str(out)])
        if code:
            raise ValueError(f"replaying {Path(record).name} failed (exit {code})")
        (result,) = json.loads(out.read_text())
    return result


def tail_steps(result: dict) -> list[dict]:
    """The replay's aligned tail steps (compare.steps rows of kind tail measured and predicted)."""
    return [r for r in result["compare"]["steps"]["rows"]
            if r["kind"] == "tail" and r["measured_ms"] is not None and r["predicted_ms"] is not None]


def fit_tail(profile: dict, record: Path, layers: int) -> tuple[float, list[dict]]:
    """eager_mixer_layer_s that puts the replayed record's tail steps on their measured mean (secant; resident, each
    is host-bound and its time affine in the term), and the tail steps at it. ValueError without tail steps or if
    the secant does not settle within 1 us of the mean."""

    def tail_mean(term: float) -> tuple[float, float, list[dict]]:
        trial = json.loads(json.dumps(profile))
        trial["cost"]["eager_mixer_layer_s"] = term
        rows = tail_steps(replay(record, trial))
        if not rows:
            raise ValueError(f"{Path(record).name}: no tail step in its step trace to fit on")
        return (statistics.fmean(r["measured_ms"] for r in rows) * 1e-3,
                statistics.fmean(r["predicted_ms"] for r in rows) * 1e-3, rows)

    measured, p0, rows = tail_mean(0.0)
    a, pa = 0.0, p0
    b = max(0.0, (measured - p0) / layers)
    for _ in range(8):
        _, pb, rows = tail_mean(b)
        if abs(pb - measured) < 1e-6:
            return b, rows
        if pb == pa:
            break
        a, b, pa = b, max(0.0, b + (measured - pb) * (b - a) / (pb - pa)), pb
    raise ValueError(f"{Path(record).name}: the tail fit did not settle ({b * 1e3:.4f} ms a layer)")


def prefill_points(spec: ModelSpec, cost: CostParams, seed: int) -> list[dict]:
    """Every bench_prefill point of the split's record (fit) and of HELD_PREFILL (held out), simulated with `cost`
    on its own card and pools (fit_prefill._point: it refuses unless the staged bytes are the record's)."""
    points = []
    split = _load(SPLIT_RECORD, "bench_prefill")
    for record_path, card, scenario, role in ((SPLIT_RECORD, SPLIT_CARD, SPLIT_SCENARIO, "fit"),
                                              *((p, c, s, "held_out") for p, c, s in HELD_PREFILL)):
        record = split if record_path == SPLIT_RECORD else _load(record_path, "bench_prefill")
        chunk = int(_number(record, "args.chunk", record_path.name))
        for n in sorted(int(k) for k in record["scenarios"][scenario]["prompts"]):
            p = _point(spec, get_profile(card), cost, seed, record, scenario, n, chunk, record_path.name, role)
            points.append({"record": _rel(record_path), "card": card, **p})
    return points


def build(base_name: str = BASE, name: str | None = None) -> dict:
    spec = qwen36_35b_a3b()
    base = Calibration.resolve(base_name)
    cost = base.cost_params()
    if not cost.eager_compute_efficiency:
        raise ValueError(f"{base_name}: no eager_compute_efficiency to keep (the split needs v6's)")
    split = _load(SPLIT_RECORD, "bench_prefill")
    per_layer, per_token = fit_split(spec, get_profile(SPLIT_CARD), cost, base.seed, split, SPLIT_RECORD.name)
    profile = json.loads(json.dumps(base.to_dict()))
    profile["name"] = name or OUT.stem
    profile["cost"].update(eager_layer_s=per_layer, eager_token_s=per_token)
    mixer, fitted_tails = fit_tail(profile, TAIL_RECORD, spec.num_layers)
    profile["cost"]["eager_mixer_layer_s"] = mixer
    fitted = CostParams.from_dict(profile["cost"])
    points = prefill_points(spec, fitted, base.seed)
    http = http_points(spec, get_profile("h200"), fitted, base.seed, _load(H200_HTTP, "prefill"), H200_HTTP.name)
    held_tails = []
    for record in HELD_MIXED:
        held_tails += [{"record": _rel(record), **r} for r in tail_steps(replay(record, profile))]
    profile["procedure"] = (f"python -m simulator.fit_short_steps --base {base_name} (simulator/fit_short_steps.py "
                            f"docstring) over {base_name} ({base.procedure})")
    profile["reading"] = {**base.reading, "prefill": (
        "an uncaptured step whose layer calls route more than lookup_max_keys pairs pays eager_layer_s per layer and "
        "eager_token_s per token and layer it computes, and runs its compute-bound kernels at eager_compute_efficiency "
        "of dense bf16 throughput; captured decode steps keep the base's terms"), "short_steps": (
        "an uncaptured step of at most lookup_max_keys pairs a layer call (the prefill graphs' steps: a prompt's tail "
        "beside decodes, a short prompt) launches each layer's eager token mixer and MoE graph in eager_mixer_layer_s "
        "of host time; a layer's GPU work (its copies included) starts no earlier than its launches end")}
    profile["provenance"] = {**base.provenance, "short_steps_fit": {
        "base": base_name,
        "split": {"record": _rel(SPLIT_RECORD), "card": SPLIT_CARD,
                  "fitted_on": f"scenarios.{SPLIT_SCENARIO}.prompts[*].ttft_s (4,096 tokens: one step; 32,768: four "
                               "of 8,192; every expert preloaded)",
                  "fields": ["scenarios.resident.plan.expert_slots", "scenarios.resident.prompts[*].ttft_s",
                             "args.chunk"],
                  "kept": f"eager_compute_efficiency ({base_name}'s, fitted on "
                          f"{base.provenance['prefill_fit']['record']})",
                  "solve": "exact: two prompts of two chunk sizes, two terms linear in the time"},
        "tail": {"record": _rel(TAIL_RECORD), "card": SPLIT_CARD,
                 "fitted_on": "points[*].window_steps of kind tail (prefill_tokens 4 beside 3 decode rows, no layer "
                              "group): their mean ms, replayed with python -m simulator mixed --record",
                 "fields": ["points[*].window_steps[*].ms, decode_rows, prefill_tokens, prefill_works, layers, "
                            "end_ms", "points[*].ttft_s", "the record's settings (mixed_record.py)"],
                 "solve": "secant to 1 us on the tail steps' mean"},
        "held_out": [f"{_rel(p)} scenarios.{s}" for p, _, s in HELD_PREFILL]
        + [f"{_rel(H200_HTTP)} points[*].ttft_s_median, runs[-1].ttft_s"]
        + [f"{_rel(p)} points[*].window_steps (tail)" for p in HELD_MIXED],
    }}
    errors = [abs(p["error"]) for p in points if p["role"] == "held_out"]
    profile["validation"] = {**base.validation, "short_steps": {
        "eager_layer_s": per_layer, "eager_token_s": per_token, "eager_mixer_layer_s": mixer,
        "eager_step_fixed_s": per_layer * spec.num_layers, "eager_token_s_per_step_layers": per_token * spec.num_layers,
        "prefill_points": points, "http_held_out": http,
        "tail_fit": fitted_tails, "tail_held_out": held_tails,
        "max_abs_held_out_prefill_error": max(errors) if errors else None,
        "max_abs_held_out_tail_error_pct": max((abs(r["error_pct"]) for r in held_tails), default=None)}}
    return profile


def print_table(profile: dict, log=print) -> None:
    v = profile["validation"]["short_steps"]
    log(f"eager_layer_s = {v['eager_layer_s'] * 1e3:.4f} ms ({v['eager_step_fixed_s'] * 1e3:.1f} ms a 40-layer step), "
        f"eager_token_s = {v['eager_token_s'] * 1e9:.2f} ns a token and layer "
        f"({v['eager_token_s_per_step_layers'] * 1e6:.2f} us a token over 40 layers), "
        f"eager_mixer_layer_s = {v['eager_mixer_layer_s'] * 1e3:.4f} ms")
    log(f"{'point':58} {'role':9} {'measured':>9} {'predicted':>10} {'error':>7}")
    for p in v["prefill_points"]:
        label = f"{Path(p['record']).stem} {p['scenario']} {p['prompt_tokens']}"
        log(f"{label:58} {p['role']:9} {p['measured_s']:8.3f}s {p['predicted_s']:9.3f}s {p['error']:+7.1%}")
    for p in v["http_held_out"]:
        log(f"{p['label']:58} {p['role']:9} {p['measured_last_s']:8.3f}s {p['predicted_s']:9.3f}s "
            f"{p['error_last']:+7.1%}  (median of repeats {p['measured_median_s']:.3f}s: {p['error_median']:+.1%})")
    for role, rows in (("fit", v["tail_fit"]), ("held_out", v["tail_held_out"])):
        for r in rows:
            label = f"{Path(r.get('record', TAIL_RECORD.name)).stem} r{r['repeat']} tail"
            log(f"{label:58} {role:9} {r['measured_ms']:7.1f}ms {r['predicted_ms']:8.1f}ms {r['error_pct']:+6.1f}%")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulator.fit_short_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help="profile whose terms are kept (name or file)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="compare a fresh build with --out instead of writing it")
    p.add_argument("--report", action="store_true", help="also write the before/after records (docs/bench)")
    args = p.parse_args(argv)

    def report(profile: dict) -> None:
        from simulator.short_steps_report import write_reports

        write_reports(args.base, profile, REPORT_SPLIT, REPORT_TAIL)

    return run_fit(lambda: build(args.base, args.out.stem), print_table, args.out, args.check,
                   after=report if args.report else None)


if __name__ == "__main__":
    sys.exit(main())
