"""Layered prefill in the simulator (docs/adr/0024-layered-prefill.md; docs/simulator.md, "Layered prefill"): a
chunk run as layer groups computes and counts its tokens once, routes as the whole chunk, streams each
non-resident expert once per chunk (not once per short chunk), runs each step shorter, and its decode rows cost
their graph step; and the mixed prediction (`python -m simulator mixed`) shows the gap falling with it on."""

import json

import pytest

from app.bench import mixed as bench_mixed
from domain.expert_parallel import ExpertPartition, plan_expert_parallel
from domain.gap_stats import gap_figures, gaps_between, percentile
from domain.kv_pages import PageAllocator
from domain.ports import SequenceWork, StepBatch
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from domain.serve_plan import plan_serve_pools
from simulator import mixed as sim_mixed
from simulator.__main__ import main
from simulator.cost_model import CostModel, CostParams
from simulator.expert_parallel import ExchangeParams, ExpertParallelSimExecutor
from simulator.hardware import HardwareProfile, get_profile
from simulator.host import SimHost
from simulator.mixed import MixedConfig, MixedScenario, predict_mixed
from simulator.predict import Deployment
from simulator.routing import UniformRouting
from simulator.sim_executor import SimExecutor

from .conftest import tiny_spec

SPEC = tiny_spec()  # 4 layers, 16 experts, top-2
L = SPEC.num_layers
LINK = 1e9  # bytes/s
FAST_GPU = HardwareProfile("fast-gpu", 1 << 40, LINK, 1e18, 1e21)  # compute ~free: copies are what a step costs
STREAMED = dict(streamed_prefill=True, lookup_max_keys=8, graph_buckets=(1, 2, 4), memory_efficiency=1.0,
                compute_efficiency=1.0)
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
PROMPT = tuple((i * 31 + 11) % 900 for i in range(64))


def executor(slots=12, staging=4, hardware=FAST_GPU, **params) -> SimExecutor:
    cost = CostParams(**{**STREAMED, **params})
    return SimExecutor(SimHost(), CostModel(SPEC, hardware, cost), UniformRouting(L, 16, 2, seed=3), slots,
                       via_server=False, staging_experts=staging)


def warm(ex: SimExecutor, keys) -> None:
    """Makes `keys` resident (the executor's counters follow the residency's, as check_valid wants)."""
    lookup = ex.residency.lookup(keys)
    ex.residency.release()
    ex.counters.expert_hits += len(lookup.hits)
    ex.counters.expert_misses += len(lookup.fills)
    ex.counters.bytes_moved += len(lookup.fills) * ex.cost.expert_bytes


