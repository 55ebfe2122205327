"""ADR 0024 "A0" (session 28, SchedulerConfig.layer_short_prompts): beside decodes, on a plan that leaves experts out
(partial_residency, live through Scheduler.set_partial_residency), every prompt chunk is layered however short, and
no other prompt takes a chunk beside decodes while one is part-way. Where every expert is resident, or no decode
runs, scheduling is exactly what it was. Targeted cases, then random workloads (the state machines in
test_scheduler.py and test_scheduler_prefix.py draw the policy and flip the residency too)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.fakes import FakeExecutor
from domain.kv_pages import PageAllocator
from domain.request import Request, RequestState, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from tests.domain.test_scheduler import EOS, VOCAB, solo_output, step_charge
from tests.domain.test_scheduler import step_once as step

LAYERS = 8


def config(**overrides) -> SchedulerConfig:
    # mixed budget 8 (2 streams leave 6), groups sized by 16: (16 - 2) x 8 // 64 = 1 layer a group
    base = dict(page_size=4, max_running=4, max_step_tokens=64, mixed_step_tokens=8, layer_group_tokens=16,
                layered_prefill=True, num_layers=LAYERS, eos_token_ids=EOS, layer_short_prompts=True,
                partial_residency=True)
    return SchedulerConfig(**{**base, **overrides})


def make(cfg: SchedulerConfig, num_pages: int = 256, num_slots: int = 4):
    executor = FakeExecutor(cfg.page_size, num_pages, num_slots, VOCAB, num_layers=LAYERS)
    return Scheduler(cfg, PageAllocator(num_pages), num_slots), executor


def streams(n=2, max_tokens=60):
    return [Request(f"s{k}", [1 + k, 2], SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for k in range(n)]


def one_token(request_id, length, first=1):
    return Request(request_id, [(first + 3 * i) % (VOCAB - 1) + 1 for i in range(length)],
                   SamplingParams(max_tokens=1, ignore_eos=True))


def works_of(scheduler, executor, arrivals: dict[int, list[Request]], request_id: str, steps=400):
    """Steps (adding arrivals[i] before step i) until idle; each step's work for `request_id` as
    (step, start, tokens, layers), and the outputs."""
    got, outputs = [], {}
    for i in range(steps):
        for request in arrivals.get(i, ()):
            scheduler.add(Request(request.request_id, list(request.prompt_token_ids), request.sampling))
        batch = step(scheduler, executor, outputs)
        if batch is None:
            if i > max(arrivals):
                return got, outputs
            continue
        got += [(i, w.start_position, len(w.token_ids), w.layers) for w in batch.works if w.request_id == request_id]
    raise AssertionError("not idle")


def test_a_short_prompt_beside_decodes_is_layered_where_the_plan_leaves_experts_out():
    def layers(**overrides):
        scheduler, executor = make(config(**overrides))
        prompt = one_token("short", 5)  # 5 tokens: the mixed budget left (8 - 2 decodes) takes it whole
        got, outputs = works_of(scheduler, executor, {0: streams(), 3: [prompt]}, "short")
        assert outputs["short"] == solo_output(list(prompt.prompt_token_ids), prompt.sampling)[0]
        return [w[3] for w in got]

    # one chunk, a layer a step beside the two decodes (its experts cross the link once, in 8 short steps)
    assert layers() == [(i, i + 1) for i in range(LAYERS)]
    assert layers(partial_residency=False) == [None]  # every expert resident: one ordinary mixed step, as before
    assert layers(layer_short_prompts=False) == [None]  # the policy off (ft serve --layer-short-prompts off)


def test_a_prompt_with_no_decode_beside_it_is_not_layered():
    scheduler, executor = make(config())
    got, outputs = works_of(scheduler, executor, {0: [one_token("alone", 5)]}, "alone")
    assert got == [(0, 0, 5, None)]  # a lone prefill step takes its chunk whole, on any plan
    scheduler, executor = make(config())
    # two prompts arriving together on an idle server: one step, both whole
    got, outputs = works_of(scheduler, executor, {0: [one_token("a", 30), one_token("b", 20, first=2)]}, "b")
    assert got == [(0, 0, 20, None)] and set(outputs) == {"a", "b"}


def test_a_second_prompt_waits_while_a_chunk_is_part_way():
    scheduler, executor = make(config())
    arrivals = {0: streams(), 3: [one_token("first", 5)], 4: [one_token("second", 3, first=5)]}
    outputs: dict[str, list[int]] = {}
    batches = []
    for i in range(200):
        for request in arrivals.get(i, ()):
            scheduler.add(request)
        batch = step(scheduler, executor, outputs)
        if batch is None:
            break
        batches.append(batch)
        prefills = [w for w in batch.works if w.request_id not in ("s0", "s1")]
        if any(scheduler.get(s) for s in ("s0", "s1")):
            assert len(prefills) <= 1 and all(w.layers is not None for w in prefills)  # one prompt a step, layered
    first = [i for i, b in enumerate(batches) for w in b.works if w.request_id == "first"]
    second = [i for i, b in enumerate(batches) for w in b.works if w.request_id == "second"]
    assert first == list(range(3, 3 + LAYERS))  # arrived at step 3: 8 groups in a row
    assert second == list(range(3 + LAYERS, 3 + 2 * LAYERS))  # waited for the last of them, then its own groups
    assert scheduler.get("second") is None and len(outputs["second"]) == 1
    assert scheduler.get("first") is None and len(outputs["first"]) == 1


def test_without_the_policy_a_second_prompt_takes_an_ordinary_chunk_beside_a_part_way_one():
    # what A0's wait prevents (ADR 0024, "A gap the single-prompt scenario does not cover"): the long prompt's group
    # charges 40 x 1 / 8 = 5 of the 6 tokens the decodes leave, the short one takes the last token of each step as an
    # ordinary chunk (on a card, each of them a step that copies every non-resident expert)
    scheduler, executor = make(config(layer_short_prompts=False, layer_group_tokens=8))
    arrivals = {0: streams(), 3: [one_token("long", 40)], 4: [one_token("short", 3, first=5)]}
    got, _ = works_of(scheduler, executor, arrivals, "short")
    assert got == [(4, 0, 1, None), (5, 1, 1, None), (6, 2, 1, None)]
    scheduler, executor = make(config(layer_group_tokens=8))  # A0: it waits for the long chunk's 8 groups
    got, _ = works_of(scheduler, executor, arrivals, "short")
    assert [(i, layers) for i, _, _, layers in got] == [(3 + LAYERS + g, (g, g + 1)) for g in range(LAYERS)]


def test_the_residency_flag_is_live():
    scheduler, executor = make(config(partial_residency=False))
    assert not scheduler.partial_residency and not scheduler.layers_every_chunk
    outputs: dict[str, list[int]] = {}
    for request in streams():
        scheduler.add(request)
    step(scheduler, executor, outputs)
    scheduler.add(one_token("resident", 5))
    (work,) = [w for w in step(scheduler, executor, outputs).works if w.request_id == "resident"]
    assert work.layers is None
    scheduler.set_partial_residency(True)  # a live resize to fewer expert slots than the model's experts
    assert scheduler.partial_residency and scheduler.layers_every_chunk
    scheduler.add(one_token("partial", 5))
    (work,) = [w for w in step(scheduler, executor, outputs).works if w.request_id == "partial"]
    assert work.layers == (0, 1)
    scheduler.set_partial_residency(False)  # and back: the chunk part-way still finishes its groups
    assert [w.layers for w in step(scheduler, executor, outputs).works if w.request_id == "partial"] == [(1, 2)]
    with pytest.raises(ValueError, match="must be a bool"):
        scheduler.set_partial_residency(1)


def test_config_refuses_the_policy_without_layered_prefill():
    with pytest.raises(ValueError, match="layer_short_prompts .* needs layered_prefill"):
        SchedulerConfig(layer_short_prompts=True)
    assert SchedulerConfig(partial_residency=True).partial_residency  # the plan's fact alone is fine


# ---- random workloads ----------------------------------------------------------------------------------------------


@st.composite
def workloads(draw):
    """Streams, then prompts of every size arriving while they decode (or after), on a pool that may be short."""
    arrivals: dict[int, list[Request]] = {}
    for k in range(draw(st.integers(0, 3))):
        arrivals.setdefault(draw(st.integers(0, 3)), []).append(Request(
            f"s{k}", [1 + k, 2, 3], SamplingParams(max_tokens=draw(st.integers(2, 50)), ignore_eos=True)))
    for n in range(draw(st.integers(1, 5))):
        arrivals.setdefault(draw(st.integers(0, 40)), []).append(Request(
            f"p{n}", [(n + 5 * i) % (VOCAB - 1) + 1 for i in range(draw(st.integers(1, 90)))],
            SamplingParams(max_tokens=draw(st.integers(1, 6)), ignore_eos=True)))
    return arrivals


def run(scheduler: Scheduler, executor: FakeExecutor, arrivals: dict[int, list[Request]], check=None):
    """Every batch and every output, to idle; `check(batch, decoding)` after each schedule()."""
    batches, outputs = [], {}
    fresh = {i: [Request(r.request_id, list(r.prompt_token_ids), r.sampling) for r in rs] for i, rs in arrivals.items()}
    for i in range(5_000):
        for request in fresh.get(i, ()):
            if scheduler.check_request(request) is None:
                scheduler.add(request)
        batch = scheduler.schedule()
        if batch is None:
            if i > max(fresh, default=0):
                return batches, outputs
            continue
        decoding = [scheduler.get(w.request_id).state is RequestState.DECODING for w in batch.works]
        if check is not None:
            check(batch, decoding)
        batches.append(batch)
        for ev in scheduler.complete(batch, executor.execute(batch)):
            outputs.setdefault(ev.request_id, []).append(ev.token_id)
        scheduler.check_valid()
    raise AssertionError("not idle")


BUDGETS = st.tuples(st.integers(4, 12), st.integers(0, 40), st.integers(24, 256))  # mixed, group extra, pages


@settings(max_examples=150, deadline=None)
@given(arrivals=workloads(), budgets=BUDGETS)
def test_a0_layers_every_chunk_beside_decodes_and_leaks_nothing(arrivals, budgets):
    mixed, group_extra, num_pages = budgets
    cfg = config(mixed_step_tokens=mixed, layer_group_tokens=min(64, mixed + group_extra))
    scheduler, executor = make(cfg, num_pages=num_pages)

    def check(batch, decoding):
        prefills = [w for w, d in zip(batch.works, decoding, strict=True) if not d]
        layered = [w for w in batch.works if w.layers is not None]
        assert len(layered) <= 1
        if any(decoding):  # A0: no ordinary chunk beside decodes, so at most one prompt in the step
            assert all(w.layers is not None for w in prefills), batch
            assert sum(step_charge(w, LAYERS) for w in batch.works) <= max(cfg.mixed_step_tokens,
                                                                           cfg.layer_group_tokens)

    batches, outputs = run(scheduler, executor, arrivals, check)
    for requests in arrivals.values():
        for r in requests:
            if r.request_id in outputs:  # refused ones (too large for the pool) have none
                assert outputs[r.request_id] == solo_output(list(r.prompt_token_ids), r.sampling)[0], r.request_id
    # idle: every page and every state slot is free again (check_valid counted them after every step)
    assert scheduler.is_idle() and scheduler.allocator.num_free == num_pages
    assert sorted(scheduler._free_slots) == list(range(scheduler.num_state_slots))


@settings(max_examples=100, deadline=None)
@given(arrivals=workloads(), budgets=BUDGETS)
def test_where_every_expert_is_resident_the_policy_changes_nothing(arrivals, budgets):
    mixed, group_extra, num_pages = budgets
    cfg = config(mixed_step_tokens=mixed, layer_group_tokens=min(64, mixed + group_extra), partial_residency=False)
    on = run(*make(cfg, num_pages), arrivals)
    off = run(*make(config(mixed_step_tokens=mixed, layer_group_tokens=cfg.layer_group_tokens,
                           layer_short_prompts=False, partial_residency=False), num_pages), arrivals)
    assert on == off
