"""The host lane (ADR 0030): a share of each decode lookup's misses computed on the host CPU beside the link's copies
of the rest, in the parameters, the simulated executor, the step model and predict."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.budget import GpuBudget, PoolRequest, plan_pools
from domain.model_spec import qwen36_35b_a3b
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams
from domain.residency import HOST_LANE_MAX_ROWS, host_split
from domain.serve_plan import cap_bytes
from simulator.__main__ import main
from simulator.cost_model import HOST_LANE_DEFAULTS, CostModel, CostParams, decode_step
from simulator.hardware import get_profile
from simulator.host import SimHost
from simulator.host_lane import (
    balanced_host_permille,
    host_keys_at,
    miss_points,
    passes_per_key,
    weight_passes,
)
from simulator.predict import Workload, predict_point, run_workload
from simulator.routing import UniformRouting
from simulator.sim_executor import SimExecutor
from simulator.sweep import CALIBRATION_DIR, Calibration

from .conftest import tiny_spec

SPEC = qwen36_35b_a3b()
H100 = get_profile("h100")
V3 = Calibration.resolve("h100_records_v3")
LINK_GB_S = H100.h2d_bytes_per_s / 1e9  # 54.6
SMALL = Workload(prompt_tokens=18, warmup_iterations=1, warmup_tokens=16, measure_iterations=1, measure_tokens=48)


def cost(**host) -> CostParams:
    return V3.cost_params().replace(**host)


# ---- parameters -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"host_permille": 100}, "needs host_expert_gb_s > 0"),
    ({"host_expert_gb_s": 10.0, "host_permille": 1001}, "host_permille must be an integer in 0..1000"),
    ({"host_expert_gb_s": 10.0, "host_permille": -1}, "host_permille must be an integer in 0..1000"),
    ({"host_expert_gb_s": 10.0, "host_permille": 1.5}, "host_permille must be an integer"),
    ({"host_expert_gb_s": 10.0, "host_permille": True}, "host_permille must be an integer"),
    ({"host_expert_gb_s": -1.0}, "host_expert_gb_s must be a finite number >= 0"),
    ({"host_expert_gb_s": math.inf}, "host_expert_gb_s must be a finite number >= 0"),
    ({"host_expert_gb_s": math.nan}, "host_expert_gb_s must be a finite number >= 0"),
    ({"host_expert_gb_s": "40"}, "host_expert_gb_s must be a finite number >= 0"),
    ({"host_call_s": -1e-6}, "host_call_s must be a finite number >= 0"),
    ({"host_max_rows": -1}, "host_max_rows must be an integer >= 0"),
    ({"host_max_rows": 2.5}, "host_max_rows must be an integer >= 0"),
])
def test_bad_host_parameters_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        CostParams.from_dict(fields)


def test_the_host_fields_are_unwritten_at_their_defaults_and_round_trip_when_set():
    for path in sorted(CALIBRATION_DIR.glob("*_v*.json")):
        written = json.loads(path.read_text())["cost"]
        assert not set(HOST_LANE_DEFAULTS) & set(written), path.name
        assert not set(HOST_LANE_DEFAULTS) & set(Calibration.load(path).cost_params().to_dict()), path.name
    on = cost(host_expert_gb_s=40.0, host_permille=423, host_call_s=15e-6)
    assert {k: on.to_dict()[k] for k in HOST_LANE_DEFAULTS} == {
        "host_expert_gb_s": 40.0, "host_permille": 423, "host_call_s": 15e-6}
    assert CostParams.from_dict(on.to_dict()) == on


@pytest.mark.parametrize("host, link, permille", [(40, 54.6, 423), (10, 54.6, 155), (20, 54.6, 268), (1, 1, 500),
                                                  (1e-9, 50, 0), (50, 1e-9, 1000)])
def test_the_balanced_share_is_where_both_lanes_move_bytes_for_the_same_time(host, link, permille):
    assert balanced_host_permille(host, link) == permille
    p = balanced_host_permille(host, link) / 1000
    if 0 < p < 1:  # the share p of m bytes at host, the rest at link: equal times up to the rounding
        assert p / host == pytest.approx((1 - p) / link, rel=2e-3 / min(p, 1 - p))


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True])
def test_the_balanced_share_needs_two_rates(bad):
    with pytest.raises(ValueError, match="finite number > 0"):
        balanced_host_permille(bad, 50.0)
    with pytest.raises(ValueError, match="finite number > 0"):
        balanced_host_permille(50.0, bad)


@settings(max_examples=200, deadline=None)
@given(st.floats(0, 40), st.integers(0, 1000))
def test_the_step_model_costs_a_layer_at_whole_miss_counts_with_the_average_kept(misses, permille):
    points = miss_points(misses, permille)
    assert sum(w for w, _ in points) == pytest.approx(1.0) and all(w > 0 for w, _ in points)
    assert sum(w * m for w, m in points) == pytest.approx(misses, rel=1e-12, abs=1e-12)
    if not permille:
        assert points == [(1.0, misses)]  # off: the average itself, as before the host lane
    else:
        assert all(m == int(m) and abs(m - misses) <= 1 for _, m in points)
        assert len(points) == (1 if misses == int(misses) else 2)


# ---- the simulated executor against the step model -----------------------------------------------------------------

def cold_step(params: CostParams, rows: int, spec=SPEC) -> tuple[SimExecutor, float]:
    """One decode step of `rows` lockstep rows (one prompt: the same experts) on an empty pool: every layer misses
    its top-k experts, so each lookup has exactly top_k misses, as decode_step's misses_per_step = top_k x layers."""
    routing = UniformRouting(spec.num_layers, spec.num_experts, spec.top_k, seed=2)
    ex = SimExecutor(SimHost(), CostModel(spec, H100, params), routing, spec.total_experts, via_server=False)
    ex.execute(StepBatch(tuple(SequenceWork(f"r{i}", (5,), 1, (0,), i, True, SamplingParams(temperature=0.0), 1)
                               for i in range(rows))))
    ex.check_valid()
    return ex, ex.host.now()


