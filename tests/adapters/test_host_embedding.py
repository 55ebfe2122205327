"""The input embedding in pinned host memory on CUDA (adapters.checkpoint.loader.hosts_embedding): which deployments
keep it there, and that a decoder reading it through the gather kernel embeds exactly what the on-device table
does. The plan's side (the table out of the GPU budget) is in tests/domain/test_serve_plan.py."""

import pytest
import torch

from adapters.checkpoint.loader import EMBEDDING, host_embedding_enabled, hosts_embedding
from adapters.torch_exec import qwen3_5_moe
from tests.adapters.torch_exec_models import QWEN3_5_CONFIGS, build_hf_model, save_and_load

UNTIED = {EMBEDDING: None, "lm_head.weight": None, "norm.weight": None}


def test_only_an_untied_cuda_deployment_with_copyable_rows_hosts_the_embedding():
    assert hosts_embedding("cuda", UNTIED, 2048) and hosts_embedding(torch.device("cuda", 1), UNTIED, 64)
    assert not hosts_embedding("cpu", UNTIED, 2048)  # a CPU deployment has no other memory to use
    tied = {EMBEDDING: None, "norm.weight": None}
    assert not hosts_embedding("cuda", tied, 2048)  # the table is the head's weight: read whole every step
    assert not hosts_embedding("cuda", UNTIED, 2044)  # rows of 4,088 bytes: not a multiple of 16


def test_the_switch_turns_it_off_and_refuses_what_it_cannot_read(monkeypatch):
    monkeypatch.setenv("FLUXTIDE_HOST_EMBEDDING", "0")
    assert not host_embedding_enabled() and not hosts_embedding("cuda", UNTIED, 2048)
    monkeypatch.setenv("FLUXTIDE_HOST_EMBEDDING", "1")
    assert host_embedding_enabled() and hosts_embedding("cuda", UNTIED, 2048)
    monkeypatch.setenv("FLUXTIDE_HOST_EMBEDDING", "off")  # a typo is not read as either
    with pytest.raises(ValueError, match="FLUXTIDE_HOST_EMBEDDING must be 0 or 1"):
        hosts_embedding("cuda", UNTIED, 2048)


def test_a_cpu_decoder_keeps_its_table_and_embeds_by_indexing(tmp_path):
    ckpt = save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path)
    model = qwen3_5_moe.build(ckpt.dense, ckpt.text_config, torch.float32, "cpu")
    assert model.embed.device.type == "cpu" and model.embed.dtype == torch.float32 and not model.embed_hosted
    ids = torch.tensor([3, 0, 3, 17])
    assert torch.equal(model.embed_rows(ids), ckpt.dense[EMBEDDING].float()[ids])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory, UVA)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_cuda_decoder_reads_the_hosted_table_bit_for_bit_also_inside_a_graph(tmp_path, dtype):
    ckpt = save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path)
    hosted = qwen3_5_moe.build(ckpt.dense, ckpt.text_config, dtype, "cuda")
    assert hosted.embed_hosted and hosted.embed.device.type == "cpu" and hosted.embed.is_pinned()
    assert hosted.embed.dtype == dtype
    with pytest.raises(ValueError, match="ids must be on the decoder's device"):
        hosted.embed_rows(torch.tensor([0]))  # host ids would index the host table: host rows
    assert EMBEDDING not in hosted.w  # no device copy of the table
    on_device = qwen3_5_moe.build({**ckpt.dense, EMBEDDING: ckpt.dense[EMBEDDING].cuda()}, ckpt.text_config, dtype,
                                  "cuda")
    assert on_device.embed.device.type == "cuda"
    vocab = ckpt.dense[EMBEDDING].shape[0]
    ids = torch.tensor([vocab - 1, 0, 5, 5, 9], device="cuda")
    assert torch.equal(hosted.embed_rows(ids), on_device.embed_rows(ids))
    out = hosted.embed_rows(ids)  # warm-up (the kernel compiles) before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hosted.embed_rows(ids)
    ids.copy_(torch.tensor([1, 2, 3, 4, vocab - 2], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, on_device.embed_rows(ids))
