"""Session 43's held-out check of the host lane's hand-off on the GPU (docs/simulator.md, "The host lane's hand-off on
the GPU (session 43)"): sessions 41 and 42's HTTP sweeps (24 GiB, 8k / 64k KV, bs 1 / 3 / 4 / 6, one prompt), none of
them fitted on, predicted with h100_records_v3 and uniform routing

- off: the lane off (every off server; these must not move);
- old: the lane at session 41's 44 GB/s and 20 µs (the server's share: 465 ‰ for `auto`, 423 ‰ for `h423`);
- refit: session 42's request cost (host_lane.H100_HOST_REQUEST_S41: 66.4 µs, 64.1 GB/s, row factor 0.191);
- wait: the refit plus the hand-off's GPU side (host_lane.H100_HOST_WAIT_S43, fitted on bench_decode's profiles by
  host_lane.fit_host_wait).

    python scripts/sim_heldout_h100_s43.py            # ~1 min; prints the table, --json FILE to write the rows

Errors are (predicted - measured) / measured of the aggregate tok/s, against each server. Session 41's lane servers ran
the unweighted split at bs6 (the simulator models the weighted one since): their bs6 rows are printed, not scored."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simulator.heldout import error_pct, run_json
from simulator.host_lane import H100_HOST_REQUEST_S41, H100_HOST_WAIT_S43

ROOT = Path(__file__).resolve().parents[1]
BENCH = "docs/bench/2026-12-07"
BOUND = 10.0
PREDICT = ("python -m simulator predict --hardware h100 --model qwen3.6-35b-a3b-fp8 --kv 8192,65536 --batch 1,3,4,6 "
           "--gpu-budget-gib 24 --max-running-requests 6 --layered-prefill on --host-embedding on --dense-copy on "
           "--prefill-kernels triton --short-prompt-replays 8 --routing uniform --calibration h100_records_v3 "
           "--workers 1 --json")
REQ = H100_HOST_REQUEST_S41
REFIT = (f" --host-experts-gb-s {REQ['host_expert_gb_s']} --host-call-us {REQ['host_call_s'] * 1e6:.1f}"
         f" --host-row-factor {REQ['host_row_factor']}")
WAIT = f" --host-wait-row-us {H100_HOST_WAIT_S43['host_wait_row_s'] * 1e6:.1f}"
MODELS = {"old": " --host-experts-gb-s 44", "refit": REFIT, "wait": REFIT + WAIT}
SERVERS = [  # (record, session, share: None off)
    (f"{BENCH}-s41-h100-http-sweep-24gib-off.json", 41, None),
    (f"{BENCH}-s41-h100-http-sweep-24gib-off-run2.json", 41, None),
    (f"{BENCH}-s42-h100-http-sweep-24gib-off.json", 42, None),
    (f"{BENCH}-s41-h100-http-sweep-24gib-h423.json", 41, 423),
    (f"{BENCH}-s41-h100-http-sweep-24gib-h423-run2.json", 41, 423),
    (f"{BENCH}-s41-h100-http-sweep-24gib-hauto.json", 41, 465),
    (f"{BENCH}-s42-h100-http-sweep-24gib-hauto.json", 42, 465),
]


def predictions(commands: dict[str, str]) -> dict[str, dict[tuple[int, int], float]]:
    """decode_tok_s by (kv, batch) of each command."""
    out = {}
    for name, cmd in commands.items():
        got = run_json(cmd, ROOT)
        out[name] = {(p["kv_tokens"], p["batch"]): p["decode_tok_s"] for p in got}
    return out


def rows() -> list[dict]:
    commands = {"off": PREDICT}
    for share in sorted({s for _, _, s in SERVERS if s}):
        for name, extra in MODELS.items():
            commands[f"{name}@{share}"] = f"{PREDICT}{extra} --host-permille {share}"
    pred = predictions(commands)
    out = []
    for record, session, share in SERVERS:
        data = json.loads((ROOT / record).read_text())
        for p in data["points"]:
            key = (p["kv_tokens"], p["batch_size"])
            row = {"record": Path(record).name, "session": session, "share": share, "kv": key[0], "batch": key[1],
                   "measured": round(p["aggregate_tok_s"], 1),
                   "scored": not (share and session == 41 and key[1] > 4)}
            names = ("off",) if share is None else tuple(MODELS)
            for name in names:
                got = pred["off" if name == "off" else f"{name}@{share}"][key]
                row[name] = round(got, 1)
                row[f"{name}_error_pct"] = round(error_pct(got, p["aggregate_tok_s"]), 1)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    got = rows()
    for r in got:
        cols = " | ".join(f"{n} {r[n]} ({r[n + '_error_pct']:+.1f} %)" for n in ("off", *MODELS) if n in r)
        print(f"{r['record']:45s} {r['kv'] // 1024:>2}k bs{r['batch']} measured {r['measured']:6.1f} | {cols}"
              + ("" if r["scored"] else "  [unweighted split: not scored]"))
    for name in MODELS:
        errs = [r[f"{name}_error_pct"] for r in got if name in r and r["scored"]]
        print(f"{name}: {sum(abs(e) <= BOUND for e in errs)} of {len(errs)} lane points within ±{BOUND:g} %, "
              f"range {min(errs):+.1f} .. {max(errs):+.1f} %")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1) + "\n")


if __name__ == "__main__":
    main()
