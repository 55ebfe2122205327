"""The host lane's request cost (ADR 0030; docs/simulator.md, "The host lane's request cost refit on the host-kernel
file (session 42)"): host_call_s + weight passes at host_expert_gb_s, a pass of n rows routed alike costing
(1 + host_row_factor x (n - 1)) 1-row passes; at the defaults (host_row_factor 0) the figures before the field."""

import json
import math
from pathlib import Path

import pytest

from domain.model_spec import qwen36_35b_a3b
from simulator.cost_model import OFF_WHEN_ZERO, CostModel, CostParams, decode_step
from simulator.hardware import get_profile
from simulator.host_lane import H100_HOST_REQUEST_S41, fit_host_request
from simulator.sweep import Calibration

from .conftest import tiny_spec
from .test_host_lane import cold_step

SPEC = qwen36_35b_a3b()  # 3,146,496 expert bytes
H100 = get_profile("h100")
V3 = Calibration.resolve("h100_records_v3")
LANE_FILE = Path(__file__).parents[2] / "docs/bench/2026-12-07-s41-h100-host-experts-lane.json"


def model(**host) -> CostModel:
    return CostModel(SPEC, H100, V3.cost_params().replace(**host))


def test_the_old_defaults_give_the_old_figures_exactly():
    assert CostParams().host_row_factor == 0.0 and "host_row_factor" in OFF_WHEN_ZERO
    assert "host_row_factor" not in V3.cost_params().replace(host_expert_gb_s=44.0).to_dict()
    on = V3.cost_params().replace(host_permille=465, **H100_HOST_REQUEST_S41)
    assert on.to_dict()["host_row_factor"] == 0.191 and CostParams.from_dict(on.to_dict()) == on
    m = model(host_expert_gb_s=44.0, host_permille=465)
    for passes, calls, pairs in ((1, 1, None), (2, 1, 2), (2, 1, 8), (3.5, 2.0, 11.0)):
        # 20 us a call + 3,146,496 B a pass at 44 GB/s (71.51 us), however many rows a pass serves
        assert m.host_compute(passes, calls, pairs) == calls * 20e-6 + passes * 3146496 / 44e9
    assert m.host_compute(2) == pytest.approx(163.02e-6, abs=0.01e-6)
    assert m.host_compute(0, pairs=0) == 0.0


@pytest.mark.parametrize("experts, rows, us", [(1, 1, 115.49), (2, 1, 164.57), (4, 1, 262.75), (8, 1, 459.10),
                                               (2, 4, 220.83)])
def test_the_refit_prices_the_host_kernel_files_requests(experts, rows, us):
    """66.4 us + a pass's 3,146,496 B at 64.1 GB/s (49.087 us) x (1 + 0.191 x (rows - 1)): a 2-expert request of 4 rows
    routed alike is 66.4 + 2 x 49.087 x 1.573 = 220.83 us (measured 220.9; 1 / 2 / 4 / 8 experts of a row 117.9 /
    163.6 / 259.8 / 460.3)."""
    m = model(host_permille=465, **H100_HOST_REQUEST_S41)
    assert m.host_compute(experts, pairs=experts * rows) * 1e6 == pytest.approx(us, abs=0.01)


def test_the_refit_is_the_host_kernel_files_fit():
    got = fit_host_request(json.loads(LANE_FILE.read_text())["results"], SPEC.expert_bytes())
    assert got == pytest.approx({"host_call_s": 66.40e-6, "host_expert_gb_s": 64.13, "host_row_factor": 0.1915},
                                rel=1e-3)
    assert got == pytest.approx(H100_HOST_REQUEST_S41, rel=3e-3)  # the constant is its rounding
    with pytest.raises(ValueError, match="two sizes"):
        fit_host_request(json.loads(LANE_FILE.read_text())["results"], SPEC.expert_bytes(), threads=3)


def test_the_fit_counts_the_passes_of_more_than_four_rows():
    """A record priced exactly by host_compute (66 us + 50 us a one-row pass, factor 0.2), with requests of 6 and 8
    rows (two passes a key) and an old entry without "rows": the fit gives the three back."""
    fixed, per, a = 66.0, 50.0, 0.2

    def entry(k, rows, passes):
        return {"experts_per_call": k, "rows": rows, "threads": 15, "team": "spin",
                "us_per_request": fixed + k * per * (passes + a * (rows - passes))}

    results = {f"lane_spin_{k}@15": entry(k, 1, 1) for k in (1, 2, 4)}
    results["lane_spin_8@15"] = {key: v for key, v in entry(8, 1, 1).items() if key != "rows"}
    results |= {"lane_spin_1@15x6rows": entry(1, 6, 2), "lane_spin_2@15x8rows": entry(2, 8, 2),
                "lane_spin_2@15x4rows": entry(2, 4, 1)}
    got = fit_host_request(results, 5_000_000)
    assert got == pytest.approx({"host_call_s": 66e-6, "host_expert_gb_s": 100.0, "host_row_factor": 0.2})


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan, "0.2", True])
def test_a_bad_row_factor_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="host_row_factor must be a finite number >= 0"):
        CostParams.from_dict({"host_row_factor": bad})


def test_a_pass_serves_at_least_one_row():
    with pytest.raises(ValueError, match="fewer than passes"):
        model(host_expert_gb_s=44.0).host_compute(2, pairs=1)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
def test_the_step_model_and_the_executor_charge_the_rows_of_a_pass(rows):
    """Lockstep rows on an empty pool, every layer's 2 misses on the host (a budget of 2 passes: both keys up to 4 rows,
    one of 2 passes from 5 to 8): each pass of n rows costs 1 + a (n - 1) 1-row passes, in the step model and the
    simulated executor alike."""
    spec = tiny_spec(layers=4, experts=16, top_k=2)
    a, rate, call = 0.25, 10.0, 20e-6
    params = V3.cost_params().replace(host_expert_gb_s=rate, host_permille=1000, host_call_s=call, host_row_factor=a)
    read = spec.expert_bytes() / (rate * 1e9)
    per_pass = [min(4, rows - 4 * i) for i in range(math.ceil(rows / 4))]  # a key's passes and their rows
    keys = 2 if len(per_pass) == 1 else 1
    lane = 4 * (call + keys * sum(1 + a * (n - 1) for n in per_pass) * read)
    assert decode_step(CostModel(spec, H100, params), rows, 2, 2.0, 8.0).host_lane_s == pytest.approx(lane, rel=1e-9)
    ex, _ = cold_step(params, rows, spec)
    assert ex.host.cpu.busy_at() == pytest.approx(lane, rel=1e-9)
