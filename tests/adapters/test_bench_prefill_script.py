"""scripts/bench_prefill.py's logic at tiny scale on the CPU (the H200 run is the lead's): every scenario
and prompt recorded, the PCIe bound zero when resident and positive when streaming, the streamed prefill
leaving the warm cache as it was while the LRU path changes it, the same first tokens either way."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.mark.slow
def test_bench_prefill_records_ttft_bounds_and_cache_effects_at_tiny_scale(tmp_path):
    import bench_prefill

    # NOTE: chunks of 12 (two per prompt): a tail of 8 tokens or fewer runs as decode replays through the expert cache,
    # as decode tokens do (ADR 0026), where this test checks that the streamed prefill leaves the cache as it was
    record = bench_prefill.main(["--out", str(tmp_path / "out"), "--device", "cpu", "--geometry", "tiny",
                                 "--synth-dir", str(tmp_path / "ckpt"), "--prompts", "24", "--chunk", "12",
                                 "--moe-slots", "8", "--staging", "6", "--prefill-kernels", "reference",
                                 "--format", "bf16", "--link-gbps", "1e-6",
                                 "--scenarios", "resident,slots,lru"])
    saved = json.loads((tmp_path / "out" / "bench_prefill.json").read_text())
    assert saved["scenarios"].keys() == {"resident", "slots", "lru"} and "error" not in saved
    assert saved["link_bytes_per_s"] == pytest.approx(1e3)
    row = saved["row_bytes"]
    for name, scen in record["scenarios"].items():
        assert "error" not in scen, scen.get("error")
        point = scen["prompts"]["24"]
        assert "error" not in point, point.get("traceback")
        assert point["ttft_s"] > 0 and point["prefill_tok_s"] > 0
        if name == "resident":  # filled as ft serve fills a pool that holds every expert
            assert point["bytes_not_resident"] == 0 and point["ttft_over_bound"] is None
            assert point["every_key_resident"] is True
        else:
            assert point["every_key_resident"] is False
            assert point["bytes_not_resident"] > 0 and point["bytes_not_resident"] % row == 0
            assert point["pcie_bound_s"] == pytest.approx(point["bytes_not_resident"] / 1e3, rel=1e-3)
    slots, lru = record["scenarios"]["slots"], record["scenarios"]["lru"]
    assert slots["plan"]["staging_experts"] == 6 and lru["plan"]["staging_experts"] == 0
    streamed, evicting = slots["prompts"]["24"], lru["prompts"]["24"]
    assert streamed["cache_unchanged"] is True and evicting["cache_unchanged"] is False
    # both chunks stream (12 tokens = 24 pairs each, past the one-launch lookup of 8 slots)
    assert streamed["streamed_steps"] == 2 and streamed["lru_miss_bytes"] == 0
    assert streamed["bytes_staged"] >= streamed["bytes_not_resident"]
    # the LRU path moves at least what the streamed one needed (it also re-misses what it evicts)
    assert evicting["lru_miss_bytes"] >= streamed["bytes_not_resident"]


def test_timeline_overlap_separates_copy_compute_and_their_overlap():
    import bench_prefill

    # copies on stream 9: [0, 10) and [20, 30) µs; compute on stream 7: [5, 25) (a GEMM) and [40, 50)
    acts = [("_gather_rows_kernel", 0.0, 10.0, 9), ("Memcpy HtoD (Pinned -> Device)", 20.0, 10.0, 9),
            ("_moe_grouped_gate_up_kernel", 5.0, 20.0, 7), ("_gdn_chunk_scan_kernel", 40.0, 10.0, 7)]
    got = bench_prefill.timeline_overlap(acts)
    assert got["copy_busy_ms"] == pytest.approx(0.020) and got["compute_busy_ms"] == pytest.approx(0.030)
    assert got["overlap_ms"] == pytest.approx(0.010) and got["span_ms"] == pytest.approx(0.050)
    assert got["link_idle_ms"] == pytest.approx(0.030) and got["serial_ms"] == pytest.approx(0.040)
    assert got["copy_streams"] == [9] and got["compute_streams"] == [7]
    assert bench_prefill.timeline_overlap([]) == {}
    trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1.0, "dur": 2.0, "args": {"stream": 7}},
                             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 9.0},
                             {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 3.0, "dur": 1.0,
                              "args": {"stream": 9}}]}
    assert list(bench_prefill.trace_activities(trace)) == [("k", 1.0, 2.0, 7), ("Memcpy HtoD", 3.0, 1.0, 9)]


def test_overlap_floor_is_the_larger_of_the_bound_and_the_resident_prefill():
    import bench_prefill

    record = {"scenarios": {"resident": {"prompts": {"4096": {"ttft_s": 0.312}, "8192": {"ttft_s": 0.589}}},
                            "slots": {"prompts": {"4096": {"ttft_s": 0.808, "pcie_bound_s": 0.467},
                                                  "8192": {"ttft_s": 0.992, "pcie_bound_s": 0.467}}}}}
    bench_prefill.overlap_floors(record)
    four, eight = record["scenarios"]["slots"]["prompts"]["4096"], record["scenarios"]["slots"]["prompts"]["8192"]
    assert four["overlap_floor_s"] == 0.467 and four["target_reachable"] is True
    assert four["ttft_over_floor"] == pytest.approx(0.808 / 0.467, abs=1e-3)
    # an 8k chunk computes longer than its experts take to copy: 1.2 x the bound is below resident compute
    assert eight["overlap_floor_s"] == 0.589 and eight["target_reachable"] is False
    assert eight["floor_over_bound"] == pytest.approx(1.261, abs=1e-3)
    assert "overlap_floor_s" not in record["scenarios"]["resident"]["prompts"]["4096"]


def test_host_summary_counts_syncs_launches_idle_time_and_sync_sites():
    import bench_prefill

    def x(cat, name, ts, dur, **extra):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **extra}

    # device busy [0, 10) and [30, 40): 20 µs busy, 20 µs idle; two syncs on thread 1, one launch of each API
    trace = {"traceEvents": [
        x("kernel", "k", 0.0, 10.0), x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 30.0, 4.0),
        x("gpu_memset", "Memset (Device)", 34.0, 6.0),
        x("cuda_runtime", "cudaLaunchKernel", 0.0, 1.0), x("cuda_driver", "cuLaunchKernelEx", 1.0, 1.0),
        x("cuda_runtime", "cudaStreamSynchronize", 12.0, 15.0, tid=1),
        x("cuda_runtime", "cudaStreamSynchronize", 50.0, 5.0, tid=1),
        x("python_function", "adapters/cuda_exec/device_residency.py(133): lookup_flat", 11.0, 20.0, tid=1),
        x("python_function", "adapters/cuda_exec/expert_pool.py(280): routed", 5.0, 60.0, tid=1),
        x("python_function", "torch/nn/modules/module.py(1): _call_impl", 12.0, 2.0, tid=1),
        x("python_function", "adapters/cuda_exec/expert_pool.py(280): routed", 12.0, 2.0, tid=2),
    ]}
    got = bench_prefill.host_summary(trace)
    assert got["syncs"] == 2 and got["sync_ms"] == pytest.approx(0.020) and got["launches"] == 2
    assert got["h2d_pageable"] == 1
    assert got["gpu_busy_ms"] == pytest.approx(0.020) and got["gpu_idle_ms"] == pytest.approx(0.020)
    # the innermost repo frame of the same thread: lookup_flat for the first, routed for the second
    assert got["sync_sites"] == [{"site": "adapters/cuda_exec/device_residency.py(133): lookup_flat", "syncs": 1},
                                 {"site": "adapters/cuda_exec/expert_pool.py(280): routed", "syncs": 1}]
    assert "sync_sites" not in bench_prefill.host_summary({"traceEvents": trace["traceEvents"][:7]})
    assert bench_prefill.host_summary({}) == {"syncs": 0, "sync_ms": 0.0, "launches": 0, "h2d_pageable": 0}


@pytest.mark.slow
def test_bench_prefill_with_fp8_activations_records_how_far_the_logits_move(tmp_path, monkeypatch):
    """--fp8-activations on a block-FP8 checkpoint with the Triton prefill: the prompts run and `a8_logits`
    compares the last-token logits of the two paths (not equal, and not far apart)."""
    import bench_prefill

    from adapters.cuda_exec import expert_pool as pool_mod

    monkeypatch.setattr(pool_mod, "GEMV_MAX_PAIRS", 8)  # the tiny chunks reach the grouped GEMMs
    record = bench_prefill.main(["--out", str(tmp_path / "out"), "--device", "cpu", "--geometry", "tiny",
                                 "--synth-dir", str(tmp_path / "ckpt"), "--prompts", "24", "--chunk", "16",
                                 "--prefill-kernels", "triton", "--format", "fp8_block", "--fp8-activations",
                                 "--scenarios", "resident"])
    scen = record["scenarios"]["resident"]
    assert "error" not in scen and "a8_logits_error" not in scen, scen
    assert "error" not in scen["prompts"]["24"] and scen["prompts"]["24"]["ttft_s"] > 0
    moved = scen["a8_logits"]
    assert moved["tokens"] == 16 and 0 < moved["rel_l2"] < 0.2 and 1 <= moved["top5_overlap"] <= 5
    assert moved["control_rel_l2"] < 1e-4, moved  # two bf16 runs of one executor agree: no state carries over
    assert record["args"]["fp8_activations"] is True
