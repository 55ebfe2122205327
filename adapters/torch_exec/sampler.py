"""Token sampling: greedy, temperature, top-k, top-p; seeded per (seed, output_index) so batching never
changes a seeded result; log-probabilities of the model's raw distribution.

Shape legend: B rows, V vocab.

The draw is on the device, for a whole batch at once (`sample_rows`, tensor ops only: no host sync, so
the fast path samples every row of a step and copies the tokens back once): a Gumbel-max race over the
filtered distribution, token = argmax(log p_i + G_i) with G_i = -log(-log u_i), which samples exactly
from p (Gumbel 1954; the "Gumbel-max trick"). The uniforms u_i come from a counter-based hash of
(row key, token id): a row's draw depends on its key alone, never on the batch, the device's RNG state
or the order rows run in. A seeded request's key is a hash of (seed, output index); an unseeded one's
comes from the sampler's shared host stream (reproducible per process, not per request).
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


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (two xor-shift-multiply rounds) of int64 values in [0, 2^32); every product
    stays below 2^59, so int64 arithmetic never overflows on any device."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """u [B, V] fp32 in (0, 1): a deterministic function of (keys[b], token id) only. keys int64 [B] >= 0."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :]  # [1, V]
    lo, hi = (keys & _MASK32)[:, None], ((keys >> 32) & _MASK32)[:, None]  # [B, 1]
    x = _hash32(_hash32(ids ^ lo) ^ hi)
    x = _hash32((x + 0x9E3779B9) & _MASK32)  # one more round: neighbouring ids decorrelated
    return ((x >> 8).to(torch.float32) + 0.5) * (2.0 ** -24)  # 24 bits: exact in fp32, never 0 or 1


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                keys: torch.Tensor) -> torch.Tensor:
    """tokens int64 [B] drawn from logits [B, V] row by row, on logits' device, with no host sync.

    temperature fp32 [B] (0: greedy), top_k int64 [B] (0: off; 1: greedy), top_p fp32 [B] (1: off), keys
    int64 [B] (see uniforms). Filtering is filtered_probs' (temperature, then top-k keeping ties with the
    k-th value, then the smallest prefix of mass >= top_p, the top token always kept); greedy rows take
    the argmax of the raw logits.
    """
    logits = logits.float()
    rows, vocab = logits.shape
    greedy = (temperature <= 0) | (top_k == 1)  # [B]
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]  # [B, V]
    values, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [B]
    kth = values.gather(1, (k - 1)[:, None])  # [B, 1]
    keep = values >= kth  # top-k with its ties (what masking below the k-th value keeps)
    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)  # [B, V] sorted order
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
    rank0 = torch.arange(vocab, device=logits.device)[None, :] == 0
    keep &= (before < top_p[:, None]) | rank0
    gumbel = -torch.log(-torch.log(uniforms(keys, vocab).gather(1, order)))  # [B, V], keyed by token id
    score = torch.where(keep, torch.log(probs) + gumbel, float("-inf"))
    drawn = order.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]  # [B]
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


class Sampler:
    def __init__(self, seed: int = 0):
        # Requests without a seed draw their keys from one shared stream (reproducible per process).
        self._shared = torch.Generator(device="cpu").manual_seed(seed)

    def key(self, params: SamplingParams, output_index: int) -> int:
        """The row key of one draw: a hash of (seed, output index), or the shared stream's next value."""
        if params.seed is not None:
            return _seed_for(params.seed, output_index)
        return int(torch.randint(0, 2**62, (1,), generator=self._shared))

    def sample_batch(self, logits: torch.Tensor, params: list[SamplingParams],
                     output_indices: list[int]) -> torch.Tensor:
        """tokens int64 [B] (on logits' device) for logits [B, V]: one small host->device copy of the rows'
        settings, the draw on the device (sample_rows)."""
        dev = logits.device
        # two transfers per step, not four: the float settings and the integer ones each in one tensor
        temperature, top_p = torch.tensor([[p.temperature for p in params], [p.top_p for p in params]],
                                          dtype=torch.float32).to(dev)
        # NOTE: a cut past the vocabulary is no cut; clamped so a huge top_k still fits the int64 tensor
        vocab = logits.shape[-1]
        top_k, keys = torch.tensor([[min(p.top_k, vocab) for p in params],
                                    [self.key(p, i) for p, i in zip(params, output_indices, strict=True)]],
                                   dtype=torch.int64).to(dev)
        return sample_rows(logits, temperature, top_k, top_p, keys)

    def sample(self, request_id: str, logits: torch.Tensor, params: SamplingParams,
               output_index: int, token: int | None = None) -> SampledToken:
        """logits [V] (any device) -> one token with its log-probability and top alternatives.
        token: already drawn (by sample_batch for the whole step); only the log-probabilities are added."""
        logits = logits.float()
        if token is None:
            if params.temperature == 0.0 or params.top_k == 1:
                token = int(torch.argmax(logits))
            else:
                token = int(self.sample_batch(logits[None], [params], [output_index])[0])
        logprob, top = None, ()
        if params.logprobs or params.top_logprobs:
            logprobs = torch.log_softmax(logits, dim=-1)  # [V] the model's own distribution
            logprob = float(logprobs[token])
            if params.top_logprobs:
                values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.shape[-1]))
                top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return SampledToken(request_id, token, logprob, top)
