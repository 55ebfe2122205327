"""Bad files fail at load, naming file and tensor, before the bank is allocated: truncated or
malformed shards, tensors whose shape disagrees with config.json, non-finite or zero-divisor scales,
NaN weights (behind verify_weights / `ft check`), a missing untied lm_head, experts in two formats."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from pathlib import Path

import httpx
import pytest
import torch

import adapters.checkpoint.loader as loader
from adapters.checkpoint.formats import CheckpointFormatError
from adapters.checkpoint.synth import synthesize
from adapters.checkpoint.synth_config import GEOMETRIES
from app.cli import main as ft_main
from app.containers import Container
from tests.adapters.test_loader_errors import copy_with
from tests.app.conftest import start_server
from tests.log_records import logger_records

TINY = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256, num_hidden_layers=4, num_experts=4)
P = "model.language_model."
Q_PROJ = P + "layers.3.self_attn.q_proj"
EXPERT = P + "layers.1.mlp.experts.2.down_proj"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {fmt: synthesize(root / fmt, TINY, fmt, seed=1, tokenizer=False, shard_bytes=1 << 30)
            for fmt in ("bf16", "nvfp4_modelopt", "nvfp4_ct", "mixed_modelopt")}


@pytest.fixture
def no_allocation(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("bank allocated before the checkpoint was validated")

    monkeypatch.setattr(loader, "allocate_rows", refuse)


def load(path: Path, **kw):
    return loader.load_checkpoint(path, progress=False, **kw)


# ---- truncated and malformed shards ------------------------------------------------------------

@pytest.mark.parametrize("mmap", [False, True])
def test_truncated_shard_names_file_and_tensor(sources, tmp_path, no_allocation, mmap):
    dst = copy_with(sources["bf16"], tmp_path / "c")
    os.truncate(dst / "model.safetensors", (dst / "model.safetensors").stat().st_size - 4096)
    with pytest.raises(CheckpointFormatError, match=r"model\.safetensors: tensor \S+ ends at byte \d+ but the "
                                                    r"file has \d+ bytes \(truncated"):
        load(dst, mmap=mmap)  # mmap used to load, say ok on /health, and fail the first request


def test_file_shorter_than_its_header(sources, tmp_path, no_allocation):
    dst = copy_with(sources["bf16"], tmp_path / "c")
    os.truncate(dst / "model.safetensors", 100)
    with pytest.raises(CheckpointFormatError, match=r"model\.safetensors: header says \d+ bytes but the file has 100"):
        load(dst)


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # same length: the data offsets stay where they were
    assert len(text) == n
    path.write_bytes(raw[:8] + text + raw[8 + n:])


def test_offsets_disagreeing_with_shape_and_overlapping_tensors(sources, tmp_path, no_allocation):
    dst = copy_with(sources["bf16"], tmp_path / "c")
    name = Q_PROJ + ".weight"
    _rewrite_header(dst / "model.safetensors", lambda h: h[name].update(shape=[h[name]["shape"][0] - 1,
                                                                              h[name]["shape"][1]]))
    with pytest.raises(CheckpointFormatError, match=rf"model\.safetensors: tensor {name}: data_offsets .* needs"):
        load(dst)
    dst = copy_with(sources["bf16"], tmp_path / "d")

    def overlap(h):
        a, b = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])[:2]
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]

    _rewrite_header(dst / "model.safetensors", overlap)
    with pytest.raises(CheckpointFormatError, match=r"model\.safetensors: tensors \S+ and \S+ overlap"):
        load(dst)


# ---- shapes against the config -----------------------------------------------------------------

def test_dense_tensor_one_row_short_names_file_and_tensor(sources, tmp_path, no_allocation):
    dst = copy_with(sources["bf16"], tmp_path / "c",
                    edit_tensors=lambda t: t.update({Q_PROJ + ".weight": t[Q_PROJ + ".weight"][:-1].clone()}))
    with pytest.raises(CheckpointFormatError, match=rf"{Q_PROJ}\.weight in model\.safetensors: shape \(255, 160\), "
                                                    r"expected \(256, 160\) from config\.json"):
        load(dst)


def test_quantized_dense_tensor_with_wrong_shape(sources, tmp_path, no_allocation):
    def short(t):
        for suffix in ("weight", "weight_scale"):
            t[f"{Q_PROJ}.{suffix}"] = t[f"{Q_PROJ}.{suffix}"][:-1].clone()

    dst = copy_with(sources["nvfp4_modelopt"], tmp_path / "c", edit_tensors=short)
    with pytest.raises(CheckpointFormatError, match=r"q_proj\.weight in model\.safetensors: logical shape "
                                                    r"\(255, 160\), expected \(256, 160\)"):
        load(dst)


def test_missing_dense_tensor_and_norm_of_wrong_length(sources, tmp_path, no_allocation):
    name = P + "layers.0.linear_attn.A_log"
    dst = copy_with(sources["bf16"], tmp_path / "c", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointFormatError, match=r"missing tensor layers\.0\.linear_attn\.A_log \(shape \(4,\)"):
        load(dst)
    norm = P + "norm.weight"
    dst = copy_with(sources["bf16"], tmp_path / "d", edit_tensors=lambda t: t.update({norm: t[norm][:-2].clone()}))
    with pytest.raises(CheckpointFormatError, match=rf"{norm} in model\.safetensors: shape \(158,\), expected \(160,\)"):
        load(dst)


def test_untied_checkpoint_without_lm_head_is_refused(sources, tmp_path, no_allocation):
    dst = copy_with(sources["bf16"], tmp_path / "c", edit_tensors=lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointFormatError, match=r"missing tensor lm_head\.weight: config\.json has "
                                                    r"tie_word_embeddings false"):
        load(dst)


# ---- values -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, suffix, value", [
    ("nvfp4_modelopt", "weight_scale_2", float("nan")),
    ("nvfp4_modelopt", "weight_scale", float("nan")),  # e4m3 (no infinities): the S.1111.111 code
    ("nvfp4_ct", "weight_global_scale", 0.0),  # a divisor: 1/0
    ("nvfp4_ct", "weight_scale", -1.0),
])
@pytest.mark.parametrize("where", [EXPERT, Q_PROJ])
def test_bad_scales_are_refused_naming_tensor(sources, tmp_path, no_allocation, fmt, suffix, value, where):
    def poison(t):
        name = f"{where}.{suffix}"
        bad = t[name].float().clone()
        bad.view(-1)[0] = value
        t[name] = bad.to(t[name].dtype)

    dst = copy_with(sources[fmt], tmp_path / "c", edit_tensors=poison)
    with pytest.raises(CheckpointFormatError, match=rf"{where}\.{suffix} in model\.safetensors: 1 non-finite, "
                                                    r"negative or zero-divisor scale"):
        load(dst)


def _small_tokenizer(model_dir: Path) -> None:
    """A two-token tokenizer, inside the TINY checkpoints' 256-row vocabulary."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "<eos>": 1}, unk_token="a")).save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def test_nan_weight_refused_with_verify_weights_and_by_ft_check(sources, tmp_path, capsys):
    def poison(t):
        t[Q_PROJ + ".weight"] = t[Q_PROJ + ".weight"].clone()
        t[Q_PROJ + ".weight"][3, 5] = float("nan")

    dst = copy_with(sources["bf16"], tmp_path / "c", edit_tensors=poison)
    load(dst)  # without the scan the values are not read before serving (documented cost trade-off)
    with pytest.raises(CheckpointFormatError, match=rf"{Q_PROJ}\.weight in model\.safetensors: 1 NaN/Inf value\(s\), "
                                                    r"first nan at index \(3, 5\)"):
        load(dst, verify_weights=True)
    assert ft_main(["check", str(dst)]) == 1
    assert f"{Q_PROJ}.weight in model.safetensors: 1 NaN/Inf" in capsys.readouterr().err
    ok = copy_with(sources["mixed_modelopt"], tmp_path / "ok")
    _small_tokenizer(ok)  # `ft check` reads the tokenizer as `ft serve` does
    assert ft_main(["check", str(ok)]) == 0
    assert "format mixed: experts nvfp4_modelopt" in capsys.readouterr().out


