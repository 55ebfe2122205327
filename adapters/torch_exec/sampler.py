"""Token sampling: greedy, temperature, top-k, top-p; seeded per (seed, output_index) so batching never
changes a seeded result; log-probabilities of the model's raw distribution.

Shape legend: V vocab.
"""

import hashlib

import torch

from domain.ports import SampledToken
from domain.request import SamplingParams


def _seed_for(seed: int, output_index: int) -> int:
    """Independent, well-mixed 63-bit seed per (request seed, token index)."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution [V] fp32 after temperature, top-k, then top-p."""
    scaled = logits.float() / params.temperature  # [V]
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)  # [V]
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        # NOTE: keep the smallest prefix whose mass reaches top_p; the top token always survives.
        drop_sorted = before >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


class Sampler:
    def __init__(self, seed: int = 0):
        # Requests without a seed draw from one shared stream (reproducible per process, not per request).
        self._shared = torch.Generator(device="cpu").manual_seed(seed)

    def sample(self, request_id: str, logits: torch.Tensor, params: SamplingParams,
               output_index: int) -> SampledToken:
        """logits [V] (any device) -> one token with its log-probability and top alternatives."""
        logits = logits.float()
        if params.temperature == 0.0 or params.top_k == 1:
            token = int(torch.argmax(logits))
        else:
            probs = filtered_probs(logits, params).cpu()
            if params.seed is not None:
                gen = torch.Generator(device="cpu").manual_seed(_seed_for(params.seed, output_index))
            else:
                gen = self._shared
            token = int(torch.multinomial(probs, 1, generator=gen))
        logprob, top = None, ()
        if params.logprobs or params.top_logprobs:
            logprobs = torch.log_softmax(logits, dim=-1)  # [V] the model's own distribution
            logprob = float(logprobs[token])
            if params.top_logprobs:
                values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.shape[-1]))
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return SampledToken(request_id, token, logprob, top)
