"""The fast path with the host lane (ADR 0030, `ft serve --host-experts`): a share of each decode lookup's misses
computed by the C++ host thread while the rest are copied, against the reference executor on a tiny block-FP8
checkpoint: the same tokens, logits within 1e-4 of the logit scale in fp32; a lane that fails a step fails that
step alone and turns itself off; options the lane cannot serve are refused at construction.

On the CPU the publish and wait kernels run in Triton's interpreter while the host thread serves them for real
(no GIL); the GPU run (`-m gpu`) captures them inside the decode graphs."""

import dataclasses

import pytest
import torch

from adapters.checkpoint.loader import load_checkpoint
from adapters.checkpoint.synth import synthesize
from adapters.checkpoint.synth_config import GEOMETRIES
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.host_kernels.host_lane import available
from adapters.torch_exec.executor import TorchExecutor
from domain.ports import StepBatch
from domain.residency import HOST_LANE_MAX_ROWS
from tests.adapters.torch_exec_models import Sequence, assert_close, make_plan, pages_for, run_requests

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 11], [2, 33, 71, 4], [8, 1, 4, 4, 90, 12, 6]]
NEW_TOKENS = 6

pytestmark = pytest.mark.skipif(not available()[0], reason=f"the host lane does not build here: {available()[1]}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    geometry = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)
    return load_checkpoint(synthesize(tmp_path_factory.mktemp("fp8"), geometry, "fp8_block", seed=5,
                                      tokenizer=False), progress=False)


def _slots(ckpt) -> int:
    return ckpt.spec.top_k * 4  # a 3-row decode step never splits, and most lookups miss


def _fast(ckpt, host_experts, **kw):
    return CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=_slots(ckpt)), DEVICE, torch.float32,
                             max_decode_rows=4, host_experts=host_experts, **kw)


def _seqs():
    return [Sequence(f"r{i}", p, pages_for(i, len(p) + NEW_TOKENS + 1), state_slot=i) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("share,team", [(1000, None), (423, None), (423, "openmp")])
def test_the_host_lane_gives_the_reference_executors_tokens_and_logits(ckpt, share, team, monkeypatch):
    if team is not None:
        monkeypatch.setenv("FLUXTIDE_HOST_LANE_TEAM", team)
    ref = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=_slots(ckpt)), DEVICE, torch.float32)
    fast = _fast(ckpt, share)
    assert fast.host_lane is not None and fast.host_lane.running and fast.host_lane.share == share
    assert fast.host_lane.team == (team or "spin")
    ref_seqs, fast_seqs = _seqs(), _seqs()
    ref_logits, fast_logits = {}, {}
    run_requests(ref, ref_seqs, NEW_TOKENS, chunk=4, record=ref_logits)
    run_requests(fast, fast_seqs, NEW_TOKENS, chunk=4, record=fast_logits)
    assert [s.output for s in fast_seqs] == [s.output for s in ref_seqs]
    for rid, steps in ref_logits.items():
        for step, (ours, want) in enumerate(zip(fast_logits[rid], steps, strict=True)):
            assert_close(ours, want, f"{rid} step {step}")
    # the host computed some of the misses; the lane answered every request it got, without an error
    residency = fast.experts.residency
    assert 0 < residency.host_computed <= residency.misses
    assert fast.host_lane.served > 0
    assert fast.host_lane.device_error()[0] == 0 and fast.host_lane.host_error()[0] == 0
    fast.check_valid()
    fast.host_lane.stop()


