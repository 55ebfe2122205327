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

    record = bench_prefill.main(["--out", str(tmp_path / "out"), "--device", "cpu", "--geometry", "tiny",
                                 "--synth-dir", str(tmp_path / "ckpt"), "--prompts", "24", "--chunk", "16",
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
        if name == "resident":
            assert point["bytes_not_resident"] == 0 and point["ttft_over_bound"] is None
        else:
            assert point["bytes_not_resident"] > 0 and point["bytes_not_resident"] % row == 0
            assert point["pcie_bound_s"] == pytest.approx(point["bytes_not_resident"] / 1e3, rel=1e-3)
    slots, lru = record["scenarios"]["slots"], record["scenarios"]["lru"]
    assert slots["plan"]["staging_experts"] == 6 and lru["plan"]["staging_experts"] == 0
    streamed, evicting = slots["prompts"]["24"], lru["prompts"]["24"]
    assert streamed["cache_unchanged"] is True and evicting["cache_unchanged"] is False
    # both chunks stream (the last, 8 tokens = 16 pairs, is past the one-launch lookup of 8 slots)
    assert streamed["streamed_steps"] == 2 and streamed["lru_miss_bytes"] == 0
    assert streamed["bytes_staged"] >= streamed["bytes_not_resident"]
    # the LRU path moves at least what the streamed one needed (it also re-misses what it evicts)
    assert evicting["lru_miss_bytes"] >= streamed["bytes_not_resident"]
