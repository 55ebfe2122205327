"""What-if layering policies for short prompts beside decodes (simulator/layering_policy.py; ADR 0024, "Short
prompts beside decodes"): with both candidates off the CandidateScheduler schedules exactly as the domain's
Scheduler (its own short-prompt policy, session 28, off or on); "layer what streams" layers a short chunk whose step
would stream, and with "faulting" at partial residency schedules one prompt as the domain's policy does; "decoupled
group budget" sizes the groups apart from the unlayered threshold; every output stays the solo run's; and
`simulator mixed` takes them, its default following `ft serve`'s."""

from __future__ import annotations

import json
import random

import pytest

from domain.fakes import FakeExecutor
from domain.kv_pages import PageAllocator
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from simulator.__main__ import main
from simulator.cost_model import CostParams
from simulator.layering_policy import CandidateScheduler, LayeringPolicy
from simulator.mixed import MixedConfig, MixedScenario, predict_mixed
from simulator.predict import Deployment
from simulator.routing import UniformRouting
from tests.domain.test_scheduler import EOS, VOCAB, solo_output

from .conftest import tiny_spec
from .test_layered_prefill import SLOW_LINK

LAYERS = 8


def config(**overrides) -> SchedulerConfig:
    base = dict(page_size=4, max_running=4, max_step_tokens=64, mixed_step_tokens=8, layered_prefill=True,
                num_layers=LAYERS, eos_token_ids=EOS)
    return SchedulerConfig(**{**base, **overrides})


def pair(scheduler_cls, cfg, num_pages=256, **kwargs):
    executor = FakeExecutor(cfg.page_size, num_pages, 4, VOCAB, num_layers=LAYERS)
    return scheduler_cls(cfg, PageAllocator(num_pages), 4, **kwargs), executor


def run(scheduler, executor, arrivals: dict[int, list[Request]], steps=2_000):
    """Steps to idle, adding arrivals[i] before step i; every batch and every output."""
    batches, outputs = [], {}
    for i in range(steps):
        for request in arrivals.get(i, ()):
            scheduler.add(request)
        batch = scheduler.schedule()
        if batch is None:
            if i > max(arrivals):
                return batches, outputs
            continue
        batches.append(batch)
        for ev in scheduler.complete(batch, executor.execute(batch)):
            outputs.setdefault(ev.request_id, []).append(ev.token_id)
        scheduler.check_valid()
    raise AssertionError("not idle")


def workload(seed: int) -> dict[int, list[Request]]:
    """Streams, then prompts of every size (short, near the budget, long) arriving while they decode."""
    rng = random.Random(seed)
    arrivals: dict[int, list[Request]] = {0: [Request(f"s{k}", [1 + k, 2, 3], SamplingParams(
        max_tokens=rng.randint(20, 60), ignore_eos=True)) for k in range(rng.randint(1, 3))]}
    for n in range(rng.randint(2, 5)):
        length = rng.choice([3, 5, 7, 9, 20, 40, 100])
        arrivals.setdefault(rng.randint(1, 40), []).append(Request(
            f"p{n}", [rng.randint(1, VOCAB - 1) for _ in range(length)],
            SamplingParams(max_tokens=rng.randint(1, 5), ignore_eos=True)))
    return arrivals


def check_solo(arrivals, outputs) -> None:
    for requests in arrivals.values():
        for r in requests:
            assert outputs[r.request_id] == solo_output(list(r.prompt_token_ids), r.sampling)[0], r.request_id


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("stream_rows", [None, 4])
@pytest.mark.parametrize("domain_policy", [(False, False), (True, False), (True, True)])
def test_with_both_candidates_off_it_schedules_as_the_domain_scheduler(seed, stream_rows, domain_policy):
    # NOTE: the drift guard: CandidateScheduler answers one domain hook; a change around it not made here fails this.
    # domain_policy: (layer_short_prompts, partial_residency), the domain's own policy (ADR 0024 "A0", session 28)
    short, partial = domain_policy
    cfg = config(layer_short_prompts=short, partial_residency=partial)
    today, ex_today = pair(Scheduler, cfg)
    candidate, ex_candidate = pair(CandidateScheduler, cfg, stream_rows=stream_rows)
    got_today = run(today, ex_today, workload(seed))
    got_candidate = run(candidate, ex_candidate, workload(seed))
    assert got_candidate == got_today
    assert candidate.num_layer_groups == today.num_layer_groups


