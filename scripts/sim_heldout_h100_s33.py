"""Session 33's held-out H100 check (docs/simulator.md, "Held out on an H100: session 33" and "..., refitted"):
session 33's records, none used for fitting, predicted with h100_records_v2 (simulator/fit_replays_ttft.py: v6 with the
per-pair GEMV terms of session 25's kernel profile, preloaded experts, the arrival window, and the TTFT's request
overhead, request spacing and short step's eager mixer refitted on session 32's records) and, beside it,
h100_records_v1 (the same session's first refit) and the card's default, h200_records_v6. Writes
docs/bench/2026-12-06-s33-sim-vs-h100.json.

    python scripts/sim_heldout_h100_s33.py            # ~1 min; --out FILE to write elsewhere

Records (their servers state `executor.short_prompt_replays`): the resident FP8 ladder (c1/c4/c16, 64k KV, 16
running) and probe (127 / 255 tokens) with replays 8 and 0, and `ft bench mixed` at 24 GiB with replays 8 after the
launch-hook fix. Procedures as session 32's (scripts/sim_heldout_h100_s32.py): the ladder and the probe end to end by
`python -m simulator predict --short-prompt-replays N` (N the record's; the other setting beside it, not scored), the
probe's TTFT and steady step as predict's bs1, the mixed record by `python -m simulator mixed --record`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from domain.model_spec import qwen36_35b_a3b
from simulator.cost_model import CostModel
from simulator.fit_pair_gemv import pair_kernels_s
from simulator.fit_records import predict
from simulator.hardware import get_profile
from simulator.heldout import error_pct, heldout_header, heldout_row, run_json, write_report
from simulator.records import load_records
from simulator.short_prompts import served_replays
from simulator.sweep import Calibration, find_calibration

ROOT = Path(__file__).resolve().parents[1]
BENCH = "docs/bench"
REFIT = "h100_records_v2"
BEFORE = "h100_records_v1"  # scored beside the refit (the report's before)
REPLAYS = (8, 0)
LADDER = f"{BENCH}/2026-12-06-s33-h100-ladder-fp8-resident-replays{{n}}.json"
PROBE = f"{BENCH}/2026-12-06-s33-h100-probe-fp8-resident-replays{{n}}.json"
MIXED = f"{BENCH}/2026-12-06-s33-h100-mixed-24gib-layered-replays8-hookfix.json"
# bench_decode's resident bs1/4/16 before and with ADR 0027's route (the kernel profiles the c16 fix is checked against)
DECODE = tuple(f"{BENCH}/2026-12-06-s33-h100-decode-resident-{v}.json" for v in ("baseline", "adr27-trial"))
BOUND = 0.10
PREDICT = ("python -m simulator predict --hardware h100 --model qwen3.6-35b-a3b-fp8 --kv 65536 --batch 1,4,16 "
           "--max-running-requests 16 --layered-prefill on --prefill-kernels triton --routing uniform "
           "--short-prompt-replays {n} --calibration {cal} --json")
MIXED_CMD = "python -m simulator mixed --record {rec} --short-prompt-replays {n} --calibration {cal} --json"


def _other(n: int) -> int:
    return REPLAYS[1] if n == REPLAYS[0] else REPLAYS[0]


def _stated(rec: str, n: int) -> None:
    stated = served_replays(json.loads((ROOT / rec).read_text()))
    assert stated == n, f"{rec}: its server states {stated} replays, its name {n}"


def _row(rec: str, point: str, kind: str, unit: str, measured: float, by_cal: dict[str, float], command: str,
         **extra) -> dict:
    """One point scored on the refit (REFIT); every other calibration's prediction beside it."""
    beside = {}
    for cal in (c for c in by_cal if c != REFIT):
        beside.update({f"{cal}_predicted": round(by_cal[cal], 6), f"{cal}_error_pct": error_pct(by_cal[cal], measured)})
    return heldout_row(rec, point, kind, measured, by_cal[REFIT], unit, command, BOUND, **beside, **extra)


def ttft_rows(e2e: dict) -> list[dict]:
    """Ladder c1/c4/c16 TTFT, aggregate and steady step, probe TTFT and steady step, each at its record's replays."""
    cals = list(e2e)
    rows = []
    for n in REPLAYS:
        rec = LADDER.format(n=n)
        _stated(rec, n)
        cmd = PREDICT.format(n=n, cal=REFIT)
        for p in json.loads((ROOT / rec).read_text())["points"]:
            c = p["concurrency"]
            s = {cal: e2e[cal][n][c] for cal in cals}
            o = e2e[REFIT][_other(n)][c]
            rows.append(_row(rec, f"c{c} TTFT", "HTTP TTFT", "ms", p["ttft_s_median"] * 1e3,
                             {k: v["ttft_s"] * 1e3 for k, v in s.items()}, cmd, replays=n,
                             other_replays_predicted=round(o["ttft_s"] * 1e3, 4),
                             other_replays_error_pct=error_pct(o["ttft_s"], p["ttft_s_median"])))
            rows.append(_row(rec, f"c{c} aggregate", "aggregate", "tok/s", p["aggregate_tok_s"],
                             {k: v["decode_tok_s"] for k, v in s.items()}, cmd, replays=n))
            rows.append(_row(rec, f"c{c} decode step (predict steady)", "decode step (predict steady)", "ms",
                             1e3 / p["steady_decode_tok_s_median"],
                             {k: 1e3 / v["steady_decode_tok_s_per_request"] for k, v in s.items()}, cmd, replays=n))
        rec = PROBE.format(n=n)
        _stated(rec, n)
        for p in json.loads((ROOT / rec).read_text())["points"]:
            tokens = p["max_tokens"]
            s = {cal: e2e[cal][n][1] for cal in cals}
            rows.append(_row(rec, f"{tokens} tokens TTFT", "HTTP TTFT", "ms", p["ttft_s_median"] * 1e3,
                             {k: v["ttft_s"] * 1e3 for k, v in s.items()}, cmd + " (bs1's ttft_s)", replays=n,
                             other_replays_predicted=round(e2e[REFIT][_other(n)][1]["ttft_s"] * 1e3, 4)))
            rows.append(_row(rec, f"{tokens} tokens decode step (predict steady)", "decode step (predict steady)",
                             "ms", 1e3 / p["steady_decode_tok_s_median"],
                             {k: 1e3 / v["steady_decode_tok_s_per_request"] for k, v in s.items()},
                             cmd + " (bs1's steady)", replays=n))
    return rows


