"""The step terms: per-layer fetch/compute overlap, graph bucket padding, host overhead outside the graph."""

import pytest

from domain.model_spec import qwen36_35b_a3b
from simulator.cost_model import CostModel, CostParams, decode_step
from simulator.hardware import get_profile
from simulator.predict import Deployment, Workload, predict_point
from simulator.routing import LocalityRouting

SPEC = qwen36_35b_a3b()
H200 = get_profile("h200")
BUCKETS = (1, 2, 4, 8, 16)
K = SPEC.top_k


def model(**params) -> CostModel:
    return CostModel(SPEC, H200, CostParams(**params))


def step(m: CostModel, rows: int, misses: float = 0.0, distinct: float | None = None, **kw):
    return decode_step(m, rows, 100, K * rows if distinct is None else distinct, misses, **kw)


# ---- graph bucket padding -----------------------------------------------------------------------

def test_padded_rows_pick_the_smallest_bucket_and_leave_uncaptured_sizes_alone():
    m = model(graph_buckets=BUCKETS)
    assert [m.padded_rows(b) for b in (1, 2, 3, 4, 5, 6, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 8, 16, 16, 17]
    assert [model().padded_rows(b) for b in (1, 3, 6)] == [1, 3, 6]  # no buckets: no padding
    with pytest.raises(ValueError, match="at least one row"):
        m.padded_rows(0)


@pytest.mark.parametrize("buckets", [(4, 2), (0, 1), (1, 1), (True,), (1.5,)])
def test_bad_buckets_are_rejected(buckets):
    with pytest.raises(ValueError, match="graph_buckets"):
        CostParams.from_dict({"graph_buckets": list(buckets)})


def test_buckets_round_trip_through_json_lists():
    p = CostParams.from_dict({"graph_buckets": [1, 2, 4]})
    assert p.graph_buckets == (1, 2, 4) and CostParams.from_dict(p.to_dict()) == p


def test_padding_costs_the_padded_rows_compute_but_not_their_misses():
    plain, padded = model(), model(graph_buckets=BUCKETS)
    # bs3 with the same misses as bs4 (identical greedy rows): padded bs3 pays bs4's dense compute.
    bs3, bs3_pad, bs4 = (step(m, b, misses=400, distinct=K * 3) for m, b in ((plain, 3), (padded, 3), (padded, 4)))
    assert bs3_pad.padded_rows == 4 and bs3.padded_rows == 3
    assert bs3_pad.total_s > bs3.total_s  # padding costs time...
    assert bs3_pad.copy_s == bs3.copy_s  # ...but no copies
    # The padded row's dense work is a real row's, less its KV read (it attends over 1 position).
    assert bs3.dense_s < bs3_pad.dense_s <= bs4.dense_s
    assert bs3_pad.expert_s == bs3.expert_s  # padded rows skip the experts
    # A padded step never costs more than the real bucket-sized step with the same misses.
    assert bs3_pad.total_s <= step(padded, 4, misses=400, distinct=K * 3).total_s


# ---- host overhead outside the graph ------------------------------------------------------------

def test_host_overhead_is_per_step_and_per_real_row_and_keeps_the_link_idle():
    base, host = model(graph_buckets=BUCKETS), model(graph_buckets=BUCKETS, host_step_s=1e-4, host_row_s=5e-5,
                                                     server_step_s=1e-3)
    for rows in (1, 3, 4, 16):
        a, b = step(base, rows, misses=80), step(host, rows, misses=80)
        assert b.total_s - a.total_s == pytest.approx(1e-4 + 5e-5 * rows)  # execute(): no server term
        assert b.copy_s == a.copy_s and b.link_idle_s - a.link_idle_s == pytest.approx(b.host_s)
        served = step(host, rows, misses=80, via_server=True)
        assert served.total_s - b.total_s == pytest.approx(1e-3)
    # Per real row, not per padded row: bs3 pays less host work than bs4.
    assert host.host_overhead(3) < host.host_overhead(4)
    with pytest.raises(ValueError):
        CostParams(host_row_s=-1e-6).check_valid()


# ---- per-layer fetch/compute overlap --------------------------------------------------------------

def test_layer_expert_time_hides_copies_only_behind_resident_gemms():
    serial, overlap = model(), model(overlap_copy_compute=True)
    assert serial.layer_expert_time(3.0, 2.0, 1.0) == 6.0
    assert overlap.layer_expert_time(3.0, 2.0, 1.0) == 4.0  # max(copy, hit) + miss
    assert overlap.layer_expert_time(1.0, 2.0, 1.0) == 3.0
    with pytest.raises(ValueError, match="negative"):
        overlap.layer_expert_time(-1.0, 0.0, 0.0)


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
@pytest.mark.parametrize("misses", [0, 40, 400, 2000])
def test_a_step_is_bounded_by_the_per_step_max_below_and_the_serial_sum_above(rows, misses):
    distinct = min(SPEC.num_experts, K * rows + misses / SPEC.num_layers)
    over = step(model(overlap_copy_compute=True, graph_buckets=BUCKETS), rows, misses, distinct)
    serial = step(model(graph_buckets=BUCKETS), rows, misses, distinct)
    compute = over.fixed_s + over.dense_s + over.expert_s
    per_step_max = over.host_s + max(compute, over.copy_s)
    assert per_step_max - 1e-12 <= over.total_s <= serial.total_s + 1e-12
    # The link idles at least during every layer's attention/GDN, shared expert and router.
    assert over.link_idle_s >= over.dense_s - 1e-12
    if misses >= 400:
        # Copy-bound: the per-step max would hide all compute behind the copies; per layer it cannot.
        assert over.total_s > per_step_max


def test_more_misses_never_make_a_step_faster_and_few_tokens_leave_the_link_idle_longer_per_copy():
    m = model(overlap_copy_compute=True, graph_buckets=BUCKETS, transfer_setup_s=4e-5)
    times = [step(m, 4, misses, distinct=32 + misses / 40).total_s for misses in (0, 40, 200, 800, 1200)]
    assert times == sorted(times)
    # Share of the step the link copies: bigger batches (more compute per copy) keep it lower, but
    # even a bs1 step cannot keep the link busy the whole time.
    busy = [step(m, b, 400, distinct=K * b + 10).copy_s / step(m, b, 400, distinct=K * b + 10).total_s
            for b in (1, 4, 16)]
    assert busy[0] < 1.0 and busy == sorted(busy, reverse=True)


def test_decode_step_rejects_counts_out_of_range():
    m = model()
    with pytest.raises(ValueError):
        decode_step(m, 0, 10, 8)
    with pytest.raises(ValueError, match="distinct_per_layer"):
        decode_step(m, 1, 10, SPEC.num_experts + 1)
    with pytest.raises(ValueError, match="misses_per_step"):
        decode_step(m, 1, 10, 8, misses_per_step=8 * SPEC.num_layers + 1)
    with pytest.raises(ValueError, match="layers_with_misses"):
        decode_step(m, 1, 10, 8, misses_per_step=10, layers_with_misses=41)


# ---- the simulated executor applies the same terms ------------------------------------------------

def _point(cost: CostParams, batch: int, kv: int = 65536):
    routing = LocalityRouting(SPEC.num_layers, SPEC.num_experts, SPEC.top_k, 0)
    deployment = Deployment(pool_bytes=int(20 * 2**30), state_slots=16)
    workload = Workload(warmup_iterations=1, warmup_tokens=16, measure_iterations=1, measure_tokens=32)
    return predict_point(SPEC, "m", H200, deployment, cost, routing, kv, batch, workload, check=True)


def test_simulated_padding_slows_bs3_without_adding_lookups_unless_padding_fetches():
    base = CostParams(memory_efficiency=0.3, h2d_efficiency=0.93)
    plain, padded = _point(base, 3), _point(base.replace(graph_buckets=BUCKETS), 3)
    fetching = _point(base.replace(graph_buckets=BUCKETS, padding_fetches=True), 3)
    assert padded.decode_tok_s < plain.decode_tok_s
    assert padded.extra["window"]["misses"] == plain.extra["window"]["misses"]
    assert fetching.extra["window"]["misses"] > padded.extra["window"]["misses"]
    assert fetching.decode_tok_s < padded.decode_tok_s


def test_simulated_host_overhead_adds_idle_time_per_step():
    base = CostParams(memory_efficiency=0.3)
    a, b = _point(base, 4), _point(base.replace(host_step_s=2e-3), 4)
    steps = a.extra["window"]["steps"]
    assert b.extra["window"]["steps"] == steps
    assert b.extra["window"]["seconds"] - a.extra["window"]["seconds"] == pytest.approx(2e-3 * steps, rel=1e-6)
    assert b.gpu_utilisation < a.gpu_utilisation
