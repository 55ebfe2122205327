"""Short prompts beside decodes, predicted (ADR 0024, "Short prompts beside decodes (session 25, predicted)").

Runs `python -m simulator mixed` (in-process) for each plan x policy x prompt length and writes one JSON record with
every command and its figures (the window's gap p50/p99/max for the 3 streams, the prompt's TTFT, steps, layer
groups, GB staged):
    .venv/bin/python scripts/sim_short_prompts.py [--out docs/bench/2026-12-05-sim-short-prompts-mixed.json]
The server flags are `scripts/gpu_mixed_bench.sh`'s (ft bench mixed's 2,048-token streams of a 53-token prompt,
16 snapshot slots, the Triton prefill); the policies other than "today" and "engine" are the simulator's what-ifs
(simulator/layering_policy.py). "today" is the engine of session 25 (`--layer-short-prompts off`, pinned since the
engine's default became A0 in session 28); "engine-A0+B" is the engine's own default since then (the domain's
policy, which also makes a second prompt wait while one is part-way: the same as the what-if A0+B for one prompt).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.__main__ import main as simulator_main  # noqa: E402

PROMPTS = (16, 29, 200, 400, 600, 1000, 2000, 8192)
COMMON = ["mixed", "--layered-prefill", "on", "--stream-tokens", "2048", "--stream-prompt-tokens", "53",
          "--snapshot-slots", "16", "--prefill-kernels", "triton", "--max-running-requests", "4",
          "--max-prefill-length", "8192", "--memory-ratio", "0.9", "--cache-type", "radix"]
# 130 staging rows: the 8 ms cover's default (ADR 0010, session 25), pinned so the record does not move with it
PLANS = {"24gib": ["--gpu-budget-gib", "24", "--kv", "16384", "--staging-experts", "130"],
         "resident": ["--gpu-budget-gib", "130", "--kv", "65536"]}
OFF = ["--layer-short-prompts", "off"]  # the engine's own short-prompt policy off: the session-25 baseline
POLICIES = {
    # groups sized by the mixed budget, as before --layer-group-length (session 25) raised them to 1024
    "today-512": ["--mixed-prefill-length", "512", "--layer-group-length", "512", *OFF],
    "today-1024": ["--mixed-prefill-length", "1024", *OFF],
    "A-512": ["--mixed-prefill-length", "512", "--layer-streamed-chunks"],
    "A-1024": ["--mixed-prefill-length", "1024", "--layer-streamed-chunks"],
    "B-512/768": ["--mixed-prefill-length", "512", "--layer-group-length", "768", *OFF],
    "B-512/1024": ["--mixed-prefill-length", "512", "--layer-group-length", "1024", *OFF],
    "A+B-512/1024": ["--mixed-prefill-length", "512", "--layer-streamed-chunks", "--layer-group-length", "1024"],
    "A0+B-512/1024": ["--mixed-prefill-length", "512", "--layer-streamed-chunks", "--layer-faulting-chunks",
                      "--layer-group-length", "1024"],
    # the engine's own A0 (--layer-short-prompts auto: the default in sessions 28-29, off since session 30)
    "engine-A0+B": ["--mixed-prefill-length", "512", "--layer-short-prompts", "auto"],
}


# What the code does with a short chunk beside decodes (read, session 25), and how far the simulator is from the
# two mixed records measured today (H100; replayed on the h200 profile with h200_records_v6, --record ... --hardware
# h200 --layered-prefill on).
PREMISE = {
    "engine": "an unlayered mixed step runs eagerly inside DeviceExpertPool.streamed_step (executor _forward_logits); "
              "a layer call of more than min(expert slots, 256) keys (a step of more than 32 rows at top-8, the "
              "decode rows included) takes _routed_streamed: resident experts read in place, every other expert the "
              "layer routes to copied into the staging rows, the LRU neither stamped nor filled (ADR 0010); a call "
              "of 129-256 keys takes _routed_set and 1-128 the one-launch lookup, both through the LRU (misses fill "
              "slots, evicting the decode streams' experts). A chunk of >= 256 tokens copies every round unmasked "
              "(speculate_whole_layers); shorter ones copy the first round of a layer unmasked and later rounds "
              "masked to the routed experts, which for 200 tokens + 3 decodes are 99.8 % of them (1 - (1 - 8/256)^203)",
    "simulator": "the same: SimExecutor._step streams an uncaptured step when CostModel.streams_prefill (pairs > "
                 "min(slots, lookup_max_keys) with staging rows; h200_records_v6 has streamed_prefill on), planning "
                 "the engine's rounds (domain plan_rounds, speculate_whole_layers); at most 32 rows go through the "
                 "residency (ExpertResidency, copies not overlapped: overlap_copy_compute false)",
    "consequence": "at --gpu-budget-gib 24 (51 % resident) any prompt of 30..509 tokens beside 3 decodes stages "
                   "~15.7 GB in one step (>= 0.29 s at 54 GB/s whatever the compute model) and one of 1..29 tokens "
                   "faults ~5,000 experts through the LRU in one step",
}
SIMULATOR_CHECK = {
    "what": "the two H100 mixed records of 2026-12-05 (8,196-token prompt, 24 GiB, staging 66) replayed on the h200 "
            "profile: measured vs predicted, error %",
    "512": {"record": "docs/bench/2026-12-05-h100-mixed-24gib-512-layered.json", "gap_p50_ms": [64.6, 61.3, -5.1],
            "gap_p99_ms": [131.0, 83.0, -36.6], "ttft_s": [1.474, 1.339, -9.2]},
    "1024": {"record": "docs/bench/2026-12-05-h100-mixed-24gib-1024-layered.json", "gap_p50_ms": [87.1, 84.5, -3.0],
             "gap_p99_ms": [130.0, 88.0, -32.3], "ttft_s": [1.063, 0.967, -9.1]},
    "reading": "p50 and TTFT within 10 %; the measured p99 is ~40-50 ms above the simulated one (jitter, host work, "
               "the first and last groups), so read a predicted p99 as ~1.5 x on the card",
}


def predict(argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        with contextlib.redirect_stdout(io.StringIO()):
            code = simulator_main([*argv, "--out", str(out), "--json"])
        if code != 0:
            raise SystemExit(f"simulator failed ({code}): {shlex.join(argv)}")
        (result,) = json.loads(out.read_text())
    return result


def point(plan: str, policy: str, prompt: int, argv: list[str], result: dict) -> dict:
    ok = [p for p in result["points"] if p.get("ok")]
    window = result["window"]

    def mean(key):
        return round(statistics.fmean(p[key] for p in ok), 2) if ok else None

    return {"plan": plan, "policy": policy, "prompt_tokens": prompt,
            "command": "python -m simulator " + shlex.join(argv),
            "gap_p50_ms": round(window["p50_ms"], 1), "gap_p99_ms": round(window["p99_ms"], 1),
            "gap_max_ms": round(window["max_ms"], 1), "gaps": window["count"],
            "ttft_s_median": round(result["ttft_s_median"], 3),
            "baseline_p99_ms": round(result["baseline"]["p99_ms"], 1),
            "window_steps": mean("window_steps"), "window_layered_steps": mean("window_layered_steps"),
            "gb_staged": round(mean("window_bytes_staged") / 1e9, 2) if ok else None,
            "within_target": result["within_target"], "failures": len(result["failures"]),
            "residency": round(result["residency"], 3), "expert_slots": result["plan"]["expert_slots"],
            "staging_experts": result["plan"]["staging_experts"], "scheduler": result["scheduler"],
            "calibration": result["calibration"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench/2026-12-05-sim-short-prompts-mixed.json")
    args = parser.parse_args()
    points, not_modelled = [], None
    for plan, plan_args in PLANS.items():
        for policy, policy_args in POLICIES.items():
            for prompt in PROMPTS:
                argv = [*COMMON, *plan_args, *policy_args, "--prompt-tokens", str(prompt)]
                result = predict(argv)
                not_modelled = not_modelled or result["not_modelled"]
                p = point(plan, policy, prompt, argv, result)
                points.append(p)
                print(f"{plan:9} {policy:13} {prompt:5}: gaps p50 {p['gap_p50_ms']:6.1f} p99 {p['gap_p99_ms']:6.1f} "
                      f"ms, TTFT {p['ttft_s_median']:.3f} s, steps {p['window_steps']}, groups "
                      f"{p['window_layered_steps']}, {p['gb_staged']} GB staged", flush=True)
    record = {
        "kind": "simulator_prediction", "date": "2026-12-05", "session": 25,
        "question": "a prompt shorter than the mixed budget beside 3 decoding streams runs as one unlayered mixed step "
                    "that streams every non-resident expert at partial residency: the streams' gaps and the prompt's "
                    "TTFT today (mixed budget 512 and 1024) and under two what-if policies: A, beside decodes layer any "
                    "chunk whose step would stream experts (A0: and those too short to stream, which fault experts "
                    "through the expert cache); B, a layer group budget apart from the unlayered threshold",
        "script": "python scripts/sim_short_prompts.py",
        "inputs": {"common": shlex.join(COMMON), "plans": {k: shlex.join(v) for k, v in PLANS.items()},
                   "policies": {k: shlex.join(v) for k, v in POLICIES.items()}, "prompts": list(PROMPTS),
                   "hardware": "h200", "calibration": "h200_records_v6 (the H200 default)", "routing": "uniform",
                   "repeats": "3 measured after 1 warm-up (ft bench mixed's)"},
        "premise": PREMISE,
        "simulator_check": SIMULATOR_CHECK,
        "not_modelled": not_modelled,
        "points": points,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