@settings(max_examples=60, deadline=None)
@given(top_k=st.integers(1, 8), permille=st.integers(0, 1000), rate=st.floats(0.5, 400),
       call=st.sampled_from([0.0, 20e-6, 1e-4]), rows=st.sampled_from([1, 2, 3, 4, 5, 8]), overlap=st.booleans(),
       reads=st.sampled_from(["pairs", "distinct"]))
def test_the_executor_and_the_step_model_agree_on_a_cold_step(top_k, permille, rate, call, rows, overlap, reads):
    """Every layer misses top_k experts (1 to 8): the domain's host keys, copies, host lane and step time of the
    simulated executor are the step model's, to rounding."""
    spec = tiny_spec(layers=4, experts=16, top_k=top_k)
    params = cost(host_expert_gb_s=rate, host_permille=permille, host_call_s=call, overlap_copy_compute=overlap,
                  expert_reads=reads)
    ex, took = cold_step(params, rows, spec)
    # the domain's rule, per layer: lockstep rows put `rows` pairs on every key, each weighing weight_passes(rows)
    layers, on_host = spec.num_layers, host_split([rows] * top_k, permille)
    assert on_host == host_keys_at(top_k, permille, passes_per_key(float(rows)))  # the step model's count
    c = ex.counters
    assert c.expert_misses == top_k * layers and c.host_experts == on_host * layers
    assert c.host_pairs == rows * on_host * layers  # lockstep rows: each host expert is routed once a row
    assert c.host_passes == weight_passes(rows) * on_host * layers  # ... and read once for up to 4 of them
    assert c.bytes_moved == (top_k - on_host) * layers * spec.expert_bytes()
    step = decode_step(CostModel(spec, H100, params), rows, 2, float(top_k), float(top_k * layers))
    assert took == pytest.approx(step.total_s, rel=1e-9)
    assert ex.host.pcie.busy_at() == pytest.approx(step.copy_s, rel=1e-9)
    assert ex.host.cpu.busy_at() == pytest.approx(step.host_lane_s, rel=1e-9)
    assert ex.host.cpu.uses == (layers if on_host else 0)


