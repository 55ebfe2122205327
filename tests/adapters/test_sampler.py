"""Sampler: greedy, temperature, top-k, top-p, per-(seed, output_index) reproducibility, log-probs."""

import math

import pytest
import torch

from adapters.torch_exec.sampler import Sampler, filtered_probs, sample_rows, uniforms
from domain.request import SamplingParams

LOGITS = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))  # probabilities 0.05 / 0.5 / 0.15 / 0.3


def draws(params: SamplingParams, n: int, logits=LOGITS) -> list[int]:
    sampler = Sampler(seed=0)
    return [sampler.sample("r", logits, params, i).token_id for i in range(n)]


def test_greedy_is_argmax_and_ignores_seed():
    assert draws(SamplingParams(temperature=0.0), 5) == [1] * 5
    assert draws(SamplingParams(temperature=0.0, seed=3), 5) == [1] * 5
    assert draws(SamplingParams(temperature=0.7, top_k=1), 5) == [1] * 5


def test_top_k_keeps_exactly_the_k_best():
    probs = filtered_probs(LOGITS, SamplingParams(top_k=2))
    assert torch.allclose(probs, torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]))
    assert set(draws(SamplingParams(top_k=2), 300)) == {1, 3}


@pytest.mark.parametrize("top_k", [4, 5, 2**63 - 1, 2**63, 10**30])
def test_a_top_k_at_or_past_the_vocabulary_is_no_cut(top_k):
    # NOTE: 2**63 and up used to fail packing the settings into an int64 tensor (HTTP 500 for a client's top_k)
    params = SamplingParams(top_k=top_k, seed=7)
    assert draws(params, 40) == draws(SamplingParams(top_k=0, seed=7), 40)
    assert set(draws(params, 300)) == {0, 1, 2, 3}


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, {1}), (0.7, {1, 3}), (0.8, {1, 3}), (0.81, {1, 3, 2}),
                                             (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    probs = filtered_probs(LOGITS, SamplingParams(top_p=top_p))
    assert {i for i, p in enumerate(probs.tolist()) if p > 0} == kept
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_temperature_sharpens_and_flattens():
    cold = filtered_probs(LOGITS, SamplingParams(temperature=0.25))
    hot = filtered_probs(LOGITS, SamplingParams(temperature=4.0))
    assert cold[1] > 0.85 and 0.25 < hot[1] < 0.4


def test_sampling_frequencies_follow_the_distribution():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0), 4000)), minlength=4).float()
    assert torch.allclose(counts / 4000, LOGITS.exp(), atol=0.03)


def test_seeded_draws_depend_only_on_seed_and_output_index():
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler(seed=0).sample("a", LOGITS, params, i).token_id for i in range(40)]
    # a different sampler whose shared stream has been advanced by unseeded requests in between
    busy = Sampler(seed=99)
    mixed = []
    for i in range(40):
        busy.sample("b", LOGITS, SamplingParams(temperature=1.0), i)
        mixed.append(busy.sample("a", LOGITS, params, i).token_id)
    assert mixed == alone
    assert len(set(alone)) > 1, "draws at different output indices must not all coincide"
    other_seed = [Sampler().sample("a", LOGITS, SamplingParams(temperature=1.0, seed=1235), i).token_id
                  for i in range(40)]
    assert other_seed != alone


def test_logprobs_are_the_raw_distribution():
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    tok = Sampler().sample("r", LOGITS, params, 0)
    assert tok.token_id == 1 and math.isclose(tok.logprob, math.log(0.5), rel_tol=1e-5)
    assert [t for t, _ in tok.top_logprobs] == [1, 3, 2]
    assert [round(lp, 5) for _, lp in tok.top_logprobs] == [round(math.log(p), 5) for p in (0.5, 0.3, 0.15)]
    plain = Sampler().sample("r", LOGITS, SamplingParams(temperature=0.0), 0)
    assert plain.logprob is None and plain.top_logprobs == ()


# ---- the batched device draw (sample_rows): what the fast path runs for a whole step -------------------


def _rows(params: list[SamplingParams], logits: torch.Tensor, keys: list[int]) -> list[int]:
    return sample_rows(logits, torch.tensor([p.temperature for p in params]), torch.tensor([p.top_k for p in params]),
                       torch.tensor([p.top_p for p in params]), torch.tensor(keys)).tolist()


def test_a_rows_draw_depends_on_its_key_and_logits_only():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=gen)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
              ((0.7, 0, 1.0), (1.0, 5, 1.0), (0.0, 0, 1.0), (1.3, 0, 0.8), (0.9, 1, 1.0), (1.0, 10, 0.5))]
    keys = [11, 2**61 + 7, 3, 99, 5, 123456789]
    batch = _rows(params, logits, keys)
    alone = [_rows([p], logits[i:i + 1], [k])[0] for i, (p, k) in enumerate(zip(params, keys, strict=True))]
    shuffled = _rows(params[::-1], logits.flip(0), keys[::-1])[::-1]
    assert batch == alone == shuffled
    assert batch[2] == int(logits[2].argmax()) and batch[4] == int(logits[4].argmax())  # greedy rows


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(top_k=4),
                                    SamplingParams(temperature=1.5, top_p=0.7), SamplingParams(top_k=6, top_p=0.9)])
def test_batched_draws_follow_the_filtered_distribution(params):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    n = 20000
    tokens = torch.tensor(_rows([params] * n, logits.expand(n, -1), list(range(n))))
    freq = torch.bincount(tokens, minlength=12).float() / n
    want = filtered_probs(logits, params)
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-3).all(), (freq, want)
    assert (freq[want == 0] == 0).all()  # nothing outside the top-k / top-p set is ever drawn


def test_uniforms_are_open_unit_interval_and_keyed():
    u = uniforms(torch.tensor([0, 1, 2**62 - 1]), 100000)
    assert ((u > 0) & (u < 1)).all()
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and torch.equal(u, uniforms(torch.tensor([0, 1, 2**62 - 1]), 100000))
    assert abs(float(torch.corrcoef(torch.stack((u[0, :-1], u[0, 1:])))[0, 1])) < 0.02  # neighbours unrelated