def mixed_rows(cals: list[str]) -> list[dict]:
    """The mixed record's figures (gap p50 / p99, baseline, TTFT), replayed at its server's replays (8)."""
    n = 8
    _stated(MIXED, n)
    results = {cal: run_json(MIXED_CMD.format(rec=MIXED, n=n, cal=cal), ROOT)[0] for cal in cals}
    rows = []
    for name, fig in results[REFIT]["compare"]["figures"].items():
        if name == "window_max_ms":
            continue
        scale = 1e3 if name == "ttft_s_median" else 1.0  # every figure in ms
        rows.append(_row(MIXED, name.replace("ttft_s_median", "TTFT median"), "mixed figure", "ms",
                         fig["measured"] * scale,
                         {cal: r["compare"]["figures"][name]["predicted"] * scale for cal, r in results.items()},
                         MIXED_CMD.format(rec=MIXED, n=n, cal=REFIT), replays=n,
                         plan_expert_slots=results[REFIT]["plan"]["expert_slots"],
                         record_expert_slots=results[REFIT]["compare"]["plan"]["expert_slots"]["record"]))
    return rows


def decode_check(cals: list[str]) -> list[dict]:
    """Not scored (a kernel benchmark, no HTTP): each DECODE record's execute() steps by the step model
    (fit_records.predict on its observations, as sessions 25 and 31), and the per-pair kernels' growth per routed pair
    from bs1 to bs16 against the model's (pair_read_efficiency's rate; memory_efficiency's before h100_records_v2)."""
    spec, hw = qwen36_35b_a3b(), get_profile("h100")
    models = {cal: CostModel(spec, hw, Calibration.resolve(cal).cost_params()) for cal in cals}
    added = 15 * spec.top_k * spec.num_layers  # routed pairs a step from bs1 to bs16
    out = []
    for rec in DECODE:
        for o in load_records([ROOT / rec], spec).observations:
            if o.kind == "step":
                out.append({"record": rec, "point": f"bs{o.batch} execute() step", "measured_ms": o.measured_s * 1e3,
                            **{f"{cal}_error_pct": error_pct(predict(m, o), o.measured_s) for cal, m in models.items()}})
        record = json.loads((ROOT / rec).read_text())
        grown = pair_kernels_s(record, 16, rec) - pair_kernels_s(record, 1, rec)
        out.append({"record": rec, "point": "per-pair kernels' time per routed pair, bs1 to bs16",
                    "measured_us": grown / added * 1e6,
                    **{f"{cal}_error_pct": error_pct(m.expert_read(1, 1, per_pair=True), grown / added)
                       for cal, m in models.items()}})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / BENCH / "2026-12-06-s33-sim-vs-h100.json"))
    args = ap.parse_args()
    default, _ = find_calibration("h100")
    refit = Calibration.resolve(REFIT)
    cals = [REFIT, BEFORE, default.name]
    e2e = {cal: {n: {p["batch"]: p for p in run_json(PREDICT.format(n=n, cal=cal), ROOT)} for n in REPLAYS}
           for cal in cals}
    points = ttft_rows(e2e) + mixed_rows(cals)
    title = (f"the simulator against session 33's H100 records, held out: {REFIT} (per-pair GEMV terms from session "
             f"25's kernel profile, preloaded experts, arrival window; TTFT host terms and request spacing refitted on "
             f"session 32's records) scored, {BEFORE} and the default {default.name} beside it")
    header = heldout_header(33, title, get_profile("h100").to_dict(), refit, refit.hardware == "h100", BOUND,
                            "python scripts/sim_heldout_h100_s33.py",
                            replays="each record predicted at its server's stated executor.short_prompt_replays; "
                                    "other_replays_* is the other setting with the refit, not scored",
                            compared_with=[BEFORE, default.name])
    # NOTE: refit stays False as in every held-out report: no term was fitted on these records (the refit's were fitted
    # on session 32's and 25's, named in fitted_on)
    fit = refit.provenance["replays_ttft_fit"]
    header.update(decode_profile_check=decode_check(cals),
                  fitted_on={**fit["records"], "pair_call_s, pair_read_efficiency": fit["pair_gemv"]["record"]},
                  calibration_rule=f"--calibration {REFIT} (python -m simulator.fit_replays_ttft); {BEFORE}_* fields: "
                                   f"--calibration {BEFORE}; {default.name}_* fields: sweep.find_calibration('h100')")
    write_report(args.out, header, points,
                 lambda r: f"{r['kind']} (replays {r['replays']})", slice(15, 60), 45, 38)


if __name__ == "__main__":
    main()