@pytest.mark.parametrize("rows", [4, 8])
def test_a_decode_call_past_the_lanes_rows_copies_every_miss_in_both_models(rows):
    """host_max_rows 4 (as session 44's first HTTP sweep ran): a 4-row call sends the host its share, an 8-row call
    sends nothing and costs what the lane off costs, in the simulated executor and the step model alike."""
    spec = tiny_spec(layers=4, experts=16, top_k=4)
    capped = cost(host_expert_gb_s=40.0, host_permille=500, host_max_rows=4)
    ex, took = cold_step(capped, rows, spec)
    step = decode_step(CostModel(spec, H100, capped), rows, 2, 4.0, 4.0 * spec.num_layers)
    assert took == pytest.approx(step.total_s, rel=1e-9)
    off_ex, off_took = cold_step(cost(), rows, spec)
    if rows <= 4:
        assert ex.counters.host_experts > 0 and step.host_lane_s > 0
    else:
        assert ex.counters.host_experts == 0 and step.host_lane_s == 0
        assert took == pytest.approx(off_took, rel=1e-12) and ex.counters.bytes_moved == off_ex.counters.bytes_moved


def test_a_host_key_shared_by_rows_is_read_once_for_up_to_four_of_them():
    """The host kernel (adapters/host_kernels/fp8_block_experts.cpp, MAX_VECTORS) converts an expert's weights once
    for up to 4 of a lookup's rows routed to it: lockstep rows (one prompt to every request, as the customer's
    benchmark sends) on a host key cost ceil(rows / 4) passes, not a pass a row, and the domain's split weighs a key
    by them (host_split). Every layer misses its 2 experts with the whole share (a budget of 2 passes): up to 4 rows
    both go to the host at a pass each; 5 to 8 rows, one key of 2 passes (the other is copied); 9 rows, none (3
    passes are over the budget). The lane is its round trips and passes, in the executor and the step model alike."""
    spec = tiny_spec(layers=4, experts=16, top_k=2)
    rate, call = 10.0, 20e-6
    params = cost(host_expert_gb_s=rate, host_permille=1000, host_call_s=call)
    model, read = CostModel(spec, H100, params), spec.expert_bytes() / (rate * 1e9)
    lane = {}
    for rows, keys in ((1, 2), (2, 2), (4, 2), (5, 1), (8, 1), (9, 0)):
        ex, _ = cold_step(params, rows, spec)
        c = ex.counters
        assert (c.host_experts, c.host_pairs, c.host_passes) == (4 * keys, 4 * keys * rows,
                                                                 4 * keys * weight_passes(rows))
        assert c.bytes_moved == 4 * (2 - keys) * spec.expert_bytes()
        lane[rows] = ex.host.cpu.busy_at()
        assert lane[rows] == pytest.approx(4 * (call + keys * math.ceil(rows / 4) * read) if keys else 0.0, rel=1e-9)
        assert decode_step(model, rows, 2, 2.0, 8.0).host_lane_s == pytest.approx(lane[rows], rel=1e-9)
    assert lane[1] == pytest.approx(lane[2]) == pytest.approx(lane[4])  # a pass a pair would be 4 x one row's reads
    assert lane[5] == pytest.approx(lane[8]) == pytest.approx(lane[1])  # one key, a second pass: the same budget
    assert lane[9] == 0.0


