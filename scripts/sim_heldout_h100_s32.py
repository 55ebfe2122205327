"""Session 32's held-out H100 check (docs/simulator.md, "Held out on an H100: short-prompt replays (session 32)"):
every record of 2026-12-06's session 32 predicted with the card's default calibration, no refit, short-prompt replays
(ADR 0026) as the record's server ran them. Writes docs/bench/2026-12-06-s32-sim-vs-h100.json.

    python scripts/sim_heldout_h100_s32.py            # ~3 min; --out FILE to write elsewhere

Records: three server pairs (a, b, c) of the resident FP8 ladder and probe, each pair once with
FLUXTIDE_SHORT_PROMPT_REPLAYS=8 (`replays8`, the server's default) and once with 0 (`replays0`); the probe and `ft
bench mixed` at 24 GiB, a pair each; bench_prefill at 24 GiB with 260 staging rows.
Procedures are session 31's (scripts/sim_heldout_h100_s31.py): the ladder and the probe's TTFT end to end by `python
-m simulator predict --short-prompt-replays N` (N the record's; the other setting beside it, not scored), decode steps
by the step model (`fit_records.predict`), the prefill by `fit_prefill._point` (staged bytes must equal the
record's), the mixed record by `python -m simulator mixed --record`."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from domain.model_spec import qwen36_35b_a3b
from simulator.cost_model import CostModel
from simulator.fit_prefill import _point
from simulator.fit_records import predict
from simulator.hardware import get_profile
from simulator.heldout import error_pct, heldout_header, heldout_row, run_json, write_report
from simulator.records import expected_distinct, load_records
from simulator.sweep import find_calibration

ROOT = Path(__file__).resolve().parents[1]
BENCH = "docs/bench"
PAIRS = ("a", "b", "c")
REPLAYS = (8, 0)
LADDER = f"{BENCH}/2026-12-06-s32-h100-ladder-fp8-resident-replays{{n}}-{{pair}}.json"
PROBE = f"{BENCH}/2026-12-06-s32-h100-probe-fp8-resident-replays{{n}}-{{pair}}.json"
PREFILL = f"{BENCH}/2026-12-06-s32-h100-prefill-budget-staging260.json"
PROBE_24 = f"{BENCH}/2026-12-06-s32-h100-probe-fp8-24gib-replays{{n}}.json"
MIXED = f"{BENCH}/2026-12-06-s32-h100-mixed-24gib-layered-replays{{n}}.json"
BOUND = 0.10
PREDICT = ("python -m simulator predict --hardware h100 --model qwen3.6-35b-a3b-fp8 --kv 65536 --batch 1,4,16 "
           "--max-running-requests 16 --layered-prefill on --prefill-kernels triton --routing uniform "
           "--short-prompt-replays {n} --json")
# the 24 GiB probe's server: --gpu-budget-gib 24, 16k KV, 4 running, 130 staging rows, the dense copy held (its plan
# has 5,224 expert slots, as the record's)
PREDICT_24 = ("python -m simulator predict --hardware h100 --model qwen3.6-35b-a3b-fp8 --gpu-budget-gib 24 --kv 16384 "
              "--batch 1 --max-running-requests 4 --layered-prefill on --dense-copy on --prefill-kernels triton "
              "--routing uniform --short-prompt-replays {n} --json")
MIXED_CMD = "python -m simulator mixed --record {rec} --short-prompt-replays {n} --json"
STEP_CMD = ("scripts/sim_heldout_h100_s32.py: fit_records.predict(CostModel(qwen36_35b_a3b(), get_profile('h100'), "
            "find_calibration('h100')[0].cost_params()), obs), obs from simulator.records.load_records([{rec}]) "
            "({label})")
PREFILL_CMD = ("scripts/sim_heldout_h100_s32.py: fit_prefill._point(qwen36_35b_a3b(), get_profile('h100'), "
               "cal.cost_params(), cal.seed, record, 'budget', {n}, 8192, ...) on " + PREFILL)


def _pct(pred: float, meas: float) -> float:
    return error_pct(pred, meas)


def _row(record: str, point: str, kind: str, measured: float, predicted: float, unit: str, command: str,
         **extra) -> dict:
    return heldout_row(record, point, kind, measured, predicted, unit, command, BOUND, **extra)


def _run_json(command: str):
    return run_json(command, ROOT)


def _other(n: int) -> int:
    return REPLAYS[1] if n == REPLAYS[0] else REPLAYS[0]


def ladder_points(cal, e2e: dict[int, dict[int, dict]]) -> list[dict]:
    """Each ladder's TTFT, aggregate and steady step by `predict` at the record's replays, and its decode steps by
    the step model."""
    spec = qwen36_35b_a3b()
    model = CostModel(spec, get_profile("h100"), cal.cost_params())
    rows = []
    for n in REPLAYS:
        for pair in PAIRS:
            rec = LADDER.format(n=n, pair=pair)
            obs = {o.label: o for o in load_records([ROOT / rec], spec).observations if o.kind == "step"}
            for p in json.loads((ROOT / rec).read_text())["points"]:
                c, s, o = p["concurrency"], e2e[n][p["concurrency"]], e2e[_other(n)][p["concurrency"]]
                cmd = PREDICT.format(n=n)
                rows.append(_row(rec, f"c{c} TTFT", "HTTP TTFT", p["ttft_s_median"] * 1e3, s["ttft_s"] * 1e3, "ms",
                                 cmd, replays=n, other_replays=_other(n),
                                 other_replays_predicted=round(o["ttft_s"] * 1e3, 4),
                                 other_replays_error_pct=_pct(o["ttft_s"], p["ttft_s_median"])))
                rows.append(_row(rec, f"c{c} aggregate", "aggregate", p["aggregate_tok_s"], s["decode_tok_s"],
                                 "tok/s", cmd, replays=n, other_replays_predicted=round(o["decode_tok_s"], 4)))
                steady = 1e3 / p["steady_decode_tok_s_median"]
                rows.append(_row(rec, f"c{c} decode step (predict steady)", "decode step (predict steady)", steady,
                                 1e3 / s["steady_decode_tok_s_per_request"], "ms", cmd, replays=n))
                ob = obs[f"ladder kv=65536 bs={c}"]
                rows.append(_row(rec, f"c{c} decode step (step model)", "decode step (step model)",
                                 ob.measured_s * 1e3, predict(model, ob) * 1e3, "ms",
                                 STEP_CMD.format(rec=rec, label=ob.label), replays=n, context=ob.context,
                                 misses_per_step=ob.misses_per_step))
    return rows


def probe_points(cal, e2e: dict[int, dict[int, dict]]) -> list[dict]:
    """Each probe's TTFT (predict's bs1 TTFT at the record's replays) and decode step (session 20's supplement: a
    bs1 resident observation at the prompt plus half the tokens, as session 31's)."""
    spec = qwen36_35b_a3b()
    model = CostModel(spec, get_profile("h100"), cal.cost_params())
    ladder = LADDER.format(n=8, pair="a")
    c1 = next(o for o in load_records([ROOT / ladder], spec).observations if o.label == "ladder kv=65536 bs=1")
    rows = []
    for n in REPLAYS:
        for pair in PAIRS:
            rec = PROBE.format(n=n, pair=pair)
            for p in json.loads((ROOT / rec).read_text())["points"]:
                tokens, s, o = p["max_tokens"], e2e[n][1], e2e[_other(n)][1]
                rows.append(_row(rec, f"{tokens} tokens TTFT", "HTTP TTFT", p["ttft_s_median"] * 1e3,
                                 s["ttft_s"] * 1e3, "ms", PREDICT.format(n=n) + " (bs1's ttft_s)", replays=n,
                                 other_replays=_other(n), other_replays_predicted=round(o["ttft_s"] * 1e3, 4),
                                 other_replays_error_pct=_pct(o["ttft_s"], p["ttft_s_median"])))
                ob = replace(c1, source=Path(rec).name, label=f"probe {tokens}",
                             context=p["runs"][0]["prompt_tokens"] + tokens // 2,
                             distinct_per_layer=expected_distinct(spec.num_experts, spec.top_k, 1),
                             measured_s=1 / p["steady_decode_tok_s_median"])
                rows.append(_row(rec, f"{tokens} tokens decode step (step model)", "decode step (step model)",
                                 ob.measured_s * 1e3, predict(model, ob) * 1e3, "ms",
                                 f"scripts/sim_heldout_h100_s32.py: fit_records.predict on a bs1 resident "
                                 f"StepObservation of {rec} (context {ob.context}, 0 misses)", replays=n))
    return rows


