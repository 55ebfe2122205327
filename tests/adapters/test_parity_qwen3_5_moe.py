"""qwen3_5_moe through TorchExecutor matches transformers in fp32: prefill logits (computed in chunks),
32 greedy decode steps, all with a small expert cache that evicts constantly."""

import pytest

from tests.adapters.torch_exec_models import QWEN3_5_CONFIGS, check_parity


@pytest.mark.parametrize(("name", "prompt_len", "chunk"),
                         [("hybrid_3to1", 75, 70), ("alternating_mqa", 19, 6), ("wide_router", 9, 9)])
def test_qwen3_5_moe_matches_transformers(name, prompt_len, chunk, tmp_path):
    check_parity("qwen3_5_moe", QWEN3_5_CONFIGS[name], tmp_path, prompt_len, chunk)