def single_prompt(seed: int) -> dict[int, list[Request]]:
    """Streams, then one prompt of any size arriving while they decode (the mixed scenario's shape)."""
    arrivals = workload(seed)
    first = min(k for k in arrivals if k > 0)
    return {0: arrivals[0], first: arrivals[first][:1]}


@pytest.mark.parametrize("seed", range(12))
def test_layering_every_chunk_at_partial_residency_is_the_domains_policy_for_one_prompt(seed):
    # the what-if "A0" (layer_streamed + layer_faulting: stream_rows 0) against the domain's own since session 28:
    # alike with one prompt beside the streams; with several the domain also makes the others wait (below)
    candidate, ex_candidate = pair(CandidateScheduler, config(), policy=LayeringPolicy(
        layer_streamed=True, layer_faulting=True), stream_rows=0)
    domain, ex_domain = pair(Scheduler, config(layer_short_prompts=True, partial_residency=True))
    arrivals = single_prompt(seed)
    got_candidate, got_domain = run(candidate, ex_candidate, arrivals), run(domain, ex_domain, single_prompt(seed))
    assert got_candidate == got_domain and candidate.num_layer_groups == domain.num_layer_groups
    check_solo(arrivals, got_domain[1])


def test_with_several_prompts_the_domain_policy_runs_no_ordinary_chunk_beside_decodes():
    def ordinary_beside_decodes(scheduler_cls, cfg, **kwargs):
        scheduler, executor = pair(scheduler_cls, cfg, **kwargs)
        arrivals = {0: [Request(f"s{k}", [1 + k, 2], SamplingParams(max_tokens=40, ignore_eos=True)) for k in range(2)],
                    3: [Request("long", [1 + i % 9 for i in range(40)], SamplingParams(max_tokens=1, ignore_eos=True))],
                    4: [Request("short", [3, 4, 5], SamplingParams(max_tokens=1, ignore_eos=True))]}
        batches, outputs = run(scheduler, executor, arrivals)
        check_solo(arrivals, outputs)
        return sum(1 for b in batches for w in b.works if w.layers is None and w.request_id in ("long", "short")
                   and any(x.request_id.startswith("s") for x in b.works))

    # the candidate gives the short prompt an ordinary chunk beside the long one's groups; the domain makes it wait
    assert ordinary_beside_decodes(CandidateScheduler, config(), policy=LayeringPolicy(
        layer_streamed=True, layer_faulting=True), stream_rows=0) > 0
    assert ordinary_beside_decodes(Scheduler, config(layer_short_prompts=True, partial_residency=True)) == 0


def test_layer_what_streams_layers_a_short_prompt_beside_decodes_only_where_the_step_streams():
    prompt = Request("short", list(range(1, 6)), SamplingParams(max_tokens=1, ignore_eos=True))  # 5 < 8 - 2
    streams = [Request(f"s{k}", [1 + k, 2], SamplingParams(max_tokens=40, ignore_eos=True)) for k in range(2)]

    def groups(stream_rows, layer_streamed=True):
        scheduler, executor = pair(CandidateScheduler, config(), policy=LayeringPolicy(layer_streamed=layer_streamed),
                                   stream_rows=stream_rows)
        arrivals = {0: [Request(r.request_id, list(r.prompt_token_ids), r.sampling) for r in streams],
                    3: [Request(prompt.request_id, list(prompt.prompt_token_ids), prompt.sampling)]}
        batches, outputs = run(scheduler, executor, arrivals)
        check_solo(arrivals, outputs)
        return [w.layers for b in batches for w in b.works if w.request_id == "short"]

    # a step of 5 + 2 rows streams past 4 rows: one chunk, groups of 6 x 8 // 64 -> 1 layer (sized as today's, for a
    # max_step_tokens chunk), the streams decoding beside each
    assert groups(4) == [(i, i + 1) for i in range(LAYERS)]
    assert groups(7) == [None]  # 7 rows take the device lookup: nothing streams, one ordinary step
    assert groups(0) == [(i, i + 1) for i in range(LAYERS)]  # layer_faulting at partial residency: any chunk
    assert groups(None) == [None]  # every expert resident
    assert groups(4, layer_streamed=False) == [None]  # today