def test_ft_check_reports_an_unquantized_checkpoints_real_dtype(sources, tmp_path, capsys):
    """The demo model's fp32 checkpoint was reported as "format bf16": the name of the unquantized variant."""
    demo = Path(__file__).resolve().parents[2] / "app" / "demo_model" / "checkpoint"
    assert json.loads((demo / "config.json").read_text())["dtype"] == "float32"
    assert ft_main(["check", str(demo)]) == 0
    assert "format fp32," in capsys.readouterr().out
    bf16 = copy_with(sources["bf16"], tmp_path / "bf16")
    _small_tokenizer(bf16)
    assert ft_main(["check", str(bf16), "--no-verify-weights"]) == 0
    assert "format bf16," in capsys.readouterr().out


def test_nan_fp8_code_in_expert_found_by_scan(tmp_path):
    src = synthesize(tmp_path / "s", TINY, "mixed_modelopt", seed=2, tokenizer=False)
    name = P + "layers.3.self_attn.k_proj.weight"  # FP8 in the mixed layout

    def poison(t):
        raw = t[name].clone().view(torch.uint8)
        raw[0, 0] = 0x7F  # e4m3fn NaN
        t[name] = raw.view(torch.float8_e4m3fn)

    dst = copy_with(src, tmp_path / "c", edit_tensors=poison)
    with pytest.raises(CheckpointFormatError, match=rf"{name} in model\.safetensors: 1 NaN/Inf"):
        load(dst, verify_weights=True)


