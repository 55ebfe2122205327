"""A tiny model in each quantization format, written by `synthesize` and loaded by our loader,
generates the same greedy tokens with TorchExecutor (weights kept quantized, dequantized per K
block inside the matmul) as transformers running the dequantized weights in fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adapters.checkpoint.loader import LoadedCheckpoint, load_checkpoint
from adapters.checkpoint.quant import QTensor, dequantize
from adapters.checkpoint.synth import synthesize
from adapters.checkpoint.synth_config import FORMATS, GEOMETRIES
from adapters.torch_exec.executor import TorchExecutor
from domain.ports import SequenceWork, StepBatch
from tests.adapters.test_quant_formats import FORMAT_NAME
from tests.adapters.torch_exec_models import GREEDY, assert_close, hf_greedy, make_plan, pages_for

transformers = pytest.importorskip("transformers")

DECODE_STEPS = 12
PROMPT_LEN = 11
GEOMETRY = {
    "qwen3_5_moe": dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256),
    "qwen3_moe": dataclasses.replace(GEOMETRIES["tiny-qwen3moe"], vocab_size=256),
}


def hf_model_from(ckpt: LoadedCheckpoint):
    """transformers model holding the dequantized (fp32) weights of our loaded checkpoint."""
    spec, text = ckpt.spec, dict(ckpt.text_config)
    if spec.architecture == "qwen3_5_moe":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**text))
    state = {}
    for name, w in ckpt.dense.items():
        full = dequantize(w) if isinstance(w, QTensor) else w.float()
        state[name if name == "lm_head.weight" else "model." + name] = full
    for layer in range(spec.num_layers):
        experts = [ckpt.experts.weights(layer, e) for e in range(spec.num_experts)]
        gate_up = torch.stack([torch.cat([dequantize(x.gate), dequantize(x.up)]) for x in experts])  # [E, 2I, H]
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([dequantize(x.down) for x in experts])
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def our_greedy(ckpt: LoadedCheckpoint, prompt: list[int], steps: int):
    executor = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=ckpt.spec.top_k + 1), "cpu", torch.float32)
    pages = pages_for(0, len(prompt) + steps + 1)
    work = SequenceWork("r", tuple(prompt), 0, pages, 0, True, GREEDY, 0)
    logits = executor.compute_logits(StepBatch((work,)))["r"][0]
    tokens, all_logits = [int(logits.argmax())], []
    for step in range(steps):
        work = SequenceWork("r", (tokens[-1],), len(prompt) + step, pages, 0, True, GREEDY, step + 1)
        logits = executor.compute_logits(StepBatch((work,)))["r"][0]
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
    executor.check_valid()
    return tokens, all_logits


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_generates_like_transformers_on_dequantized_weights(fmt, tmp_path):
    ckpt = load_checkpoint(synthesize(tmp_path, GEOMETRY["qwen3_5_moe"], fmt, seed=11, tokenizer=False),
                           progress=False)
    assert ckpt.format_name == FORMAT_NAME.get(fmt, fmt)
    if fmt != "bf16":  # the executor really receives quantized weights
        assert isinstance(ckpt.dense["layers.3.self_attn.q_proj.weight"], QTensor)
    model = hf_model_from(ckpt)
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2)).tolist()
    _, ref_logits, ref_tokens = hf_greedy(model, prompt, DECODE_STEPS)
    tokens, logits = our_greedy(ckpt, prompt, DECODE_STEPS)
    for step, (ours, ref) in enumerate(zip(logits, ref_logits, strict=True)):
        assert_close(ours, ref, f"{fmt} decode step {step}")
    assert tokens == ref_tokens
    assert len(set(tokens)) > 1  # not a degenerate constant continuation


@pytest.mark.parametrize("fmt", ["fp8_channel", "int8_quark"])
def test_second_architecture_in_quantized_formats(fmt, tmp_path):
    ckpt = load_checkpoint(synthesize(tmp_path, GEOMETRY["qwen3_moe"], fmt, seed=12, tokenizer=False),
                           progress=False)
    model = hf_model_from(ckpt)
    prompt = list(range(3, 3 + PROMPT_LEN))
    _, _, ref_tokens = hf_greedy(model, prompt, DECODE_STEPS)
    tokens, _ = our_greedy(ckpt, prompt, DECODE_STEPS)
    assert tokens == ref_tokens


def _generate_and_compare(ckpt: LoadedCheckpoint, what: str) -> None:
    model = hf_model_from(ckpt)
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2)).tolist()
    _, ref_logits, ref_tokens = hf_greedy(model, prompt, DECODE_STEPS)
    tokens, logits = our_greedy(ckpt, prompt, DECODE_STEPS)
    for step, (ours, ref) in enumerate(zip(logits, ref_logits, strict=True)):
        assert_close(ours, ref, f"{what} decode step {step}")
    assert tokens == ref_tokens and len(set(tokens)) > 1


def test_compressed_tensors_nvfp4_fused_packed_experts_generate_like_transformers(tmp_path):
    """`mlp.experts.gate_up_proj_packed` / `down_proj_packed` with their scales, split per expert at load."""
    out = synthesize(tmp_path, GEOMETRY["qwen3_5_moe"], "nvfp4_ct", seed=13, tokenizer=False, experts="fused")
    ckpt = load_checkpoint(out, progress=False)
    assert ckpt.experts.layout.fmt.value == "nvfp4" and ckpt.format_name == "nvfp4_ct"
    _generate_and_compare(ckpt, "fused nvfp4_ct")


def test_config_with_only_full_attention_interval_generates_like_transformers(tmp_path):
    """No `layer_types`: the kinds are derived once (domain) and the executor reads the same ones."""
    import json

    out = synthesize(tmp_path, dataclasses.replace(GEOMETRY["qwen3_5_moe"], full_attention_interval=2), "bf16",
                     seed=14, tokenizer=False)
    config = json.loads((out / "config.json").read_text())
    del config["text_config"]["layer_types"]
    (out / "config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(out, progress=False)
    assert ckpt.text_config["layer_types"] == ["linear_attention", "full_attention"] * 2
    _generate_and_compare(ckpt, "derived layer_types")
