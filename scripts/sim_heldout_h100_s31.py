"""Session 31's held-out H100 check (docs/simulator.md, "Held out on an H100 again (session 31)"): every new record
of 2026-12-06 predicted with the card's default calibration, no refit. Writes docs/bench/2026-12-06-s31-sim-vs-h100.json.

    python scripts/sim_heldout_h100_s31.py            # ~1 min; --out FILE to write elsewhere

Procedures are session 25's ("Held out on an H100"): decode steps by the step model (`fit_records.predict` on the
record's observations, measured misses given), the resident ladder/probe/bench_decode also end to end by `python -m
simulator predict` (its steady step is 1 / steady_decode_tok_s_per_request); prefill by `fit_prefill._point` on the
record's pools (the staged bytes must equal the record's)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from domain.model_spec import WeightFormat, qwen36_35b_a3b
from simulator.cost_model import CostModel
from simulator.fit_prefill import _point
from simulator.fit_records import predict
from simulator.hardware import get_profile
from simulator.heldout import error_pct, heldout_header, heldout_row, run_json, write_report
from simulator.records import expected_distinct, load_records
from simulator.sweep import Calibration, find_calibration

ROOT = Path(__file__).resolve().parents[1]
BENCH = "docs/bench"
LADDER = f"{BENCH}/2026-12-06-s31-h100-ladder-fp8-resident.json"
PROBE = f"{BENCH}/2026-12-06-s31-h100-probe-fp8-resident.json"
DECODE_24 = (f"{BENCH}/2026-12-06-s31-h100-decode-24gib-bs3-head.json",
             f"{BENCH}/2026-12-06-s31-h100-decode-24gib-bs3-at-3f11e0c.json")
PREFILL = f"{BENCH}/2026-12-06-s31-h100-prefill-resident-budget.json"
BF16 = f"{BENCH}/2026-12-06-s31-h100-decode-bf16-resident.json"
BOUND = 0.10
STEP_MODEL_CMD = ("scripts/sim_heldout_h100_s31.py: fit_records.predict(CostModel(qwen36_35b_a3b({fmt}), "
                  "get_profile('h100'), find_calibration('h100')[0].cost_params()), obs), obs from "
                  "simulator.records.load_records([{rec}]) ({label})")
PREFILL_CMD = ("scripts/sim_heldout_h100_s31.py: fit_prefill._point(qwen36_35b_a3b(), get_profile('h100'), "
               "cal.cost_params(), cal.seed, record, '{scen}', {n}, 8192, ...) on {rec}")
PREDICT_LADDER = ("python -m simulator predict --hardware h100 --model qwen3.6-35b-a3b-fp8 --kv 65536 --batch 1,4,16 "
                  "--max-running-requests 16 --layered-prefill on --prefill-kernels triton --routing uniform "
                  "--short-prompt-replays 0 --json")  # NOTE: session 31's server ran no short-prompt replays
PREDICT_BF16 = ("python -m simulator predict --hardware h100 --model qwen3.6-35b-a3b-bf16 --kv 8192 --batch 1,4 "
                "--max-running-requests 4 --prefill-kernels triton --routing uniform --short-prompt-replays 0 --json")


def _pct(pred: float, meas: float) -> float:
    return error_pct(pred, meas)


def _row(record, point, measured, predicted, unit, command, **extra) -> dict:
    fmt = "bf16 " if record == BF16 else ""
    kind = ("prefill TTFT" if record == PREFILL else "HTTP TTFT" if point.endswith("TTFT")
            else "aggregate" if point.endswith("aggregate") else f"{fmt}decode step ({point.split('(')[1]}")
    return heldout_row(record, point, kind, measured, predicted, unit, command, BOUND, **extra)


def _predict_cli(command: str):
    return run_json(command, ROOT)


def _step_model(spec, cal, paths) -> dict[tuple[str, str], tuple[float, float, object]]:
    model = CostModel(spec, get_profile("h100"), cal.cost_params())
    return {(o.source, o.label): (o.measured_s, predict(model, o), o)
            for o in load_records([ROOT / p for p in paths], spec).observations if o.kind == "step"}


def decode_points(cal) -> list[dict]:
    rows = []
    fp8, bf16 = qwen36_35b_a3b(), qwen36_35b_a3b(WeightFormat.BF16)
    model = CostModel(fp8, get_profile("h100"), cal.cost_params())
    steps = _step_model(fp8, cal, [LADDER, *DECODE_24])
    e2e = {p["batch"]: p for p in _predict_cli(PREDICT_LADDER)}
    e2e_v7 = {p["batch"]: p for p in _predict_cli(PREDICT_LADDER + " --calibration h200_records_v7")}
    ladder = json.loads((ROOT / LADDER).read_text())
    for p in ladder["points"]:
        c = p["concurrency"]
        meas, pred, obs = steps[(Path(LADDER).name, f"ladder kv=65536 bs={c}")]
        cmd = STEP_MODEL_CMD.format(fmt="", rec=LADDER, label=obs.label)
        rows.append(_row(LADDER, f"c{c} decode step (step model)", meas * 1e3, pred * 1e3, "ms", cmd,
                         misses_per_step=obs.misses_per_step, context=obs.context))
        s = e2e[c]
        rows.append(_row(LADDER, f"c{c} decode step (predict steady)", meas * 1e3,
                         1e3 / s["steady_decode_tok_s_per_request"], "ms", PREDICT_LADDER,
                         plan_expert_slots=s["expert_slots"], record_expert_slots=ladder["pool_plan"]["expert_slots"]))
        rows.append(_row(LADDER, f"c{c} aggregate", p["aggregate_tok_s"], s["decode_tok_s"], "tok/s", PREDICT_LADDER))
        rows.append(_row(LADDER, f"c{c} TTFT", p["ttft_s_median"] * 1e3, s["ttft_s"] * 1e3, "ms", PREDICT_LADDER,
                         h200_records_v7_predicted=round(e2e_v7[c]["ttft_s"] * 1e3, 4),
                         h200_records_v7_error_pct=_pct(e2e_v7[c]["ttft_s"], p["ttft_s_median"])))
    # the probe: records.py skips probes (decode mixed with its prefill); session 20's supplement made each length
    # a bs1 resident observation, its context the prompt plus half the tokens, 8 experts a layer, no misses
    probe = json.loads((ROOT / PROBE).read_text())
    ladder_c1 = steps[(Path(LADDER).name, "ladder kv=65536 bs=1")][2]
    for p in probe["points"]:
        prompt = p["runs"][0]["prompt_tokens"]
        obs = replace(ladder_c1, source=Path(PROBE).name, label=f"probe {p['max_tokens']}",
                      context=prompt + p["max_tokens"] // 2,
                      distinct_per_layer=expected_distinct(fp8.num_experts, fp8.top_k, 1),
                      measured_s=1 / p["steady_decode_tok_s_median"])
        cmd = (f"scripts/sim_heldout_h100_s31.py: fit_records.predict on a bs1 resident StepObservation of {PROBE} "
               f"(session 20's probe supplement: context {obs.context}, 0 misses)")
        rows.append(_row(PROBE, f"{p['max_tokens']} tokens decode step (step model)", obs.measured_s * 1e3,
                         predict(model, obs) * 1e3, "ms", cmd, context=obs.context))
        rows.append(_row(PROBE, f"{p['max_tokens']} tokens TTFT", p["ttft_s_median"] * 1e3, e2e[1]["ttft_s"] * 1e3,
                         "ms", PREDICT_LADDER + " (bs1's ttft_s)",
                         h200_records_v7_predicted=round(e2e_v7[1]["ttft_s"] * 1e3, 4),
                         h200_records_v7_error_pct=_pct(e2e_v7[1]["ttft_s"], p["ttft_s_median"])))
    for rec in DECODE_24:
        ((meas, pred, obs),) = [v for k, v in steps.items() if k[0] == Path(rec).name]
        rows.append(_row(rec, "budget_24gib bs3 step (step model)", meas * 1e3, pred * 1e3, "ms",
                         STEP_MODEL_CMD.format(fmt="", rec=rec, label=obs.label),
                         misses_per_step=round(obs.misses_per_step, 1), expert_slots=obs.expert_slots))
    bf = _step_model(bf16, cal, [BF16])
    e2e16 = {p["batch"]: p for p in _predict_cli(PREDICT_BF16)}
    for (_, label), (meas, pred, obs) in bf.items():
        rows.append(_row(BF16, f"bf16 resident bs{obs.batch} step (step model)", meas * 1e3, pred * 1e3, "ms",
                         STEP_MODEL_CMD.format(fmt="WeightFormat.BF16", rec=BF16, label=label)))
        s = e2e16[obs.batch]
        rows.append(_row(BF16, f"bf16 resident bs{obs.batch} step (predict steady)", meas * 1e3,
                         1e3 / s["steady_decode_tok_s_per_request"], "ms", PREDICT_BF16,
                         plan_expert_slots=s["expert_slots"]))
    return rows


def prefill_points(cal, v7) -> list[dict]:
    spec, hw = qwen36_35b_a3b(), get_profile("h100")
    record = json.loads((ROOT / PREFILL).read_text())
    rows = []
    for scen, v in record["scenarios"].items():
        for n in sorted(map(int, v["prompts"])):
            p = _point(spec, hw, cal.cost_params(), cal.seed, record, scen, n, 8192, PREFILL, "held_out")
            q = _point(spec, hw, v7.cost_params(), v7.seed, record, scen, n, 8192, PREFILL, "held_out")
            rows.append(_row(PREFILL, f"{scen} {n} TTFT", p["measured_s"], p["predicted_s"], "s",
                             PREFILL_CMD.format(scen=scen, n=n, rec=PREFILL), steps=p["steps"],
                             expert_slots=p["expert_slots"], staging_experts=p["staging_experts"],
                             bytes_staged=p["bytes_staged"], h200_records_v7_predicted=round(q["predicted_s"], 6),
                             h200_records_v7_error_pct=_pct(q["predicted_s"], p["measured_s"])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / BENCH / "2026-12-06-s31-sim-vs-h100.json"))
    args = ap.parse_args()
    cal, measured_here = find_calibration("h100")
    points = decode_points(cal) + prefill_points(cal, Calibration.resolve("h200_records_v7"))
    title = "the simulator against session 31's H100 records, held out (no refit)"
    header = heldout_header(31, title, get_profile("h100").to_dict(), cal, measured_here, BOUND,
                            "python scripts/sim_heldout_h100_s31.py",
                            not_used="the s27/s28/s30 H100 ladders (polled by a stalling /v1/stats) and the "
                                     "*-polled20hz / bf16 poll A/B ladders of this session")
    write_report(args.out, header, points, lambda r: r["kind"], slice(11, 50), 40, 42)


if __name__ == "__main__":
    main()
