"""The H200 fast-path calibration: the committed file is what the records give, the held-out
24 GiB steps are predicted within the stated bound, and they do not take part in the fit."""

import copy
import json

import pytest

from simulator import calibration_fastpath as fp
from simulator.cost_model import CostModel, CostParams
from simulator.hardware import get_profile
from simulator.sweep import Calibration, find_calibration
from tests.simulator.same_profile import assert_same_profile

SPEC_NAME = "qwen3.6-35b-a3b-fp8"


@pytest.fixture(scope="module")
def records():
    return json.loads(fp.RECORD.read_text()), json.loads(fp.PROBE.read_text())


def test_committed_calibration_is_a_fresh_fit_of_the_records():
    # Re-derived from docs/bench/*.json: the file cannot drift from the measurements.
    committed = json.loads(fp.OUT.read_text())
    assert_same_profile(json.loads(json.dumps(fp.build())), committed)
    for name in committed["provenance"]["records"]:
        assert (fp.REPO / name).is_file(), name
    assert committed["provenance"]["records"][0].endswith("2026-11-30-bench-decode-h200-run2.json")


def test_held_out_24gib_steps_are_predicted_within_the_bound(records):
    result = fp.fit(*records)
    assert fp.HELD_OUT_BOUND == 0.10
    assert [p["batch"] for p in result.held_out] == [1, 4, 16]
    for p in result.held_out:
        assert p["miss_bytes_per_step"] > 0 and p["scenario"] == "budget_24gib"
        assert abs(p["step_error"]) < fp.HELD_OUT_BOUND, p
        assert abs(p["tok_s_error"]) < fp.HELD_OUT_BOUND / (1 - fp.HELD_OUT_BOUND), p
    # the fitted (resident) points: two free parameters end up active on three points
    assert max(abs(p["step_error"]) for p in result.fitted) < 0.01
    assert 0.1 < result.cost.memory_efficiency < 1 and result.cost.step_overhead_s > 0
    assert 40e9 < result.gather_bytes_per_s < 55.4e9  # below the record's pinned memcpy 55.4 GB/s


def test_the_procedure_also_predicts_the_first_kernel_version():
    # run 1: launch-bound kernels (10 ms resident bs1), a different engine, the same procedure
    check = json.loads(fp.OUT.read_text())["validation"]["procedure_check"]
    assert check["record"].endswith("run1.json") and len(check["held_out"]) == 3
    assert check["max_abs_held_out_step_error"] < fp.HELD_OUT_BOUND
    assert check["cost"]["step_overhead_s"] > 2 * json.loads(fp.OUT.read_text())["cost"]["step_overhead_s"]


def test_the_held_out_figures_do_not_enter_the_fit(records):
    record, probe = records
    doctored = copy.deepcopy(record)
    for b in doctored["scenarios"]["budget_24gib"]["batches"].values():
        b["execute_median_ms"] *= 3
    honest, cheat = fp.fit(record, probe), fp.fit(doctored, probe)
    assert honest.cost == cheat.cost
    assert cheat.max_held_out_error > 0.5  # ... so a wrong measurement shows up as an error


def test_resident_figures_do_drive_the_fit(records):
    record, probe = records
    slower = copy.deepcopy(record)
    slower["scenarios"]["resident"]["batches"]["1"]["execute_median_ms"] *= 1.05
    assert fp.fit(slower, probe).cost != fp.fit(record, probe).cost
    flat = copy.deepcopy(record)
    for b in flat["scenarios"]["resident"]["batches"].values():
        b["execute_median_ms"] = 1.0  # faster than reading the weights once at full bandwidth
    with pytest.raises(ValueError, match="physics alone"):
        fp.fit(flat, probe)


def test_gather_line_is_recovered_from_the_probe():
    row = fp.qwen36_35b_a3b().expert_bytes()
    probe = {"gather": {str(n): {"ms": 1e3 * (4e-5 + n * row / 50e9)} for n in (8, 32, 128)},
             "copy_engine_32_rows_gb_s": 55.0}
    setup, bps = fp.fit_gather(probe)
    assert setup == pytest.approx(4e-5) and bps == pytest.approx(50e9)
    with pytest.raises(ValueError, match="two or more"):
        fp.fit_gather({"gather": {"8": {"ms": 1.0}}})


