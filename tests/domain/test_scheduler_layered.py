"""Layered prefill (docs/adr/0024-layered-prefill.md): a long prompt arriving while streams decode runs as one
chunk, a layer group per step, each step within the mixed budget; targeted cases (the state machines in
test_scheduler.py and test_scheduler_prefix.py run it on random schedules too)."""

from __future__ import annotations

import pytest

from domain.fakes import FakeExecutor
from domain.kv_pages import PageAllocator
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from tests.domain.test_scheduler import EOS, VOCAB, run_to_idle, solo_output, step_charge

LAYERS = 8


def make(num_pages=128, num_slots=4, snapshot_slots=0, layered=True, **config):
    config.setdefault("eos_token_ids", EOS)
    cfg = SchedulerConfig(layered_prefill=layered, num_layers=LAYERS, **config)
    allocator = PageAllocator(num_pages)
    executor = FakeExecutor(cfg.page_size, num_pages, num_slots, VOCAB, num_snapshot_slots=snapshot_slots,
                            num_layers=LAYERS)
    return Scheduler(cfg, allocator, num_slots, snapshot_slots), executor


def step(scheduler, executor, outputs):
    batch = scheduler.schedule()
    for ev in scheduler.complete(batch, executor.execute(batch)):
        outputs.setdefault(ev.request_id, []).append(ev.token_id)
    scheduler.check_valid()
    return batch