# ---- formats the config gives the experts ---------------------------------------------------------

def test_experts_in_two_formats_refused_naming_the_module(sources, tmp_path, no_allocation):
    key = P + "layers.2.mlp.experts.1.up_proj"
    dst = copy_with(sources["mixed_modelopt"], tmp_path / "c", edit_config=lambda c: c["quantization_config"][
        "quantized_layers"].update({key: {"quant_algo": "FP8"}}))
    with pytest.raises(CheckpointFormatError, match=r"config\.json: modelopt MIXED_PRECISION: routed experts use "
                                                    r"several formats.*experts of one model must share one format"):
        load(dst)


def test_expert_left_out_of_the_mixed_map_is_refused(sources, tmp_path, no_allocation):
    key = P + "layers.2.mlp.experts.1.up_proj"
    dst = copy_with(sources["mixed_modelopt"], tmp_path / "c",
                    edit_config=lambda c: c["quantization_config"]["quantized_layers"].pop(key))
    with pytest.raises(CheckpointFormatError, match=r"layers\.2\.mlp\.experts\.1\.up_proj: modelopt MIXED_PRECISION "
                                                    r"gives it bf16 .* routed experts are nvfp4_modelopt"):
        load(dst)


# ---- the server ---------------------------------------------------------------------------------

def test_load_error_puts_health_into_error_and_keeps_answering(sources, tmp_path):
    dst = copy_with(sources["bf16"], tmp_path / "c")
    os.truncate(dst / "model.safetensors", (dst / "model.safetensors").stat().st_size - 4096)
    (dst / "tokenizer.json").write_text("{}")  # never read: the load fails first
    srv = start_server(Container(), wait=False, model_dir=str(dst), mmap_experts=True, gpu_budget_gib=0.5,
                       kv_tokens=None, moe_slots=None)
    try:
        assert not srv.runtime.wait_ready(60)
        for _ in range(2):  # still answering after the failure
            body = httpx.get(srv.base_url + "/health", timeout=5).json()
            assert body["status"] == "error"
            assert "model.safetensors: tensor" in body["error"] and "truncated" in body["error"]
    finally:
        srv.stop()


