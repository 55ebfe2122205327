"""The fast path with the expert-deduplicated MoE GEMVs switched on (expert_pool.DEDUP_MIN_PAIRS) gives the
per-pair path's decode logits bit for bit, at another expert-slot count too (a tiny random Qwen3.5 MoE;
prefill chunks, mixed steps and decode steps through the fused routing)."""

import pytest
import torch

import adapters.kernels.fused_moe as fused_moe_mod
from adapters.cuda_exec import expert_pool
from tests.adapters.test_fast_executor import _fast, _run
from tests.adapters.torch_exec_models import QWEN3_5_CONFIGS, build_hf_model, save_and_load


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"])
    return save_and_load(model, tmp_path_factory.mktemp("hybrid_3to1"))


def test_dedup_decode_logits_are_bitwise_the_per_pair_logits(ckpt, monkeypatch):
    total = ckpt.spec.num_layers * ckpt.spec.num_experts
    per_pair, dedup = {}, {}
    _run(_fast(ckpt, total), per_pair)
    calls = []
    real = fused_moe_mod.moe_gate_up_dedup
    monkeypatch.setattr(fused_moe_mod, "moe_gate_up_dedup", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(expert_pool, "DEDUP_MIN_PAIRS", 1)
    _run(_fast(ckpt, 4 * ckpt.spec.top_k), dedup)  # a small pool: prefill chunks go in groups of experts
    assert calls, "the dedup kernels never ran"
    assert per_pair.keys() == dedup.keys()
    for rid in per_pair:
        for a, b in zip(per_pair[rid], dedup[rid], strict=True):
            assert torch.equal(a, b)
