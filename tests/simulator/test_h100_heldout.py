"""Session 25's held-out H100 check (docs/simulator.md, "Held out on an H100"): the card's default calibration, and
golden backtests of docs/bench/2026-12-05-sim-vs-h100.json against the code that wrote it (no refit)."""

import json
from pathlib import Path

import pytest

from domain.model_spec import qwen36_35b_a3b
from simulator.cost_model import CostModel
from simulator.fit_prefill import _point
from simulator.fit_records import predict
from simulator.hardware import get_profile
from simulator.records import load_records
from simulator.sweep import find_calibration

BENCH = Path(__file__).resolve().parents[2] / "docs/bench"
RESULT = json.loads((BENCH / "2026-12-05-sim-vs-h100.json").read_text())


def test_the_h100_takes_the_h200s_v6_carried_over():
    # the H200's die: v6's eager prefill terms hold there, where v5 (the carried-over default) has none and came out
    # -65 to -75 % on the resident prefills and -16 to -64 % on the mixed gap p50
    cal, measured_here = find_calibration("h100")
    assert (cal.name, measured_here, cal.predicts) == ("h200_records_v6", False, "fluxtide")
    assert RESULT["calibration"] == cal.name and RESULT["refit"] is False
    assert RESULT["hardware_profile"] == get_profile("h100").to_dict()


def test_the_streamed_8k_prefill_on_the_h100_reproduces_the_record_within_the_bound():
    spec, (cal, _) = qwen36_35b_a3b(), find_calibration("h100")
    record = json.loads((BENCH / "2026-12-05-h100-prefill-24gib-staging66.json").read_text())
    # _point refuses unless the simulated staged bytes are the record's (14,706,722,304: every non-resident expert)
    point = _point(spec, get_profile("h100"), cal.cost_params(), cal.seed, record, "budget", 8192, 8192, "h100", "held_out")
    assert abs(point["error"]) < RESULT["held_out_bound"]
    (row,) = [r for r in RESULT["prefill"] if r["record"].endswith("staging66.json") and r["point"] == "budget 8192"]
    assert point["predicted_s"] == pytest.approx(row["predicted_ttft_s"], abs=1e-5)
    assert row["h200_records_v5_error_pct"] < -20  # the old default: no prefill compute


def test_the_h100_decode_steps_move_with_its_memory_bandwidth():
    spec, (cal, _) = qwen36_35b_a3b(), find_calibration("h100")
    (obs,) = [o for o in load_records([BENCH / "2026-12-05-h100-decode-wlhs0.json"], spec).observations
              if o.label == "bench_decode resident bs=1"]
    on_h100 = predict(CostModel(spec, get_profile("h100"), cal.cost_params()), obs)
    on_h200 = predict(CostModel(spec, get_profile("h200"), cal.cost_params()), obs)
    assert abs(on_h100 / obs.measured_s - 1) < RESULT["held_out_bound"] < abs(on_h200 / obs.measured_s - 1)
    (row,) = [r for r in RESULT["decode"] if r["record"].endswith("wlhs0.json") and r["point"] == "resident bs1"]
    assert on_h100 * 1e3 == pytest.approx(row["step_model_ms"], abs=1e-4)