def test_a_decoupled_group_budget_sizes_the_groups_and_keeps_the_unlayered_threshold():
    streams = [Request(f"s{k}", [1 + k, 2], SamplingParams(max_tokens=60, ignore_eos=True)) for k in range(2)]

    def groups(prompt_tokens, group_tokens):
        scheduler, executor = pair(CandidateScheduler, config(), policy=LayeringPolicy(group_tokens=group_tokens))
        arrivals = {0: [Request(r.request_id, list(r.prompt_token_ids), r.sampling) for r in streams],
                    3: [Request("p", [1 + i % 9 for i in range(prompt_tokens)],
                                SamplingParams(max_tokens=1, ignore_eos=True))]}
        batches, outputs = run(scheduler, executor, arrivals)
        check_solo(arrivals, outputs)
        return [w.layers for b in batches for w in b.works if w.request_id == "p"]

    # budget 8 - 2 decodes = 6: today a 40-token chunk gets 6 x 8 // 64 = 0 -> 1 layer a group; a group budget of
    # 34 (decodes included) gives 32 x 8 // 64 = 4 layers a group
    assert groups(40, None) == [(i, i + 1) for i in range(LAYERS)]
    assert groups(40, 34) == [(0, 4), (4, 8)]
    assert groups(5, 34) == [None]  # a prompt within the mixed budget still runs unlayered
    with pytest.raises(ValueError, match="group_tokens"):
        LayeringPolicy(group_tokens=0)
    with pytest.raises(ValueError, match="layered prefill on"):
        CandidateScheduler(config(layered_prefill=False), PageAllocator(8), 4, policy=LayeringPolicy(group_tokens=8))


def _mixed(policy, prompt_tokens=24, layer_short_prompts=True):
    spec = tiny_spec(layers=16)
    kv = 1024
    cost = CostParams(streamed_prefill=True, lookup_max_keys=16, graph_buckets=(1, 2, 4), step_overhead_s=1e-4,
                      transfer_latency_s=1e-6, request_overhead_s=1e-3)
    pool = kv * spec.kv_bytes_per_token() + 4 * spec.linear_state_bytes_per_sequence() + 132 * spec.expert_bytes()
    dep = Deployment(pool_bytes=pool, state_slots=4, cache_type="none", expert_slots=128, staging_experts=4,
                     max_prefill_length=512)
    cfg = MixedConfig(spec, "tiny", SLOW_LINK, dep, cost, kv, "test", mixed_prefill_length=32, policy=policy,
                      layer_short_prompts=layer_short_prompts)
    scenario = MixedScenario(streams=3, stream_prompt_tokens=8, stream_tokens=64, warmup_tokens=4, baseline_tokens=8,
                             prompt_tokens=prompt_tokens, repeats=1)
    return predict_mixed(cfg, UniformRouting(16, 16, 2, seed=1), scenario, True, check=True)