def prefill_points(cal) -> list[dict]:
    spec, record = qwen36_35b_a3b(), json.loads((ROOT / PREFILL).read_text())
    rows = []
    for n in sorted(map(int, record["scenarios"]["budget"]["prompts"])):
        p = _point(spec, get_profile("h100"), cal.cost_params(), cal.seed, record, "budget", n, 8192, PREFILL,
                   "held_out")
        m = record["scenarios"]["budget"]["prompts"][str(n)]
        rows.append(_row(PREFILL, f"budget {n} TTFT", "prefill TTFT", p["measured_s"], p["predicted_s"], "s",
                         PREFILL_CMD.format(n=n), steps=p["steps"], expert_slots=p["expert_slots"],
                         staging_experts=p["staging_experts"], bytes_staged=p["bytes_staged"],
                         pcie_bound_s=m["pcie_bound_s"]))
    return rows


def probe_24_points() -> list[dict]:
    """The 24 GiB probe pair's TTFT and steady step by `predict` at each record's replays (the other beside it)."""
    e2e = {n: _run_json(PREDICT_24.format(n=n))[0] for n in REPLAYS}
    rows = []
    for n in REPLAYS:
        rec, s, o = PROBE_24.format(n=n), e2e[n], e2e[_other(n)]
        record = json.loads((ROOT / rec).read_text())
        assert s["expert_slots"] == record["pool_plan"]["expert_slots"], "the plan is not the record's"
        for p in record["points"]:
            rows.append(_row(rec, f"{p['max_tokens']} tokens TTFT", "HTTP TTFT", p["ttft_s_median"] * 1e3,
                             s["ttft_s"] * 1e3, "ms", PREDICT_24.format(n=n), replays=n, other_replays=_other(n),
                             other_replays_predicted=round(o["ttft_s"] * 1e3, 4),
                             other_replays_error_pct=_pct(o["ttft_s"], p["ttft_s_median"])))
            rows.append(_row(rec, f"{p['max_tokens']} tokens decode step (predict steady)",
                             "decode step (predict steady)", 1e3 / p["steady_decode_tok_s_median"],
                             1e3 / s["steady_decode_tok_s_per_request"], "ms", PREDICT_24.format(n=n), replays=n))
    return rows


