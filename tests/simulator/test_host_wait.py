"""The host lane's hand-off on the GPU (ADR 0030; docs/simulator.md, "The host lane's hand-off on the GPU (session
43)"): a lookup with host keys keeps the GPU host_wait_row_s a routed row past both lanes (the wait kernel), fitted on
bench_decode's per-kernel profiles; at the default 0 the figures before the field, bit for bit."""

import json
from pathlib import Path

import pytest

from domain.model_spec import qwen36_35b_a3b
from simulator.cost_model import OFF_WHEN_ZERO, CostModel, CostParams, decode_step
from simulator.hardware import get_profile
from simulator.host_lane import (
    H100_HOST_REQUEST_S41,
    H100_HOST_WAIT_S43,
    H100_HOST_WAIT_S44,
    fit_host_wait,
    host_split,
    host_wait_points,
    with_host_lane,
)
from simulator.sweep import Calibration

from .conftest import tiny_spec
from .test_host_lane import cold_step

SPEC = qwen36_35b_a3b()
H100 = get_profile("h100")
V3 = Calibration.resolve("h100_records_v3")
BENCH = Path(__file__).parents[2] / "docs/bench"
LANE_RECORDS = ["2026-12-07-s41-h100-bench-decode-h423.json", "2026-12-07-s41-h100-bench-decode-same-prompt-h423.json",
                "2026-12-07-s42-h100-bench-decode-same-prompt-hauto.json"]
OFF_RECORD = "2026-12-07-s42-h100-bench-decode-same-prompt-off.json"


def records(names=LANE_RECORDS) -> list[dict]:
    return [json.loads((BENCH / n).read_text()) for n in names]


def test_the_default_is_off_and_left_out_of_the_files():
    assert CostParams().host_wait_row_s == 0.0 and "host_wait_row_s" in OFF_WHEN_ZERO
    assert "host_wait_row_s" not in V3.cost_params().replace(host_expert_gb_s=44.0, host_permille=465).to_dict()
    on = V3.cost_params().replace(host_permille=465, **H100_HOST_REQUEST_S41, **H100_HOST_WAIT_S43)
    assert on.to_dict()["host_wait_row_s"] == 17.3e-6 and CostParams.from_dict(on.to_dict()) == on


@pytest.mark.parametrize("bad", [-1e-6, float("inf"), float("nan"), True, "17"])
def test_a_bad_wait_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="host_wait_row_s"):
        CostParams().replace(host_wait_row_s=bad)


def test_predicts_flag_sets_the_wait_and_needs_a_lane():
    cost = with_host_lane(V3.cost_params(), H100, 64.1, 465, 66.4, 0.191, 17.3)
    assert cost.host_wait_row_s == pytest.approx(17.3e-6) and cost.host_row_factor == 0.191
    with pytest.raises(ValueError, match="--host-wait-row-us"):
        with_host_lane(V3.cost_params(), H100, None, None, wait_row_us=17.3)


@pytest.mark.parametrize("rows, with_keys", [(1, 1.0), (3, 1.0), (6, 0.6)])
def test_the_step_model_adds_the_wait_a_row_of_each_layer_with_host_keys(rows, with_keys):
    """Lockstep rows, 3.6 misses a layer (3 and 4 misses, weighted 40 / 60 %): at 465 ‰ both send the host a key up
    to 4 rows; at 6 rows a key weighs 2 passes and only 4 misses (budget 2) send one. Each layer with host keys pays
    rows x the wait past both lanes, on top of the same step; the copies and the host's lane do not move."""
    base = V3.cost_params().replace(host_permille=465, **H100_HOST_REQUEST_S41)
    before = decode_step(CostModel(SPEC, H100, base), rows, 8192, 8.0, 3.6 * 40)
    after = decode_step(CostModel(SPEC, H100, base.replace(host_wait_row_s=17.3e-6)), rows, 8192, 8.0, 3.6 * 40)
    assert after.total_s - before.total_s == pytest.approx(with_keys * 40 * rows * 17.3e-6, rel=1e-9)
    assert (after.copy_s, after.host_lane_s, after.expert_s) == (before.copy_s, before.host_lane_s, before.expert_s)
    zero = decode_step(CostModel(SPEC, H100, base.replace(host_wait_row_s=0.0)), rows, 8192, 8.0, 3.6 * 40)
    assert zero == before  # the default: bit for bit


def test_a_layer_without_host_keys_pays_no_wait():
    """bs6 of one prompt at 3 misses a layer: a key weighs 2 passes, 465 ‰ of 3 is a budget of 1: no host key."""
    assert host_split([6] * 3, 465) == 0
    base = V3.cost_params().replace(host_permille=465, **H100_HOST_REQUEST_S41)
    before = decode_step(CostModel(SPEC, H100, base), 6, 8192, 8.0, 3.0 * 40)
    after = decode_step(CostModel(SPEC, H100, base.replace(host_wait_row_s=1e-3)), 6, 8192, 8.0, 3.0 * 40)
    assert after == before


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_the_executor_waits_as_the_step_model_does(rows):
    """A cold step (every layer misses its top-k, some on the host): the simulated executor's step grows by the layers
    x rows x the wait, as the step model's, and the host's lane is unchanged."""
    spec = tiny_spec(layers=4, experts=16, top_k=4)
    params = V3.cost_params().replace(host_expert_gb_s=10.0, host_permille=1000, host_call_s=20e-6)
    wait = 50e-6
    ex0, t0 = cold_step(params, rows, spec)
    ex1, t1 = cold_step(params.replace(host_wait_row_s=wait), rows, spec)
    assert t1 - t0 == pytest.approx(spec.num_layers * rows * wait, rel=1e-9)
    assert ex1.host.cpu.busy_at() == ex0.host.cpu.busy_at()
    step0 = decode_step(CostModel(spec, H100, params), rows, 2, 4.0, 16.0)
    step1 = decode_step(CostModel(spec, H100, params.replace(host_wait_row_s=wait)), rows, 2, 4.0, 16.0)
    assert step1.total_s - step0.total_s == pytest.approx(t1 - t0, rel=1e-9)


