"""Held-out checks of the simulator against measured records (scripts/sim_heldout_*.py): one row per predicted point
and the report file, in the shape `fluxtide.sim-shipped-check/1` records share (docs/bench/*-sim-vs-*.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def error_pct(predicted: float, measured: float) -> float:
    """The prediction's error in percent of the measured value (positive: predicted high), to 2 decimals."""
    return round((predicted / measured - 1) * 100, 2)


def run_json(command: str, cwd: str | Path) -> list[dict] | dict:
    """Run a documented `python -m simulator ... --json` command line in `cwd` with this interpreter; its JSON.
    Raises CalledProcessError where the command fails."""
    out = subprocess.run([sys.executable, *command.split()[1:]], cwd=cwd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def heldout_row(record: str, point: str, kind: str, measured: float, predicted: float, unit: str, command: str,
                bound: float, **extra) -> dict:
    """One held-out point: its figures, error and whether it is within `bound` (a fraction, e.g. 0.10)."""
    err = error_pct(predicted, measured)
    return {"record": record, "point": point, "kind": kind, "unit": unit, "measured": round(measured, 6),
            "predicted": round(predicted, 6), "error_pct": err, "within_bound": abs(err) <= bound * 100,
            "command": command, **extra}


def heldout_header(session: int, title: str, hardware: dict, cal, measured_here, bound: float, reproduce: str,
                   **extra) -> dict:
    """The report's fields before the points: an H100-style held-out check with the card's default calibration
    (`sweep.find_calibration`), no refit; `extra` adds the check's own notes."""
    return {"schema": "fluxtide.sim-shipped-check/1", "date": "2026-12-06", "session": session, "title": title,
            "hardware_profile": hardware, "calibration": cal.name, "calibration_measured_on": cal.hardware,
            "calibration_measured_here": measured_here,
            "calibration_rule": "sweep.find_calibration('h100'): DEFAULT_CALIBRATIONS['h100']",
            "refit": False, "held_out_bound": bound, **extra, "reproduce": reproduce}


def write_report(out: str | Path, header: dict, points: list[dict], group: Callable[[dict], str],
                 name_slice: slice, name_width: int, point_width: int) -> None:
    """Write `header` + the per-group within-bound counts (`group(row)` names a row's group) + the points to `out`
    (JSON), and print one line per point (the record's file name cut by `name_slice`)."""
    kinds: dict[str, list[bool]] = {}
    for r in points:
        kinds.setdefault(group(r), []).append(r["within_bound"])
    report = {**header, "within_bound": {k: f"{sum(v)} of {len(v)}" for k, v in kinds.items()}, "points": points}
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    for r in points:
        print(f"{Path(r['record']).name[name_slice]:{name_width}} {r['point']:{point_width}} {r['measured']:10.4f} "
              f"{r['predicted']:10.4f} {r['error_pct']:+7.1f} %")


def scored_row(record: str, point: str, kind: str, unit: str, measured: float, by_cal: dict[str, float], scored: str,
               command: str, bound: float, **extra) -> dict:
    """heldout_row of `by_cal[scored]`, every other calibration's prediction, error and within-bound beside it
    (`<name>_predicted`, `<name>_error_pct`, `<name>_within_bound`)."""
    beside = {}
    for cal, value in by_cal.items():
        if cal != scored:
            err = error_pct(value, measured)
            beside |= {f"{cal}_predicted": round(value, 6), f"{cal}_error_pct": err,
                       f"{cal}_within_bound": abs(err) <= bound * 100}
    return heldout_row(record, point, kind, measured, by_cal[scored], unit, command, bound, **beside, **extra)


def http_rows(record: str, data: dict, by_cal: dict[str, dict[int, dict]], scored: str, command: str, bound: float,
              **extra) -> list[dict]:
    """An `ft bench` ladder's or probe's points against `predict --json` results (`by_cal[cal][batch]`): per point its
    median TTFT (ms), aggregate tok/s (ladder) and steady decode step (ms, 1 / steady tok/s a request); a probe is
    one request, predict's bs1."""
    rows = []
    for p in data["points"]:
        batch, name = (p["concurrency"], f"c{p['concurrency']}") if data["kind"] == "ladder" else \
            (1, f"{p['max_tokens']} tokens")
        got = {cal: r[batch] for cal, r in by_cal.items()}
        figures = [("TTFT", "HTTP TTFT", "ms", p["ttft_s_median"] * 1e3, {c: g["ttft_s"] * 1e3 for c, g in got.items()})]
        if "aggregate_tok_s" in p:
            figures.append(("aggregate", "aggregate", "tok/s", p["aggregate_tok_s"],
                            {c: g["decode_tok_s"] for c, g in got.items()}))
        figures.append(("decode step (predict steady)", "decode step (predict steady)", "ms",
                        1e3 / p["steady_decode_tok_s_median"],
                        {c: 1e3 / g["steady_decode_tok_s_per_request"] for c, g in got.items()}))
        rows += [scored_row(record, f"{name} {label}", kind, unit, measured, values, scored,
                            command + ("" if data["kind"] == "ladder" else " (bs1)"), bound, **extra)
                 for label, kind, unit, measured, values in figures]
    return rows


def step_rows(record: str, observations: list, models: dict, scored: str, command: str, bound: float,
              predict: Callable, **extra) -> list[dict]:
    """Each "step" observation (records.StepObservation) of a record against the step model of every calibration
    (`models[cal]`, a CostModel; `predict(model, obs)` in seconds), in ms."""
    return [scored_row(record, o.label.removeprefix("bench_decode ") + " execute() step", "bench_decode step", "ms",
                       o.measured_s * 1e3, {cal: predict(m, o) * 1e3 for cal, m in models.items()}, scored, command,
                       bound, misses_per_step=round(o.misses_per_step, 2), **extra)
            for o in observations if o.kind == "step"]


def within_counts(points: list[dict], field: str, select: Callable[[dict], bool]) -> str:
    """'<n> of <m>' selected rows whose `field` (a within-bound flag) is true."""
    chosen = [r[field] for r in points if select(r)]
    return f"{sum(chosen)} of {len(chosen)}"
