"""Layer by layer against transformers' own modules (fp32): Gated DeltaNet across chunk boundaries and
prefill/decode splits, RMS norms, partial rotary, the router."""

import pytest
import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf3

from adapters.torch_exec.gated_deltanet import GatedDeltaNet, GdnGeometry, LinearStatePool
from adapters.torch_exec.moe import route
from adapters.torch_exec.norms import rms_norm
from adapters.torch_exec.rotary import Rotary, apply_rotary

torch.set_num_threads(1)


def gdn_config():
    # one layer, linear attention only, so transformers' cache treats decode tokens as decode
    return Qwen3_5MoeTextConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                                num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@pytest.mark.parametrize("splits", [(130,), (64, 66), (70, 1, 59), (1, 1, 1, 127)])
def test_gated_deltanet_matches_transformers(splits):
    torch.manual_seed(0)
    cfg = gdn_config()
    ref = hf.Qwen3_5MoeGatedDeltaNet(cfg, 0).float()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
        ref.norm.weight.uniform_(0.5, 1.5)
    total, decode = sum(splits), 3
    x = torch.randn(1, total + decode, cfg.hidden_size)
    cache = hf.Qwen3_5MoeDynamicCache(cfg)
    with torch.no_grad():
        want = [ref(x[:, :total], cache_params=cache, cache_position=torch.arange(total))]
        for t in range(total, total + decode):
            want.append(ref(x[:, t:t + 1], cache_params=cache, cache_position=torch.tensor([t])))
    want = torch.cat(want, dim=1)[0]

    geo = GdnGeometry.from_text_config(cfg.to_dict())
    ours = GatedDeltaNet({k: v.detach() for k, v in ref.state_dict().items()}, geo, cfg.rms_norm_eps)
    pool = LinearStatePool(1, 3, geo, torch.float32, "cpu")
    got, start = [], 0
    with torch.no_grad():
        for n in splits:  # prefill in the given chunks, continuing from the slot's state
            got.append(ours.forward_sequence(x[0, start:start + n], pool, 0, 2))
            start += n
        for t in range(total, total + decode):
            got.append(ours.forward_decode(x[0, t:t + 1], pool, 0, torch.tensor([2])))
    got = torch.cat(got)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.allclose(pool.recurrent[0, 2], cache.recurrent_states[0][0], atol=1e-5)
    assert pool.recurrent[0, :2].abs().sum() == 0, "other slots must be untouched"


def test_norms_match_transformers():
    torch.manual_seed(1)
    x = torch.randn(5, 16)
    offset = hf.Qwen3_5MoeRMSNorm(16, eps=1e-6)
    plain = hf3.Qwen3MoeRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        offset.weight.normal_(0.0, 0.3)
        plain.weight.normal_(1.0, 0.3)
    assert torch.allclose(rms_norm(x, offset.weight, 1e-6, unit_offset=True), offset(x), atol=1e-6)
    assert torch.allclose(rms_norm(x, plain.weight, 1e-6, unit_offset=False), plain(x), atol=1e-6)
    assert not torch.allclose(rms_norm(x, offset.weight, 1e-6, unit_offset=False), offset(x), atol=1e-3)


@pytest.mark.parametrize("partial", [0.25, 0.5, 1.0])
def test_partial_rotary_matches_transformers(partial):
    cfg = Qwen3_5MoeTextConfig(head_dim=32, num_attention_heads=2, hidden_size=64, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial})
    emb = hf.Qwen3_5MoeTextRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 7, 300])
    q, k = torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32)  # [B, N, T, D]
    cos, sin = emb(q, positions[None])
    want_q, want_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    rot = Rotary(32, 10000.0, partial, "cpu")
    c, s = rot.cos_sin(positions, torch.float32)
    got_q = apply_rotary(q[0].transpose(0, 1), c, s).transpose(0, 1)  # [N, T, D]
    got_k = apply_rotary(k[0].transpose(0, 1), c, s).transpose(0, 1)
    assert torch.allclose(got_q, want_q[0], atol=1e-5) and torch.allclose(got_k, want_k[0], atol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_transformers(renormalize):
    cfg = hf3.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=renormalize)
    router = hf3.Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(6, 16)
    _, want_w, want_ids = router(x)
    got_w, got_ids = route(x, router.weight, 3, renormalize)
    assert torch.equal(got_ids, want_ids) and torch.allclose(got_w, want_w, atol=1e-6)