def test_the_wait_is_the_bench_decode_profiles_fit():
    got = fit_host_wait(records(), SPEC.expert_bytes(), H100_HOST_REQUEST_S41)
    assert got["host_wait_row_s"] == pytest.approx(17.35e-6, abs=0.01e-6)
    assert got["host_wait_row_s"] == pytest.approx(H100_HOST_WAIT_S43["host_wait_row_s"], abs=0.06e-6)  # its rounding
    assert len(got["points"]) == 6  # bs1 / bs4 of session 41's two records, bs1 / bs6 of session 42's
    # an off record has no lane point; a record list without one is an error
    assert host_wait_points(records([OFF_RECORD])[0], SPEC.expert_bytes(), H100_HOST_REQUEST_S41) == []
    with pytest.raises(ValueError, match="no bench_decode point"):
        fit_host_wait(records([OFF_RECORD]), SPEC.expert_bytes(), H100_HOST_REQUEST_S41)


S44_RECORDS = ["2026-12-07-s44-h100-bench-decode-same-prompt-hauto-rows4.json",
               "2026-12-07-s44-h100-bench-decode-same-prompt-hauto-rows8.json",
               "2026-12-07-s44-h100-bench-decode-hauto-rows4.json"]


def test_session_44s_wait_is_its_profiles_fit_without_the_batches_past_the_lane():
    got = fit_host_wait(records(S44_RECORDS), SPEC.expert_bytes(), H100_HOST_REQUEST_S41)
    assert got["host_wait_row_s"] == pytest.approx(H100_HOST_WAIT_S44["host_wait_row_s"], abs=0.01e-6)
    # the 4-row lane's bs6 copied every miss (its graph holds 6 rows): no hand-off point; the 8-row lane's bs6 is one
    capped, uncapped = (host_wait_points(r, SPEC.expert_bytes(), H100_HOST_REQUEST_S41) for r in records(S44_RECORDS[:2]))
    assert [p["rows"] for p in capped] == [1] and [p["rows"] for p in uncapped] == [1, 6]


def test_a_batch_is_past_the_lane_by_the_graph_it_runs_in():
    """A 3-row batch runs in the 4-row graph: with the lane capped at 3 it sent the host nothing."""
    record = records(S44_RECORDS[1:2])[0]
    scenario = record["scenarios"]["budget_24gib"]
    scenario["batches"] = {"3": scenario["batches"]["6"]}  # a point with a miss profile, as 3 rows
    scenario["host_experts"]["max_rows"] = 3
    assert host_wait_points(record, SPEC.expert_bytes(), H100_HOST_REQUEST_S41) == []
    scenario["host_experts"]["max_rows"] = 4
    assert [p["rows"] for p in host_wait_points(record, SPEC.expert_bytes(), H100_HOST_REQUEST_S41)] == [3]


def test_the_wait_is_per_row_not_the_hosts_imbalance():
    """The finding: where the GPU has far more of its own work than the host (session 41's distinct bs4: 5.2 host keys
    of 1 row against 7.2 copies; session 42's bs6: 1 key of 6 rows against 3.5 copies) the imbalance is nil, yet the
    wait is 78-88 µs a layer with host keys: it does not shrink where the link has more to copy. Past the imbalance,
    every point waits 14-32 µs a routed row, where a fixed cost a layer would range 17-88 µs."""
    points = fit_host_wait(records(), SPEC.expert_bytes(), H100_HOST_REQUEST_S41)["points"]
    by = {(p["same_prompt"], p["share"], p["rows"]): p for p in points}
    for key in ((False, 423, 4), (True, 487, 6)):
        p = by[key]
        assert p["gpu"] - p["host"] > 75 and p["imbalance"] < 0.01 and p["residual"] > 75
    per_row = [p["residual"] / p["rows"] for p in points]
    assert all(14 < r < 32 for r in per_row)
    residuals = [p["residual"] for p in points]
    assert max(residuals) > 4 * min(residuals)  # not one fixed cost a layer
    assert all(p["empty"] < 2 for p in points)  # a wait without a request is one flag read: ~1.2 µs a launch


def test_the_fit_recovers_a_known_wait():
    """Points rebuilt from the stored ones with their wait set to the empty launches + the imbalance + 25 µs a row of
    each layer with host keys: the fit gives 25 µs."""
    recs = records()
    base = fit_host_wait(recs, SPEC.expert_bytes(), H100_HOST_REQUEST_S41)["points"]
    it = iter(base)
    for rec in recs:
        scenario = rec["scenarios"]["budget_24gib"]
        for rows, point in scenario["batches"].items():
            if not point.get("miss_profile"):
                continue
            p = next(it)
            assert p["rows"] == int(rows)
            layer_us = (1 - p["host_layers"]) * p["empty"] + p["imbalance"] + p["host_layers"] * 25.0 * p["rows"]
            for k in point["miss_profile"]["top_kernels"]:
                if k["kernel"] == "_wait_add_kernel":
                    k["us_per_step"] = layer_us * 40
    assert fit_host_wait(recs, SPEC.expert_bytes(), H100_HOST_REQUEST_S41)["host_wait_row_s"] == pytest.approx(
        25e-6, rel=1e-9)
