"""scripts/diag/serve_with_knobs.py (the same-machine HTTP A/B's server): it sets the kernel-choice constants
before `ft serve` builds anything and hands every other argument to it unchanged."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "diag"))


def test_the_knobs_are_set_before_serve_runs_and_the_rest_is_passed_through(monkeypatch):
    import serve_with_knobs

    import adapters.cuda_exec.prefill_linear as pl
    import adapters.kernels.packed_gemv as pg
    import app.cli

    for mod, name in ((pl, "SPLITK_MAX_ROWS"), (pl, "GEMV_MAX_ROWS"), (pg, "PAIRS_BUCKET_MAX")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    seen = []
    monkeypatch.setattr(app.cli, "main", lambda argv: seen.append(
        (argv, pl.SPLITK_MAX_ROWS, pl.GEMV_MAX_ROWS, pg.PAIRS_BUCKET_MAX)) or 0)
    assert serve_with_knobs.main(["--splitk-max-rows", "0", "--pairs-bucket-max", "256", "--",
                                  "--model", "/m", "--port", "8101"]) == 0
    assert seen == [(["serve", "--model", "/m", "--port", "8101"], 0, pl.GEMV_MAX_ROWS, 256)]
    seen.clear()
    default_splitk = pl.SPLITK_MAX_ROWS
    assert serve_with_knobs.main(["--", "--device", "cpu"]) == 0  # no knob: the modules' values
    assert seen == [(["serve", "--device", "cpu"], default_splitk, pl.GEMV_MAX_ROWS, pg.PAIRS_BUCKET_MAX)]
