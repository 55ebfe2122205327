"""The expert-parallel simulation: one GPU is exactly the single-GPU prediction, every rank's LRU holds only
its own keys, the exchange costs what its model says, host memory can cap the links, and the issue's
targets as predicted at 24 GiB per H200."""

import json

import pytest

from domain.model_spec import qwen36_35b_a3b
from simulator.__main__ import main
from simulator.cost_model import CostParams
from simulator.expert_parallel import ExchangeParams, large_synthetic, predict_expert_parallel
from simulator.hardware import GB, GIB, get_profile
from simulator.predict import Deployment, Workload, predict_point
from simulator.routing import UniformRouting, make_routing
from simulator.sweep import Calibration
from tests.simulator.conftest import tiny_spec

FAST = Workload(warmup_iterations=1, warmup_tokens=16, measure_iterations=1, measure_tokens=32)


def tiny_point(spec, ranks, slots, exchange=None, hardware="rtx3090", **kw):
    routing = UniformRouting(spec.num_layers, spec.num_experts, spec.top_k, seed=3)
    return predict_expert_parallel(spec, "tiny", get_profile(hardware), Deployment(pool_bytes=1 << 30, expert_slots=slots),
                                   CostParams(step_overhead_s=1e-4), routing, ranks, exchange, 256, 1, FAST, **kw)


def test_one_rank_is_the_single_gpu_prediction():
    spec = tiny_spec()
    routing = UniformRouting(spec.num_layers, spec.num_experts, spec.top_k, seed=3)
    dep = Deployment(pool_bytes=1 << 30, expert_slots=6)
    one = predict_point(spec, "tiny", get_profile("rtx3090"), dep, CostParams(step_overhead_s=1e-4), routing, 256, 1,
                        FAST)
    ep = tiny_point(spec, 1, 6)
    assert ep.decode_tok_s == pytest.approx(one.decode_tok_s, rel=1e-9)
    assert (ep.hit_rate, ep.expert_slots) == (one.hit_rate, one.expert_slots)


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_holds_only_its_keys_and_more_ranks_hold_more(ranks):
    spec = tiny_spec(layers=4, experts=12, top_k=3)
    one = tiny_point(spec, 1, 6, check=True)
    # check=True: the executor's check_valid (keys owned, counters) after every step
    many = tiny_point(spec, ranks, 6, ExchangeParams(latency_s=0.0), check=True)
    assert many.extra["expert_slots_per_rank"] == [6] * ranks
    assert many.hit_rate > one.hit_rate
    assert many.decode_tok_s > one.decode_tok_s  # tiny experts: a 20 us exchange would cost more than they save


def test_the_exchange_costs_latency_per_moe_layer_and_bytes_over_the_link():
    spec = qwen36_35b_a3b()
    ex = ExchangeParams(latency_s=10e-6, link_bytes_per_s=100 * GB)
    assert ex.seconds(spec, 1, 1) == 0.0
    partials = 1 * (8 + 1) * 2048 * 4  # [T, K+1, H] fp32
    assert ex.seconds(spec, 1, 2) == pytest.approx(10e-6 + partials / 100e9)
    assert ex.seconds(spec, 1, 4) == pytest.approx(10e-6 + 1.5 * partials / 100e9)
    assert ex.replace(rows_per_token="sum").seconds(spec, 4, 2) == pytest.approx(10e-6 + 4 * 2048 * 4 / 100e9)
    with pytest.raises(ValueError, match="rows_per_token"):
        ExchangeParams(rows_per_token="max").check_valid()
    with pytest.raises(ValueError, match="unknown field"):
        ExchangeParams.from_dict({"latency": 1})


def test_with_every_expert_resident_the_exchange_latency_adds_exactly_once_per_layer_and_token():
    spec = tiny_spec(layers=4, experts=8, top_k=2)
    slow = tiny_point(spec, 2, 16, ExchangeParams(latency_s=1e-3))
    fast = tiny_point(spec, 2, 16, ExchangeParams(latency_s=0.0))
    assert slow.hit_rate == fast.hit_rate == 1.0  # warm-up filled every slot: no copies in the window
    per_token = 1 / slow.decode_tok_s - 1 / fast.decode_tok_s
    assert per_token == pytest.approx(spec.num_layers * 1e-3, rel=1e-6)


def test_host_memory_caps_the_links_together():
    spec = tiny_spec(layers=4, experts=16, top_k=4)
    free = tiny_point(spec, 4, 4, ExchangeParams(latency_s=0.0))
    capped = tiny_point(spec, 4, 4, ExchangeParams(latency_s=0.0, host_bytes_per_s=10 * GB))
    assert free.misses_per_token > 0 and capped.misses_per_token == free.misses_per_token
    assert capped.decode_tok_s < free.decode_tok_s


def test_a_rank_that_does_not_fit_is_refused_by_rank():
    spec = tiny_spec()
    r = tiny_point(spec, 2, 9)  # 4 layers x 16 experts / 2 = 32 keys each: fine
    assert r.fits
    r = predict_expert_parallel(spec, "tiny", get_profile("rtx3090"), Deployment(pool_bytes=1000),
                                CostParams(), UniformRouting(4, 16, 2), 2, workload=FAST)
    assert not r.fits and r.reason.startswith("rank 0:")


H200_24 = get_profile("h200").replace(vram_bytes=24 * GIB)


def h200_speedups(spec, ranks, routing_kind="uniform"):
    cal = Calibration.resolve("h200_v1")
    routing = make_routing(routing_kind, spec.num_layers, spec.num_experts, spec.top_k, cal.seed, cal.locality_params())
    rates = [predict_expert_parallel(spec, spec.name, H200_24, cal.deployment_params(), cal.cost_params(), routing, n,
                                     workload=FAST).decode_tok_s for n in (1, *ranks)]
    return [r / rates[0] for r in rates[1:]]


def test_qwen36_at_24_gib_per_h200_two_ranks_meet_the_issue_target():
    # two ranks hold every expert: the 1.6x target is met with room (the exchange is ~15 % of the step)
    (two,) = h200_speedups(qwen36_35b_a3b(), (2,))
    assert two >= 1.6


def test_a_model_too_large_for_one_gpu_scales_with_links_and_cache():
    spec = large_synthetic()
    assert spec.total_experts * spec.expert_bytes() > 141 * GB  # not even a whole H200 holds its experts
    two, four = h200_speedups(spec, (2, 4))
    assert 1.4 < two < four  # measured speed-ups from the short FAST workload; the ADR lists the long runs


def test_cli_prints_speedups_as_json(capsys):
    rc = main(["expert-parallel", "--ranks", "1,2", "--model", "qwen3.6-35b-a3b-fp8", "--json",
               "--exchange-latency-us", "30"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["ranks"] for r in rows] == [1, 2] and rows[0]["speedup"] == 1.0 and rows[1]["speedup"] > 1.6
    assert rows[1]["expert_slots_per_rank"] == [5120, 5120]


def test_the_large_synthetic_geometry_is_what_ft_synth_writes():
    import dataclasses

    from adapters.checkpoint.synth_config import GEOMETRIES, config_json
    from domain.model_spec import ModelSpec

    written = ModelSpec.from_hf_config(config_json(GEOMETRIES["synthetic-moe-155b"], "fp8_block", "nested"))
    ours = large_synthetic()
    assert dataclasses.replace(written, name=ours.name, max_context=ours.max_context) == ours
