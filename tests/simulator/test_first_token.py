"""Before the first token: the streamed prefill (ADR 0010), the prefix cache in the simulated scheduler and the
per-request HTTP overhead (docs/simulator.md, "Before the first token")."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.budget import GpuBudget, PoolRequest, plan_pools
from domain.kv_pages import PageAllocator
from domain.request import Request, SamplingParams
from domain.routing_streams import stream_key
from domain.scheduler import Scheduler, SchedulerConfig
from domain.streamed_prefill import plan_rounds, staging_buffers
from simulator import fit_ttft
from simulator.cost_model import CostModel, CostParams
from simulator.hardware import HardwareProfile, get_profile
from simulator.host import SimHost
from simulator.predict import Deployment, Workload, predict_point, run_workload
from simulator.routing import LocalityRouting, UniformRouting
from simulator.sim_executor import SimExecutor
from simulator.sweep import Calibration
from tests.simulator.same_profile import assert_same_profile

from .conftest import tiny_spec

SPEC = tiny_spec()  # 4 layers, 16 experts, top-2
LINK = 1e9  # bytes/s
# compute is ~free on this machine: copies are all a streamed step costs
FAST_GPU = HardwareProfile("fast-gpu", 1 << 40, LINK, 1e18, 1e21)
STREAMED = dict(streamed_prefill=True, lookup_max_keys=8, graph_buckets=(1, 2, 4), memory_efficiency=1.0,
                compute_efficiency=1.0)
REPO = Path(__file__).resolve().parents[2]


def executor(slots=12, staging=4, hardware=FAST_GPU, **params) -> SimExecutor:
    cost = CostParams(**{**STREAMED, **params})
    return SimExecutor(SimHost(), CostModel(SPEC, hardware, cost), UniformRouting(4, 16, 2, seed=3), slots,
                       via_server=False, staging_experts=staging)


def prefill(ex: SimExecutor, tokens: int, rid: str = "r", seed: int = 0):
    """One prompt of `tokens` tokens prefilled in one step; (seconds, the step's work)."""
    scheduler = Scheduler(SchedulerConfig(max_running=4, max_step_tokens=4096, max_context=4096),
                          PageAllocator(512), 4)
    prompt = [(seed * 7919 + i * 31 + 11) % 900 for i in range(tokens)]
    scheduler.add(Request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    batch = scheduler.schedule()
    t0 = ex.host.now()
    scheduler.complete(batch, ex.execute(batch))
    return ex.host.now() - t0, batch.works[0]


def warm(ex: SimExecutor, keys) -> None:
    ex.residency.lookup(keys)
    ex.residency.release()


# ---- streamed prefill ---------------------------------------------------------------------------------------

def test_a_speculating_streamed_prefill_takes_the_bytes_of_every_non_resident_expert_over_the_link():
    ex = executor()
    warm(ex, [(layer, e) for layer in range(2) for e in range(5)])  # 10 of 64 experts resident
    before = (ex.residency.lru_order(), ex.residency.hits, ex.residency.misses)
    # 64 tokens x top-2 = 128 pairs = 8 per expert: every round is copied before its router (speculation)
    seconds, _ = prefill(ex, 64)
    staged = SPEC.total_experts - 10
    assert ex.counters.streamed_steps == 1 and ex.counters.streamed_staged == staged
    assert seconds == pytest.approx(staged * SPEC.expert_bytes() / LINK, rel=1e-6)
    # the LRU is neither stamped nor filled, and the hit/miss counters do not move (as on the engine)
    assert (ex.residency.lru_order(), ex.residency.hits, ex.residency.misses) == before
    assert (ex.counters.expert_hits, ex.counters.expert_misses, ex.counters.bytes_moved) == (0, 0, 0)
    ex.residency.check_valid()
    ex.host.check_valid()


def test_a_masked_streamed_prefill_copies_each_layers_first_round_whole_and_then_only_what_it_routes():
    ex = executor(staging=6)  # halves of 3 rows
    seconds, work = prefill(ex, 8)  # 16 pairs > min(12 slots, 8 keys): streamed; < 8 per expert: masked
    tokens = ex.routing.stream(stream_key(work)).tokens(0, 8)
    missing = [list(range(SPEC.num_experts))] * SPEC.num_layers  # cold: nothing resident
    expected = 0
    for rnd in plan_rounds(missing, 6):
        routed = {e for token in tokens for e in token[rnd.layer]}
        expected += len(rnd.experts) if rnd.first else len(routed & set(rnd.experts))
    assert staging_buffers(6) == (2, 3) and ex.counters.streamed_staged == expected
    routed_all = sum(len({e for t in tokens for e in t[layer]}) for layer in range(SPEC.num_layers))
    assert ex.counters.streamed_not_resident == routed_all < expected  # the first rounds copy unrouted experts
    assert seconds == pytest.approx(expected * SPEC.expert_bytes() / LINK, rel=1e-6)


def test_copies_overlap_compute_but_never_beat_either_alone():
    slow = HardwareProfile("slow-gpu", 1 << 40, LINK, 2e9, 1e12)  # compute of the order of the copies
    for tokens in (8, 64):
        ex = executor(hardware=slow, step_overhead_s=1e-4)
        seconds, _ = prefill(ex, tokens)
        copy, compute = ex.host.pcie.busy_at(), ex.host.gpu.busy_at()
        assert copy == pytest.approx(ex.counters.streamed_staged * SPEC.expert_bytes() / LINK)
        assert max(copy, compute) <= seconds + 1e-12 and seconds < copy + compute  # overlapped, not serial


def test_only_eager_steps_with_staging_rows_and_more_keys_than_one_lookup_stream():
    model = CostModel(SPEC, FAST_GPU, CostParams(**STREAMED))
    assert not model.streams_prefill(8, 12, 4) and model.streams_prefill(9, 12, 4)  # min(12 slots, 8 keys)
    assert not model.streams_prefill(6, 6, 4) and model.streams_prefill(7, 6, 4)  # a pool smaller than the keys
    assert not model.streams_prefill(100, 12, 0)  # no staging rows: through the residency
    assert not CostModel(SPEC, FAST_GPU, CostParams()).streams_prefill(100, 12, 4)  # off (older files)
    assert model.graph_step(4, True) and not model.graph_step(5, True) and not model.graph_step(1, False)
    # a short prompt (8 pairs) goes through the LRU: misses counted, nothing streamed
    ex = executor()
    prefill(ex, 4)
    assert ex.counters.streamed_steps == 0 and ex.counters.expert_misses > 0
    ex = executor(staging=0)
    prefill(ex, 64)
    assert ex.counters.streamed_steps == 0 and ex.counters.expert_misses > 0


@pytest.mark.parametrize("field,value", [("streamed_prefill", 1), ("lookup_max_keys", 0),
                                         ("lookup_max_keys", True), ("request_overhead_s", -1e-3)])
def test_bad_new_cost_fields_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        CostParams.from_dict({field: value})


def test_staging_rows_must_be_a_count():
    with pytest.raises(ValueError, match="staging_experts"):
        executor(staging=-1)


# ---- the workload: request overhead and the prefix cache ----------------------------------------------------

def _plan(slots=12, staging=4, snapshots=8):
    return plan_pools(SPEC, GpuBudget(total_bytes=1 << 34, memory_ratio=1.0),
                      PoolRequest(kv_tokens=512, expert_slots=slots, state_slots=4, staging_experts=staging,
                                  snapshot_slots=snapshots))


WORKLOAD = Workload(prompt_tokens=18, warmup_iterations=1, warmup_tokens=8, measure_iterations=2, measure_tokens=16)


def _run(overhead=0.0, prefix_cache=False, batch=3):
    plan = _plan()
    cost = CostParams(**{**STREAMED, "step_overhead_s": 1e-3, "transfer_latency_s": 1e-5,
                         "request_overhead_s": overhead})
    ex = SimExecutor(SimHost(), CostModel(SPEC, get_profile("rtx4060-laptop"), cost),
                     LocalityRouting(4, 16, 2, seed=1), plan.expert_slots, staging_experts=plan.staging_experts)
    return run_workload(ex, plan, WORKLOAD, batch, SPEC.max_context, check=True, prefix_cache=prefix_cache)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_the_request_overhead_shifts_every_time_to_first_token_by_exactly_its_value(prefix_cache):
    base, late = _run(0.0, prefix_cache), _run(0.0375, prefix_cache)
    assert [b - a for a, b in zip(base.ttfts, late.ttfts, strict=True)] == pytest.approx([0.0375] * len(base.ttfts),
                                                                                          abs=1e-12)
    assert late.seconds - base.seconds == pytest.approx(0.0375 * WORKLOAD.measure_iterations, abs=1e-12)
    assert (late.misses, late.steps, late.gpu_utilisation < base.gpu_utilisation) == (base.misses, base.steps, True)


def test_the_request_overhead_is_paid_only_over_http():
    cost = CostModel(SPEC, FAST_GPU, CostParams(request_overhead_s=0.02))
    assert cost.request_overhead(True) == 0.02 and cost.request_overhead(False) == 0.0


def test_with_the_prefix_cache_a_repeated_prompt_prefills_only_past_its_last_whole_page():
    cold, cached = _run(), _run(prefix_cache=True)
    assert cold.cached_prompt_tokens == 0
    # 18-token prompt, 16-token pages: every measured request resumes at 16 and prefills 2 tokens
    assert cached.cached_prompt_tokens == 16 * 3 * WORKLOAD.measure_iterations
    assert max(cached.ttfts) < min(cold.ttfts) and cached.seconds < cold.seconds
    # each measured round's prefill step (3 rows x 2 tokens x top-2 = 12 keys > min(12 slots, 8)) still streams
    assert cached.streamed_steps == cold.streamed_steps == WORKLOAD.measure_iterations


def test_the_cache_needs_the_deployment_to_ask_for_it():
    point = dict(spec=SPEC, model_name="tiny", hardware=get_profile("rtx4060-laptop"),
                 cost=CostParams(**STREAMED), routing=LocalityRouting(4, 16, 2, seed=1), kv_tokens=256, batch=2,
                 workload=WORKLOAD)
    pool = 256 * SPEC.kv_bytes_per_token() + 12 * SPEC.linear_state_bytes_per_sequence() + 16 * SPEC.expert_bytes()
    base = Deployment(pool_bytes=pool, state_slots=2, snapshot_slots=4, max_prefill_length=None)
    off = predict_point(deployment=base, **point)
    on = predict_point(deployment=base.replace(simulate_prefix_cache=True), **point)
    assert off.expert_slots == on.expert_slots and "cached_prompt_tokens" not in off.extra["window"]
    assert on.extra["window"]["cached_prompt_tokens"] == 16 * 2 * 2 and on.ttft_s < off.ttft_s
    # cache_type none: there is no cache to run, whatever the field says
    none = base.replace(cache_type="none", snapshot_slots=None)
    a = predict_point(deployment=none, **point).to_json()
    b = predict_point(deployment=none.replace(simulate_prefix_cache=True), **point).to_json()
    assert a == b and "cached_prompt_tokens" not in a["window"]
    with pytest.raises(ValueError, match="simulate_prefix_cache"):
        Deployment.from_dict({"simulate_prefix_cache": "yes"})


scenario = st.fixed_dictionaries({
    "slots": st.integers(SPEC.top_k, SPEC.total_experts), "staging": st.integers(0, 8), "batch": st.integers(1, 4),
    "prompt": st.integers(1, 40), "tokens": st.integers(1, 10), "max_keys": st.integers(1, 64),
    "prefix_cache": st.booleans(), "same_prompt": st.booleans(), "seed": st.integers(0, 3),
})


@settings(max_examples=40, deadline=None)
@given(scenario)
def test_invariants_hold_with_the_prefix_cache_and_the_streamed_prefill(s):
    plan = _plan(slots=s["slots"], staging=s["staging"])
    cost = CostParams(streamed_prefill=True, lookup_max_keys=s["max_keys"], graph_buckets=(1, 2, 4),
                      step_overhead_s=1e-3, transfer_latency_s=1e-5, request_overhead_s=2e-3)
    ex = SimExecutor(SimHost(), CostModel(SPEC, get_profile("rtx4060-laptop"), cost),
                     UniformRouting(4, 16, 2, seed=s["seed"]), plan.expert_slots, staging_experts=plan.staging_experts)
    workload = Workload(prompt_tokens=s["prompt"], warmup_iterations=1, warmup_tokens=s["tokens"], measure_iterations=1,
                        measure_tokens=s["tokens"], same_prompt=s["same_prompt"])
    stats = run_workload(ex, plan, workload, s["batch"], SPEC.max_context, check=True, prefix_cache=s["prefix_cache"])
    assert stats.requests_finished == stats.requests_added == 2 * s["batch"]
    assert min(stats.ttfts) >= 2e-3
    c = ex.counters
    # the link is busy exactly for the misses' copies and the staged rows
    assert ex.host.pcie.busy_at() == pytest.approx(ex.cost.transfer(c.expert_misses)
                                                   + sum_staged_transfer(ex), abs=1e-9)
    if not plan.staging_experts:
        assert c.streamed_steps == 0
    ex.check_valid()


def sum_staged_transfer(ex: SimExecutor) -> float:
    # transfer_setup_s is 0 here, so rounds cost per row and their sum is the rows' cost
    return ex.cost.transfer(ex.counters.streamed_staged)


# ---- the fitted profile --------------------------------------------------------------------------------------

def test_prompt_length_must_be_what_every_record_counted():
    a = {"server_after": {"stats": {"prefix_cache": {"prompt_tokens": 36, "requests": 2}}}}
    b = {"server_after": {"stats": {"prefix_cache": {"prompt_tokens": 40, "requests": 2}}}}
    c = {"server_after": {"stats": {"prefix_cache": {"prompt_tokens": 37, "requests": 2}}}}
    assert fit_ttft.prompt_tokens([("a", a), ("a2", a)]) == 18
    with pytest.raises(ValueError, match="different prompt lengths"):
        fit_ttft.prompt_tokens([("a", a), ("b", b)])
    with pytest.raises(ValueError, match="whole prompt length"):
        fit_ttft.prompt_tokens([("c", c)])


def test_h200_records_v5_is_a_fresh_fit_of_session_17s_records_on_v4s_step_terms():
    committed = json.loads(fit_ttft.OUT.read_text())
    assert_same_profile(json.loads(json.dumps(fit_ttft.build())), committed)
    v4, v5 = Calibration.resolve("h200_records_v4"), Calibration.resolve("h200_records_v5")
    step_terms = {k: v for k, v in v4.cost.items() if k not in ("streamed_prefill", "lookup_max_keys",
                                                                "request_overhead_s")}
    assert {k: v5.cost[k] for k in step_terms} == step_terms  # the step model is v4's, untouched
    assert v5.workload["prompt_tokens"] == 18 and v5.deployment_params().simulate_prefix_cache
    fit = v5.validation["ttft_fit"]
    # the fitted records are session 17's, never session 20's held-out ones
    assert all("2026-12-04-sbs" not in r for r in v5.provenance["ttft_fit"]["records"])
    assert 0.005 < fit["request_overhead_s"] < 0.05
    residuals = sorted(p["measured_ttft_s"] - p["simulated_ttft_s_without_overhead"] for p in fit["points"])
    assert fit["request_overhead_s"] == pytest.approx(residuals[len(residuals) // 2])
