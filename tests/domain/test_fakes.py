"""Fakes: they honour their ports and catch callers that break the contracts."""

import pytest

from domain.fakes import (
    ContractViolation,
    FakeClock,
    FakeExecutor,
    FakeExpertTransfer,
    FakeTokenizer,
    ListMetricsSink,
    sequence_hash,
)
from domain.ports import Clock, ExpertTransfer, MetricsSink, ModelExecutor, SequenceWork, StepBatch, Tokenizer
from domain.request import SamplingParams


def work(rid, tokens, start, pages, slot, sample=True, output_index=0, **sampling):
    return SequenceWork(
        rid, tuple(tokens), start, tuple(pages), slot, sample, SamplingParams(**sampling), output_index
    )


def test_fakes_satisfy_their_ports():
    assert isinstance(FakeExecutor(4, 8, 2), ModelExecutor)
    assert isinstance(FakeClock(), Clock)
    assert isinstance(FakeTokenizer(), Tokenizer)
    assert isinstance(ListMetricsSink(), MetricsSink)
    assert isinstance(FakeExpertTransfer(4), ExpertTransfer)


def test_executor_token_is_a_hash_of_the_sequence_and_chunking_does_not_matter():
    whole = FakeExecutor(4, 8, 2, vocab_size=97)
    out = whole.execute(StepBatch((work("a", [5, 6, 7, 8, 9], 0, [0, 1], 0),)))
    assert out["a"].token_id == sequence_hash([5, 6, 7, 8, 9]) % 97
    chunked = FakeExecutor(4, 8, 2, vocab_size=97)
    assert chunked.execute(StepBatch((work("a", [5, 6, 7], 0, [3], 1, sample=False),))) == {}
    out2 = chunked.execute(StepBatch((work("a", [8, 9], 3, [3, 5], 1),)))
    assert out2["a"].token_id == out["a"].token_id


def test_executor_asserts_pages_cover_the_positions():
    executor = FakeExecutor(4, 8, 2)
    with pytest.raises(ContractViolation, match="cover"):
        executor.execute(StepBatch((work("a", [1, 2, 3, 4, 5], 0, [0], 0),)))


def test_executor_asserts_start_position_matches_the_slot():
    executor = FakeExecutor(4, 8, 2)
    executor.execute(StepBatch((work("a", [1, 2, 3], 0, [0], 0),)))
    with pytest.raises(ContractViolation, match="start_position"):
        executor.execute(StepBatch((work("a", [4], 4, [0, 1], 0),)))  # skips position 3


def test_executor_notices_a_page_handed_to_another_sequence():
    executor = FakeExecutor(4, 8, 2)
    executor.execute(StepBatch((work("a", [1, 2], 0, [0], 0),)))
    executor.execute(StepBatch((work("b", [9, 9, 9], 0, [0], 1),)))  # page 0 reused while a lives
    with pytest.raises(ContractViolation, match="lost its tokens"):
        executor.execute(StepBatch((work("a", [3], 2, [0], 0),)))


def test_executor_refuses_shared_slots_and_written_pages_in_one_batch():
    executor = FakeExecutor(4, 8, 2)
    with pytest.raises(ContractViolation, match="state slot"):
        executor.execute(StepBatch((work("a", [1], 0, [0], 0), work("b", [1], 0, [1], 0))))
    with pytest.raises(ContractViolation, match="written twice"):
        executor.execute(StepBatch((work("a", [1], 0, [0], 0), work("b", [1], 0, [0], 1))))


def test_executor_logprobs_and_resize():
    executor = FakeExecutor(4, 8, 2)
    out = executor.execute(StepBatch((work("a", [1], 0, [0], 0, logprobs=True, top_logprobs=3),)))
    assert out["a"].logprob is not None and len(out["a"].top_logprobs) == 3

    class Plan:  # duck-typed PoolPlan: the fake reads only these fields
        page_size, kv_pages, state_slots = 2, 3, 1

    executor.resize_pools(Plan())
    with pytest.raises(ContractViolation, match="out of range"):
        executor.execute(StepBatch((work("a", [1], 0, [5], 0),)))
    executor.check_valid()


def test_clock_moves_only_forward():
    clock = FakeClock(10.0)
    clock.advance(2.5)
    assert clock.now() == 12.5
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_tokenizer_round_trips_and_renders_chat():
    tok = FakeTokenizer()
    text = "héllo, wörld"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("ab") + [256]) == "ab"  # special tokens are skipped
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>assistant\n") and "hi" in prompt
    assert tok.decode([10_000]) == "" and tok.token_bytes(10_000) == b""  # a model's padded row: no text
    with pytest.raises(ValueError):
        tok.decode([-1])


def test_metrics_sink_keeps_every_step():
    sink = ListMetricsSink()
    sink.record_step(prefill_tokens=5, decode_tokens=2, seconds=0.1, expert_hits=3, expert_misses=1)
    assert sink.total_tokens == 7 and sink.steps[0].expert_misses == 1
    sink.check_valid()


def test_expert_transfer_slot_must_not_be_read_before_the_copy_completes():
    transfer = FakeExpertTransfer(4)
    transfer.copy_experts([((0, 5), 2), ((1, 7), 3)])
    with pytest.raises(ContractViolation, match="before its copy completed"):
        transfer.read(2)
    transfer.wait()
    assert transfer.read(2) == (0, 5) and transfer.read(0) is None and transfer.num_copies == 2
    with pytest.raises(ContractViolation):
        transfer.copy_experts([((0, 1), 1), ((0, 2), 1)])
    with pytest.raises(ContractViolation):
        transfer.copy_experts([((0, 1), 9)])
