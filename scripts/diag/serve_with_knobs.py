"""`ft serve` with kernel-choice constants overridden, for same-machine A/B runs through HTTP (not a user option).

    python3 scripts/diag/serve_with_knobs.py --splitk-max-rows 1 --pairs-bucket-max 1 -- SERVE ARGS...

--splitk-max-rows sets adapters.cuda_exec.prefill_linear.SPLITK_MAX_ROWS (1: the split-K GEMM off, 2..32-row
projections on dense_gemm) and GEMV_MAX_ROWS to --gemv-max-rows; --pairs-bucket-max sets
adapters.kernels.packed_gemv.PAIRS_BUCKET_MAX (1: one autotune key for every pair count, tuned at bs1). Both are
read at call time, so setting them before the server builds its executor changes every step it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--splitk-max-rows", type=int, default=None)
    p.add_argument("--gemv-max-rows", type=int, default=None)
    p.add_argument("--pairs-bucket-max", type=int, default=None)
    p.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    import adapters.cuda_exec.prefill_linear as pl
    import adapters.kernels.packed_gemv as pg
    from app.cli import main as ft

    for value, mod, name in ((args.splitk_max_rows, pl, "SPLITK_MAX_ROWS"), (args.gemv_max_rows, pl, "GEMV_MAX_ROWS"),
                             (args.pairs_bucket_max, pg, "PAIRS_BUCKET_MAX")):
        if value is not None:
            setattr(mod, name, value)
    print(f"knobs: SPLITK_MAX_ROWS={pl.SPLITK_MAX_ROWS} GEMV_MAX_ROWS={pl.GEMV_MAX_ROWS} "
          f"PAIRS_BUCKET_MAX={pg.PAIRS_BUCKET_MAX}", flush=True)
    rest = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    return int(ft(["serve", *rest]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
