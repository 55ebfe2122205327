"""Request lifecycle: legal moves, parameter validation, derived counts."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.request import MIN_TEMPERATURE, Request, RequestState, SamplingParams

S = RequestState


def test_lifecycle_moves_through_the_legal_states():
    request = Request("a", [1, 2, 3])
    for state in (S.PREFILLING, S.DECODING, S.WAITING, S.PREFILLING, S.FINISHED):
        assert request.can_transition(state)
        request.transition(state)
    assert request.is_done and not request.can_transition(S.ABORTED)


@pytest.mark.parametrize(
    ("start", "to"),
    [(S.WAITING, S.DECODING), (S.WAITING, S.FINISHED), (S.FINISHED, S.WAITING), (S.ABORTED, S.PREFILLING)],
)
def test_illegal_moves_are_refused(start, to):
    request = Request("a", [1], state=start)
    assert not request.can_transition(to)
    with pytest.raises(ValueError, match="illegal move"):
        request.transition(to)
    assert request.state is start


@pytest.mark.parametrize("state", [S.WAITING, S.PREFILLING, S.DECODING])
def test_every_live_state_can_be_aborted(state):
    assert Request("a", [1], state=state).can_transition(S.ABORTED)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"top_logprobs": -1},
    ],
)
def test_sampling_params_reject_nonsense(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_request_rejects_bad_ids_and_tokens():
    with pytest.raises(ValueError, match="request_id"):
        Request("", [1])
    with pytest.raises(ValueError, match="token ids"):
        Request("a", [1, -2])


def test_counts_follow_prompt_and_output():
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    request.output_token_ids += [7, 8]
    request.num_computed_tokens = 4
    assert request.all_token_ids == [1, 2, 3, 7, 8]
    assert request.num_tokens == 5 and request.num_pending_tokens == 1


def test_check_valid_catches_inconsistent_records():
    Request("a", [1]).check_valid()
    with pytest.raises(AssertionError):
        Request("a", [1], pages=[3]).check_valid()  # waiting requests hold no pages
    with pytest.raises(AssertionError):
        Request("a", [1], state=S.DECODING, state_slot=0).check_valid()  # decoding without output
    with pytest.raises(AssertionError):
        Request("a", [1], state=S.FINISHED).check_valid()  # finished without a reason
    with pytest.raises(AssertionError):
        Request("a", [1], state=S.PREFILLING, state_slot=0, pages=[2, 2]).check_valid()


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1.4e-45, 1e-6])
def test_degenerate_temperatures_sample_greedily(temperature):
    """Dividing fp32 logits by these overflows to inf (NaN after softmax): they mean greedy."""
    assert SamplingParams(temperature=temperature).temperature == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1e-40])
def test_non_finite_or_negative_temperatures_are_refused(temperature):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature)


@settings(max_examples=200)
@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=12), output=st.lists(st.integers(0, 99), max_size=12),
       data=st.data())
def test_token_ids_between_is_a_slice_of_the_whole_sequence(prompt, output, data):
    request = Request("a", prompt, output_token_ids=list(output))
    n = len(prompt) + len(output)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n + 2))  # past the end: clamped like a slice
    assert request.token_ids_between(start, end) == tuple(request.all_token_ids[start:end])
