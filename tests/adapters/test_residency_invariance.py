"""Residency never changes results: the same batched requests with every expert resident and with a
handful of constantly evicting slots give bitwise-identical logits at every step."""

import pytest
import torch

from adapters.torch_exec.executor import TorchExecutor
from tests.adapters.torch_exec_models import (
    QWEN3_5_CONFIGS,
    QWEN3_CONFIGS,
    Sequence,
    build_hf_model,
    make_plan,
    pages_for,
    run_requests,
    save_and_load,
)

NEW_TOKENS = 6


def run(ckpt, expert_slots: int, prompts) -> tuple[dict, TorchExecutor]:
    executor = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=expert_slots), "cpu", torch.float32)
    seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + NEW_TOKENS), state_slot=i) for i, p in enumerate(prompts)]
    record: dict = {}
    run_requests(executor, seqs, NEW_TOKENS, chunk=4, record=record)
    return record, executor


@pytest.mark.parametrize(("arch", "config"), [("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]),
                                              ("qwen3_moe", QWEN3_CONFIGS["raw_topk_tied"])])
def test_logits_bitwise_identical_across_cache_sizes(arch, config, tmp_path):
    model = build_hf_model(arch, config)
    ckpt = save_and_load(model, tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 3, 14)]
    total = ckpt.spec.num_layers * ckpt.spec.num_experts

    resident, full = run(ckpt, total, prompts)
    # the fewest slots the plan allows (top-k): a batch routes to more experts per layer, so lookups split
    tiny, small = run(ckpt, ckpt.spec.top_k, prompts)

    assert full.experts.residency.evictions == 0 and full.expert_misses <= total
    assert small.experts.residency.evictions > 0 and small.expert_misses > full.expert_misses
    assert resident.keys() == tiny.keys()
    for rid in resident:
        assert len(resident[rid]) == len(tiny[rid]) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(resident[rid], tiny[rid], strict=True)):
            assert torch.equal(a, b), f"{rid} step {step}: logits differ by {(a - b).abs().max().item():.3g}"
