"""The predict CLI: JSON fields, table, plot, model from config.json, errors."""

import json

import pytest

from simulator.__main__ import main, parse_count

FIELDS = {"hardware", "model", "kv_tokens", "batch", "fits", "reason", "expert_slots", "residency", "hit_rate",
          "decode_tok_s", "decode_tok_s_per_request", "pcie_utilisation"}


def test_json_output_has_the_documented_fields(capsys, tmp_path):
    png = tmp_path / "out.png"
    rc = main(["predict", "--hardware", "rtx3090", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "8k,900000",
               "--batch", "1", "--json", "--plot", str(png), "--workers", "1"])
    assert rc == 0
    points = json.loads(capsys.readouterr().out)
    assert len(points) == 2
    for p in points:
        assert FIELDS <= set(p)
        assert p["hardware"] == "rtx3090" and p["model"] == "qwen3.6-35b-a3b-fp8" and p["batch"] == 1
    fit, unfit = sorted(points, key=lambda p: p["kv_tokens"])
    assert fit["fits"] and fit["kv_tokens"] == 8192 and fit["reason"] is None
    assert 0 < fit["residency"] <= 1 and 0 < fit["hit_rate"] <= 1 and 0 <= fit["pcie_utilisation"] <= 1
    assert fit["decode_tok_s"] > 0 and fit["decode_tok_s_per_request"] > 0
    assert not unfit["fits"] and "does not fit" in unfit["reason"]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_table_output_and_model_from_a_checkpoint_config(capsys, tmp_path):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64,
                         vocab_size=1000, max_position_embeddings=4096).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # --gpu-budget-gib caps the card as `ft serve`'s does: 2 GiB x 0.9 less the weights and the 0.75 GiB the
    # reference calibration (another engine) sets aside for its fixed caches
    rc = main(["predict", "--hardware", "rtx4060-laptop", "--model", str(tmp_path), "--kv", "4096",
               "--batch", "1,2", "--gpu-budget-gib", "2", "--routing", "uniform", "--workers", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "rtx4060-laptop" in out and "4,096" in out and "yes" in out


@pytest.mark.parametrize("argv, message", [
    (["--hardware", "nope", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "8k"], "unknown hardware"),
    (["--hardware", "rtx3090", "--model", "/nonexistent", "--kv", "8k"], "no config.json"),
    (["--hardware", "rtx3090", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "8k", "--routing", "zipf"], "unknown routing"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    assert main(["predict", *argv, "--workers", "1"]) == 2
    assert message in capsys.readouterr().err


P = ["predict", "--hardware", "rtx3090", "--model", "qwen3.6-35b-a3b-fp8"]


@pytest.mark.parametrize("argv, flag", [
    ([*P, "--kv", "8k", "--gpu-budget-gib", "inf"], "--gpu-budget-gib"),  # OverflowError traceback
    ([*P, "--kv", "8k", "--gpu-budget-gib", "nan"], "--gpu-budget-gib"),
    ([*P, "--kv", ""], "--kv"),
    ([*P, "--kv", "inf"], "--kv"),  # OverflowError traceback
    ([*P, "--kv", "1e400"], "--kv"),  # predicted nothing and exited 0 with an empty table
    ([*P, "--kv", ",", "--batch", "1"], "--kv"),
    ([*P, "--kv", "8k", "--batch", ""], "--batch"),
    ([*P, "--kv", "8k", "--workers", "0"], "--workers"),  # silently ran anyway
    (["expert-parallel", "--gpu-cap-gib", "inf"], "--gpu-cap-gib"),  # OverflowError traceback
    (["expert-parallel", "--gpu-cap-gib", "nan"], "--gpu-cap-gib"),  # "cannot convert float NaN to integer"
    (["expert-parallel", "--ranks", ""], "--ranks"),  # printed nothing, exit 0
])
def test_bad_numbers_are_argument_errors_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and flag in err and "Traceback" not in err, err


def test_counts_accept_suffixes():
    assert parse_count("8k") == 8192 and parse_count("1m") == 1 << 20 and parse_count("700000") == 700000