def test_the_step_model_spreads_a_keys_pairs_as_evenly_as_their_average_allows():
    """passes_per_key: whole averages cost their own passes; at or below one pair a key (rows that never share a key)
    a pass a pair, as before passes were counted; between, the two whole counts around the average."""
    for n in range(0, 13):
        assert passes_per_key(float(n)) == weight_passes(n) == math.ceil(n / 4)
    for x in (0.0, 0.25, 0.999, 1.0):
        assert passes_per_key(x) == pytest.approx(x)
    assert passes_per_key(1.15) == passes_per_key(3.9) == 1.0  # uniform routing's distinct rows: a pass a key
    assert passes_per_key(4.25) == pytest.approx(1.25)
    # rows that never share a key (bs1: routed / distinct = 1): the step model's host lane is a pass a pair, as it was;
    # 3.65 misses a layer are costed at 3 (35 %, 1 host key at 423 per mille) and 4 (65 %, 2 host keys)
    model = CostModel(SPEC, H100, cost(host_expert_gb_s=40.0, host_permille=423))
    step = decode_step(model, 1, 144, 8.0, 146.0)
    per_pair = SPEC.num_layers * (0.35 * model.host_compute(1.0) + 0.65 * model.host_compute(2.0))
    assert step.host_lane_s == pytest.approx(per_pair, rel=1e-12)
    with pytest.raises(ValueError, match="negative"):
        passes_per_key(-0.5)
    with pytest.raises(ValueError, match="negative"):
        weight_passes(-1)


def test_the_host_lane_runs_beside_the_copies_not_after_them():
    """Half of each layer's 8 misses on the host at the link's rate: both lanes are busy for most of the step, and
    the step takes the longer of the two a layer, not their sum."""
    off = cost(host_expert_gb_s=LINK_GB_S)
    on = cost(host_expert_gb_s=LINK_GB_S, host_permille=500)
    ex_off, t_off = cold_step(off, 1)
    ex_on, t_on = cold_step(on, 1)
    pcie, cpu = ex_on.host.pcie.busy_at(), ex_on.host.cpu.busy_at()
    assert min(pcie, cpu) > 0.3 * t_on  # both large
    # v3 runs the GEMMs after the copies (overlap_copy_compute off): outside the lanes the step is GPU work and the
    # host overhead; the lanes add the longer of the two in each layer, and every layer is alike here
    others = ex_on.host.gpu.busy_at() + CostModel(SPEC, H100, on).host_overhead(1, via_server=False)
    assert t_on == pytest.approx(others + max(pcie, cpu), rel=1e-9)
    assert t_on < others + pcie + cpu - 0.25 * t_on  # far from the sum
    assert t_on < t_off and ex_off.host.cpu.busy_at() == 0.0


@settings(max_examples=40, deadline=None)
@given(slots=st.integers(2, 64), permille=st.integers(0, 1000), rate=st.floats(0.01, 100), batch=st.integers(1, 4),
       overlap=st.booleans(), same_prompt=st.booleans(), seed=st.integers(0, 3))
def test_every_run_with_a_host_lane_keeps_the_books(slots, permille, rate, batch, overlap, same_prompt, seed):
    """Random pools, shares and rates through the scheduler (check_valid after every step): the link copies the fills
    only, the host lane is busy exactly for its round trips and weight passes, and the three resources stay within
    time."""
    spec = tiny_spec()
    params = CostParams(step_overhead_s=1e-3, transfer_latency_s=1e-5, overlap_copy_compute=overlap,
                        graph_buckets=(1, 2, 4), host_expert_gb_s=rate, host_permille=permille)
    model = CostModel(spec, get_profile("rtx4060-laptop"), params)
    plan = plan_pools(spec, GpuBudget(total_bytes=1 << 34, memory_ratio=1.0),
                      PoolRequest(kv_tokens=2048, expert_slots=max(slots, spec.top_k), state_slots=4))
    ex = SimExecutor(SimHost(), model, UniformRouting(spec.num_layers, spec.num_experts, spec.top_k, seed=seed),
                     plan.expert_slots)
    workload = Workload(prompt_tokens=3, warmup_iterations=1, warmup_tokens=6, measure_iterations=1,
                        measure_tokens=6, same_prompt=same_prompt)
    stats = run_workload(ex, plan, workload, batch, spec.max_context, check=True)
    c, host = ex.counters, ex.host
    assert c.host_experts == ex.residency.host_computed and c.host_experts <= c.host_passes <= c.host_pairs
    assert c.bytes_moved == (c.expert_misses - c.host_experts) * spec.expert_bytes()
    assert host.pcie.busy_at() == pytest.approx(model.transfer(c.expert_misses - c.host_experts), rel=1e-9, abs=1e-15)
    lane = host.cpu.uses * params.host_call_s + c.host_passes * spec.expert_bytes() / (rate * 1e9)
    assert host.cpu.busy_at() == pytest.approx(lane, rel=1e-9, abs=1e-15)
    assert (c.host_experts > 0) == (host.cpu.uses > 0)
    if not permille:
        assert c.host_experts == 0 and host.cpu.busy_at() == 0.0
    for resource in (host.gpu, host.pcie, host.cpu):
        assert 0 <= resource.busy_at() <= host.now() + 1e-12 and resource.min_wait >= 0
    assert 0 <= stats.cpu_utilisation <= 1 + 1e-9 and stats.host_experts <= stats.misses


