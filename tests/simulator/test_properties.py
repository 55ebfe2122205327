"""Simulator invariants under random machines, pools, batches and workloads (Hypothesis)."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from domain.budget import PoolRequest, plan_pools
from domain.ports import ModelExecutor
from simulator.cost_model import CostModel, CostParams
from simulator.hardware import get_profile
from simulator.host import SimHost
from simulator.predict import Deployment, Workload, predict_point, run_workload
from simulator.routing import LocalityRouting, UniformRouting
from simulator.sim_executor import SimExecutor

from .conftest import tiny_spec

SPEC = tiny_spec()
HW = get_profile("rtx4060-laptop")

scenario = st.fixed_dictionaries({
    "slots": st.integers(SPEC.top_k, SPEC.total_experts),
    "kv_tokens": st.sampled_from([64, 256, 2048]),
    "batch": st.integers(1, 4),
    "same_prompt": st.booleans(),
    "overlap": st.booleans(),
    "uniform": st.booleans(),
    "seed": st.integers(0, 3),
    "prompt": st.integers(1, 40),
    "tokens": st.integers(1, 12),
    "step_tokens": st.sampled_from([4, 16, 2048]),
})


def _setup(s):
    cost = CostParams(step_overhead_s=1e-3, sequence_overhead_s=2e-4, transfer_latency_s=1e-5,
                      overlap_copy_compute=s["overlap"])
    routing_cls = UniformRouting if s["uniform"] else LocalityRouting
    routing = routing_cls(SPEC.num_layers, SPEC.num_experts, SPEC.top_k, seed=s["seed"])
    plan = plan_pools(SPEC, _pool(s), PoolRequest(kv_tokens=s["kv_tokens"], expert_slots=s["slots"], state_slots=4))
    workload = Workload(prompt_tokens=s["prompt"], warmup_iterations=1, warmup_tokens=s["tokens"],
                        measure_iterations=1, measure_tokens=s["tokens"], same_prompt=s["same_prompt"],
                        max_step_tokens=max(s["step_tokens"], s["batch"]))
    executor = SimExecutor(SimHost(), CostModel(SPEC, HW, cost), routing, plan.expert_slots)
    return executor, plan, workload


def _pool(s):
    from domain.budget import GpuBudget

    return GpuBudget(total_bytes=1 << 34, memory_ratio=1.0)


@settings(max_examples=60)
@given(scenario)
def test_invariants_hold_for_every_run(s):
    executor, plan, workload = _setup(s)
    stats = run_workload(executor, plan, workload, s["batch"], SPEC.max_context, check=True)
    # every request finishes
    assert stats.requests_finished == stats.requests_added == 2 * s["batch"]
    assert stats.output_tokens == s["batch"] * s["tokens"]
    # utilisations are shares of time
    assert 0.0 <= stats.gpu_utilisation <= 1.0 + 1e-9
    assert 0.0 <= stats.pcie_utilisation <= 1.0 + 1e-9
    # no negative waits anywhere
    for resource in (executor.host.gpu, executor.host.pcie):
        assert resource.min_wait >= 0 and resource.total_wait >= 0
    # bytes moved are exactly misses x expert bytes (window and total)
    assert stats.bytes_moved == stats.misses * SPEC.expert_bytes()
    c = executor.counters
    assert c.bytes_moved == c.expert_misses * SPEC.expert_bytes()
    assert (c.expert_hits, c.expert_misses) == (executor.residency.hits, executor.residency.misses)
    # the copy engine is busy exactly for the modelled transfers
    assert abs(executor.host.pcie.busy_at() - executor.cost.transfer(c.expert_misses)) < 1e-9
    executor.check_valid()


@settings(max_examples=15)
@given(scenario)
def test_identical_seeds_give_identical_results(s):
    runs = []
    for _ in range(2):
        executor, plan, workload = _setup(s)
        stats = run_workload(executor, plan, workload, s["batch"], SPEC.max_context)
        runs.append((dataclasses.asdict(stats), executor.host.now(), executor.residency.lru_order()))
    assert runs[0] == runs[1]


def test_sim_executor_is_a_model_executor(spec):
    executor = SimExecutor(SimHost(), CostModel(spec, HW, CostParams()), UniformRouting(4, 16, 2), 8)
    assert isinstance(executor, ModelExecutor)


def test_a_cache_of_every_expert_hits_more_than_a_top_k_cache():
    # A sanity check that the planned slots reach the residency policy: only cold misses remain
    # when every expert fits (the measured window can still see an expert for the first time).
    hit_rates = []
    for slots in (SPEC.top_k, SPEC.total_experts):
        deployment = Deployment(pool_bytes=_pool_for(slots), state_slots=4, expert_slots=slots)
        r = predict_point(SPEC, "tiny", HW, deployment, CostParams(), LocalityRouting(4, 16, 2, seed=1), 256, 2,
                          Workload(prompt_tokens=8, warmup_iterations=1, warmup_tokens=16, measure_iterations=1,
                                   measure_tokens=32))
        assert r.fits and r.expert_slots == slots
        hit_rates.append(r.hit_rate)
    assert hit_rates[0] < 0.9 < hit_rates[1]


def _pool_for(slots):
    return 256 * SPEC.kv_bytes_per_token() + 4 * SPEC.linear_state_bytes_per_sequence() + slots * SPEC.expert_bytes()


def test_sweep_results_do_not_depend_on_the_number_of_workers():
    from simulator.routing import LocalityParams
    from simulator.sweep import SweepConfig, run_sweep

    cfg = SweepConfig("tiny", SPEC, HW, Deployment(pool_bytes=_pool_for(12), state_slots=4), CostParams(),
                      "locality", LocalityParams(), Workload(prompt_tokens=6, warmup_iterations=1, warmup_tokens=8,
                                                             measure_iterations=1, measure_tokens=16), 0, "test")
    serial = [r.to_json() for r in run_sweep(cfg, [128, 256], [1, 3], workers=1)]
    parallel = [r.to_json() for r in run_sweep(cfg, [128, 256], [1, 3], workers=2)]
    assert serial == parallel
    assert len({(p["kv_tokens"], p["batch"]) for p in serial}) == 4


def test_resize_pools_rebuilds_the_expert_pool_cold():
    executor, plan, workload = _setup({"slots": 6, "kv_tokens": 256, "batch": 2, "same_prompt": True,
                                       "overlap": True, "uniform": False, "seed": 0, "prompt": 8, "tokens": 4,
                                       "step_tokens": 2048})
    run_workload(executor, plan, workload, 2, SPEC.max_context)
    assert executor.residency.num_resident == 6
    bigger = plan_pools(SPEC, _pool({}), PoolRequest(kv_tokens=256, expert_slots=12, state_slots=4))
    executor.resize_pools(bigger)
    assert executor.residency.num_slots == 12 and executor.residency.num_resident == 0
    stats = run_workload(executor, bigger, workload, 2, SPEC.max_context, check=True)
    assert stats.requests_finished == stats.requests_added
