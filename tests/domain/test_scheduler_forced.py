"""Scheduler.force_tokens: caller-decided output tokens (a thinking budget's close) go through the
scheduler like sampled ones: one step each, computed into the KV pages, bounded by max_tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.fakes import FakeExecutor, sequence_hash
from domain.kv_pages import PageAllocator
from domain.request import Request, RequestState, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig

VOCAB = 16
EOS = (0,)


def make(num_pages=16, num_slots=4, prefix_cache=False, **config):
    """prefix_cache: with the radix cache and GDN state snapshots (4 slots, every 2 pages)."""
    config.setdefault("eos_token_ids", EOS)
    snapshots = 4 if prefix_cache else 0
    if prefix_cache:
        config.update(prefix_cache=True, snapshot_interval=2 * config.get("page_size", 16))
    cfg = SchedulerConfig(**config)
    return (Scheduler(cfg, PageAllocator(num_pages), num_slots, snapshots),
            FakeExecutor(cfg.page_size, num_pages, num_slots, VOCAB, num_snapshot_slots=snapshots))


def reference(prompt: list[int], max_tokens: int, force_at: int, forced: list[int]) -> list[int]:
    """One sequence alone: FakeExecutor's next token is a hash of the whole sequence so far (read back
    from its KV pages), except that output positions force_at.. are the forced tokens."""
    out: list[int] = []
    while len(out) < max_tokens:
        i = len(out) - force_at
        out.append(forced[i] if 0 <= i < len(forced) else sequence_hash(prompt + out) % VOCAB)
    return out


def run(scheduler, executor, force: dict[str, tuple[int, list[int]]]) -> tuple[dict, dict, int]:
    """Drive to idle; force[rid] = (after how many output tokens, ids). Returns outputs, the events'
    forced flags and the number of steps."""
    outputs: dict[str, list[int]] = {}
    flags: dict[str, list[bool]] = {}
    steps = 0
    pending = dict(force)
    for rid, (at, ids) in list(pending.items()):
        if at == 0:
            scheduler.force_tokens(rid, ids)
            del pending[rid]
    while (batch := scheduler.schedule()) is not None:
        steps += 1
        for ev in scheduler.complete(batch, executor.execute(batch)):
            outputs.setdefault(ev.request_id, []).append(ev.token_id)
            flags.setdefault(ev.request_id, []).append(ev.forced)
            at_ids = pending.get(ev.request_id)
            if at_ids and len(outputs[ev.request_id]) == at_ids[0] and not ev.finished:
                scheduler.force_tokens(ev.request_id, at_ids[1])
                del pending[ev.request_id]
        scheduler.check_valid()
        executor.check_valid()
    return outputs, flags, steps


def test_forced_tokens_replace_the_samples_one_step_each_and_reach_the_kv():
    scheduler, executor = make(page_size=4)
    prompt = [1, 2, 3]
    scheduler.add(Request("a", prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
    outputs, flags, steps = run(scheduler, executor, {"a": (3, [7, 8, 9])})
    assert outputs["a"] == reference(prompt, 10, 3, [7, 8, 9])
    assert outputs["a"][3:6] == [7, 8, 9] and flags["a"] == [False] * 3 + [True] * 3 + [False] * 4
    # NOTE: the tokens after the forced ones are hashes of prompt + output INCLUDING 7, 8, 9, which the
    # fake reads back from the KV pages it wrote: the forced tokens were computed like sampled ones.
    assert outputs["a"][6] == sequence_hash(prompt + outputs["a"][:6]) % VOCAB
    assert steps == 10  # one prefill step, then one decode per token: forcing adds no step and skips none


def test_max_tokens_still_bounds_the_output_mid_forced_sequence():
    scheduler, executor = make()
    request = Request("a", [1, 2], SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.add(request)
    outputs, flags, _ = run(scheduler, executor, {"a": (2, [5, 6, 7, 8])})
    assert outputs["a"] == reference([1, 2], 4, 2, [5, 6, 7, 8]) and outputs["a"][2:] == [5, 6]
    assert request.finish_reason == "length" and flags["a"] == [False, False, True, True]


def test_the_stop_checks_apply_to_a_forced_token():
    scheduler, executor = make()
    prompt = [3, 4]
    request = Request("a", prompt, SamplingParams(max_tokens=20))
    scheduler.add(request)
    outputs, _, _ = run(scheduler, executor, {"a": (0, [5, EOS[0]])})
    assert outputs["a"] == [5, EOS[0]] and request.finish_reason == "stop"


def test_forcing_survives_preemption():
    # 6 pages of 2 tokens, two requests that each grow to 10 tokens: the newest is preempted.
    scheduler, executor = make(num_pages=6, page_size=2, max_running=2, max_step_tokens=4)
    prompts = {"old": [1, 2], "new": [3, 4]}
    for rid, prompt in prompts.items():
        scheduler.add(Request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    outputs, _, _ = run(scheduler, executor, {"new": (1, [9, 10, 11, 12, 13])})
    assert scheduler.num_preemptions >= 1
    assert outputs["new"] == reference([3, 4], 8, 1, [9, 10, 11, 12, 13])
    assert outputs["old"] == reference([1, 2], 8, 0, [])


def test_a_forced_token_reports_logprob_zero_when_logprobs_are_asked():
    scheduler, executor = make()
    scheduler.add(Request("a", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2)))
    scheduler.add(Request("b", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))
    scheduler.force_tokens("a", [5])
    scheduler.force_tokens("b", [5])
    events = scheduler.complete(batch := scheduler.schedule(), executor.execute(batch))
    by_id = {e.request_id: e for e in events}
    assert by_id["a"].token_id == 5 and by_id["a"].logprob == 0.0 and by_id["a"].top_logprobs == ()
    assert by_id["b"].token_id == 5 and by_id["b"].logprob is None and by_id["b"].forced


def test_force_tokens_refuses_bad_calls():
    scheduler, _ = make()
    with pytest.raises(ValueError, match="not live"):
        scheduler.force_tokens("nope", [1])
    request = Request("a", [1, 2], SamplingParams(max_tokens=4))
    scheduler.add(request)
    for bad in ([], [-1], [1.5]):
        with pytest.raises(ValueError, match="non-empty list of ints"):
            scheduler.force_tokens("a", bad)
    scheduler.force_tokens("a", [3, 4])
    with pytest.raises(ValueError, match="already has forced tokens"):
        scheduler.force_tokens("a", [5])
    assert request.state is RequestState.WAITING and request.forced_token_ids == [3, 4]
    scheduler.abort("a")
    with pytest.raises(ValueError, match="not live"):
        scheduler.force_tokens("a", [5])


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.lists(st.sampled_from([1, 2]), min_size=1, max_size=6), st.integers(1, 8), st.integers(0, 8),
                  st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
        min_size=1, max_size=4),
    num_pages=st.integers(5, 12),
    page_size=st.integers(1, 3),
    prefix_cache=st.booleans(),
)
def test_batched_and_preempted_runs_equal_each_request_alone_with_its_forced_tokens(specs, num_pages, page_size,
                                                                                   prefix_cache):
    # NOTE: with the prefix cache, requests sharing a prompt share its pages, and forced outputs are
    # cached and branched from like sampled ones
    scheduler, executor = make(num_pages=num_pages, page_size=page_size, max_running=3, max_step_tokens=5,
                               max_context=64, prefix_cache=prefix_cache)
    force, expected = {}, {}
    for i, (prompt, max_tokens, at, ids) in enumerate(specs):
        request = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        if scheduler.check_request(request) is not None:
            continue
        scheduler.add(request)
        if at < max_tokens:
            force[request.request_id] = (at, ids)
        expected[request.request_id] = reference(prompt, max_tokens, at if at < max_tokens else max_tokens, ids)
    outputs, _, _ = run(scheduler, executor, force)
    assert outputs == expected
    assert scheduler.is_idle() and scheduler.allocator.num_used == scheduler.num_cached_pages