# ---- host mode off changes nothing --------------------------------------------------------------------------------

def point(params: CostParams, batch: int = 1):
    deployment = V3.deployment_params().replace(gpu_budget_bytes=cap_bytes(24), pool_bytes=None)
    routing = UniformRouting(SPEC.num_layers, SPEC.num_experts, SPEC.top_k, seed=V3.seed)
    return predict_point(SPEC, "qwen3.6-35b-a3b-fp8", H100, deployment, params, routing, 8192, batch, SMALL,
                         check=True)


def test_host_mode_off_predicts_what_the_model_without_the_fields_predicts():
    base = point(V3.cost_params()).to_json()
    assert "host_lane" not in base
    # a rate or a round trip without a share is no host lane: the same point, figure for figure
    for params in (cost(host_expert_gb_s=40.0), cost(host_expert_gb_s=40.0, host_call_s=1e-3)):
        assert point(params).to_json() == base
    model, off = CostModel(SPEC, H100, V3.cost_params()), CostModel(SPEC, H100, cost(host_expert_gb_s=40.0))
    for rows, misses in ((1, 0.0), (1, 146.0), (4, 565.75), (16, 2438.57)):
        distinct = min(256.0, 8 * rows + misses / 40)
        assert decode_step(off, rows, 144, distinct, misses) == decode_step(model, rows, 144, distinct, misses)


# ---- what the lane buys, and when it does not pay -----------------------------------------------------------------

def test_a_partial_pool_copies_less_and_steps_faster_with_a_host_as_fast_as_the_link():
    off = point(V3.cost_params())
    balanced = point(cost(host_expert_gb_s=40.0, host_permille=balanced_host_permille(40.0, LINK_GB_S)))
    lane = balanced.extra["host_lane"]
    assert 0 < off.residency < 1 and off.misses_per_token > 100  # a partial pool: copy-bound at bs1
    assert lane["host_experts"] > 0 and 0.2 < lane["host_share_of_misses"] < 0.45
    assert lane["copied_bytes_per_token"] < 0.85 * off.misses_per_token * SPEC.expert_bytes()
    assert 0 < lane["cpu_utilisation"] <= 1 and balanced.pcie_utilisation < off.pcie_utilisation
    assert balanced.steady_decode_tok_s_per_request > 1.15 * off.steady_decode_tok_s_per_request


def test_a_slow_host_with_a_big_share_does_not_pay():
    off = point(V3.cost_params())
    slow = point(cost(host_expert_gb_s=2.0, host_permille=600))
    assert slow.extra["host_lane"]["host_experts"] > 0
    assert slow.steady_decode_tok_s_per_request < 0.8 * off.steady_decode_tok_s_per_request
    # the balanced share of a slow host is small, and costs little either way
    small = point(cost(host_expert_gb_s=2.0, host_permille=balanced_host_permille(2.0, LINK_GB_S)))
    assert small.steady_decode_tok_s_per_request > slow.steady_decode_tok_s_per_request


