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


def test_the_aggregate_and_per_request_speeds_are_labelled_as_the_different_figures_they_are(capsys):
    # batch 1 printed an aggregate (127.5) under its per-request figure (128.0): a mean of each round's rate is
    # not the ratio of all tokens to all time, and the headers did not say which was which
    argv = ["predict", "--hardware", "rtx3090", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "8k", "--batch", "1,4",
            "--workers", "1"]
    assert main([*argv, "--json"]) == 0
    for point in json.loads(capsys.readouterr().out):
        assert point["decode_tok_s_per_request"] >= point["decode_tok_s"] / point["batch"] * (1 - 1e-12)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "aggregate tok/s" in out and "mean tok/s/request" in out
    assert "all measured tokens / all measured time" in out and "never below" in out  # the caption says how


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


def _tiny_checkpoint(tmp_path) -> str:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=64,
                         vocab_size=1000, max_position_embeddings=65536).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_a_ttft_probe_too_long_for_one_points_pool_refuses_the_probe_not_the_sweep(capsys, tmp_path):
    """--ttft-prompt 4k on a 2,048-token pool: that point keeps its decode figures and says why the probe cannot run
    (it used to raise, exit 2 and print nothing); the 16k point still times the probe."""
    argv = ["predict", "--hardware", "rtx3090", "--model", _tiny_checkpoint(tmp_path), "--kv", "2048,16k",
            "--batch", "1", "--routing", "uniform", "--ttft-prompt", "4k", "--workers", "1"]
    assert main([*argv, "--json"]) == 0
    small, large = sorted(json.loads(capsys.readouterr().out), key=lambda p: p["kv_tokens"])
    assert small["fits"] and small["decode_tok_s"] > 0 and small["reason"] is None
    assert small["ttft_prompt_s"] is None and small["ttft_prompt_tokens"] == 4096
    assert "TTFT probe of 4096 tokens not possible" in small["ttft_prompt_reason"]
    assert "KV pages" in small["ttft_prompt_reason"]
    assert large["fits"] and large["ttft_prompt_s"] > 0 and "ttft_prompt_reason" not in large
    assert main(argv) == 0
    out = capsys.readouterr().out
    # the reason column wraps: its first words and the 16k point's probe cell (23 ms) are on the rows
    assert "TTFT probe of" in out and "possible" in out and "16,384" in out


RECORDS = "fitted from the records listed in provenance (whatever engine produced them)"
CUSTOMER = "measured on rtx3090 with the customer's existing engine (its RTX 3090 reference table, docs/simulator.md)"


@pytest.mark.parametrize("hardware, calibration, title, label, engine", [
    # a card without a fluxtide calibration of its own borrows fluxtide's H200 profile (it used to borrow the
    # customer's engine's rtx3090_v2, and so predicted the other engine)
    ("rtx4090", None, f"predicts fluxtide: calibration h200_records_v5: measured on h200, {RECORDS}; its engine "
                      "overheads carried over to rtx4090", "h200_records_v5 (engine overheads carried over)", "fluxtide"),
    ("rtx3090", None, f"predicts fluxtide: calibration h200_records_v5: measured on h200, {RECORDS}; its engine "
                      "overheads carried over to rtx3090", "h200_records_v5 (engine overheads carried over)", "fluxtide"),
    # named on the command line for another card: used to say nothing
    ("rtx4090", "h200_v2", f"predicts fluxtide: calibration h200_v2: measured on h200, {RECORDS}; its engine overheads "
                           "carried over to rtx4090", "h200_v2 (engine overheads carried over)", "fluxtide"),
    # the customer's engine's fit, by name, for comparison: the title says it is not fluxtide
    ("rtx3090", "rtx3090_v2", f"predicts the customer's existing engine, not fluxtide: calibration rtx3090_v2: "
                              f"{CUSTOMER}; routing", "rtx3090_v2", "customer-engine"),
    ("rtx4090", "rtx3090_v2", f"predicts the customer's existing engine, not fluxtide: calibration rtx3090_v2: "
                              f"{CUSTOMER}; its engine overheads carried over to rtx4090",
     "rtx3090_v2 (engine overheads carried over)", "customer-engine"),
    # one default rule (docs/simulator.md, "One default rule"): fluxtide's best held-out H200 profile; h200_v2 by name
    ("h200", None, f"predicts fluxtide: calibration h200_records_v6: measured on h200, {RECORDS}; routing",
     "h200_records_v6", "fluxtide"),
    ("h200", "h200_v2", f"predicts fluxtide: calibration h200_v2: measured on h200, {RECORDS}; routing", "h200_v2",
     "fluxtide"),
])
def test_the_table_title_and_json_name_the_engine_and_the_calibration(monkeypatch, tmp_path, capsys, hardware,
                                                                       calibration, title, label, engine):
    import simulator.table

    titles = []
    monkeypatch.setattr(simulator.table, "print_table", lambda results, title="": titles.append(title))
    argv = ["predict", "--hardware", hardware, "--model", _tiny_checkpoint(tmp_path), "--kv", "2048",
            "--routing", "uniform", "--workers", "1"] + (["--calibration", calibration] if calibration else [])
    assert main(argv) == 0
    assert title in titles[0]
    assert ("carried over" in titles[0]) == label.endswith("(engine overheads carried over)")
    assert main([*argv, "--json"]) == 0
    point = json.loads(capsys.readouterr().out)[0]
    assert (point["calibration"], point["engine"]) == (label, engine)


