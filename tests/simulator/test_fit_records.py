"""`python -m simulator calibrate --records ...`: records -> observations -> fit -> held-out report."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from domain.model_spec import qwen36_35b_a3b
from simulator import fit_records as fr
from simulator.__main__ import main as sim_main
from simulator.cost_model import CostModel, decode_step
from simulator.hardware import get_profile
from simulator.records import load_records
from simulator.sweep import Calibration
from tests.simulator.same_profile import assert_same_profile

REPO = Path(__file__).resolve().parents[2]
SPEC = qwen36_35b_a3b()
H200 = get_profile("h200")
BUCKETS = [1, 2, 4, 8, 16]
TODAY = [REPO / "docs/bench" / n for n in ("2026-12-01-http-sweep-24gib-h200-baseline.json",
                                           "2026-12-01-http-ladder-resident-h200-baseline.json",
                                           "2026-12-01-bench-decode-h200-run3.json",
                                           "2026-12-01-bench-kernels-h200-ab.json")]
TRUE = dict(step_overhead_s=0.9e-3, memory_efficiency=0.3, host_step_s=0.1e-3, host_row_s=0.05e-3,
            server_step_s=1.5e-3, transfer_latency_s=20e-6)
GEOMETRY = {"num_hidden_layers": 40, "num_experts": 256, "num_experts_per_tok": 8}


def _model(**truth) -> CostModel:
    return CostModel(SPEC, H200, fr.unit_params(tuple(BUCKETS)).replace(**truth))


def synthetic_records(tmp_path: Path, truth: dict) -> list[Path]:
    """A bench_decode record and an ft bench sweep whose figures the step model itself produced."""
    m = _model(**truth)
    warmup, steps = 16, 32
    ctx = 16 + warmup + steps // 2
    batches = {}
    for b in (1, 4, 16):
        distinct = 256 * (1 - (1 - 8 / 256) ** b)
        s = decode_step(m, b, ctx, distinct).total_s
        batches[str(b)] = {"execute_median_ms": s * 1e3, "miss_bytes_per_step": 0.0, "hit_rate": 1.0,
                           "execute_minus_replay_ms": m.host_overhead(b, via_server=False) * 1e3}
    bench = {"kind": "bench_decode", "row_bytes": SPEC.expert_bytes(), "geometry": GEOMETRY,
             "hardware": {"h2d_pinned_gbps": 55.0},
             "args": {"warmup": warmup, "steps": steps, "fixed_gib": 1.0},
             "scenarios": {"resident": {"plan": {"kv_tokens": 8192, "expert_slots": 10240, "state_slots": 16},
                                        "graph_buckets": BUCKETS, "batches": batches}}}
    points = []
    for kv, slots, miss_rate in ((8192, 6000, 0.4), (65536, 5000, 0.5), (262144, 3000, 0.6)):
        for b in (1, 3, 4, 6):
            distinct = 8 * b * 0.6 + 8 * 0.4  # partly shared rows
            misses = miss_rate * distinct * 40
            s = decode_step(m, b, 24 + 64, distinct, misses, via_server=True).total_s
            steps_n = 256 / b * b  # completion tokens = 256 * b over b rows
            points.append({"ok": True, "batch_size": b, "kv_tokens": kv, "expert_slots": slots,
                           "steady_decode_tok_s_median": 1 / s, "completion_tokens": 256 * b,
                           "expert_hits": (distinct * 40 - misses) * steps_n, "expert_misses": misses * steps_n})
    sweep = {"schema": "fluxtide.bench/1", "kind": "sweep", "settings": {"tokens": 128},
             "model": {"geometry": GEOMETRY, "expert_bytes": SPEC.expert_bytes()},
             "budget": {"fixed_bytes": 0}, "pool_plan": {"kv_tokens": 8192, "expert_slots": 6000, "state_slots": 4},
             "points": points}
    paths = [tmp_path / "bench.json", tmp_path / "sweep.json"]
    for path, rec in zip(paths, (bench, sweep), strict=True):
        path.write_text(json.dumps(rec))
    return paths


def test_nnls_recovers_a_nonnegative_solution_and_clamps_a_negative_one():
    rng = np.random.default_rng(0)
    A = rng.random((12, 4))
    x = np.array([0.5, 0.0, 2.0, 1.0])
    assert np.allclose(fr.nnls(A, A @ x), x, atol=1e-9)
    b = A @ np.array([1.0, -3.0, 0.5, 0.0])
    got = fr.nnls(A, b)
    assert (got >= 0).all() and got[1] == 0.0
    # No non-negative point does better (check against random feasible points).
    best = np.linalg.norm(A @ got - b)
    assert all(np.linalg.norm(A @ rng.random(4) * 2 - b) >= best - 1e-12 for _ in range(200))


def test_the_fitter_recovers_the_parameters_that_generated_the_records(tmp_path):
    paths = synthetic_records(tmp_path, TRUE)
    records = load_records(paths, SPEC)
    assert records.graph_buckets == tuple(BUCKETS)
    split = fr.default_split(records.observations)
    # Fitted: bench_decode bs1/4/16 (steps and host) and the sweep's 8k bs1/bs4; held out: bs3, bs6, other KV.
    held = {(o.label) for o, t in zip(records.observations, split, strict=True) if not t}
    assert {"sweep kv=8192 bs=3", "sweep kv=8192 bs=6", "sweep kv=65536 bs=4", "sweep kv=262144 bs=1"} <= held
    report = fr.fit_observations(records, split, SPEC, H200)
    assert report.held == {}
    for name, value in TRUE.items():
        assert getattr(report.cost, name) == pytest.approx(value, rel=1e-6), name
    assert report.max_abs_held_out_error < 1e-6 and report.max_abs_fit_error < 1e-6
    # Padded bs3/bs6 points come out exact only because padding is modelled; without it they miss (a
    # small miss here: these synthetic steps are copy-bound).
    records.graph_buckets = ()
    unpadded = fr.fit_observations(records, split, SPEC, H200)
    worst = max((r for r in unpadded.rows if r["role"] == "held_out"), key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) > 1e-3 and worst["batch"] in (3, 6)


def test_a_parameter_the_fit_set_cannot_see_is_held_and_named(tmp_path):
    paths = synthetic_records(tmp_path, TRUE)
    records = load_records(paths[:1], SPEC)  # bench_decode only: no HTTP, no misses
    report = fr.fit_observations(records, [True] * len(records.observations), SPEC, H200)
    assert set(report.held) == {"server_step_s", "transfer_latency_s"}
    assert report.cost.server_step_s == 0 and report.cost.transfer_latency_s == 0
    assert report.cost.step_overhead_s == pytest.approx(TRUE["step_overhead_s"], rel=1e-6)
    assert report.max_abs_held_out_error is None


@pytest.mark.parametrize("which, drop, message", [
    ("sweep", ("points", 0, "steady_decode_tok_s_median"), "steady_decode_tok_s_median"),
    ("sweep", ("points", 2, "expert_misses"), "expert_misses"),
    ("sweep", ("settings", "tokens"), "tokens"),
    ("bench", ("scenarios", "resident", "batches", "4", "execute_median_ms"), "execute_median_ms"),
    ("bench", ("row_bytes",), "row_bytes"),
    ("bench", ("args", "warmup"), "warmup"),
])
def test_a_missing_field_fails_loudly_naming_it(tmp_path, which, drop, message):
    paths = synthetic_records(tmp_path, TRUE)
    path = paths[0] if which == "bench" else paths[1]
    record = json.loads(path.read_text())
    node = record
    for key in drop[:-1]:
        node = node[key]
    del node[drop[-1]]
    if drop[-1] == "expert_misses":
        del node["expert_hits"]  # a point with misses and no counts at all
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=message):
        load_records(paths, SPEC)


def test_unknown_kinds_and_other_models_are_refused_and_micro_benchmarks_skipped(tmp_path):
    paths = synthetic_records(tmp_path, TRUE)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"kind": "mystery"}))
    with pytest.raises(ValueError, match="unknown record kind 'mystery'"):
        load_records([*paths, odd], SPEC)
    other = json.loads(paths[1].read_text())
    other["model"]["geometry"] = {**GEOMETRY, "num_experts": 128}
    paths[1].write_text(json.dumps(other))
    with pytest.raises(ValueError, match="geometry"):
        load_records(paths, SPEC)
    kernels = tmp_path / "k.json"
    kernels.write_text(json.dumps({"kind": "bench_kernels"}))
    skipped = load_records([paths[0], kernels], SPEC).skipped
    assert skipped == [{"source": "k.json", "reason": "kernel micro-benchmark: no decode step"}]
    with pytest.raises(ValueError, match="no decode-step observations"):
        load_records([kernels], SPEC)


def test_a_failed_point_is_listed_not_fitted(tmp_path):
    paths = synthetic_records(tmp_path, TRUE)
    rec = json.loads(paths[1].read_text())
    rec["points"][1] = {**copy.deepcopy(rec["points"][1]), "ok": False, "error": "timeout"}
    paths[1].write_text(json.dumps(rec))
    records = load_records(paths, SPEC)
    assert {"source": "sweep.json", "reason": "points[1] failed: timeout"} in records.skipped
    assert not any(o.label == "sweep kv=8192 bs=3" for o in records.observations)


def refit(tmp_path, records, name: str, *args: str) -> tuple[int, dict, Path]:
    """`ft sim calibrate --strict` over `records` (extra `args`) into tmp_path/name.json, checked against the
    committed simulator/calibration/name.json (the same profile); (exit code, report, the new file)."""
    out, report = tmp_path / f"{name}.json", tmp_path / "report.json"
    rc = sim_main(["calibrate", "--records", *map(str, records), *args, "--out", str(out), "--report", str(report),
                   "--strict"])
    fresh = json.loads(out.read_text())
    committed = json.loads((REPO / f"simulator/calibration/{name}.json").read_text())
    fresh["provenance"]["records"] = committed["provenance"]["records"]  # absolute here, relative there
    assert_same_profile(fresh, committed)
    return rc, json.loads(report.read_text()), out


def test_todays_records_reproduce_the_committed_profile_and_report_their_error(tmp_path, capsys):
    # Fitted reading each distinct expert once (--expert-reads distinct): the HTTP records are the old engine's, and
    # the per-pair refit is no better (held-out max 17.5 %, also outside +-10 %), so the file keeps its fit.
    rc, rep, out = refit(tmp_path, TODAY, "h200_records_v1", "--expert-reads", "distinct")
    table = capsys.readouterr().out
    held = [p for p in rep["points"] if p["role"] == "held_out"]
    assert {p["label"] for p in held} == {"sweep kv=65536 bs=1", "sweep kv=65536 bs=4", "ladder kv=65536 bs=2",
                                          "ladder kv=65536 bs=8"}
    assert rep["max_abs_held_out_error"] == max(abs(p["error"]) for p in held)
    for p in rep["points"]:
        assert p["predicted_ms"] / p["measured_ms"] - 1 == pytest.approx(p["error"], abs=1e-3)
    # Honest today: the old engine's HTTP records and the fast engine's micro-benchmark do not fit one
    # profile within +-10 %; --strict says so with exit 3.
    assert rep["max_abs_held_out_error"] > fr.HELD_OUT_BOUND and rc == 3 and not rep["within_bound"]
    assert "OUTSIDE" in table and "kernel micro-benchmark" in table
    assert Calibration.load(out).cost_params().graph_buckets == tuple(BUCKETS)


FAST = [REPO / "docs/bench" / n for n in ("2026-12-01-http-sweep-24gib-h200-triton-prefill.json",
                                          "2026-12-01-http-ladder-resident-h200-triton-prefill.json",
                                          "2026-12-01-bench-decode-h200-run5.json",
                                          "2026-12-01-bench-kernels-h200-ab.json")]


def test_the_fast_engines_records_reproduce_h200_v2_within_the_held_out_bound(tmp_path):
    # The fast engine's own records (run 5 micro-benchmark + HTTP with the Triton prefill) fit one profile:
    # held-out points (other KV size, c2, c8) within +-10 %, so it is the H200 default (h200_v2). Fitted reading each
    # distinct expert once (--expert-reads distinct); the per-pair refit is outside the bound (next test), so h200_v2
    # keeps this fit.
    rc, rep, out = refit(tmp_path, FAST, "h200_v2", "--expert-reads", "distinct")
    held = [p for p in rep["points"] if p["role"] == "held_out"]
    assert len(held) == 4 and rc == 0 and rep["within_bound"]
    assert rep["max_abs_held_out_error"] <= fr.HELD_OUT_BOUND
    assert Calibration.load(out).cost_params().expert_reads == "distinct"


def test_the_per_pair_refit_of_h200_v2s_records_is_outside_the_bound_so_h200_v2_is_not_refitted(tmp_path):
    # The same records fitted with per-pair expert reads (the default since 2026-12-04): ladder c8 -11.7 % held out
    # (fitted on 2026-12-04). Outside +-10 %, so h200_v2 keeps its distinct-read fit; --strict says so with exit 3.
    out, report = tmp_path / "h200_v2_pairs.json", tmp_path / "report.json"
    rc = sim_main(["calibrate", "--records", *map(str, FAST), "--out", str(out), "--report", str(report), "--strict"])
    rep = json.loads(report.read_text())
    assert rep["cost"]["expert_reads"] == "pairs" and rc == 3 and not rep["within_bound"]
    assert rep["max_abs_held_out_error"] == pytest.approx(0.117, abs=0.002)


SESSION14 = [REPO / "docs/bench" / n for n in ("2026-12-02-http-sweep-24gib-h200-triton-prefill.json",
                                               "2026-12-02-http-ladder-resident-h200-spans.json",
                                               "2026-12-02-bench-decode-h200-run7-triton-prefill.json")]


def test_the_current_engines_records_reproduce_h200_records_v3_with_bs3_and_bs6_held_out(tmp_path):
    # Session 14's records (Triton prefill by default, batched spans): the 8k bs3/bs6 points, every 64k point
    # and c2/c8 are held out and predicted within +-10 % (6.3 % at most when fitted on 2026-12-02 reading each
    # distinct expert once; 8.5 % refitted on 2026-12-04 with per-pair expert reads, the default, which ships)
    rc, rep, out = refit(tmp_path, SESSION14, "h200_records_v3")
    held = {p["label"] for p in rep["points"] if p["role"] == "held_out"}
    assert len(held) == 8 and rc == 0 and rep["within_bound"]
    assert any("bs=3" in h for h in held) and any("bs=6" in h for h in held)
    assert rep["max_abs_held_out_error"] <= fr.HELD_OUT_BOUND
    assert Calibration.load(out).cost_params().expert_reads == "pairs"


SESSION17 = [REPO / "docs/bench" / name for name in (
    "2026-12-04-http-sweep-24gib-h200-prefill-graphs.json", "2026-12-04-http-ladder-resident-h200-prefill-graphs.json",
    "2026-12-02-bench-decode-h200-run7-triton-prefill.json")]


def test_session_17s_records_reproduce_h200_records_v4_with_bs3_and_bs6_held_out(tmp_path):
    # Session 17's records (prefill graphs, the arrival window: identical prompts decode in lockstep) with session
    # 14's split: the held-out points predicted within +-10 % (6.7 % at most when fitted on 2026-12-04 reading each
    # distinct expert once; 8.5 % with per-pair expert reads, the default, which ships: bs6 +7.6 / +8.5 %)
    rc, rep, out = refit(tmp_path, SESSION17, "h200_records_v4", "--hardware", "h200")
    held = {p["label"] for p in rep["points"] if p["role"] == "held_out"}
    assert rc == 0 and rep["within_bound"]
    assert any("bs=3" in h for h in held) and any("bs=6" in h for h in held)
    assert rep["max_abs_held_out_error"] <= fr.HELD_OUT_BOUND
    assert Calibration.load(out).cost_params().expert_reads == "pairs"
    # Per pair, more rows at equal misses cost more: the lockstep bs4 points (bs1's misses) are now predicted
    # within 1.5 % where the distinct-read fit had bs1 +4.8 % and bs4 -5.3 %.
    by_label = {p["label"]: p for p in rep["points"]}
    assert abs(by_label["sweep kv=8192 bs=1"]["error"]) < 0.02 and abs(by_label["sweep kv=8192 bs=4"]["error"]) < 0.02
