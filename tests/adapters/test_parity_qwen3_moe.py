"""qwen3_moe (plain attention, no shared expert) through TorchExecutor matches transformers in fp32."""

import pytest

from tests.adapters.torch_exec_models import QWEN3_CONFIGS, check_parity


@pytest.mark.parametrize(("name", "prompt_len", "chunk"), [("renormalised", 17, 5), ("raw_topk_tied", 11, 11)])
def test_qwen3_moe_matches_transformers(name, prompt_len, chunk, tmp_path):
    check_parity("qwen3_moe", QWEN3_CONFIGS[name], tmp_path, prompt_len, chunk)