def test_max_prefill_length_sets_the_simulated_step_budget_too(tmp_path, capsys):
    # it used to change the memory plan only: the 8k probe still prefilled in the calibration's 2,048-token steps
    argv = ["predict", "--hardware", "rtx3090", "--model", _tiny_checkpoint(tmp_path), "--kv", "16k",
            "--routing", "uniform", "--ttft-prompt", "8k", "--workers", "1", "--json"]
    for calibration, default in (("rtx3090_v2", "2048"), ("h200_v2", "8192")):
        steps = {}
        for length in ("2048", "8192"):
            assert main([*argv, "--calibration", calibration, "--max-prefill-length", length]) == 0
            point = json.loads(capsys.readouterr().out)[0]
            steps[length] = point["simulated_s"], point["ttft_prompt_s"]
            assert point["scheduler"]["max_step_tokens"] == int(length)
        assert main([*argv, "--calibration", calibration]) == 0
        point = json.loads(capsys.readouterr().out)[0]
        # the customer's engine: its fit's 2,048-token steps; fluxtide: ft serve's default --max-prefill-length (8,192;
        # h200_v2's workload says 2,048, which predictions ran with before the server's budgets were applied)
        assert (point["simulated_s"], point["ttft_prompt_s"]) == steps[default], calibration
        assert point["scheduler"]["max_step_tokens"] == int(default)
        assert steps["8192"][1] < steps["2048"][1]  # one 8k step instead of four 2k ones


@pytest.mark.parametrize("hardware, label", [("h200", "h200_records_v6"),
                                             # the H200's die: its eager prefill terms carry over (session 25)
                                             ("h100", "h200_records_v6 (engine overheads carried over)"),
                                             ("rtx3090", "h200_records_v5 (engine overheads carried over)")])
def test_predict_and_mixed_take_their_default_calibration_by_one_rule(tmp_path, capsys, hardware, label):
    # mixed used to keep its own table (h200_records_v6 on the H200) while predict took h200_v2 there
    assert main(["predict", "--hardware", hardware, "--model", _tiny_checkpoint(tmp_path), "--kv", "2048",
                 "--routing", "uniform", "--workers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["calibration"] == label
    # an 8k pool cannot hold the 8k prompt beside the streams: refused at once, the calibration still named
    assert main(["mixed", "--hardware", hardware, "--kv", "8k", "--layered-prefill", "on", "--json"]) == 0
    mixed = json.loads(capsys.readouterr().out)[0]
    assert mixed["calibration"] == label and not mixed["fits"]


def test_a_reader_that_closes_the_pipe_early_ends_python_m_simulator_quietly(tmp_path):
    # `python -m simulator predict ... --json | head -2` ended in a BrokenPipeError traceback (ft sim did not): the
    # reader closes its end before a byte is written, so every write and the final flush meet a broken pipe
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "simulator", "predict", "--hardware", "rtx3090", "--model", _tiny_checkpoint(tmp_path),
           "--kv", "2048", "--batch", "1", "--routing", "uniform", "--workers", "1", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err  # 128 + SIGPIPE, as `ft sim` and a shell report it
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