def test_bad_records_are_clear_errors(records):
    record, probe = records
    with pytest.raises(ValueError, match="not a bench_decode record"):
        fp.load_points({"scenarios": {"x": {"batches": {"1": {}}}}})
    wrong = copy.deepcopy(record)
    wrong["row_bytes"] = 123
    with pytest.raises(ValueError, match="row_bytes"):
        fp.fit(wrong, probe)


def test_transfer_setup_is_paid_per_call_and_only_with_misses():
    spec = fp.qwen36_35b_a3b()
    model = CostModel(spec, get_profile("h200"), CostParams(transfer_setup_s=1e-4))
    per_row = spec.expert_bytes() / 53.3e9
    assert model.transfer(0, 40) == 0.0
    assert model.transfer(10, 4) == pytest.approx(4e-4 + 10 * per_row)
    assert model.expert_read(9, 9) == pytest.approx(model.expert_gemms([1] * 9))


def test_predict_uses_it_by_default_and_by_name(capsys):
    from simulator.__main__ import main

    cal, measured_here = find_calibration("h200")
    # the H200's default is fluxtide's best held-out profile (sweep.DEFAULT_CALIBRATIONS); h200_v2 and v1 by name
    assert measured_here and cal.name == "h200_records_v6" and cal.provenance["records"]
    assert Calibration.resolve("h200_v2").name == "h200_v2" and Calibration.resolve("h200_v1").name == "h200_v1"
    with pytest.raises(FileNotFoundError, match="known: .*h200_v1"):
        Calibration.resolve("h200_v0")
    rc = main(["predict", "--hardware", "h200", "--model", SPEC_NAME, "--kv", "8k", "--batch", "1",
               "--calibration", "h200_v1", "--routing", "uniform", "--json", "--workers", "1"])
    assert rc == 0
    (point,) = json.loads(capsys.readouterr().out)
    assert point["calibration"] == "h200_v1" and point["fits"] and point["decode_tok_s"] > 0


def _perturbed(value, factor):
    """Every float of a parsed JSON document times `factor`."""
    if isinstance(value, float):
        return value * factor
    if isinstance(value, dict):
        return {k: _perturbed(v, factor) for k, v in value.items()}
    if isinstance(value, list):
        return [_perturbed(v, factor) for v in value]
    return value


def test_check_accepts_last_digit_float_noise_and_refuses_a_real_difference(tmp_path, capsys):
    # --check used to compare the text byte for byte, and a clean checkout failed on the fit's last digits
    out = tmp_path / fp.OUT.name
    committed = json.loads(fp.OUT.read_text())
    out.write_text(json.dumps(_perturbed(committed, 1 + 1e-13), indent=2) + "\n")
    assert out.read_text() != fp.OUT.read_text()
    assert fp.main(["--check", "--out", str(out)]) == 0
    assert "up to date" in capsys.readouterr().out
    changed = copy.deepcopy(committed)
    changed["cost"]["memory_efficiency"] *= 1 + 1e-6
    out.write_text(json.dumps(changed, indent=2) + "\n")
    assert fp.main(["--check", "--out", str(out)]) == 1
    assert "differs from a fresh fit: $.cost.memory_efficiency" in capsys.readouterr().out
    del changed["cost"]["memory_efficiency"]
    out.write_text(json.dumps(changed, indent=2) + "\n")
    assert fp.main(["--check", "--out", str(out)]) == 1
    assert "keys differ" in capsys.readouterr().out


def test_json_difference_compares_structure_and_floats_to_a_relative_tolerance():
    from simulator.params import json_difference

    assert json_difference({"a": [1, 0.2775530208681904, "x"]}, {"a": [1, 0.27755302086819017, "x"]}) is None
    assert json_difference({"a": 0.2776}, {"a": 0.2775}) == "$.a: 0.2775 committed, 0.2776 fresh"
    assert json_difference({"a": [1, 2]}, {"a": [1]}) == "$.a: lengths differ"
    assert json_difference({"a": True}, {"a": 1}) is not None
    assert json_difference({"a": "1"}, {"a": 1.0}) is not None