def _tails(result: dict) -> list[dict]:
    return [r for r in result["compare"]["steps"]["rows"] if r["kind"] == "tail" and r["predicted_ms"] is not None]


def mixed_points() -> list[dict]:
    """Each mixed record's figures and tail steps, replayed at its replays and, beside them, at the other setting."""
    rows = []
    for n in REPLAYS:
        rec = MIXED.format(n=n)
        on, off = (_run_json(MIXED_CMD.format(rec=rec, n=m))[0] for m in (n, _other(n)))
        cmd = MIXED_CMD.format(rec=rec, n=n)
        for name, fig in on["compare"]["figures"].items():
            if name == "window_max_ms":
                continue
            scale = 1e3 if name == "ttft_s_median" else 1.0  # every figure in ms
            other = off["compare"]["figures"][name]
            rows.append(_row(rec, name.replace("ttft_s_median", "TTFT median"), "mixed figure",
                             fig["measured"] * scale, fig["predicted"] * scale, "ms", cmd, replays=n,
                             other_replays_predicted=round(other["predicted"] * scale, 4),
                             other_replays_error_pct=round(other["error_pct"], 2),
                             plan_expert_slots=on["plan"]["expert_slots"],
                             record_expert_slots=on["compare"]["plan"]["expert_slots"]["record"]))
        tails, tails_off = _tails(on), _tails(off)
        measured, predicted = (statistics.median(r[k] for r in tails) for k in ("measured_ms", "predicted_ms"))
        rows.append(_row(rec, "tail step median", "mixed tail step", measured, predicted, "ms",
                         cmd + " (compare.steps, kind tail: 4 prompt tokens beside 3 decodes)", replays=n,
                         steps=len(tails), measured_ms=[r["measured_ms"] for r in tails],
                         measured_misses=[r["measured_misses"] for r in tails],
                         predicted_misses=[r["predicted_misses"] for r in tails],
                         other_replays_predicted=round(statistics.median(r["predicted_ms"] for r in tails_off), 4)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / BENCH / "2026-12-06-s32-sim-vs-h100.json"))
    args = ap.parse_args()
    cal, measured_here = find_calibration("h100")
    e2e = {n: {p["batch"]: p for p in _run_json(PREDICT.format(n=n))} for n in REPLAYS}
    points = (ladder_points(cal, e2e) + probe_points(cal, e2e) + probe_24_points() + prefill_points(cal)
              + mixed_points())
    title = ("the simulator against session 32's H100 records, held out (no refit), short-prompt replays "
             "modelled")
    header = heldout_header(32, title, get_profile("h100").to_dict(), cal, measured_here, BOUND,
                            "python scripts/sim_heldout_h100_s32.py",
                            replays="each record predicted at its server's FLUXTIDE_SHORT_PROMPT_REPLAYS (its file "
                                    "name: replays8 or replays0); other_replays_* is the other setting, not scored")
    write_report(args.out, header, points,
                 lambda r: f"{r['kind']} (replays {r['replays']})" if "replays" in r else r["kind"],
                 slice(15, 58), 43, 40)


if __name__ == "__main__":
    main()
