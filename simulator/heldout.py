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
