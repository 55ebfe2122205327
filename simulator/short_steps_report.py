"""The before/after records of h200_records_v7 (`python -m simulator.fit_short_steps --report`; docs/simulator.md,
"Short steps: h200_records_v7"): v6 and v7 side by side on every held-out comparison docs/simulator.md makes with v6,
re-run, and whether v7 is at least as good on each (the rule for making it a default).

- docs/bench/2026-12-05-sim-prefill-split.json: the bench_prefill points of both cards and the H200's HTTP prefills;
- docs/bench/2026-12-05-sim-tail-step.json: the `ft bench mixed` records replayed (figures, and the window steps by
  kind with every tail step), and session 20's thirteen `predict` points (aggregate and TTFT), whose measured steps
  include short prefills (2 tokens a request) that v7's eager_mixer_layer_s costs.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from domain.model_spec import qwen36_35b_a3b
from simulator.fit_prefill import HTTP as H200_HTTP
from simulator.fit_prefill import RECORD as H200_PREFILL
from simulator.fit_prefill import http_points
from simulator.fit_short_steps import (
    BENCH,
    H200_MIXED,
    HELD_MIXED,
    TAIL_RECORD,
    _load,
    _rel,
    prefill_points,
    replay,
)
from simulator.hardware import get_profile
from simulator.sweep import Calibration

SESSION20 = BENCH / "2026-12-04-sim-heldout-h200-session21.json"  # session 20's thirteen points, measured
PREDICT = {  # session 20's commands ("Before the first token", Reproduce), --calibration appended
    "sweep": ["predict", "--hardware", "h200", "--model", "qwen3.6-35b-a3b-fp8", "--gpu-budget-gib", "24", "--kv",
              "8192,65536", "--batch", "1,3,4,6", "--prefill-kernels", "triton", "--max-running-requests", "6",
              "--routing", "uniform", "--json", "--workers", "1"],
    "ladder": ["predict", "--hardware", "h200", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "65536", "--batch",
               "1,2,4,8,16", "--max-running-requests", "16", "--prefill-kernels", "triton", "--routing", "uniform",
               "--json", "--workers", "1"],
}
FIGURES = ("window_p50_ms", "window_p99_ms", "window_max_ms", "baseline_p50_ms", "baseline_p99_ms", "ttft_s_median")


def _err(predicted: float, measured: float) -> float:
    return (predicted / measured - 1) * 100


def _not_worse(before: float | None, after: float | None, slack: float = 1e-9) -> bool | None:
    """|after| <= |before| (errors in percent), or None without both."""
    if before is None or after is None:
        return None
    return abs(after) <= abs(before) + slack


def prefill_report(before: Calibration, after: Calibration) -> dict:
    spec = qwen36_35b_a3b()
    old = prefill_points(spec, before.cost_params(), before.seed)
    new = prefill_points(spec, after.cost_params(), after.seed)
    points = []
    for a, b in zip(old, new, strict=True):
        # v6 fitted its terms on the H200's resident prompts; every other point was held out of it
        v6_role = "fit" if a["record"] == _rel(H200_PREFILL) and a["scenario"] == "resident" else "held_out"
        points.append({"record": a["record"], "card": a["card"], "scenario": a["scenario"],
                       "prompt_tokens": a["prompt_tokens"], "steps": a["steps"], "measured_s": a["measured_s"],
                       "v6": {"role": v6_role, "predicted_s": a["predicted_s"], "error_pct": a["error"] * 100},
                       "v7": {"role": b["role"], "predicted_s": b["predicted_s"], "error_pct": b["error"] * 100},
                       "v7_not_worse": _not_worse(a["error"], b["error"])})
    record = _load(H200_HTTP, "prefill")
    hw = get_profile("h200")
    http = []
    for a, b in zip(http_points(spec, hw, before.cost_params(), before.seed, record, H200_HTTP.name),
                    http_points(spec, hw, after.cost_params(), after.seed, record, H200_HTTP.name), strict=True):
        http.append({"point": a["label"], "prompt_tokens": a["prompt_tokens"], "steps": a["steps"],
                     "measured_last_s": a["measured_last_s"], "measured_median_s": a["measured_median_s"],
                     "v6": {"predicted_s": a["predicted_s"], "error_last_pct": a["error_last"] * 100,
                            "error_median_pct": a["error_median"] * 100},
                     "v7": {"predicted_s": b["predicted_s"], "error_last_pct": b["error_last"] * 100,
                            "error_median_pct": b["error_median"] * 100},
                     "v7_not_worse": _not_worse(a["error_last"], b["error_last"])})
    return {"points": points, "http": http}


def _predict(argv: list[str], calibration: str) -> list[dict]:
    from simulator.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--calibration", calibration])
    if code:
        raise ValueError(f"predict {' '.join(argv)} failed (exit {code})")
    return json.loads(out.getvalue())


def predict_report(before: str, after: str) -> list[dict]:
    """Session 20's thirteen points (measured in the session-21 record) with both calibrations."""
    measured = json.loads(SESSION20.read_text())["points"]
    results = {}
    for name in (before, after):
        for kind, argv in PREDICT.items():
            for r in _predict(argv, name):
                results[(name, kind, r["kv_tokens"], r["batch"])] = r
    rows = []
    for m in measured:
        kind = "ladder" if m["label"].startswith("ladder") else "sweep"
        row = {"point": m["label"], "measured_aggregate_tok_s": m["measured"]["aggregate_tok_s"],
               "measured_ttft_s": m["measured"]["ttft_s_median"]}
        for tag, name in (("v6", before), ("v7", after)):
            r = results[(name, kind, m["kv_tokens"], m["batch"])]
            row[tag] = {"aggregate_tok_s": r["decode_tok_s"],
                        "aggregate_error_pct": _err(r["decode_tok_s"], m["measured"]["aggregate_tok_s"]),
                        "ttft_s": r["ttft_s"], "ttft_error_pct": _err(r["ttft_s"], m["measured"]["ttft_s_median"])}
        row["v7_aggregate_not_worse"] = _not_worse(row["v6"]["aggregate_error_pct"], row["v7"]["aggregate_error_pct"])
        row["v7_ttft_not_worse"] = _not_worse(row["v6"]["ttft_error_pct"], row["v7"]["ttft_error_pct"])
        rows.append(row)
    return rows