def test_a_load_error_in_the_checkpoint_is_logged_without_a_traceback(tmp_path):
    """A damaged checkpoint is the operator's mistake: /health and the log say what is wrong in one line.
    The log carried a 20-line traceback through the loader's internals for every such error."""
    dst = tmp_path / "c"
    shutil.copytree(DEMO, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["hidden_size"]
    (dst / "config.json").write_text(json.dumps(config))
    with logger_records("fluxtide.serve") as records:
        srv = start_server(Container(), wait=False, model_dir=str(dst), gpu_budget_gib=0.5, kv_tokens=None,
                           moe_slots=None)
        try:
            assert not srv.runtime.wait_ready(60)
            assert "config field 'hidden_size' is missing" in httpx.get(srv.base_url + "/health",
                                                                      timeout=5).json()["error"]
        finally:
            srv.stop()
    failed = [r for r in records if "model load failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelname == "ERROR"
    assert "config.json: config field 'hidden_size' is missing" in failed[0].getMessage()
    assert not failed[0].exc_info, "a traceback for a checkpoint error"


def test_serve_verify_weights_refuses_a_nan_weight_on_health(sources, tmp_path):
    def poison(t):
        t[Q_PROJ + ".weight"] = t[Q_PROJ + ".weight"].clone()
        t[Q_PROJ + ".weight"][0, 0] = float("inf")

    dst = copy_with(sources["bf16"], tmp_path / "c", edit_tensors=poison)
    srv = start_server(Container(), wait=False, model_dir=str(dst), verify_weights=True, gpu_budget_gib=0.5,
                       kv_tokens=None, moe_slots=None)
    try:
        assert not srv.runtime.wait_ready(60)
        body = httpx.get(srv.base_url + "/health", timeout=5).json()
        assert body["status"] == "error" and f"{Q_PROJ}.weight in model.safetensors: 1 NaN/Inf" in body["error"]
    finally:
        srv.stop()


def test_ft_serve_has_verify_weights_and_ft_check_reports_missing_dir(tmp_path, capsys):
    import argparse

    from app.cli import _add_serve

    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "--verify-weights"]).verify_weights is True
    assert parser.parse_args(["serve"]).verify_weights is False
    assert ft_main(["check", str(tmp_path / "nowhere")]) == 1
    assert "no config.json" in capsys.readouterr().err


# ---- the JSON files beside the shards ------------------------------------------------------------

DEMO = Path(__file__).resolve().parents[2] / "app" / "demo_model" / "checkpoint"


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json", "tokenizer.json"])
@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\xff\xfe"])
def test_a_corrupt_json_file_is_named_by_ft_check(tmp_path, capsys, name, content):
    """A hand-edited config.json with a typo failed with json's bare "Expecting property name ... line 1
    column 2" (no file named), a list where an object belongs with an AttributeError traceback, and a
    broken tokenizer file passed `ft check` (which did not read the tokenizer) to fail `ft serve`."""
    dst = tmp_path / "c"
    shutil.copytree(DEMO, dst)
    (dst / name).write_bytes(content.encode("latin-1"))
    assert ft_main(["check", str(dst), "--no-verify-weights"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ft check: ") and f"{dst / name}" in err, err
    assert "Traceback" not in err


def test_ft_check_refuses_a_checkpoint_without_its_tokenizer(tmp_path, capsys):
    dst = tmp_path / "c"
    shutil.copytree(DEMO, dst)
    (dst / "tokenizer.json").unlink()
    assert ft_main(["check", str(dst), "--no-verify-weights"]) == 1  # said "ok"; `ft serve` then failed to load
    assert "no tokenizer.json" in capsys.readouterr().err


def _with_a_token_past_the_model(tmp_path) -> Path:
    """The demo checkpoint (vocab_size 1030) with a tokenizer that knows one more token, id 1030: what a
    tokenizer.json copied from another model of the family looks like."""
    dst = tmp_path / "c"
    shutil.copytree(DEMO, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    tok["added_tokens"].append({"id": 1030, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": False})
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


def test_ft_check_refuses_a_tokenizer_with_ids_past_the_models_vocabulary(tmp_path, capsys):
    dst = _with_a_token_past_the_model(tmp_path)
    assert ft_main(["check", str(dst), "--no-verify-weights"]) == 1
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "1031" in err and "vocab_size 1030" in err, err


def test_serve_refuses_a_tokenizer_with_ids_past_the_models_vocabulary(tmp_path):
    """It loaded, and every prompt with that token failed its step: 500 engine_error, IndexError in the embedding."""
    dst = _with_a_token_past_the_model(tmp_path)
    srv = start_server(Container(), wait=False, model_dir=str(dst), gpu_budget_gib=0.5, kv_tokens=None, moe_slots=None)
    try:
        assert not srv.runtime.wait_ready(60)
        error = httpx.get(srv.base_url + "/health", timeout=5).json()["error"]
        assert "tokenizer.json" in error and "vocab_size 1030" in error, error
    finally:
        srv.stop()


def test_ft_check_reports_an_unreadable_file_without_a_traceback(tmp_path, capsys):
    """`config.json` that is a folder (an unpacking mistake) was an IsADirectoryError traceback: `ft check`
    caught only ValueError and FileNotFoundError of the OSErrors."""
    (tmp_path / "config.json").mkdir()
    assert ft_main(["check", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ft check: ") and "config.json" in err and "Is a directory" in err, err
