"""Session 44's held-out check of the host lane's row cap (docs/simulator.md, "Session 44: one poller a row"): session
44's HTTP sweep (24 GiB, 8k / 64k KV, bs 1 / 3 / 4 / 6, one prompt; the lane capped at 4 rows, the wait kernel before
the change, `auto` at 482 ‰ from 8k and 472 ‰ after the rebuild to 64k), not fitted on, predicted with
h100_records_v3, uniform routing and session 43's lane terms (sim_heldout_h100_s43's refit + wait), twice: with the
cap (`--host-lane-rows 4`, as the server ran) and without it (`0`, as the simulator was before the cap).

    python scripts/sim_heldout_h100_s44.py            # ~20 s; prints the table, --json FILE to write the rows

Errors are (predicted - measured) / measured of the aggregate tok/s."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_heldout_h100_s43 import BOUND, PREDICT, REFIT, ROOT, WAIT  # noqa: E402

from simulator.heldout import error_pct, run_json  # noqa: E402

RECORD = "docs/bench/2026-12-07-s44-h100-http-sweep-24gib-hauto-rows4.json"
SHARES = {8192: 482, 65536: 472}  # the server's auto share at each KV size (its log)
MODELS = {"cap4": " --host-lane-rows 4", "no_cap": " --host-lane-rows 0"}


def rows() -> list[dict]:
    pred: dict[str, dict[tuple[int, int], float]] = {}
    for name, cap in MODELS.items():
        pred[name] = {}
        for kv, share in SHARES.items():
            cmd = PREDICT.replace("--kv 8192,65536", f"--kv {kv}") + REFIT + WAIT + cap + f" --host-permille {share}"
            pred[name].update({(p["kv_tokens"], p["batch"]): p["decode_tok_s"] for p in run_json(cmd, ROOT)})
    out = []
    for p in json.loads((ROOT / RECORD).read_text())["points"]:
        key = (p["kv_tokens"], p["batch_size"])
        row = {"kv": key[0], "batch": key[1], "measured": round(p["aggregate_tok_s"], 1)}
        for name in MODELS:
            row[name] = round(pred[name][key], 1)
            row[f"{name}_error_pct"] = round(error_pct(pred[name][key], p["aggregate_tok_s"]), 1)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    got = rows()
    for r in got:
        cols = " | ".join(f"{n} {r[n]} ({r[n + '_error_pct']:+.1f} %)" for n in MODELS)
        print(f"{r['kv'] // 1024:>2}k bs{r['batch']} measured {r['measured']:6.1f} | {cols}")
    for name in MODELS:
        errs = [r[f"{name}_error_pct"] for r in got]
        print(f"{name}: {sum(abs(e) <= BOUND for e in errs)} of {len(errs)} points within ±{BOUND:g} %, "
              f"range {min(errs):+.1f} .. {max(errs):+.1f} %")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