def start_streams(scheduler, executor, outputs, n=2, max_tokens=60):
    for i in range(n):
        scheduler.add(Request(f"s{i}", [1 + i, 2], SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    step(scheduler, executor, outputs)  # their prompts, then they decode


def long_prompt_groups(scheduler, executor, outputs, prompt, limit):
    """A 1-token answer to `prompt` arriving beside streams s0 and s1: its (start, tokens, layers, sample) per step,
    each step holding both decodes, one layer group and at most `limit` tokens of charge."""
    scheduler.add(Request("long", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    groups = []
    while "long" not in outputs:
        batch = step(scheduler, executor, outputs)
        assert sorted(w.request_id for w in batch.works if w.layers is None) == ["s0", "s1"]  # decodes every step
        assert sum(step_charge(w, LAYERS) for w in batch.works) <= limit
        (work,) = [w for w in batch.works if w.layers is not None]
        groups.append((work.start_position, len(work.token_ids), work.layers, work.sample))
    return groups


def test_a_long_prompt_beside_decodes_runs_as_one_chunk_a_layer_group_per_step():
    scheduler, executor = make(page_size=4, max_running=3, max_step_tokens=32, mixed_step_tokens=6)
    outputs: dict[str, list[int]] = {}
    start_streams(scheduler, executor, outputs)
    prompt = list(range(1, 40))
    groups = long_prompt_groups(scheduler, executor, outputs, prompt, 6)  # the mixed budget holds
    # budget 6 - 2 decodes = 4 tokens x 8 layers = 32 token-layers: the chunk may be 32 tokens (one layer each
    # step); the last 7 tokens go one layer a step too: groups are sized for a max_step_tokens chunk, since a
    # layer's copies and launches do not shrink with its tokens
    assert groups == [(0, 32, (i, i + 1), False) for i in range(LAYERS)] + [
        (32, 7, (i, i + 1), i == LAYERS - 1) for i in range(LAYERS)]
    assert outputs["long"] == solo_output(prompt, SamplingParams(max_tokens=1, ignore_eos=True))[0]
    assert scheduler.num_layer_groups == 16 and executor.num_layer_groups == 16


def test_without_layered_prefill_the_same_prompt_takes_budget_sized_chunks():
    scheduler, executor = make(layered=False, page_size=4, max_running=3, max_step_tokens=32, mixed_step_tokens=6)
    outputs: dict[str, list[int]] = {}
    start_streams(scheduler, executor, outputs)
    scheduler.add(Request("long", list(range(1, 40)), SamplingParams(max_tokens=1, ignore_eos=True)))
    steps = 0
    while "long" not in outputs:
        batch = step(scheduler, executor, outputs)
        assert all(w.layers is None for w in batch.works)
        steps += 1
    assert steps == 10  # 39 tokens in chunks of 4: fewer steps than the layered run above (16), but 10 passes
    # over every layer's experts instead of 2 (where the experts are not resident, 10 copies of the model)


def test_once_no_decode_runs_the_rest_of_the_chunk_goes_in_one_step():
    scheduler, executor = make(page_size=4, max_running=3, max_step_tokens=32, mixed_step_tokens=6)
    outputs: dict[str, list[int]] = {}
    start_streams(scheduler, executor, outputs)
    scheduler.add(Request("long", list(range(1, 30)), SamplingParams(max_tokens=2, ignore_eos=True)))
    batch = step(scheduler, executor, outputs)
    (work,) = [w for w in batch.works if w.layers is not None]
    assert work.layers == (0, 1) and len(work.token_ids) == 29
    step(scheduler, executor, outputs)
    scheduler.abort("s0")
    scheduler.abort("s1")
    batch = step(scheduler, executor, outputs)
    assert [(w.request_id, w.layers, w.sample) for w in batch.works] == [("long", (2, LAYERS), True)]
    assert len(outputs["long"]) == 1


def test_a_chunk_abandoned_mid_way_restarts_from_its_first_group():
    scheduler, executor = make(page_size=4, max_running=3, max_step_tokens=32, mixed_step_tokens=6)
    outputs: dict[str, list[int]] = {}
    start_streams(scheduler, executor, outputs)
    prompt = list(range(3, 30))
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    scheduler.add(Request("long", prompt, sampling))
    for _ in range(3):
        step(scheduler, executor, outputs)
    request = scheduler.get("long")
    assert request.layers_done == 3 and request.num_computed_tokens == 0
    scheduler._preempt(request)  # what a decode short of pages does to the newest request
    scheduler.check_valid()
    assert request.layer_chunk is None and request.layers_done == 0 and not request.pages
    batch = step(scheduler, executor, outputs)
    (work,) = [w for w in batch.works if w.request_id == "long"]
    assert work.layers == (0, 1) and work.start_position == 0
    outputs.update(run_to_idle(scheduler, executor))
    assert outputs["long"] == solo_output(prompt, sampling)[0]

    scheduler.add(Request("gone", prompt, sampling))
    scheduler.add(Request("s9", [5, 6], SamplingParams(max_tokens=30, ignore_eos=True)))
    step(scheduler, executor, outputs)  # both prefill alone (no decode): whole chunks
    scheduler.add(Request("next", prompt[::-1], sampling))
    step(scheduler, executor, outputs)
    assert scheduler.get("next").layer_chunk is not None
    scheduler.abort("next")  # part-way: its pages and slot are freed, another chunk may be layered
    scheduler.check_valid()
    scheduler.add(Request("after", prompt, sampling))
    batch = step(scheduler, executor, outputs)
    assert [w.layers for w in batch.works if w.request_id == "after"] == [(0, 1)]


def test_with_the_prefix_cache_only_the_first_group_restores_and_every_group_carries_the_snapshots():
    scheduler, executor = make(page_size=4, max_running=3, max_step_tokens=32, mixed_step_tokens=6,
                               snapshot_slots=8, prefix_cache=True, snapshot_interval=8)
    outputs: dict[str, list[int]] = {}
    system = list(range(1, 21))
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    scheduler.add(Request("first", system + [7], sampling))
    outputs.update(run_to_idle(scheduler, executor))
    start_streams(scheduler, executor, outputs)
    prompt = system + list(range(30, 50))
    scheduler.add(Request("again", prompt, sampling))
    works = []
    while "again" not in outputs:
        batch = step(scheduler, executor, outputs)
        works += [w for w in batch.works if w.request_id == "again"]
    assert works[0].layers[0] == 0 and works[0].restore_from is not None and works[0].start_position == 20
    assert all(w.restore_from is None for w in works[1:])
    assert all(w.layers is not None for w in works)
    assert len({w.snapshots for w in works}) == 1 and works[0].snapshots  # the chunk's snapshots, every group
    while not scheduler.is_idle():
        step(scheduler, executor, outputs)
    assert outputs["again"] == solo_output(prompt, sampling)[0]
    assert executor.num_restores >= 1


def test_config_checks_the_layer_count():
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        SchedulerConfig(layered_prefill=True, num_layers=0)


def test_a_layer_group_budget_sizes_the_groups_while_the_mixed_budget_decides_what_is_layered():
    # ADR 0024, session 25: groups sized by layer_group_tokens (10 here, decodes included), prompts layered only
    # when longer than the mixed budget left (6 - 2 decodes = 4)
    scheduler, executor = make(page_size=4, max_running=3, max_step_tokens=32, mixed_step_tokens=6,
                               layer_group_tokens=10)
    outputs: dict[str, list[int]] = {}
    start_streams(scheduler, executor, outputs)
    prompt = list(range(1, 40))
    groups = [g[:3] for g in long_prompt_groups(scheduler, executor, outputs, prompt, 10)]  # the group budget holds
    # (4 + 10 - 6) = 8 tokens x 8 layers: a 32-token chunk, 8 * 8 // 32 = 2 layers a step; the 7-token rest is
    # layered too (7 > 4), its groups sized for a 32-token chunk as well
    assert groups == [(0, 32, (i, i + 2)) for i in range(0, LAYERS, 2)] + [(32, 7, (i, i + 2))
                                                                           for i in range(0, LAYERS, 2)]
    assert outputs["long"] == solo_output(prompt, SamplingParams(max_tokens=1, ignore_eos=True))[0]
    # a prompt no longer than the mixed budget left is one ordinary chunk, whatever the group budget
    scheduler.add(Request("short", [5, 6, 7, 8], SamplingParams(max_tokens=1, ignore_eos=True)))
    batch = step(scheduler, executor, outputs)
    (work,) = [w for w in batch.works if w.request_id == "short"]
    assert work.layers is None and len(work.token_ids) == 4


def test_config_checks_the_layer_group_budget():
    assert SchedulerConfig(max_running=2, max_step_tokens=8, mixed_step_tokens=4).layer_group_tokens == 4  # default
    assert SchedulerConfig(max_running=2, max_step_tokens=8, mixed_step_tokens=4,
                           layer_group_tokens=8).layer_group_tokens == 8
    for bad in (1, 9):
        with pytest.raises(ValueError, match=rf"layer_group_tokens \({bad}\) must be in \[max_running \(2\), "
                                             r"max_step_tokens \(8\)\]"):
            SchedulerConfig(max_running=2, max_step_tokens=8, mixed_step_tokens=4, layer_group_tokens=bad)


def test_a_group_budget_below_the_mixed_one_never_makes_an_empty_or_oversized_chunk():
    # found by the state machine: with layer_group_tokens < mixed_step_tokens the group room (the mixed budget
    # left + 3 - 10) went negative, and the layered chunk's size with it (an empty work for the third request)
    cfg = SchedulerConfig(max_running=3, max_step_tokens=10, mixed_step_tokens=10, page_size=3, max_context=15,
                          eos_token_ids=EOS, layered_prefill=True, num_layers=1, layer_group_tokens=3)
    scheduler = Scheduler(cfg, PageAllocator(7), 3)
    executor = FakeExecutor(3, 7, 3, VOCAB, num_layers=1)
    for i, (prompt, max_tokens) in enumerate([(3, 2), (14, 1), (3, 1)]):
        scheduler.add(Request(f"r{i}", [(7 * j) % VOCAB for j in range(prompt)], SamplingParams(max_tokens=max_tokens)))
    outputs: dict[str, list[int]] = {}
    for _ in range(30):
        if scheduler.is_idle():
            break
        batch = step(scheduler, executor, outputs)  # FakeExecutor refuses an empty work
        assert all(len(w.token_ids) >= 1 for w in batch.works)
        assert sum(step_charge(w, 1) for w in batch.works) <= 10
    assert scheduler.is_idle() and set(outputs) == {"r0", "r1", "r2"}
