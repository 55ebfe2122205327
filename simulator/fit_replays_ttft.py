"""h100_records_v1: h200_records_v6 with the time to first token's host terms refitted on the H100 servers of session
32, whose short prompts ran as decode replays (ADR 0026) or, in the A/B pairs, eagerly (issue 10; docs/simulator.md,
"Held out on an H100: session 33").

    python -m simulator.fit_replays_ttft [--out FILE] [--check]

Why: v5's `request_overhead_s` (18.9 ms, kept by v6) is the median of measured minus simulated TTFT on session 17's
H200 servers, whose cached prompt's 2-token step ran eagerly (the prefill graphs: token mixers launched from Python,
~30 ms more than a graph replay on the resident ladder) while the model costed it as one decode-graph replay. So it
holds two things: the HTTP path before the engine sees a request, and the eager short step's host time. A server with
short-prompt replays (the default since session 32) runs that step as 2 decode replays, which the model costs as it
costs every decode step, so it pays the first and not the second; v6 charged both (+100 % on session 32's c1 and
probe TTFTs). This fit splits them, each on the points where it is the only unknown, v6's step terms untouched:

- `cost.request_overhead_s`: the median over session 32's replays-ON resident ladders (a, b, c) of their
  single-request (c1) points' measured minus simulated TTFT at overhead 0 (fit_ttft.simulate_points, each point as
  its record ran, replays 8). Single-request points only: the model admits a burst's requests together after one
  overhead (no arrival spread; ADR 0021's window), so the c4 / c16 points' TTFT beyond it is not a per-request
  constant, and a median over them (v5's rule) would put it on every request (c1 +30 to +45 %).
- `cost.eager_mixer_layer_s` (SimExecutor "Short steps"; 0 in v6): the host time a layer of a short uncaptured step
  takes to launch its eager token mixer, which replays skip. The value that makes the median of the replays-OFF
  ladders' (a, b, c) c1 residuals 0 with the overhead above (each point resident and host-bound, so its TTFT is affine
  in the term: secant, then checked). The two fits alternate (FIT_ROUNDS), since a replays-on step of a chunk longer
  than 8 tokens (an uncached prompt) pays the mixer term too.

Session 32's records do not state their servers' replays (servers state `executor.short_prompt_replays` since); the
file names do (`replays8` / `replays0`), and the fit names them. Session 33's records are held out
(scripts/sim_heldout_h100_s33.py). Not a default: `sweep.DEFAULT_CALIBRATIONS["h100"]` stays h200_records_v6 until
this profile has been held out beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from domain.model_spec import qwen36_35b_a3b
from simulator.fit_ttft import TtftPoint, _load, simulate_points
from simulator.hardware import get_profile
from simulator.params import run_fit
from simulator.sweep import CALIBRATION_DIR, Calibration

REPO = Path(__file__).resolve().parents[1]
BASE = "h200_records_v6"
CARD = "h100"
LADDER = "docs/bench/2026-12-06-s32-h100-ladder-fp8-resident-replays{n}-{pair}.json"
PAIRS = ("a", "b", "c")
ON, OFF = 8, 0  # FLUXTIDE_SHORT_PROMPT_REPLAYS of the records' servers (their file names)
OUT = CALIBRATION_DIR / "h100_records_v1.json"
PROBE_MIXER_S = 1e-3  # the secant's step (s a layer)
FIT_ROUNDS = 3  # alternations of the two fits (build: each depends on the other's term)


def records(replays: int) -> list[str]:
    return [LADDER.format(n=replays, pair=p) for p in PAIRS]


def _profile(base: Calibration, overhead: float, mixer: float, name: str) -> dict:
    profile = json.loads(json.dumps(base.to_dict()))
    # NOTE: `hardware` stays the base's (h200), as h200_records_v7's: the step terms, most of the model, were measured
    # there; only the two terms below are the H100's (provenance.replays_ttft_fit.card)
    profile["name"] = name
    profile["cost"].update(request_overhead_s=overhead, eager_mixer_layer_s=mixer)
    return profile


def _points(profile: dict, paths: list[str], replays: int) -> list[TtftPoint]:
    loaded = _load([REPO / p for p in paths])
    cal = Calibration.from_dict(profile, where=profile["name"])
    return simulate_points(cal, loaded, qwen36_35b_a3b(), get_profile(CARD), {name: replays for name, _ in loaded})


def single_request(points: list[TtftPoint]) -> list[TtftPoint]:
    return [p for p in points if p.batch == 1]


def median_residual(points: list[TtftPoint]) -> float:
    """Median of measured minus simulated TTFT (s) over the single-request points."""
    return statistics.median(p.measured_ttft_s - p.simulated_ttft_s for p in single_request(points))


def build(base_name: str = BASE, name: str | None = None) -> dict:
    base = Calibration.resolve(base_name)
    name = name or OUT.stem
    on, off = records(ON), records(OFF)
    overhead = mixer = 0.0
    # NOTE: alternate the two one-parameter fits: every point pays the overhead, and a replays-on point pays the mixer
    # term wherever a step's prompt chunk is longer than 8 tokens (an uncached prompt), so each fit may depend on the
    # other's term; a few rounds settle both (on session 32's records the overhead did not move)
    for _ in range(FIT_ROUNDS):
        overhead += median_residual(_points(_profile(base, overhead, mixer, name), on, ON))
        if overhead < 0:
            raise ValueError(f"the single-request points' simulated TTFT is {-overhead * 1e3:.2f} ms longer than "
                             "measured")
        # the mixer term: secant on the replays-off single-request median residual (affine while host-bound)
        r0 = median_residual(_points(_profile(base, overhead, mixer, name), off, OFF))
        r1 = median_residual(_points(_profile(base, overhead, mixer + PROBE_MIXER_S, name), off, OFF))
        mixer += PROBE_MIXER_S * r0 / (r0 - r1)
        if mixer < 0:
            raise ValueError(f"the replays-off points need a negative mixer term ({mixer * 1e3:.3f} ms a layer)")
    profile = _profile(base, overhead, mixer, name)
    after_on, after_off = _points(profile, on, ON), _points(profile, off, OFF)
    left = max(abs(median_residual(after_on)), abs(median_residual(after_off)))
    if left > 1e-4:
        raise ValueError(f"the fit left {left * 1e3:.3f} ms on a median residual (not settled)")
    profile["procedure"] = (f"python -m simulator.fit_replays_ttft (simulator/fit_replays_ttft.py docstring) over "
                            f"{base_name} ({base.procedure})")
    profile["reading"] = {**base.reading, "ttft": (
        "time to first token through HTTP = request_overhead_s (before the engine sees the request: send, parse, "
        "template, tokenize, the first token's way back; fitted where the first step is decode replays, so it holds "
        "no eager step) + the simulated first step: with short-prompt replays (ADR 0026) a cached prompt's 2 "
        "uncached tokens are 2 decode replays; without, one short uncaptured step whose token mixers the host "
        "launches eagerly, eager_mixer_layer_s a layer")}
    profile["provenance"] = {**base.provenance, "replays_ttft_fit": {
        "base": base_name, "card": CARD,
        "records": {"request_overhead_s": on, "eager_mixer_layer_s": off},
        "replays": {"request_overhead_s": ON, "eager_mixer_layer_s": OFF,
                    "from": "the records' file names (session 32's servers did not state it)"},
        "fields": ["points[].ttft_s_median (c1 fitted)", "points[].aggregate_tok_s (reported)", "settings.warmup, "
                   "warmup_tokens, rounds, tokens", "budget.total_bytes, budget.memory_ratio",
                   "pool_plan.state_slots, kv_tokens, expert_slots, staging_experts",
                   "server_after.stats.prefix_cache.enabled", "server_after.stats.executor.prefill_kernels"],
        "request_overhead_s": "median over the replays-on ladders' c1 points of measured - simulated TTFT at 0",
        "eager_mixer_layer_s": "zero of the replays-off ladders' c1 median residual (secant, 1 ms step)",
        "alternations": FIT_ROUNDS,
        "held_out": "session 33's records (scripts/sim_heldout_h100_s33.py)"}}

    def rows(points: list[TtftPoint], replays: int) -> list[dict]:
        return [{"source": p.source, "label": p.label, "replays": replays, "fitted": p.batch == 1,
                 "measured_ttft_s": p.measured_ttft_s, "simulated_ttft_s": p.simulated_ttft_s,
                 "ttft_error": p.simulated_ttft_s / p.measured_ttft_s - 1,
                 "measured_aggregate_tok_s": p.measured_aggregate_tok_s,
                 "simulated_aggregate_tok_s": p.simulated_aggregate_tok_s,
                 "aggregate_error": p.simulated_aggregate_tok_s / p.measured_aggregate_tok_s - 1} for p in points]

    profile["validation"] = {**base.validation, "replays_ttft_fit": {
        "note": "c1 points fitted (one parameter each); c4, c16 and aggregates reported, not fitted",
        "request_overhead_s": overhead, "eager_mixer_layer_s": mixer,
        "points": rows(after_on, ON) + rows(after_off, OFF)}}
    return profile


def print_table(profile: dict, log=print) -> None:
    fit = profile["validation"]["replays_ttft_fit"]
    log(f"request_overhead_s = {fit['request_overhead_s'] * 1e3:.3f} ms, eager_mixer_layer_s = "
        f"{fit['eager_mixer_layer_s'] * 1e3:.4f} ms a layer")
    log(f"{'record':44} {'point':22} {'TTFT meas':>10} {'sim':>9} {'err':>7} {'agg err':>8}")
    for r in fit["points"]:
        log(f"{r['source'][-44:]:44} {r['label']:22} {r['measured_ttft_s'] * 1e3:8.2f}ms "
            f"{r['simulated_ttft_s'] * 1e3:7.2f}ms {r['ttft_error']:+7.1%} {r['aggregate_error']:+8.1%}"
            + (" (fitted)" if r["fitted"] else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulator.fit_replays_ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=BASE, help="profile whose step terms are kept (name or file)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="compare a fresh build with --out instead of writing it")
    args = p.parse_args(argv)
    return run_fit(lambda: build(args.base, args.out.stem), print_table, args.out, args.check)


if __name__ == "__main__":
    sys.exit(main())
