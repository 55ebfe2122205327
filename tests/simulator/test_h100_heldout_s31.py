"""Session 31's held-out H100 check (docs/simulator.md, "Held out on an H100 again (session 31)"): golden backtests of
docs/bench/2026-12-06-s31-sim-vs-h100.json (scripts/sim_heldout_h100_s31.py) against the code and default calibration
that wrote it, and the errors' bounds pinned: a change that moves a point across them must update the section."""

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

ROOT = Path(__file__).resolve().parents[2]
RESULT = json.loads((ROOT / "docs/bench/2026-12-06-s31-sim-vs-h100.json").read_text())
LADDER = "docs/bench/2026-12-06-s31-h100-ladder-fp8-resident.json"
DECODE_24 = "docs/bench/2026-12-06-s31-h100-decode-24gib-bs3-head.json"
PREFILL = "docs/bench/2026-12-06-s31-h100-prefill-resident-budget.json"


def _row(record: str, point: str) -> dict:
    (row,) = [r for r in RESULT["points"] if r["record"] == record and r["point"] == point]
    return row


def test_the_report_used_the_h100s_default_and_no_refit():
    cal, _ = find_calibration("h100")
    assert (RESULT["calibration"], RESULT["refit"]) == (cal.name, False)
    assert RESULT["hardware_profile"] == get_profile("h100").to_dict()


def test_the_decode_steps_reproduce_the_report_and_only_c16_is_outside_the_bound():
    spec, (cal, _) = qwen36_35b_a3b(), find_calibration("h100")
    model = CostModel(spec, get_profile("h100"), cal.cost_params())
    obs = {o.label: o for o in load_records([ROOT / LADDER, ROOT / DECODE_24], spec).observations if o.kind == "step"}
    errors = {}
    for label, record, point in (("ladder kv=65536 bs=1", LADDER, "c1 decode step (step model)"),
                                 ("ladder kv=65536 bs=4", LADDER, "c4 decode step (step model)"),
                                 ("ladder kv=65536 bs=16", LADDER, "c16 decode step (step model)"),
                                 ("bench_decode budget_24gib bs=3", DECODE_24, "budget_24gib bs3 step (step model)")):
        predicted = predict(model, obs[label])
        assert predicted * 1e3 == pytest.approx(_row(record, point)["predicted"], abs=1e-4)
        errors[label] = predicted / obs[label].measured_s - 1
    bound = RESULT["held_out_bound"]
    assert all(abs(e) < bound for label, e in errors.items() if "bs=16" not in label)
    # bs16 over-scales with the memory bandwidth, as session 25's bench_decode bs16 (+11 %) did
    assert 0.10 < errors["ladder kv=65536 bs=16"] < 0.16


def test_the_prefill_comes_out_high_on_the_faster_kernels():
    spec, (cal, _) = qwen36_35b_a3b(), find_calibration("h100")
    record = json.loads((ROOT / PREFILL).read_text())
    resident = _point(spec, get_profile("h100"), cal.cost_params(), cal.seed, record, "resident", 8192, 8192, "s31",
                      "held_out")
    budget = _point(spec, get_profile("h100"), cal.cost_params(), cal.seed, record, "budget", 8192, 8192, "s31",
                    "held_out")  # refuses unless the simulated staged bytes are the record's (130 staging rows)
    assert resident["predicted_s"] == pytest.approx(_row(PREFILL, "resident 8192 TTFT")["predicted"], abs=1e-5)
    assert budget["predicted_s"] == pytest.approx(_row(PREFILL, "budget 8192 TTFT")["predicted"], abs=1e-5)
    # v6's fixed 174.8 ms a step was fitted on the older, slower kernels: +36 to +46 % resident; at 24 GiB the copies
    # set a floor (0.27 s) under the measured 0.316 s, so the excess compute shows less
    assert 0.30 < resident["error"] < 0.50
    assert 0 < budget["error"] < RESULT["held_out_bound"]
