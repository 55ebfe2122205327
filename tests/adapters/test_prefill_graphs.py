"""The MoE segments of short prefill steps (adapters/cuda_exec/prefill_graphs.py, --prefill-graphs): prefill chunks,
mixed steps and decode steps give the eager path's logits (fp32, within 1e-5 of the logit scale), its greedy tokens
and its residency decisions, with every step of up to 32 tokens run over a padded bucket (a tiny random Qwen3.5
MoE, on the CPU the same buffers and code without capture; on CUDA the segments replay from graphs)."""

import pytest
import torch

from adapters.cuda_exec import prefill_graphs
from adapters.cuda_exec.prefill_graphs import MoeSegments
from tests.adapters.test_fast_executor import _fast, _run
from tests.adapters.test_fast_executor_dedup import ckpt  # noqa: F401  (the module's checkpoint fixture)


@pytest.mark.parametrize("tokens_per_pool", [16, 8])
def test_segment_steps_match_the_eager_steps(ckpt, monkeypatch, tokens_per_pool):  # noqa: F811
    """A pool of every expert (buckets 8 and 16: every step of the run is a segment step), and one of 8 tokens'
    keys (bucket 8 only: steps of more tokens run eagerly between them; misses and evictions between steps)."""
    slots = min(tokens_per_pool * ckpt.spec.top_k, ckpt.spec.num_layers * ckpt.spec.num_experts)
    eager, segmented = {}, {}
    plain = _fast(ckpt, slots)
    # NOTE: replays off in both: this run's 4-token chunks would otherwise run as decode replays (ADR 0026), which
    # take short chunks before the segments do
    plain.short_prompt_tokens = 0
    tokens = _run(plain, eager)
    runs = []
    real = MoeSegments.run
    monkeypatch.setattr(MoeSegments, "run", lambda self, i, buf: runs.append(buf.valid.shape[0]) or real(self, i, buf))
    fast = _fast(ckpt, slots, prefill_graphs=True)
    fast.short_prompt_tokens = 0
    assert fast.model.segments.buckets == tuple(b for b in prefill_graphs.BUCKETS if b <= tokens_per_pool)
    assert _run(fast, segmented) == tokens
    assert runs and set(runs) <= set(fast.model.segments.buckets)
    assert len(runs) % ckpt.spec.num_layers == 0  # every layer of every segment step
    assert fast.expert_counters() == plain.expert_counters()  # the same hits and misses: the same decisions
    assert torch.equal(fast.experts.residency.slot_of_key, plain.experts.residency.slot_of_key)
    fast.check_valid()
    assert eager.keys() == segmented.keys()
    for rid in eager:
        for want, got in zip(eager[rid], segmented[rid], strict=True):
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_prefill_graphs_need_the_triton_prefill(ckpt):  # noqa: F811
    with pytest.raises(ValueError, match="prefill graphs"):
        _fast(ckpt, 4 * ckpt.spec.top_k, prefill_graphs=True, prefill_kernels=False)