def test_the_step_model_says_the_same_on_session_35s_24_gib_step():
    """decode_step at the measured 146 misses a bs1 step (bench_decode, 24 GiB on the H100)."""
    def step_s(**host) -> float:
        return decode_step(CostModel(SPEC, H100, cost(**host)), 1, 144, 7.999, 146.0).total_s

    off = step_s()
    assert step_s(host_expert_gb_s=40.0, host_permille=balanced_host_permille(40.0, LINK_GB_S)) < 0.9 * off
    assert step_s(host_expert_gb_s=2.0, host_permille=600) > 1.2 * off
    rates = [step_s(host_expert_gb_s=r, host_permille=balanced_host_permille(r, LINK_GB_S)) for r in (10, 20, 40)]
    assert rates == sorted(rates, reverse=True)  # a faster host never predicts a slower step at its balanced share
    # 3.65 misses a layer: 10 GB/s's balanced 155 per mille sends round(3 x 0.155) = 0 but round(4 x 0.155) = 1 to the
    # host, whose ~3.1 MB take ~330 us there against ~200 us to copy all four: the lumps make a slow host's share cost
    assert rates[0] > off


# ---- predict's flags ------------------------------------------------------------------------------------------------

P = ["predict", "--hardware", "h100", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "8k", "--gpu-budget-gib", "24",
     "--routing", "uniform", "--calibration", "h100_records_v3", "--workers", "1"]


def test_predict_names_the_host_lane_and_takes_the_balanced_share_by_default(capsys):
    assert main([*P, "--host-experts-gb-s", "40", "--json"]) == 0
    (got,) = json.loads(capsys.readouterr().out)
    lane = got["host_lane"]
    assert lane["mode"] == "host experts (ADR 0030)" and lane["host_expert_gb_s"] == 40.0
    assert lane["host_permille"] == balanced_host_permille(40.0, LINK_GB_S) == 423 and lane["host_experts"] > 0
    assert lane["host_max_rows"] == HOST_LANE_MAX_ROWS  # ft serve's default, unless --host-lane-rows says otherwise
    assert main([*P, "--host-experts-gb-s", "40", "--host-lane-rows", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["host_lane"]["host_max_rows"] == 0
    assert main([*P, "--host-experts-gb-s", "40", "--host-permille", "200"]) == 0
    assert "host lane (ADR 0030): up to 20 % of each lookup's misses on the host at 40 GB/s" in capsys.readouterr().out


def test_predict_takes_the_host_requests_fixed_cost_and_row_factor(capsys):
    """--host-call-us and --host-row-factor reach the cost model: a bs4 batch of one prompt (4 rows on each host key)
    is slower with a row factor, and the record names both."""
    lane = [*P, "--batch", "4", "--host-experts-gb-s", "64.1", "--host-permille", "465", "--json"]
    assert main(lane) == 0
    (plain,) = json.loads(capsys.readouterr().out)
    assert main([*lane, "--host-call-us", "66.4", "--host-row-factor", "0.191"]) == 0
    (priced,) = json.loads(capsys.readouterr().out)
    assert plain["host_lane"]["host_row_factor"] == 0.0 and plain["host_lane"]["host_call_s"] == 20e-6
    assert priced["host_lane"]["host_row_factor"] == 0.191
    assert priced["host_lane"]["host_call_s"] == pytest.approx(66.4e-6)
    assert priced["decode_tok_s"] < 0.95 * plain["decode_tok_s"]


@pytest.mark.parametrize("argv, message", [
    (["--host-row-factor", "0.2"], "give --host-experts-gb-s too"),
    (["--host-lane-rows", "6"], "give --host-experts-gb-s too"),
    (["--host-call-us", "-1"], "finite number >= 0"),
    (["--host-permille", "100"], "needs host_expert_gb_s > 0"),
    (["--host-permille", "auto"], "--host-permille auto needs --host-experts-gb-s"),
    (["--host-experts-gb-s", "40", "--host-permille", "1001"], "integer in 0..1000"),
    (["--host-experts-gb-s", "-3"], "finite rate >= 0"),
])
def test_bad_host_flags_are_clear_errors(capsys, argv, message):
    try:
        rc = main([*P, *argv])
    except SystemExit as err:  # argparse's own refusal
        rc = err.code
    assert rc == 2 and message in capsys.readouterr().err
