"""scripts/bench_decode.py's A/B variants on the CPU (the scenario runner needs CUDA: a fake stands in): every
scenario runs once per --splitk-max-rows / --pairs-bucket-max value (their cross product), named per value,
with the module constants set for it and restored after, a failed variant recorded, parity on the defaults."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """bench_decode with a fake checkpoint, a fake run_scenario / run_parity recording the constants they saw."""
    import bench_decode

    import adapters.checkpoint.loader as loader
    import adapters.checkpoint.synth as synth
    import adapters.cuda_exec.prefill_linear as pl
    import adapters.kernels.packed_gemv as pg

    seen = []
    ckpt = SimpleNamespace(experts=SimpleNamespace(pinned=False, layout=SimpleNamespace(row_bytes=1)))

    def run_scenario(args, ckpt, name, budget_gib, record):
        seen.append((name, pl.SPLITK_MAX_ROWS, pg.PAIRS_BUCKET_MAX))
        if name.endswith("splitk1_pairs1") and budget_gib is not None:
            raise RuntimeError("out of memory")
        record["scenarios"].setdefault(name, {})["batches"] = {}

    monkeypatch.setattr(bench_decode, "run_scenario", run_scenario)
    monkeypatch.setattr(bench_decode, "run_parity", lambda args, ckpt, record: seen.append(
        ("parity", pl.SPLITK_MAX_ROWS, pg.PAIRS_BUCKET_MAX)))
    monkeypatch.setattr(bench_decode, "hardware_profile", lambda dev: {})
    monkeypatch.setattr(synth, "synthesize", lambda *a, **k: None)
    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: ckpt)

    def main(*extra):
        seen.clear()
        assert bench_decode.main(["--out", str(tmp_path), "--synth-dir", str(tmp_path / "ckpt"), *extra]) == 0
        return json.loads((tmp_path / "bench_decode.json").read_text()), list(seen)

    return main, (pl.SPLITK_MAX_ROWS, pg.PAIRS_BUCKET_MAX)


def test_without_the_options_scenarios_keep_their_names(bench):
    main, (splitk, pairs) = bench
    record, seen = main()
    assert seen == [("resident", splitk, pairs), ("budget_24gib", splitk, pairs), ("parity", splitk, pairs)]
    assert set(record["scenarios"]) == {"resident", "budget_24gib"}
    assert record["scenarios"]["budget_24gib"]["budget_gib"] == 24.0
    for scen in record["scenarios"].values():
        assert scen["splitk_max_rows"] == splitk and scen["pairs_bucket_max"] == pairs


def test_one_option_runs_each_scenario_per_value(bench):
    main, (splitk, pairs) = bench
    record, seen = main("--plans", "resident", "--splitk-max-rows", "1,32")
    assert seen == [("resident_splitk1", 1, pairs), ("resident_splitk32", 32, pairs), ("parity", splitk, pairs)]
    assert {n: s["splitk_max_rows"] for n, s in record["scenarios"].items()} == {
        "resident_splitk1": 1, "resident_splitk32": 32}


def test_both_options_run_the_cross_product_and_restore_the_defaults(bench):
    import adapters.cuda_exec.prefill_linear as pl
    import adapters.kernels.packed_gemv as pg

    main, (splitk, pairs) = bench
    record, seen = main("--splitk-max-rows", "1,32", "--pairs-bucket-max", "1,1024")
    combos = [(1, 1), (1, 1024), (32, 1), (32, 1024)]
    assert seen == [(f"{plan}_splitk{s}_pairs{p}", s, p) for plan in ("resident", "budget_24gib")
                    for s, p in combos] + [("parity", splitk, pairs)]
    failed = record["scenarios"]["budget_24gib_splitk1_pairs1"]  # recorded; the later variants still ran
    assert "out of memory" in failed["error"] and "batches" not in failed
    for name, scen in record["scenarios"].items():
        splitk_tag, pairs_tag = name.split("_")[-2:]
        assert scen["splitk_max_rows"] == int(splitk_tag.removeprefix("splitk"))
        assert scen["pairs_bucket_max"] == int(pairs_tag.removeprefix("pairs"))
        assert name == "budget_24gib_splitk1_pairs1" or "error" not in scen
    assert (pl.SPLITK_MAX_ROWS, pg.PAIRS_BUCKET_MAX) == (splitk, pairs)
