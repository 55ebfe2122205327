"""Batching never changes tokens: requests of different lengths, prefilled in chunks and decoded
together, produce the same greedy tokens as each run alone (reusing one state slot in turn)."""

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

NEW_TOKENS = 10
PROMPT_LENGTHS = (13, 4, 22)


@pytest.mark.parametrize(("arch", "config"), [("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]),
                                              ("qwen3_moe", QWEN3_CONFIGS["renormalised"])])
def test_batched_equals_alone(arch, config, tmp_path):
    model = build_hf_model(arch, config)
    vocab = model.config.vocab_size
    ckpt = save_and_load(model, tmp_path)
    executor = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=6), "cpu", torch.float32)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]

    alone = []
    for i, prompt in enumerate(prompts):  # one after another in slot 0: each must reset what the last left
        seq = Sequence(f"r{i}", prompt, pages_for(i, len(prompt) + NEW_TOKENS), state_slot=0)
        run_requests(executor, [seq], NEW_TOKENS, chunk=5)
        alone.append(seq.output)

    together = [Sequence(f"r{i}", p, pages_for(i, len(p) + NEW_TOKENS), state_slot=3 - i)
                for i, p in enumerate(prompts)]
    run_requests(executor, together, NEW_TOKENS, chunk=5)
    assert [s.output for s in together] == alone
    assert len({tuple(o) for o in alone}) == len(alone), "distinct prompts should continue differently"
