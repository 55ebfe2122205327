"""`python -m simulator mixed --record FILE`: the scenario and the server come from an `ft bench mixed` record (a
trimmed copy of docs/bench/2026-12-05-mixed-24gib-h200-layered.json's structure, with values the defaults do not
have), flags override it, unreplayable records are one-line errors, and the comparison's arithmetic."""

import copy
import json

import pytest

from simulator.__main__ import main
from simulator.hardware import GIB
from simulator.mixed_record import error_pct, gap_differences, read_record

GAPS = [37.6] + [61.0] * 20 + [95.3]  # one stream's window: the straddling gap, 20 layer groups, the tail step
RECORD = {
    "schema": "fluxtide.bench/1", "kind": "mixed", "ok": True, "started_at": "2026-12-05T04:31:34+00:00",
    "settings": {"streams": 2, "prompt_tokens": 8192, "stream_tokens": 96, "warmup_tokens": 2, "baseline_tokens": 4,
                 "repeats": 1, "warmup_repeats": 0,
                 "calibration": {"tokens_fixed": 19.0, "tokens_per_filler_unit": 17.0, "long_prompt_units": 481}},
    "hardware": {"gpus": [{"name": "NVIDIA H200", "memory_bytes": 150109880320}]},
    "model": {"name": "qwen36-fp8", "total_experts": 10240, "expert_bytes": 3146496, "format": "fp8 e4m3 block 128x128",
              "geometry": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                           "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                           "shared_expert_intermediate_size": 512, "num_attention_heads": 16,
                           "num_key_value_heads": 2, "vocab_size": 248320, "max_position_embeddings": 262144}},
    "budget": {"total_bytes": 25769803776, "memory_ratio": 0.9},
    "pool_plan": {"page_size": 16, "kv_tokens": 12288, "expert_slots": 5000, "state_slots": 3, "snapshot_slots": 8,
                  "staging_experts": 32},
    "routing": "natural",
    "server": {"stats": {"prefix_cache": {"enabled": True}, "executor": {"prefill_kernels": True}}},
    "points": [{"repeat": 0, "streams": 2, "prompt_tokens_target": 8192, "prompt_tokens": 8196, "ok": True,
                "error": None, "window_gaps_ms": GAPS * 2}],
    "failures": [],
    "summary": {"window": {"count": 44, "p50_ms": 61.0, "p99_ms": 95.3, "max_ms": 95.3},
                "baseline": {"count": 8, "p50_ms": 36.7, "p99_ms": 39.4, "max_ms": 39.5}, "ttft_s_median": 1.399,
                "server_step_budgets": {"max_running": 3, "max_step_tokens": 4096, "mixed_step_tokens": 256,
                                        "layered_prefill": True, "layer_groups": 0, "arrival_window_ms": 30.0}},
}


def write(tmp_path, record=RECORD, name="record.json"):
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return str(path)


