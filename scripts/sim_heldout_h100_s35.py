"""Sessions 34 and 35's held-out H100 check (docs/simulator.md, "Held out on an H100: sessions 34-35"): the records of
ADR 0027's engine (a pool that holds every key routes without lookup or gather launches), predicted with
h100_records_v2 (scored: fitted on sessions 25 and 32, none of these records), h100_records_v3 (v2 refitted on
session 34's records, simulator/fit_resident_h100.py: held out on session 35's only), the reverse fit on session 35
(held out on session 34's only; built here, not a calibration file) and the card's default, h200_records_v6. Writes
docs/bench/2026-12-06-s35-sim-vs-h100.json.

    python scripts/sim_heldout_h100_s35.py            # ~1 min; --out FILE to write elsewhere

Records (servers state short_prompt_replays 8; FLUXTIDE_PDL off, the default; the PDL variants are not scored):
- the resident FP8 ladder (c1/c4/c16, 64k KV, 16 running) and probe (127 / 255 tokens) of each session, end to end
  by `python -m simulator predict --short-prompt-replays 8` (TTFT, aggregate, steady step; the probe as bs1);
- bench_decode's execute() steps by batch (1/4/8/16) by the step model (fit_records.predict, misses measured):
  session 34's resident plan, session 35's resident plan and 24 GiB plan (5,539 slots, copy-bound);
- session 35's NVFP4 (modelopt) ladder (c1/c4) and probe (127 / 255 / 1,023) by predict on the NVFP4 model (the
  calibrations' kernels are block FP8's: modelled by bytes only)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from domain.model_spec import qwen36_35b_a3b
from simulator import fit_resident_h100
from simulator.cost_model import CostModel
from simulator.fit_records import predict
from simulator.hardware import get_profile
from simulator.heldout import heldout_header, http_rows, run_json, step_rows, within_counts, write_report
from simulator.records import load_records
from simulator.short_prompts import served_replays
from simulator.sweep import Calibration, find_calibration

ROOT = Path(__file__).resolve().parents[1]
BENCH = "docs/bench/2026-12-06"
SCORED = "h100_records_v2"
REFIT = "h100_records_v3"  # fitted on session 34
REVERSE = "h100_records_v3_s35"  # the same procedure on session 35
FITTED_ON = {REFIT: 34, REVERSE: 35}
BOUND = 0.10
HTTP = {  # session -> [(record, model, batches)]
    34: [(f"{BENCH}-s34-h100-ladder-fp8-resident.json", "fp8", "1,4,16"),
         (f"{BENCH}-s34-h100-probe-fp8-resident.json", "fp8", "1,4,16")],
    35: [(f"{BENCH}-s35-h100-ladder-fp8-resident-pdl0.json", "fp8", "1,4,16"),
         (f"{BENCH}-s35-h100-probe-fp8-resident-pdl0.json", "fp8", "1,4,16"),
         (f"{BENCH}-s35-h100-ladder-nvfp4-modelopt-resident.json", "nvfp4", "1,4"),
         (f"{BENCH}-s35-h100-probe-nvfp4-modelopt-resident.json", "nvfp4", "1,4")],
}
DECODE = {34: f"{BENCH}-s34-h100-decode-resident-adr27.json",
          35: f"{BENCH}-s35-h100-decode-resident-24gib-router-rowblocks.json"}
PREDICT = ("python -m simulator predict --hardware h100 --model qwen3.6-35b-a3b-{fmt} --kv 65536 --batch {batches} "
           "--max-running-requests 16 --layered-prefill on --prefill-kernels triton --routing uniform "
           "--short-prompt-replays 8 --calibration {cal} --json")
STEP = "fit_records.predict(CostModel(h100, --calibration {cal}), the record's observation)"


def session_rows(session: int, cals: dict[str, str]) -> list[dict]:
    """Every scored figure of one session's records; `cals` maps a calibration's name to what --calibration takes."""
    runs: dict[tuple[str, str], dict] = {}
    rows = []
    for rec, fmt, batches in HTTP[session]:
        data = json.loads((ROOT / rec).read_text())
        assert served_replays(data) == 8, f"{rec}: its server states {served_replays(data)} replays, not 8"
        for cal, arg in cals.items():
            if (fmt, cal) not in runs:
                got = run_json(PREDICT.format(fmt=fmt, batches=batches, cal=arg), ROOT)
                runs[fmt, cal] = {p["batch"]: p for p in got}
        rows += http_rows(rec, data, {cal: runs[fmt, cal] for cal in cals}, SCORED,
                          PREDICT.format(fmt=fmt, batches=batches, cal=SCORED), BOUND, session=session, format=fmt)
    spec = qwen36_35b_a3b()
    models = {cal: CostModel(spec, get_profile("h100"), Calibration.resolve(arg).cost_params())
              for cal, arg in cals.items()}
    rec = DECODE[session]
    rows += step_rows(rec, load_records([ROOT / rec], spec).observations, models, SCORED, STEP.format(cal=SCORED),
                      BOUND, predict, session=session, format="fp8")
    return rows


def summary(points: list[dict], default: str) -> dict:
    """Within-bound counts: the scored v2 and the default on every figure, each refit only on the other session's."""
    out = {}
    for cal, field in ((SCORED, "within_bound"), (default, f"{default}_within_bound")):
        out[cal] = {f"session {s}": within_counts(points, field, lambda r, s=s: r["session"] == s) for s in (34, 35)}
        out[cal]["all"] = within_counts(points, field, lambda r: True)
        out[cal]["FP8 only"] = within_counts(points, field, lambda r: r["format"] == "fp8")
    for cal, fit in FITTED_ON.items():
        held = [r for r in points if r["session"] != fit]
        out[f"{cal} (held out: session {69 - fit})"] = {
            "all": within_counts(held, f"{cal}_within_bound", lambda r: True),
            "FP8 only": within_counts(held, f"{cal}_within_bound", lambda r: r["format"] == "fp8")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / f"{BENCH}-s35-sim-vs-h100.json"))
    args = ap.parse_args()
    default, _ = find_calibration("h100")
    with tempfile.TemporaryDirectory() as tmp:
        reverse = Path(tmp) / f"{REVERSE}.json"
        reverse.write_text(json.dumps(fit_resident_h100.build(35, name=REVERSE), indent=1) + "\n")
        cals = {SCORED: SCORED, REFIT: REFIT, REVERSE: str(reverse), default.name: default.name}
        points = session_rows(34, cals) + session_rows(35, cals)
    scored = Calibration.resolve(SCORED)
    title = (f"the simulator against sessions 34 and 35's H100 records (ADR 0027's engine), held out: {SCORED} scored; "
             f"{REFIT} (fitted on session 34) held out on session 35, {REVERSE} (the same fit on session 35) on "
             f"session 34; the default {default.name} beside them")
    header = heldout_header(35, title, get_profile("h100").to_dict(), scored, scored.hardware == "h100", BOUND,
                            "python scripts/sim_heldout_h100_s35.py", compared_with=[REFIT, REVERSE, default.name],
                            fitted_on={SCORED: "sessions 25 and 32 (none of these records)",
                                       REFIT: fit_resident_h100.RECORDS[34], REVERSE: fit_resident_h100.RECORDS[35]},
                            scoring=f"{REFIT}_* counts only on session 35's rows, {REVERSE}_* only on session 34's: "
                                    "each is fitted on the other session's ladder and bench_decode records",
                            within_bound_by_calibration=summary(points, default.name))
    header["calibration_rule"] = (f"--calibration {SCORED}; {REFIT}: python -m simulator.fit_resident_h100; {REVERSE}: "
                                  f"python -m simulator.fit_resident_h100 --fit-session 35 --out FILE; "
                                  f"{default.name}: sweep.find_calibration('h100')")
    write_report(args.out, header, points, lambda r: f"session {r['session']} {r['kind']}", slice(11, 60), 49, 44)


if __name__ == "__main__":
    main()