def test_layering_a_short_streamed_prompt_trades_its_ttft_for_the_streams_gaps():
    # 24 tokens + 3 decodes = 27 rows route 54 keys > 16 a layer: the step streams every non-resident expert
    # groups sized by the mixed budget (32): one layer a step (ft serve's default group budget, 1024 since session
    # 25, bounded by the 512-token max step here, would take the 16 layers in two)
    # "today": the engine before session 28 (--layer-short-prompts off)
    today = _mixed(None, layer_short_prompts=False)
    candidate = _mixed(LayeringPolicy(layer_streamed=True, group_tokens=32))
    assert "policy" not in today["scheduler"]
    assert today["scheduler"]["layer_group_tokens"] == 512  # min(--max-prefill-length, 1024)
    assert today["scheduler"]["layer_short_prompts"] is False and today["scheduler"]["partial_residency"] is True
    assert candidate["scheduler"]["policy"] == {"layer_streamed": True, "layer_faulting": False, "group_tokens": 32}
    assert candidate["scheduler"]["layer_short_prompts"] is False  # the what-if replaces the domain's policy
    assert candidate["scheduler"]["stream_rows"] == 8  # min(128 slots, 16 keys) // top-2
    assert today["points"][0]["window_layered_steps"] == 0 and candidate["points"][0]["window_layered_steps"] == 16
    assert candidate["window"]["p99_ms"] < 0.7 * today["window"]["p99_ms"]
    assert candidate["ttft_s_median"] > today["ttft_s_median"]
    # the engine's default since session 28 (A0, the default group budget: 512 here, bounded by the max step): groups
    # of (29 + 512 - 32) x 16 // 512 = 15 layers, so 2 of them (a group this large saves the streams nothing here)
    engine = _mixed(None)
    assert engine["scheduler"]["layer_short_prompts"] is True and "policy" not in engine["scheduler"]
    assert engine["points"][0]["window_layered_steps"] == 2
    json.dumps([today, candidate, engine])


def test_the_mixed_command_takes_the_candidates(capsys):
    assert main(["mixed", "--gpu-budget-gib", "24", "--prompt-tokens", "200", "--layered-prefill", "on",
                 "--layer-streamed-chunks", "--layer-group-length", "1024", "--repeats", "1", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    assert result["scheduler"]["policy"] == {"layer_streamed": True, "layer_faulting": False, "group_tokens": None}
    assert result["scheduler"]["layer_group_tokens"] == 1024  # ft serve's own option since session 25
    assert result["scheduler"]["stream_rows"] == 32  # min(slots, 256 keys) // top-8
    assert result["points"][0]["window_layered_steps"] == 10  # (1024 - 3) x 40 // 8192 = 4 layers a group
    # a 16-token prompt beside 3 decodes (19 rows) does not stream: layered only with --layer-faulting-chunks
    for extra, groups in (([], 0), (["--layer-faulting-chunks"], 10)):
        assert main(["mixed", "--gpu-budget-gib", "24", "--prompt-tokens", "16", "--layered-prefill", "on",
                     "--layer-streamed-chunks", "--layer-group-length", "1024", "--repeats", "1", "--json",
                     *extra]) == 0
        (result,) = json.loads(capsys.readouterr().out)
        assert result["points"][0]["window_layered_steps"] == groups
    assert main(["mixed", "--layer-faulting-chunks", "--layered-prefill", "on"]) == 2  # needs --layer-streamed-chunks
    # without a what-if the engine's own policy (ft serve --layer-short-prompts: auto in sessions 28-29, off by
    # default since session 30's measurement)
    for extra, groups in (([], 0), (["--layer-short-prompts", "auto"], 10), (["--layer-short-prompts", "off"], 0)):
        assert main(["mixed", "--gpu-budget-gib", "24", "--prompt-tokens", "16", "--layered-prefill", "on",
                     "--repeats", "1", "--json", *extra]) == 0
        (result,) = json.loads(capsys.readouterr().out)
        assert result["points"][0]["window_layered_steps"] == groups
        assert result["scheduler"]["layer_short_prompts"] is (groups > 0) and result["scheduler"]["partial_residency"]
