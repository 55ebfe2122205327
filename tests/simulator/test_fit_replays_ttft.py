"""h100_records_v1 (simulator/fit_replays_ttft.py --version 1): v6 with the TTFT's HTTP overhead fitted where the
first step is decode replays and the short step's eager mixer fitted on the replays-off pairs; and its predictions in
session 33's held-out report (scripts/sim_heldout_h100_s33.py, docs/simulator.md "Held out on an H100: session 33"),
which now scores h100_records_v2 (tests/simulator/test_h100_records_v2.py) with v1 beside it."""

import json
from pathlib import Path

from simulator import fit_replays_ttft
from simulator.__main__ import main
from simulator.heldout import error_pct
from simulator.sweep import DEFAULT_CALIBRATIONS, Calibration, find_calibration

ROOT = Path(__file__).resolve().parents[2]
RESULT = json.loads((ROOT / "docs/bench/2026-12-06-s33-sim-vs-h100.json").read_text())
V1, V6 = Calibration.resolve("h100_records_v1"), Calibration.resolve("h200_records_v6")
PREDICT = ["predict", "--hardware", "h100", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "65536", "--batch", "1",
           "--max-running-requests", "16", "--layered-prefill", "on", "--prefill-kernels", "triton", "--routing",
           "uniform", "--json"]


def _ttft(capsys, calibration: str, replays: int) -> float:
    assert main([*PREDICT, "--calibration", calibration, "--short-prompt-replays", str(replays)]) == 0
    return json.loads(capsys.readouterr().out)[0]["ttft_s"]


def test_v1_is_v6_but_the_two_ttft_host_terms():
    c1, c6 = V1.cost_params(), V6.cost_params()
    changed = {k for k in c1.to_dict() if c1.to_dict()[k] != c6.to_dict()[k]}
    assert changed == {"request_overhead_s", "eager_mixer_layer_s"}
    assert (V1.seed, V1.deployment, V1.workload) == (V6.seed, V6.deployment, V6.workload)
    # the HTTP path alone is far below v5's 18.9 ms, which held the eager 2-token step; a layer's launches ~1 ms
    assert 0.002 < c1.request_overhead_s < 0.008 and 0.0005 < c1.eager_mixer_layer_s < 0.002
    # named only (`--calibration h100_records_v1`): the H100's default stays v6, and the file is no `h100_v<N>`
    assert "h100_records_v1" not in DEFAULT_CALIBRATIONS.values() and find_calibration("h100")[0].name == V6.name


def test_replays_skip_the_mixer_term_and_the_overhead_moves_ttft_one_for_one(capsys):
    # with replays the cached prompt's 2-token step is 2 decode replays: the mixer term never applies, so v1 and v6
    # differ by exactly their overheads
    on1, on6 = _ttft(capsys, "h100_records_v1", 8), _ttft(capsys, "h200_records_v6", 8)
    dv = V6.cost_params().request_overhead_s - V1.cost_params().request_overhead_s
    assert abs((on6 - on1) - dv) < 1e-9
    # without them it is one short uncaptured step, host-bound on its 40 layers' eager launches
    c = V1.cost_params()
    off1 = _ttft(capsys, "h100_records_v1", 0)
    assert 40 * c.eager_mixer_layer_s < off1 - c.request_overhead_s < 40 * c.eager_mixer_layer_s + 0.002


def test_the_fit_meets_its_single_request_medians():
    fit = V1.validation["replays_ttft_fit"]
    for replays in (8, 0):
        fitted = sorted(r["measured_ttft_s"] - r["simulated_ttft_s"] for r in fit["points"]
                        if r["fitted"] and r["replays"] == replays)
        assert len(fitted) == 3 and abs(fitted[1]) < 1e-4


def test_v1_is_a_fresh_fit():
    assert fit_replays_ttft.main(["--version", "1", "--check"]) == 0


def test_the_s33_report_holds_v1s_predictions_and_its_errors_recompute(capsys):
    assert RESULT["compared_with"] == ["h100_records_v1", "h200_records_v6"]
    for r in RESULT["points"]:
        assert r["error_pct"] == error_pct(r["predicted"], r["measured"])
        assert r["within_bound"] == (abs(r["error_pct"]) <= 10)
        for cal in RESULT["compared_with"]:
            assert r[f"{cal}_error_pct"] == error_pct(r[f"{cal}_predicted"], r["measured"])
    (c1,) = [r for r in RESULT["points"] if r["point"] == "c1 TTFT" and r["replays"] == 8]
    assert abs(c1["h100_records_v1_predicted"] / 1e3 - _ttft(capsys, "h100_records_v1", 8)) < 1e-6
    assert abs(c1["predicted"] / 1e3 - _ttft(capsys, "h100_records_v2", 8)) < 1e-6
    # v1 brought the replayed single-request TTFT from v6's +100 % to under 20 % (its cold first round: below 0)
    assert -20 < c1["h100_records_v1_error_pct"] < 0 and c1["h200_records_v6_error_pct"] > 90
    gap = [r for r in RESULT["points"] if r["point"] == "window_p99_ms"]
    assert len(gap) == 1 and abs(gap[0]["h100_records_v1_error_pct"]) <= 10