def test_the_record_sets_the_scenario_the_server_and_the_comparison(tmp_path, capsys):
    assert main(["mixed", "--record", write(tmp_path), "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)  # the record's mode only (layered on), not off,on
    assert result["fits"] and result["failures"] == []
    assert result["hardware"] == "h200" and result["model"] == "qwen3.6-35b-a3b-fp8"
    assert result["layered_prefill"] is True and result["gpu_budget_gib"] == 24.0 and result["kv_tokens"] == 12288
    assert result["scenario"] == {"streams": 2, "stream_prompt_tokens": 19 + 2 * 17, "stream_tokens": 96,
                                  "warmup_tokens": 2, "baseline_tokens": 4, "prompt_tokens": 8196, "repeats": 1,
                                  "warmup_repeats": 0, "same_prompt": False, "repeat_prompt_tokens": []}
    budgets = RECORD["summary"]["server_step_budgets"]
    assert {k: result["scheduler"][k] for k in ("max_running", "max_step_tokens", "mixed_step_tokens",
                                                "layered_prefill", "prefix_cache")} == {
        **{k: budgets[k] for k in ("max_running", "max_step_tokens", "mixed_step_tokens", "layered_prefill")},
        "prefix_cache": True}
    assert result["scheduler"]["short_prompt_replays"] == 0  # served before session 32 turned them on
    compare = result["compare"]
    assert compare["record"] == write(tmp_path) and compare["overridden"] == {}
    for key in ("kv_tokens", "state_slots", "snapshot_slots", "staging_experts"):
        assert compare["plan"][key] == {"record": RECORD["pool_plan"][key], "predicted": RECORD["pool_plan"][key]}
    figures = compare["figures"]
    assert set(figures) == {"window_p50_ms", "window_p99_ms", "window_max_ms", "baseline_p50_ms", "baseline_p99_ms",
                            "ttft_s_median"}
    assert figures["window_p99_ms"]["measured"] == 95.3 and figures["ttft_s_median"]["measured"] == 1.399
    assert figures["window_p99_ms"]["predicted"] == result["window"]["p99_ms"]
    for f in figures.values():
        assert f["error_pct"] == pytest.approx((f["predicted"] - f["measured"]) / f["measured"] * 100)
    (gaps,) = compare["gaps"]
    assert gaps["repeat"] == 0 and gaps["measured_gaps"] == 44 and gaps["predicted_gaps"] > 0


def test_a_flag_beside_the_record_overrides_it_even_at_its_default(tmp_path, capsys):
    out = tmp_path / "out.json"
    # --streams 3 is the flag's default: given, it still overrides the record's 2
    assert main(["mixed", "--record", write(tmp_path), "--prompt-tokens", "2048", "--streams", "3",
                 "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "measured vs predicted" in table and "window_p99_ms" in table and "record.json" in table
    (result,) = json.loads(out.read_text())
    assert result["scenario"]["prompt_tokens"] == 2048 and result["scenario"]["streams"] == 3
    assert result["scheduler"]["mixed_step_tokens"] == 256  # the rest is still the record's
    assert result["compare"]["overridden"] == {"prompt_tokens": {"record": 8196, "used": 2048},
                                               "streams": {"record": 2, "used": 3}}


def changed(path: str, value) -> dict:
    record = copy.deepcopy(RECORD)
    *parents, last = path.split(".")
    node = record
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return record


@pytest.mark.parametrize("record, message", [
    (changed("kind", "prefill"), "not an `ft bench mixed` record"),
    (changed("points", [{**RECORD["points"][0], "prompt_tokens": 8196},
                        {**RECORD["points"][0], "repeat": 1, "prompt_tokens": 8213}]),
     "prompt_tokens differ (8196, 8213)"),
    (changed("points", [{"repeat": 0, "ok": False, "error": "stream 0 ended"}]), "no measured repeat"),
    (changed("hardware.gpus.0.name", "NVIDIA A100-SXM4-80GB"), "give --hardware"),
    (changed("model.geometry.hidden_size", 4096), "give --model"),
    (changed("summary.server_step_budgets", None), "give --max-prefill-length"),
])
def test_a_record_that_cannot_be_replayed_is_a_one_line_error(tmp_path, capsys, record, message):
    assert main(["mixed", "--record", write(tmp_path, record), "--json"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and captured.out == "", captured.err


def test_a_file_that_is_no_record_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text("{not json")
    assert main(["mixed", "--record", str(path)]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_the_comparison_error_is_predicted_minus_measured_over_measured(tmp_path):
    record = read_record(write(tmp_path))
    result = {"window": {"p50_ms": 122.0, "p99_ms": 47.65, "max_ms": None}, "baseline": {"p50_ms": 36.7},
              "ttft_s_median": 1.0, "points": [], "scenario": {"streams": 2}}
    figures = record.compare(result, {})["figures"]
    assert figures["window_p50_ms"]["error_pct"] == pytest.approx(100.0)  # (122 - 61) / 61
    assert figures["window_p99_ms"]["error_pct"] == pytest.approx(-50.0)  # (47.65 - 95.3) / 95.3
    assert figures["baseline_p50_ms"]["error_pct"] == 0
    assert figures["ttft_s_median"]["error_pct"] == pytest.approx((1.0 - 1.399) / 1.399 * 100)
    assert figures["window_max_ms"]["error_pct"] is None and figures["baseline_p99_ms"]["error_pct"] is None
    assert error_pct(1.0, 0.0) is None


def test_the_largest_gap_difference_is_found_within_each_stream():
    # measured: a tail gap (95 ms) the prediction lacks, and a 75 ms bump in stream 1. Aligned over the whole list,
    # stream 1's gaps would meet stream 0's tail one index off (95 against 37); per stream, the bump is the largest
    measured = [{"repeat": 0, "window_gaps_ms": [37.0, 60.0, 60.0, 95.0, 37.0, 75.0, 61.0, 95.0]}]
    predicted = [{"repeat": 0, "ok": True, "window_gaps_ms": [37.0, 60.0, 60.0, 37.0, 60.0, 61.0]}]
    (row,) = gap_differences(measured, predicted, streams=2)
    assert row == {"repeat": 0, "measured_gaps": 8, "predicted_gaps": 6, "stream": 1, "index": 1,
                   "measured_ms": 75.0, "predicted_ms": 60.0, "difference_ms": -15.0}
    # counts that do not split over the streams: one sequence, aligned from its start
    predicted[0]["window_gaps_ms"] = [37.0, 60.0, 60.0, 37.0, 60.0, 61.0, 60.0]
    (row,) = gap_differences(measured, predicted, streams=2)
    assert (row["stream"], row["index"], row["difference_ms"]) == (None, 3, -58.0)
    assert gap_differences(measured, [{**predicted[0], "repeat": 1}], streams=2) == []  # no twin, no row


def test_a_gpu_name_maps_to_a_profile_only_by_whole_words_and_the_same_variant():
    # a substring match took a GH200 for the h200 profile and a 4090 laptop part for the desktop card
    from simulator.hardware import BUILTIN_PROFILES
    from simulator.mixed_record import _names_profile

    def profiles(name):
        return [p for p in BUILTIN_PROFILES if _names_profile(name, p)]

    assert profiles("NVIDIA H200") == ["h200"] and profiles("NVIDIA H200 NVL") == ["h200"]
    assert profiles("NVIDIA GeForce RTX 4090") == ["rtx4090"]
    assert profiles("NVIDIA GeForce RTX 4060 Laptop GPU") == ["rtx4060-laptop"]
    assert profiles("NVIDIA GH200 480GB") == [] and profiles("NVIDIA GeForce RTX 4090 Laptop GPU") == []
    # the SXM5 H100 as CUDA names it; the PCIe card (114 SMs, 2.0 TB/s HBM2e) is a variant the profile is not
    assert profiles("NVIDIA H100 80GB HBM3") == ["h100"] and profiles("NVIDIA H100") == ["h100"]
    assert profiles("NVIDIA H100 PCIe") == [] and profiles("NVIDIA H800") == []


def test_the_h100_records_replay_on_the_h100_profile_with_the_records_server():
    # session 25's held-out records (docs/simulator.md, "Held out on an H100"): the card and the pools come from them
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "docs/bench"
    record = read_record(str(bench / "2026-12-05-h100-mixed-24gib-512-layered.json"))
    assert record.arguments["hardware"] == "h100" and record.arguments["mixed_prefill_length"] == 512
    assert record.arguments["prompt_tokens"] == 8196 and record.arguments["stream_tokens"] == 2048
    resident = read_record(str(bench / "2026-12-05-h100-mixed-resident-1024-layered-wlhs.json"))
    assert resident.arguments["gpu_budget_gib"] * GIB == 85_017_493_504 and resident.arguments["kv"] == 65536



def test_the_record_says_whether_the_server_layered_short_prompts(tmp_path):
    # ADR 0024 "A0" (session 28): the server reports layer_short_prompts in its step budgets; a record without it ran
    # before then, when only prompts longer than the mixed budget were layered (--layer-short-prompts off)
    assert read_record(write(tmp_path)).arguments["layer_short_prompts"] == "off"
    for value, flag in ((True, "auto"), (False, "off")):
        record = changed("summary.server_step_budgets.layer_short_prompts", value)
        assert read_record(write(tmp_path, record, f"{flag}.json")).arguments["layer_short_prompts"] == flag