def test_a_failed_host_lane_fails_its_step_alone_and_turns_itself_off(ckpt):
    fast = _fast(ckpt, 1000)
    seqs = _seqs()
    run_requests(fast, seqs, 2, chunk=16)  # prefill and one decode step through the lane
    lane = fast.host_lane
    served = lane.served
    assert served > 0
    lane.stop()  # a host thread that no longer answers: the step's waits give up after max_spins polls
    lane.max_spins = 200
    works = [s.next_work(1) for s in seqs]
    with pytest.raises(RuntimeError, match="host expert lane failed"):
        fast.execute(StepBatch(tuple(works)))
    assert fast.host_lane is None and fast.experts.host_lane is None and lane.served == served
    # the next steps copy every miss: the requests that start now decode as the reference does
    ref = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=_slots(ckpt)), DEVICE, torch.float32)
    again, want = _seqs(), _seqs()  # the failed requests' state slots and pages, freed and taken again
    run_requests(fast, again, NEW_TOKENS, chunk=4)
    run_requests(ref, want, NEW_TOKENS, chunk=4)
    assert [s.output for s in again] == [s.output for s in want]
    hosted = fast.experts.residency.host_computed
    run_requests(fast, [Sequence("late", [3, 1, 4], pages_for(3, 12), state_slot=3)], 2, chunk=4)
    assert fast.experts.residency.host_computed == hosted  # off: no key went to the host since
    fast.check_valid()


def test_auto_measures_both_rates_and_picks_a_share(ckpt):
    fast = _fast(ckpt, "auto")
    assert 0 <= fast.host_lane.share <= 1000 and fast.host_lane.running
    fast.host_lane.stop()


@pytest.mark.parametrize("bad", [1001, -1, "half", True])
def test_a_share_outside_0_to_1000_or_auto_is_refused(ckpt, bad):
    with pytest.raises(ValueError, match="host_permille|auto"):
        _fast(ckpt, bad)


def test_the_lane_serves_decode_calls_up_to_its_row_cap_and_larger_ones_copy(ckpt, monkeypatch):
    default = _fast(ckpt, 1000)
    assert default.host_lane.max_rows == min(4, HOST_LANE_MAX_ROWS)  # max_decode_rows 4 bounds the default
    default.host_lane.stop()
    monkeypatch.setenv("FLUXTIDE_HOST_LANE_ROWS", "1")
    ref = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=_slots(ckpt)), DEVICE, torch.float32)
    fast = _fast(ckpt, 1000)
    lane = fast.host_lane
    assert lane.max_rows == 1
    pool = fast.experts
    assert pool._host_lane_for(1, ckpt.spec.top_k) is lane and pool._host_lane_for(2, 2 * ckpt.spec.top_k) is None
    ref_seqs, fast_seqs = _seqs(), _seqs()
    run_requests(ref, ref_seqs, NEW_TOKENS, chunk=4)
    run_requests(fast, fast_seqs, NEW_TOKENS, chunk=4)  # decode steps of 1 to 3 rows: some with the lane, some not
    assert [s.output for s in fast_seqs] == [s.output for s in ref_seqs]
    assert fast.experts.residency.host_computed > 0 and lane.served > 0  # the 1-row steps went through the lane
    assert lane.device_error()[0] == 0 and lane.host_error()[0] == 0
    fast.check_valid()
    lane.stop()


@pytest.mark.parametrize("var,value", [("FLUXTIDE_HOST_LANE_TEAM", "tbb"), ("FLUXTIDE_HOST_LANE_THREADS", "0"),
                                       ("FLUXTIDE_HOST_LANE_THREADS", "many"), ("FLUXTIDE_HOST_LANE_ROWS", "0"),
                                       ("FLUXTIDE_HOST_LANE_ROWS", "four"), ("FLUXTIDE_HOST_LANE_ROWS", "\u00b2")])
def test_a_bad_lane_setting_in_the_environment_is_refused_by_name(ckpt, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        _fast(ckpt, 500)


def test_zero_is_off(ckpt):
    fast = _fast(ckpt, 0)
    assert fast.host_lane is None and fast.experts.host_lane is None


def test_experts_that_are_not_block_fp8_are_refused(tmp_path):
    geometry = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)
    ckpt = load_checkpoint(synthesize(tmp_path, geometry, "bf16", seed=5, tokenizer=False), progress=False)
    with pytest.raises(ValueError, match="--host-experts.*block FP8|block FP8.*--host-experts|reads block FP8"):
        _fast(ckpt, 500)
