"""Session 33's held-out H100 check (docs/simulator.md, "Held out on an H100: session 33"): session 33's records, none
used for fitting, predicted with h100_records_v1 (simulator/fit_replays_ttft.py: v6 with the TTFT's request overhead
and the short step's eager mixer refitted on session 32's records) and, beside it, the card's default, h200_records_v6.
Writes docs/bench/2026-12-06-s33-sim-vs-h100.json.

    python scripts/sim_heldout_h100_s33.py            # ~30 s; --out FILE to write elsewhere

Records (their servers state `executor.short_prompt_replays`): the resident FP8 ladder (c1/c4/c16, 64k KV, 16
running) and probe (127 / 255 tokens) with replays 8 and 0, and `ft bench mixed` at 24 GiB with replays 8 after the
launch-hook fix. Procedures as session 32's (scripts/sim_heldout_h100_s32.py): the ladder and the probe end to end by
`python -m simulator predict --short-prompt-replays N` (N the record's; the other setting beside it, not scored), the
probe's TTFT and steady step as predict's bs1, the mixed record by `python -m simulator mixed --record`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simulator.hardware import get_profile
from simulator.heldout import error_pct, heldout_header, heldout_row, run_json, write_report
from simulator.short_prompts import served_replays
from simulator.sweep import Calibration, find_calibration

ROOT = Path(__file__).resolve().parents[1]
BENCH = "docs/bench"
REFIT = "h100_records_v1"
REPLAYS = (8, 0)
LADDER = f"{BENCH}/2026-12-06-s33-h100-ladder-fp8-resident-replays{{n}}.json"
PROBE = f"{BENCH}/2026-12-06-s33-h100-probe-fp8-resident-replays{{n}}.json"
MIXED = f"{BENCH}/2026-12-06-s33-h100-mixed-24gib-layered-replays8-hookfix.json"
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
    """One point scored on the refit (REFIT); the default calibration's prediction beside it."""
    base = next(c for c in by_cal if c != REFIT)
    return heldout_row(rec, point, kind, measured, by_cal[REFIT], unit, command, BOUND,
                       **{f"{base}_predicted": round(by_cal[base], 6),
                          f"{base}_error_pct": error_pct(by_cal[base], measured)}, **extra)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / BENCH / "2026-12-06-s33-sim-vs-h100.json"))
    args = ap.parse_args()
    default, _ = find_calibration("h100")
    refit = Calibration.resolve(REFIT)
    cals = [REFIT, default.name]
    e2e = {cal: {n: {p["batch"]: p for p in run_json(PREDICT.format(n=n, cal=cal), ROOT)} for n in REPLAYS}
           for cal in cals}
    points = ttft_rows(e2e) + mixed_rows(cals)
    title = (f"the simulator against session 33's H100 records, held out: {REFIT} (TTFT host terms refitted on "
             f"session 32's records) scored, the default {default.name} beside it")
    header = heldout_header(33, title, get_profile("h100").to_dict(), refit, refit.hardware == "h100", BOUND,
                            "python scripts/sim_heldout_h100_s33.py",
                            replays="each record predicted at its server's stated executor.short_prompt_replays; "
                                    "other_replays_* is the other setting with the refit, not scored",
                            compared_with=default.name)
    # NOTE: refit stays False as in every held-out report: no term was fitted on these records (h100_records_v1's two
    # were fitted on session 32's, named in fitted_on)
    header.update(fitted_on=refit.provenance["replays_ttft_fit"]["records"], calibration_rule=f"--calibration {REFIT} (python -m simulator.fit_replays_ttft); "
                                               f"{default.name}_* fields: sweep.find_calibration('h100')")
    write_report(args.out, header, points,
                 lambda r: f"{r['kind']} (replays {r['replays']})", slice(15, 60), 45, 38)


if __name__ == "__main__":
    main()
