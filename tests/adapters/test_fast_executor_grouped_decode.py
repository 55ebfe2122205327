"""The fast path with the decode calls on the grouped GEMMs (expert_pool.GROUPED_DECODE_MIN_PAIRS; on CUDA inside the
captured decode graphs) gives the per-pair path's decode logits within fp32 rounding and its greedy tokens, and the
same bits at another expert-slot count (a tiny random Qwen3.5 MoE; prefill chunks, mixed steps, decode steps)."""

import torch

from adapters.cuda_exec import expert_pool
from tests.adapters.test_fast_executor import _fast, _run
from tests.adapters.test_fast_executor_dedup import ckpt  # noqa: F401  (the module's checkpoint fixture)


def test_grouped_decode_logits_match_the_per_pair_logits(ckpt, monkeypatch):  # noqa: F811
    total = ckpt.spec.num_layers * ckpt.spec.num_experts
    per_pair, grouped, grouped_small = {}, {}, {}
    tokens = _run(_fast(ckpt, total), per_pair)
    calls = []
    real = expert_pool.DeviceExpertPool._grouped_by_expert
    monkeypatch.setattr(expert_pool.DeviceExpertPool, "_grouped_by_expert",
                        lambda self, *a: calls.append(1) or real(self, *a))
    monkeypatch.setattr(expert_pool, "GROUPED_DECODE_MIN_PAIRS", 1)
    assert _run(_fast(ckpt, total), grouped) == tokens  # the greedy tokens
    assert calls, "the grouped decode path never ran"
    _run(_fast(ckpt, 4 * ckpt.spec.top_k), grouped_small)  # a small pool: misses and evictions between steps
    assert per_pair.keys() == grouped.keys() == grouped_small.keys()
    for rid in per_pair:
        for want, got, small in zip(per_pair[rid], grouped[rid], grouped_small[rid], strict=True):
            assert float((got - want).abs().max() / want.abs().max()) < 1e-4
            assert torch.equal(got, small)
