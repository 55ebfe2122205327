"""h100_records_v3's two model changes (docs/simulator.md, "Held out on an H100: sessions 34-35"), each pinned so that
undoing it fails here: a per-pair GEMV call's re-reads of an expert an earlier pair of the call read
(CostParams.pair_reread_s) and the split-K dense projections of 3 to 32 rows (CostParams.splitk_layer_s); the fit on
session 34 (simulator/fit_resident_h100.py) and the held-out report (scripts/sim_heldout_h100_s35.py)."""

import json
from pathlib import Path

import pytest

from domain.model_spec import qwen36_35b_a3b
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams
from simulator import fit_pair_gemv, fit_resident_h100
from simulator.cost_model import SPLITK_ROWS, CostModel, CostParams, SequenceLoad, decode_step
from simulator.fit_records import predict
from simulator.hardware import get_profile
from simulator.host import SimHost
from simulator.routing import UniformRouting
from simulator.sim_executor import SimExecutor
from simulator.sweep import Calibration, find_calibration

from .conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[2]
SPEC = tiny_spec()  # 4 layers, 16 experts, top-2
H100 = get_profile("h100")
PAIRS = dict(expert_reads="pairs", graph_buckets=(1, 2, 4), memory_efficiency=0.5, compute_efficiency=1.0,
             pair_call_s=3e-6, pair_read_efficiency=0.9)
V2, V3 = Calibration.resolve("h100_records_v2"), Calibration.resolve("h100_records_v3")
REPORT = ROOT / "docs/bench/2026-12-06-s35-sim-vs-h100.json"


# ---- re-reads ----------------------------------------------------------------------------------------------------

def test_pairs_of_a_shared_expert_after_its_first_cost_the_reread():
    m = CostModel(SPEC, H100, CostParams(**PAIRS, pair_reread_s=2e-7))
    read = m.expert_read(1, 1, per_pair=True)
    # 2 experts, 4 pairs each: 2 first reads and 6 re-reads (FLOPs of all 8 pairs are far below the reads)
    assert m.expert_gemms([4, 4], per_pair=True) == pytest.approx(2 * read + 6 * 2e-7, rel=1e-12)
    assert m.expert_gemms([1, 1, 1], per_pair=True) == pytest.approx(3 * read, rel=1e-12)  # distinct: no re-read
    off = CostModel(SPEC, H100, CostParams(**PAIRS))
    assert off.expert_gemms([4, 4], per_pair=True) == pytest.approx(8 * read, rel=1e-12)  # off: every pair reads
    assert m.expert_gemms([4, 4]) == off.expert_gemms([4, 4])  # grouped GEMMs read each expert once either way
    with pytest.raises(ValueError, match="re-reads"):
        off.expert_read(2, 8, per_pair=True, rereads=6)


def _lockstep_step(ex: SimExecutor, rows: int) -> None:
    """`rows` greedy decode rows of one prompt: one routing stream, so every row routes to the same experts."""
    ex.execute(StepBatch(tuple(SequenceWork(f"r{i}", (5,), 1, (0,), 0, True, SamplingParams(temperature=0.0), 1)
                               for i in range(rows))))


@pytest.mark.parametrize("terms", [{}, {"pair_reread_s": 2e-7}, {"splitk_layer_s": 7e-6},
                                   {"pair_reread_s": 2e-7, "splitk_layer_s": 7e-6}])
def test_the_executor_and_the_step_model_agree_on_a_lockstep_step(terms):
    cost = CostModel(SPEC, H100, CostParams(**PAIRS, **terms))
    ex = SimExecutor(SimHost(), cost, UniformRouting(4, 16, 2, seed=1), 64, via_server=False, preload_experts=True)
    t0 = ex.host.now()
    _lockstep_step(ex, 4)
    assert ex.host.now() - t0 == pytest.approx(decode_step(cost, 4, 2, float(SPEC.top_k)).total_s, rel=1e-9)


def test_rereads_shorten_a_lockstep_step_by_their_saving():
    def step(**terms) -> float:
        return decode_step(CostModel(SPEC, H100, CostParams(**PAIRS, **terms)), 4, 2, float(SPEC.top_k)).total_s

    read = CostModel(SPEC, H100, CostParams(**PAIRS)).expert_read(1, 1, per_pair=True)
    # 4 rows x top-2 = 8 pairs over 2 experts: 6 re-reads a layer
    assert step() - step(pair_reread_s=2e-7) == pytest.approx(4 * 6 * (read - 2e-7), rel=1e-9)