def mixed_report(before: str, after: str) -> list[dict]:
    """Each mixed record replayed with both: its figures, its window steps by kind, its tail steps."""
    rows = []
    for record in (TAIL_RECORD, *HELD_MIXED, H200_MIXED):
        results = {tag: replay(record, name) for tag, name in (("v6", before), ("v7", after))}
        figures = {}
        for f in FIGURES:
            a, b = (results[t]["compare"]["figures"][f] for t in ("v6", "v7"))
            figures[f] = {"measured": a["measured"], "v6": a["predicted"], "v6_error_pct": a["error_pct"],
                          "v7": b["predicted"], "v7_error_pct": b["error_pct"],
                          "v7_not_worse": _not_worse(a["error_pct"], b["error_pct"])}
        steps = {t: results[t]["compare"]["steps"] for t in ("v6", "v7")}
        tails = [{"repeat": a["repeat"], "index": a["index"], "decode_rows": a["decode_rows"],
                  "prefill_tokens": a["prefill_tokens"], "measured_ms": a["measured_ms"], "host_ms": a["host_ms"],
                  "measured_misses": a["measured_misses"], "predicted_misses": b["predicted_misses"],
                  "v6_ms": a["predicted_ms"], "v6_error_pct": a["error_pct"], "v7_ms": b["predicted_ms"],
                  "v7_error_pct": b["error_pct"]}
                 for a, b in zip(*(steps[t]["rows"] for t in ("v6", "v7")), strict=True) if a["kind"] == "tail"]
        rows.append({"record": _rel(record), "role_v7_tail": "fit" if record == TAIL_RECORD else "held_out",
                     "hardware": results["v7"]["hardware"],
                     "repeat_prompt_tokens": results["v7"]["scenario"]["repeat_prompt_tokens"],
                     "command": f"python -m simulator mixed --record {_rel(record)} --calibration NAME --json",
                     "figures": figures, "steps_by_kind": {t: steps[t]["by_kind"] for t in ("v6", "v7")},
                     "tail_steps": tails, "note": steps["v7"].get("note")})
    return rows


def write_reports(before: str, profile: dict, split_path: Path, tail_path: Path) -> None:
    """Both records, `profile` (the fresh v7) against `before` (a name)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        after = str(Path(tmp) / f"{profile['name']}.json")
        Path(after).write_text(json.dumps(profile))
        old, new = Calibration.resolve(before), Calibration.resolve(after)
        fit = profile["validation"]["short_steps"]
        terms = {k: fit[k] for k in ("eager_layer_s", "eager_token_s", "eager_mixer_layer_s", "eager_step_fixed_s",
                                     "eager_token_s_per_step_layers")}
        common = {"schema": "fluxtide.sim-check/1", "date": "2026-12-05", "before": before, "after": profile["name"],
                  "v6_terms": {k: old.cost[k] for k in ("eager_layer_s", "eager_compute_efficiency")},
                  "v7_terms": {**terms, "eager_compute_efficiency": new.cost["eager_compute_efficiency"]},
                  "provenance": profile["provenance"]["short_steps_fit"]}
        split = {**common, "title": "the eager prefill's fixed cost split from its per-token cost: v6 and v7 on every "
                                    "bench_prefill point and the H200's HTTP prefills",
                 "reproduce": ["python -m simulator.fit_short_steps --report   # fits v7 and writes both records",
                               "python -m simulator.fit_short_steps --check    # compares a fresh fit with the file"],
                 **prefill_report(old, new)}
        split_path.write_text(json.dumps(split, indent=1) + "\n")
        tail = {**common, "title": "the tail step (a short uncaptured step's eager token mixers): v6 and v7 on the "
                                   "ft bench mixed records and session 20's predict points",
                "reproduce": ["python -m simulator mixed --record RECORD --calibration h200_records_v7 --steps",
                              *(" ".join(["python -m simulator", *argv, "--calibration h200_records_v7"])
                                for argv in PREDICT.values())],
                "mixed": mixed_report(before, after), "predict_session20": predict_report(before, after)}
        tail_path.write_text(json.dumps(tail, indent=1) + "\n")
    print(f"wrote {split_path} and {tail_path}")