def chunk(start=0, tokens=64, layers=None, sample=True, rid="p", restore_from=None) -> SequenceWork:
    """A prefill chunk of PROMPT (positions start..start+tokens); a group samples only when it ends the chunk."""
    ends = layers is None or layers[1] == L
    return SequenceWork(rid, PROMPT[start:start + tokens], start, tuple(range(-(-(start + tokens) // 16))), 0,
                        sample and ends, GREEDY, 0, restore_from=restore_from, layers=layers)


def decode(k: int, position=40) -> SequenceWork:
    return SequenceWork(f"d{k}", (7 + k,), position, tuple(range(8 * k, 8 * k + 3)), 1 + k, True, GREEDY, 1)


def run(ex: SimExecutor, *works: SequenceWork) -> tuple[float, dict]:
    t0 = ex.host.now()
    sampled = ex.execute(StepBatch(works))
    ex.check_valid()
    return ex.host.now() - t0, sampled


GROUPS = [(0, 1), (1, 3), (3, 4)]
RESIDENT = [(layer, e) for layer in range(2) for e in range(5)]  # 10 of 64 experts resident


def test_a_chunks_groups_compute_its_tokens_once_route_as_it_and_stream_its_experts_once():
    whole, grouped = executor(), executor()
    warm(whole, RESIDENT)
    warm(grouped, RESIDENT)
    t_whole, s_whole = run(whole, chunk())
    runs = [run(grouped, chunk(layers=g)) for g in GROUPS]
    a, b = whole.counters, grouped.counters
    assert (a.prefill_tokens, b.prefill_tokens) == (64, 64)  # counted once, in the first group
    assert (a.steps, b.steps, a.layered_steps, b.layered_steps, b.layered_layers) == (1, 3, 0, 3, L)
    # the same routes (stream positions) and the same non-resident experts, each copied once over the chunk
    assert b.streamed_not_resident == a.streamed_not_resident > 0
    assert b.streamed_staged == a.streamed_staged == SPEC.total_experts - len(RESIDENT)
    assert (b.streamed_steps, b.expert_hits, b.expert_misses) == (3, 0, len(RESIDENT))  # the LRU is only read
    # each step is shorter; together they take what the chunk took (compute is free: the copies are all)
    times = [t for t, _ in runs]
    assert max(times) < t_whole
    assert sum(times) == pytest.approx(t_whole, rel=1e-9)
    copy = SPEC.expert_bytes() / LINK
    assert times == pytest.approx([11 * copy, (11 + 16) * copy, 16 * copy], rel=1e-9)  # each its layers' copies
    # only the group that ends the chunk samples, and it samples what the whole chunk does
    assert [s for _, s in runs[:-1]] == [{}, {}] and runs[-1][1] == s_whole


def test_short_chunks_stream_the_non_resident_experts_once_each_where_the_groups_stream_them_once():
    grouped, short = executor(), executor()
    warm(grouped, RESIDENT)
    warm(short, RESIDENT)
    for g in GROUPS:
        run(grouped, chunk(layers=g))
    t_short = sum(run(short, chunk(start, 16))[0] for start in range(0, 64, 16))
    assert short.counters.prefill_tokens == grouped.counters.prefill_tokens == 64
    assert short.counters.streamed_steps == 4
    assert short.counters.streamed_staged > 2 * grouped.counters.streamed_staged
    assert t_short > 2 * grouped.host.now()


def test_the_decode_rows_beside_a_group_cost_their_graph_step_and_the_overheads_come_once_per_step():
    # every expert resident: nothing copies, so time is compute and overheads, and each step adds up
    terms = dict(step_overhead_s=1e-3, host_step_s=2e-4, host_row_s=1e-5, memory_efficiency=0.7,
                 compute_efficiency=0.5)
    hw = get_profile("rtx4060-laptop")
    exs = [executor(slots=SPEC.total_experts, hardware=hw, **terms) for _ in range(2)]
    everything = [(layer, e) for layer in range(L) for e in range(16)]
    for ex in exs:
        warm(ex, everything)
    decodes = [decode(k) for k in range(3)]
    together, _ = run(exs[0], chunk(layers=(0, 2)), *decodes)
    alone_decodes, _ = run(exs[1], *decodes)  # a decode-only step: graph bucket 4
    alone_group, _ = run(exs[1], chunk(layers=(0, 2)))
    # the host overhead (per step and per row) and the fixed step overhead are paid once, not per part
    assert together == pytest.approx(alone_decodes + alone_group - 2e-4 - 1e-3, rel=1e-9)
    c = exs[0].counters
    assert (c.steps, c.layered_steps, c.decode_tokens, c.prefill_tokens) == (1, 1, 3, 64)
    assert c.expert_hits > 0 and c.expert_misses == SPEC.total_experts  # the decode rows look up, all hit


def test_lm_head_runs_only_where_the_chunk_ends_and_samples():
    hw = get_profile("rtx4060-laptop")
    ends, stops = executor(hardware=hw), executor(hardware=hw)
    for ex in (ends, stops):
        run(ex, chunk(layers=(0, 2)))
    t_sampled, sampled = run(ends, chunk(layers=(2, 4)))
    t_plain, none = run(stops, chunk(layers=(2, 4), sample=False))  # a chunk before the prompt's last
    assert set(sampled) == {"p"} and none == {}
    assert t_sampled - t_plain == pytest.approx(ends.cost.head(1), rel=1e-6)


def test_the_layers_contract_is_checked_before_the_step_runs():
    ex = executor()
    with pytest.raises(ValueError, match="continues no kept chunk"):
        ex.execute(StepBatch((chunk(layers=(1, 4)),)))
    with pytest.raises(ValueError, match="outside"):
        ex.execute(StepBatch((chunk(layers=(0, 5)),)))
    with pytest.raises(ValueError, match="outside"):
        ex.execute(StepBatch((chunk(layers=(2, 2)),)))
    with pytest.raises(ValueError, match="samples before"):
        ex.execute(StepBatch((SequenceWork("p", PROMPT, 0, (0, 1, 2, 3), 0, True, GREEDY, 0, layers=(0, 2)),)))
    with pytest.raises(ValueError, match="at most one"):
        ex.execute(StepBatch((chunk(layers=(0, 2)), chunk(layers=(0, 2), rid="q"))))
    assert ex.counters.steps == 0 and ex.host.now() == 0
    run(ex, chunk(layers=(0, 2)))
    with pytest.raises(ValueError, match="continues no kept chunk"):
        ex.execute(StepBatch((chunk(layers=(3, 4)),)))  # a gap in the layers
    with pytest.raises(ValueError, match="continues no kept chunk"):
        ex.execute(StepBatch((chunk(start=16, tokens=48, layers=(2, 4)),)))  # another chunk's tokens
    with pytest.raises(ValueError, match="restores"):
        ex.execute(StepBatch((chunk(layers=(2, 4), restore_from=3),)))
    run(ex, chunk(layers=(2, 4)))
    with pytest.raises(ValueError, match="continues no kept chunk"):
        ex.execute(StepBatch((chunk(layers=(2, 4)),)))  # the chunk is done: nothing is kept
    run(ex, chunk(layers=(0, 1)))  # a first group starts a chunk whatever was kept
    ex.resize_pools(type("Plan", (), {"expert_slots": 12})())
    with pytest.raises(ValueError, match="continues no kept chunk"):
        ex.execute(StepBatch((chunk(layers=(1, 4)),)))  # a resize drops the kept chunk


def test_expert_parallel_groups_compute_only_their_layers():
    from domain.budget import GpuBudget

    partition = ExpertPartition.modulo(L, 16, 2)
    dep = Deployment(pool_bytes=1 << 30, expert_slots=6, max_prefill_length=None)
    planned = plan_serve_pools(SPEC, GpuBudget(total_bytes=1 << 30, memory_ratio=1.0),
                               dep.pools(256, expert_parallel=True),
                               lambda s, b, r: plan_expert_parallel(s, b, r, partition))
    exs = [ExpertParallelSimExecutor(CostModel(SPEC, get_profile("rtx3090"), CostParams(step_overhead_s=1e-4)),
                                     UniformRouting(L, 16, 2, seed=3), planned.plan, ExchangeParams())
           for _ in range(2)]
    exs[0].execute(StepBatch((chunk(),)))
    for g in GROUPS:
        exs[1].execute(StepBatch((chunk(layers=g),)))
    a, b = exs[0], exs[1]
    for ex in exs:
        ex.check_valid()
    assert (b.counters.expert_hits, b.counters.expert_misses) == (a.counters.expert_hits, a.counters.expert_misses)
    assert b.exchange_seconds == pytest.approx(a.exchange_seconds, rel=1e-12)
    assert b.counters.prefill_tokens == a.counters.prefill_tokens == 64


def test_the_real_scheduler_drives_layered_chunks_through_the_simulated_executor():
    ex = executor(slots=24, staging=4, step_overhead_s=1e-4, transfer_latency_s=1e-6)
    config = SchedulerConfig(max_running=4, max_step_tokens=256, mixed_step_tokens=16, page_size=16,
                             max_context=4096, layered_prefill=True, num_layers=L)
    scheduler = Scheduler(config, PageAllocator(128), 4)
    prompts = {"a": 6, "b": 6, "long": 200}
    for rid, n in prompts.items():
        tokens = 40 if rid != "long" else 1
        scheduler.add(Request(rid, [(i * 7 + len(rid)) % 900 for i in range(n)],
                              SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)))
        if rid == "b":  # the streams decode before the long prompt arrives
            for _ in range(3):
                step = scheduler.schedule()
                scheduler.complete(step, ex.execute(step))
    layered = 0
    while (step := scheduler.schedule()) is not None:
        layered += step.layered is not None
        scheduler.complete(step, ex.execute(step))
        scheduler.check_valid()
        ex.check_valid()
    c = ex.counters
    assert layered == c.layered_steps > 0
    assert c.prefill_tokens == sum(prompts.values())
    assert c.decode_tokens == 2 * 39


# ---- the mixed prediction ------------------------------------------------------------------------------------

def test_the_gap_definitions_are_the_benchmarks():
    # one definition (domain/gap_stats.py), which the benchmark and the prediction both use
    assert (gaps_between, gap_figures) == (bench_mixed.gaps_between, bench_mixed.gap_figures) == (
        sim_mixed.gaps_between, sim_mixed.gap_figures)
    times = [0.0, 0.01, 0.05, 0.07, 0.2, 0.21, 0.4]
    assert gaps_between(times, 0.02, 0.2, overlapping=True) == pytest.approx([0.04, 0.02, 0.13])
    assert gaps_between(times, 0.02, 0.2, overlapping=False) == pytest.approx([0.02, 0.13])
    gaps = [0.013, 0.2, 0.004, 0.05, 0.05, 0.31]
    assert gap_figures(gaps) == {"count": 6, "p50_ms": pytest.approx(50.0), "p99_ms": pytest.approx(304.5),
                                 "max_ms": pytest.approx(310.0)}
    assert percentile([], 50) is None


SLOW_LINK = HardwareProfile("slow-link", 1 << 40, 1e8, 1e12, 1e14)  # the copies dominate, as at 24 GiB


def _mixed(layered: bool, prompt_tokens=464, kv=1024):
    spec = tiny_spec(layers=16)
    cost = CostParams(streamed_prefill=True, lookup_max_keys=16, graph_buckets=(1, 2, 4), step_overhead_s=1e-4,
                      transfer_latency_s=1e-6, request_overhead_s=1e-3)
    pool = kv * spec.kv_bytes_per_token() + 4 * spec.linear_state_bytes_per_sequence() + 132 * spec.expert_bytes()
    dep = Deployment(pool_bytes=pool, state_slots=4, cache_type="none", expert_slots=128, staging_experts=4,
                     max_prefill_length=512)
    # groups sized by the mixed budget, as before session 25's default of 1024 (ft serve --layer-group-length)
    cfg = MixedConfig(spec, "tiny", SLOW_LINK, dep, cost, kv, "test", mixed_prefill_length=32, layer_group_length=32)
    scenario = MixedScenario(streams=3, stream_prompt_tokens=8, stream_tokens=64, warmup_tokens=4, baseline_tokens=8,
                             prompt_tokens=prompt_tokens, repeats=1)
    return predict_mixed(cfg, UniformRouting(16, 16, 2, seed=1), scenario, layered, check=True)


def test_layered_prefill_shortens_the_gaps_and_the_ttft_of_the_mixed_scenario():
    # budget 32 - 3 decodes = 29 tokens a step: off, 16 chunks of 29 tokens, each streaming the experts not
    # resident; on, one chunk of 29 x 16 = 464 tokens, one layer a step, its experts streamed once
    off, on = _mixed(False), _mixed(True)
    for r in (off, on):
        assert r["fits"] and not r["failures"] and r["points"][0]["ok"]
        assert r["window"]["count"] >= 3 * 16 and r["baseline"]["count"] == 3 * 8
        assert r["scheduler"]["mixed_step_tokens"] == 32 and r["not_modelled"]
    assert (off["scheduler"]["layered_prefill"], on["scheduler"]["layered_prefill"]) == (False, True)
    assert off["points"][0]["window_layered_steps"] == 0 and on["points"][0]["window_layered_steps"] == 16
    assert on["window"]["p99_ms"] < 0.7 * off["window"]["p99_ms"]
    assert on["window"]["p50_ms"] < 0.7 * off["window"]["p50_ms"]
    assert on["ttft_s_median"] < 0.7 * off["ttft_s_median"]
    assert on["points"][0]["window_bytes_staged"] < 0.2 * off["points"][0]["window_bytes_staged"]
    # the same streams before the prompt arrives (within rounding: their 8-token prompts run as decode replays, whose
    # times sum differently at the two modes' different clocks)
    assert on["baseline"] == pytest.approx(off["baseline"], rel=1e-9)
    json.dumps([off, on])


def test_the_mixed_command_refuses_a_kv_pool_that_cannot_hold_the_prompt_beside_the_streams(capsys):
    assert main(["mixed", "--gpu-budget-gib", "24", "--kv", "8k", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["layered_prefill"] for r in results] == [False, True]
    assert all(not r["fits"] and "cannot hold" in r["reason"] for r in results)
    assert results[0]["calibration"] == "h200_records_v6"
    assert main(["mixed", "--layered-prefill", "maybe"]) == 2
    with pytest.raises(ValueError, match="stream_tokens"):
        MixedScenario(stream_tokens=64, warmup_tokens=16, baseline_tokens=64).check_valid()