# ---- split-K ------------------------------------------------------------------------------------------------------

def test_split_k_is_paid_from_three_to_thirty_two_rows():
    m = CostModel(SPEC, H100, CostParams(**PAIRS, splitk_layer_s=1e-5))
    off = CostModel(SPEC, H100, CostParams(**PAIRS))
    for rows, paid in ((1, False), (2, False), (3, True), (16, True), (32, True), (33, False)):
        loads = [SequenceLoad(1, 8)] * rows
        assert m.layer_pre_expert(0, loads) - off.layer_pre_expert(0, loads) == pytest.approx(1e-5 if paid else 0.0)
    assert SPLITK_ROWS == (3, 32)
    # a decode step pays it over its graph bucket: 3 rows run as bucket 4
    assert (decode_step(m, 3, 8, 6.0).total_s - decode_step(off, 3, 8, 6.0).total_s
            == pytest.approx(SPEC.num_layers * 1e-5))


def test_the_new_terms_are_off_and_unwritten_in_older_files():
    for name in ("h100_records_v2", "h200_records_v6", "h200_records_v7"):
        cost = Calibration.resolve(name).to_dict()["cost"]
        assert "pair_reread_s" not in cost and "splitk_layer_s" not in cost
    assert find_calibration("h100")[0].name == "h200_records_v6"  # v3 is not a default


# ---- the fit and the report ---------------------------------------------------------------------------------------

def test_v3_is_v2_with_its_named_terms():
    c3, c2 = V3.cost_params().to_dict(), V2.cost_params().to_dict()
    assert {k for k in c3 if c3[k] != c2.get(k, 0.0)} == {
        "step_overhead_s", "pair_reread_s", "splitk_layer_s", "pair_call_s", "pair_read_efficiency",
        "request_overhead_s", "request_spacing_s"}
    assert V3.deployment_params() == V2.deployment_params()
    fit = V3.provenance["resident_h100_fit"]
    assert fit["session"] == 34 and fit["records"] == fit_resident_h100.RECORDS[34]


def test_v3s_step_terms_come_from_session_34():
    spec, c = qwen36_35b_a3b(), V3.cost_params()
    rec = fit_resident_h100.RECORDS[34]["decode"]
    profile = fit_pair_gemv.load(ROOT, rec)
    splitk = (fit_pair_gemv.pair_kernels_s(profile, 16, rec, ("_dense_gemm_splitk_kernel",))
              - fit_pair_gemv.pair_kernels_s(profile, 1, rec, ("_dense_gemv_kernel",)))
    assert spec.num_layers * c.splitk_layer_s == pytest.approx(splitk, rel=1e-12)
    model = CostModel(spec, H100, c)
    bs1 = fit_resident_h100.step_observation(rec, "bench_decode resident bs=1")
    c16 = fit_resident_h100.lockstep(fit_resident_h100.step_observation(fit_resident_h100.RECORDS[34]["ladder"],
                                                                        "ladder kv=65536 bs=16"))
    assert predict(model, bs1) == pytest.approx(bs1.measured_s, rel=1e-9)
    assert predict(model, c16) == pytest.approx(c16.measured_s, rel=1e-9)
    # an L2 re-read is cheaper than a first read, and neither is free
    assert 0 < c.pair_reread_s < model.expert_read(1, 1, per_pair=True)


def test_v3_is_a_fresh_fit():
    assert fit_resident_h100.main(["--check"]) == 0


def test_the_s35_report_holds_v3_out_on_session_35_within_the_bound_for_every_fp8_step():
    report = json.loads(REPORT.read_text())
    assert report["calibration"] == "h100_records_v2" and report["refit"] is False
    points = report["points"]
    assert {p["session"] for p in points} == {34, 35}
    held = [p for p in points if p["session"] == 35 and p["format"] == "fp8" and p["kind"] != "HTTP TTFT"]
    assert len(held) == 16 and all(p["h100_records_v3_within_bound"] for p in held)
    # the ladder's lockstep c16 step: v2 over-costs it (no re-reads), v3 does not
    c16 = next(p for p in points if p["session"] == 35 and p["point"] == "c16 decode step (predict steady)")
    assert c16["error_pct"] > 10 and abs(c16["h100_records_v3_error_pct"]) < 5
