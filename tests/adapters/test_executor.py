"""TorchExecutor: pool resize frees before it allocates and keeps results correct, bad steps are refused
with a reason, expert counters count, unknown architectures are refused."""

import gc
import weakref

import pytest
import torch

from adapters.torch_exec import executor as executor_module
from adapters.torch_exec.executor import TorchExecutor
from domain.ports import SequenceWork, StepBatch
from tests.adapters.torch_exec_models import (
    GREEDY,
    QWEN3_5_CONFIGS,
    Sequence,
    build_hf_model,
    make_plan,
    pages_for,
    run_requests,
    save_and_load,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["wide_router"])
    return save_and_load(model, tmp_path_factory.mktemp("wide_router"))


def greedy_tokens(executor, prompt, new_tokens=6, slot=0):
    seq = Sequence("r", prompt, pages_for(0, len(prompt) + new_tokens), state_slot=slot)
    run_requests(executor, [seq], new_tokens, chunk=4)
    return seq.output


PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33]


def test_resize_frees_every_changed_pool_before_allocating(ckpt, monkeypatch):
    ex = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=8, kv_tokens=256, state_slots=2), "cpu", torch.float32)
    before = greedy_tokens(ex, PROMPT)
    old = {"kv": weakref.ref(ex.kv.k), "state": weakref.ref(ex.state.recurrent), "moe": weakref.ref(ex.experts.slots)}
    alive_at_allocation = []

    def spy(cls, pool):
        def make(*args, **kwargs):
            gc.collect()
            alive_at_allocation.append((pool, sorted(name for name, ref in old.items() if ref() is not None)))
            return cls(*args, **kwargs)
        return make

    monkeypatch.setattr(executor_module, "PagedKVCache", spy(executor_module.PagedKVCache, "kv"))
    monkeypatch.setattr(executor_module, "LinearStatePool", spy(executor_module.LinearStatePool, "state"))
    monkeypatch.setattr(executor_module, "ExpertSlotCache", spy(executor_module.ExpertSlotCache, "moe"))
    ex.resize_pools(make_plan(ckpt, expert_slots=12, kv_tokens=512, state_slots=3))
    assert [pool for pool, _ in alive_at_allocation] == ["kv", "state", "moe"]
    assert all(alive == [] for _, alive in alive_at_allocation), alive_at_allocation
    assert (ex.kv.num_pages, ex.state.num_slots, ex.experts.num_slots) == (128, 3, 12)
    assert greedy_tokens(ex, PROMPT, slot=2) == before
    ex.check_valid()


def test_resize_keeps_an_unchanged_expert_cache_warm(ckpt):
    ex = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=32, kv_tokens=256), "cpu", torch.float32)
    first = greedy_tokens(ex, PROMPT)
    misses = ex.expert_misses
    cache = ex.experts
    ex.resize_pools(make_plan(ckpt, expert_slots=32, kv_tokens=512))
    assert ex.experts is cache and ex.kv.num_pages == 128
    assert greedy_tokens(ex, PROMPT) == first
    assert ex.expert_misses == misses, "a warm cache holding every expert must serve the rerun from hits"
    assert ex.expert_hits > 0


def test_bad_steps_are_refused_with_a_reason(ckpt):
    ex = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=8, kv_tokens=64, state_slots=2), "cpu", torch.float32)

    def work(rid="a", tokens=(1, 2, 3), start=0, pages=(0,), slot=0):
        return SequenceWork(rid, tokens, start, pages, slot, True, GREEDY, 0)

    cases = {
        "do not cover": StepBatch((work(tokens=(1,) * 5),)),
        "outside the pool of 16": StepBatch((work(pages=(16,)),)),
        "state slot 2 outside": StepBatch((work(slot=2),)),
        "state slot 0 used twice": StepBatch((work(), work(rid="b", pages=(1,)))),
        "appears twice": StepBatch((work(), work(pages=(1,), slot=1))),
        "no tokens": StepBatch((work(tokens=()),)),
    }
    for reason, batch in cases.items():
        assert reason in (ex.can_execute(batch) or ""), reason
        with pytest.raises(ValueError, match=reason):
            ex.execute(batch)
    assert ex.can_execute(StepBatch((work(), work(rid="b", pages=(1,), slot=1)))) is None


def test_unknown_architecture_is_refused(ckpt):
    class Other:
        spec = type("Spec", (), {"architecture": "deepseek_v3"})()

    with pytest.raises(ValueError, match="deepseek_v3"):
        TorchExecutor(Other(), None, "cpu", torch.float32)


def test_a_rollback_after_a_failed_allocation_restores_every_pool(ckpt, monkeypatch):
    """Issue 12 #1: the allocation of the new KV pool fails after the old one was freed; the rollback
    to the old plan must re-allocate it (it once 'kept' the freed pool because the plan still named it)."""
    old_plan = make_plan(ckpt, expert_slots=8, kv_tokens=256, state_slots=2)
    ex = TorchExecutor(ckpt, old_plan, "cpu", torch.float32)
    before = greedy_tokens(ex, PROMPT)
    real = executor_module.PagedKVCache

    def failing(*args, **kwargs):
        raise MemoryError("injected allocation failure")

    monkeypatch.setattr(executor_module, "PagedKVCache", failing)
    with pytest.raises(MemoryError):
        ex.resize_pools(make_plan(ckpt, expert_slots=8, kv_tokens=512, state_slots=2))
    with pytest.raises(AssertionError, match="pool is missing"):
        ex.check_valid()  # the check, not a flag, sees the half-done resize
    monkeypatch.setattr(executor_module, "PagedKVCache", real)
    ex.resize_pools(old_plan)  # the rollback
    ex.check_valid()
    assert ex.kv is not None and ex.kv.num_pages == old_plan.kv_pages
    assert greedy_tokens(ex, PROMPT) == before


def test_one_sequences_sampling_fault_is_its_own(ckpt, monkeypatch):
    """Issue 12 #2: a sampling failure of one sequence comes back as that sequence's error only."""
    from domain.request import SamplingParams

    ex = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=8, kv_tokens=64, state_slots=2), "cpu", torch.float32)
    bad = SamplingParams(temperature=0.7, top_k=3, seed=13)
    real = ex.sampler.sample

    def sample(rid, logits, params, output_index, **kw):
        if params is bad:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(rid, logits, params, output_index, **kw)

    monkeypatch.setattr(ex.sampler, "sample", sample)
    batch = StepBatch((SequenceWork("good", (1, 2, 3), 0, (0,), 0, True, GREEDY, 0),
                       SequenceWork("bad", (4, 5, 6), 0, (1,), 1, True, bad, 0)))
    out = ex.execute(batch)
    assert out["good"].error is None and 0 <= out["good"].token_id
    assert out["bad"].error is not None and "inf, nan" in out["bad"].error


def test_degenerate_temperatures_sample_the_argmax():
    """Issue 12 #2: 1e-40 once overflowed logits / T to inf and multinomial raised for the whole step."""
    from adapters.torch_exec.sampler import Sampler
    from domain.request import SamplingParams

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for t in (1e-40, 5e-324, 1.4e-45):
        assert Sampler().sample("r", logits, SamplingParams(temperature=t, seed=1), 0).token_id == 1
