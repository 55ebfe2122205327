"""python -m simulator predict ...: capacity planning from the command line."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable

try:
    import simpy  # noqa: F401  # NOTE: the sim extra; say so instead of a traceback from deep in the imports
except ModuleNotFoundError as exc:
    if __name__ != "__main__":
        raise  # imported by `ft sim`, which says it in its own words
    sys.exit(f"python -m simulator needs {exc.name}, which the sim extra installs: pip install -e \".[sim]\"")

from domain.model_spec import ModelSpec
from domain.prefill_choice import resolve_prefill_kernels
from domain.residency import HOST_LANE_MAX_ROWS
from domain.serve_plan import cap_bytes
from simulator.hardware import GIB, get_profile, load_profiles
from simulator.host_lane import with_host_lane
from simulator.predict import Deployment, Workload
from simulator.sweep import (
    BUILTIN_MODELS,
    Calibration,
    SweepConfig,
    calibration_for,
    resolve_model,
    run_sweep,
)


def parse_count(text: str) -> int:
    """'8192', '8k' (x1024), '1m' (x1024^2), '400000'."""
    t = text.strip().lower()
    scale = {"k": 1024, "m": 1024**2}.get(t[-1:], 1)
    number = t[:-1] if scale != 1 else t
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):  # NOTE: int(inf) is an OverflowError
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def parse_count_or_zero(text: str) -> int:
    """A count as parse_count, or 0."""
    if text.strip() == "0":
        return 0
    try:
        return parse_count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a count >= 0: {text!r}") from None


def parse_count_or_auto(text: str) -> int | str:
    """'auto' or a count as parse_count_or_zero (None stays free to mean: not given)."""
    return "auto" if text.strip().lower() == "auto" else parse_count_or_zero(text)


def _finite_non_negative(text: str, noun: str, unit: str = "") -> float:
    """float(text) if a finite number >= 0, else argparse's error naming `noun` (and `unit`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a {noun}{unit}: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite {noun} >= 0{unit}: {text!r}")
    return value


def parse_gb_s(text: str) -> float:
    """A finite rate >= 0 in GB/s."""
    return _finite_non_negative(text, "rate", " in GB/s")


def parse_non_negative(text: str) -> float:
    """A finite number >= 0 (the host lane's fixed microseconds, its row factor)."""
    return _finite_non_negative(text, "number")


def parse_permille_or_auto(text: str) -> int | str:
    """'auto' or an integer share in 0..1000 (per mille)."""
    t = text.strip().lower()
    if t == "auto":
        return t
    if not t.isdigit() or int(t) > 1000:
        raise argparse.ArgumentTypeError(f"must be auto or an integer in 0..1000 (per mille): {text!r}")
    return int(t)


def _host_lane_rows(args) -> int | None:
    """predict's host_max_rows: --host-lane-rows, else ft serve's default where a lane is asked for, else None."""
    if args.host_lane_rows is not None:
        return args.host_lane_rows
    asked = args.host_experts_gb_s is not None or args.host_permille is not None
    return HOST_LANE_MAX_ROWS if asked else None


def parse_list(text: str) -> list[int]:
    values = [parse_count(x) for x in text.split(",") if x.strip()]
    if not values:  # NOTE: an empty list predicted nothing and exited 0
        raise argparse.ArgumentTypeError(f"give at least one count, e.g. 8192,64k: {text!r}")
    return values


def parse_gib(text: str) -> float:
    """A positive, finite number of GiB."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None
    if not 0 < value < float("inf"):  # NOTE: False for nan; inf overflowed int() in the byte count
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB: {text!r}")
    return value


def add_mixed_arguments(m: argparse.ArgumentParser) -> None:
    """The `mixed` subcommand's arguments (also parsed alone, to tell the flags given beside --record)."""
    m.add_argument("--record", metavar="FILE",
                   help="an `ft bench mixed` JSON record: predict the scenario and the server it ran (streams, the "
                        "long prompt as the server counted it, stream/warm-up/baseline tokens, repeats, GPU budget, "
                        "KV, max running, snapshot and staging rows, prefill kernels, step budgets, layered prefill, "
                        "model, GPU) and compare its measured gaps and TTFT with the prediction; a flag given beside "
                        "it overrides the record's value (docs/simulator.md, 'Held out: the measured record')")
    m.add_argument("--hardware", default="h200", help="a built-in profile or a name from --hardware-file")
    m.add_argument("--hardware-file", help="JSON/TOML file with extra hardware profiles")
    m.add_argument("--model", default="qwen3.6-35b-a3b-fp8",
                   help=f"one of {sorted(BUILTIN_MODELS)} or a checkpoint directory")
    m.add_argument("--kv", type=parse_count, default=16384,
                   help="KV pool in tokens, as `ft serve --kv-tokens` (default 16k, the benchmark's 24gib scenario: "
                        "8k cannot hold an 8k prompt beside the streams)")
    m.add_argument("--gpu-budget-gib", type=parse_gib, help="as `ft serve --gpu-budget-gib` (24: issue 9's card; "
                                                            "130 with --kv 64k: the benchmark's resident scenario)")
    m.add_argument("--memory-ratio", type=float, help="as `ft serve --memory-ratio`")
    m.add_argument("--max-prefill-length", type=parse_count, help="as `ft serve --max-prefill-length` (8192)")
    m.add_argument("--mixed-prefill-length", type=parse_count,
                   help="as `ft serve --mixed-prefill-length` (default: min(512, --max-prefill-length))")
    m.add_argument("--max-running-requests", "--state-slots", dest="max_running_requests", type=parse_count,
                   help="as `ft serve --max-running-requests` (default: the calibration's, 4)")
    m.add_argument("--cache-type", choices=("radix", "none"), help="as `ft serve --cache-type`")
    m.add_argument("--short-prompt-replays", type=parse_count_or_auto, metavar="N|auto",
                   help="as the server's FLUXTIDE_SHORT_PROMPT_REPLAYS: a step whose prompt chunks are all at most N tokens "
                        "runs as decode replays, one per token of its longest chunk (ADR 0026); 0 off; auto (the "
                        "server's default) 8 at every plan (0 with a calibration of the customer's engine)")
    m.add_argument("--snapshot-slots", type=parse_count_or_zero, help="as `ft serve --snapshot-slots`")
    m.add_argument("--staging-experts", type=parse_count_or_auto, metavar="N|auto", help="as `ft serve --staging-experts`")
    m.add_argument("--prefill-kernels", choices=("auto", "reference", "triton"), default="auto",
                   help="as `ft serve --prefill-kernels` (default auto: triton for block-FP8 on a card, so the "
                        "prefill streams what is not resident through the staging rows)")
    m.add_argument("--layered-prefill", default="off,on", help="off, on, or off,on (default: both)")
    m.add_argument("--layer-streamed-chunks", action="store_true",
                   help="what-if, not the engine's policy (simulator/layering_policy.py; layered prefill on only): "
                        "beside decodes, layer any prompt chunk whose step would stream experts, however short")
    m.add_argument("--layer-faulting-chunks", action="store_true",
                   help="what-if, with --layer-streamed-chunks: also layer the chunks too short to stream (at most 32 "
                        "rows at top-8), which fault their experts through the expert cache, wherever the plan is not "
                        "fully resident")
    m.add_argument("--layer-short-prompts", choices=("auto", "off"), default="off",
                   help="as `ft serve --layer-short-prompts` (auto: with layered prefill on, on a plan that does not "
                        "hold every expert, every prompt beside decodes runs as layer groups, however short; off, "
                        "the default as on the server: only prompts longer than the mixed budget); "
                        "--layer-streamed-chunks replaces it")
    m.add_argument("--layer-group-length", type=parse_count,
                   help="as `ft serve --layer-group-length`: the budget, decodes included, that sizes a layer group "
                        "(default 1024, at least --mixed-prefill-length, which keeps deciding what is layered)")
    m.add_argument("--streams", type=parse_count, default=3, help="running streams (ft bench mixed --streams)")
    m.add_argument("--prompt-tokens", type=parse_count, default=8192, help="the long prompt (--prompt-tokens)")
    m.add_argument("--repeat-prompt-tokens", type=parse_list, metavar="N,N,...",
                   help="the long prompt's tokens each measured repeat computes, one count per repeat (the rest "
                        "resumed from the prefix cache; simulated as a fresh prompt of that size); default: "
                        "--prompt-tokens in every repeat; with --record: each repeat's own chunks, from its step trace")
    m.add_argument("--steps", action="store_true",
                   help="with --record: print every window step beside its simulated twin (kind, measured and "
                        "predicted ms); the JSON's compare.steps always has them")
    m.add_argument("--stream-tokens", type=parse_count, default=128, help="each stream's output tokens")
    m.add_argument("--stream-prompt-tokens", type=parse_count, help="the streams' prompt (default: the "
                                                                   "calibration's prompt, the customer's 18 tokens)")
    m.add_argument("--warmup-tokens", type=parse_count, default=16)
    m.add_argument("--baseline-tokens", type=parse_count, default=64)
    m.add_argument("--repeats", type=parse_count, default=3, help="measured repeats (ft bench mixed: 3)")
    m.add_argument("--warmup-repeats", type=parse_count_or_zero, default=1)
    m.add_argument("--same-prompt", action="store_true",
                   help="every stream the one prompt (lockstep routing); the benchmark gives each its own")
    m.add_argument("--routing", default="uniform",
                   help="uniform (default: the random-weight `ft synth` checkpoint the benchmark serves) | "
                        "locality | trace:FILE")
    m.add_argument("--calibration", help="calibration JSON file or name in simulator/calibration/; default as "
                                         "predict's: h200_records_v6 on the H200 and the H100, else the newest fluxtide "
                                         "calibration of the hardware, else h200_records_v5 carried over")
    m.add_argument("--seed", type=int, help="routing seed (default: the calibration's)")
    m.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    m.add_argument("--out", help="also write the JSON to this file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="predict decode throughput over KV pool sizes and batch sizes")
    p.add_argument("--hardware", required=True, help="rtx3090, rtx4090, rtx5090, rtx4060-laptop, h200, "
                                                     "or a name from --hardware-file")
    p.add_argument("--hardware-file", help="JSON/TOML file with extra hardware profiles")
    p.add_argument("--model", required=True, help=f"one of {sorted(BUILTIN_MODELS)} or a checkpoint directory")
    p.add_argument("--kv", type=parse_list, required=True, help="KV pool sizes in tokens, e.g. 8192,64k,700000")
    p.add_argument("--batch", type=parse_list, default=[1], help="concurrent requests, e.g. 1,3,4,6")
    # NOTE: the pool flags below mean what `ft serve`'s flags of the same name mean, and the plan comes from the
    # server's own planner (domain/serve_plan.py); unset, they take the calibration's deployment, which for
    # our engine's calibrations is `ft serve`'s defaults (docs/simulator.md, "Pool plan").
    p.add_argument("--gpu-budget-gib", type=parse_gib, help="cap on the card's memory, as `ft serve --gpu-budget-gib`: "
                                                        "pools = cap x memory ratio - dense weights (default: the "
                                                        "hardware profile's memory)")
    p.add_argument("--memory-ratio", type=float, help="as `ft serve --memory-ratio` (default: the calibration's, 0.9)")
    p.add_argument("--max-prefill-length", type=parse_count,
                   help="as `ft serve --max-prefill-length`: the largest step, whose activations are held beside "
                        "the pools, and the simulated prefill step's token budget (default: the calibration's, "
                        "8192 for the plan; its workload.max_step_tokens for the steps)")
    p.add_argument("--mixed-prefill-length", type=parse_count,
                   help="as `ft serve --mixed-prefill-length`: the token budget of a step that carries decodes "
                        "(default: ft serve's, min(--max-prefill-length, max(512, --max-running-requests)); one "
                        "budget for a calibration of the customer's engine)")
    p.add_argument("--max-running-requests", "--state-slots", dest="max_running_requests", type=parse_count,
                   help="as `ft serve --max-running-requests`: GDN state slots and the most requests running at "
                        "once; a larger batch queues (default: the calibration's; ft serve's 4 for the H200)")
    p.add_argument("--layered-prefill", dest="serve_layered_prefill", choices=("on", "off"),
                   help="as `ft serve --layered-prefill`: a long prompt beside decodes runs a layer group per step, "
                        "and the plan holds its chunk's residual stream (ADR 0024). Default: the calibration's (off "
                        "in every calibration so far: they were measured before ft serve turned it on)")
    p.add_argument("--dense-copy", dest="serve_dense_copy", choices=("on", "off"),
                   help="whether the plan holds the dequantized copy a long chunk's dense projections run on cuBLAS "
                        "over (ft serve on CUDA since 2026-12-06: FLUXTIDE_PREFILL_DEQUANT_ROWS, 48 MiB for Qwen3.6 "
                        "block FP8). Default: the calibration's (off in every calibration so far)")
    p.add_argument("--host-embedding", dest="serve_host_embedding", choices=("on", "off"),
                   help="whether the server keeps the input embedding in host memory, out of the GPU budget (ft serve "
                        "on CUDA since 2026-12-06: 1.02 GB more for the pools on Qwen3.6). Default: the calibration's "
                        "(off in every calibration so far)")
    p.add_argument("--short-prompt-replays", type=parse_count_or_auto, metavar="N|auto",
                   help="as the server's FLUXTIDE_SHORT_PROMPT_REPLAYS: a step whose prompt chunks are all at most N tokens "
                        "runs as decode replays, one per token of its longest chunk (ADR 0026); 0 off; auto (the "
                        "server's default) 8 at every plan (0 with a calibration of the customer's engine)")
    p.add_argument("--cache-type", choices=("radix", "none"),
                   help="as `ft serve --cache-type`: radix plans 4 state snapshot slots per running request "
                        "(default: the calibration's; ft serve's radix for the H200)")
    p.add_argument("--snapshot-slots", type=parse_count_or_zero, help="as `ft serve --snapshot-slots`")
    p.add_argument("--staging-experts", type=parse_count_or_auto, metavar="N|auto",
                   help="as `ft serve --staging-experts` (auto: the geometry's rows with --prefill-kernels triton)")
    p.add_argument("--prefill-kernels", choices=("auto", "reference", "triton"),
                   help="as `ft serve --prefill-kernels`; triton turns on the auto staging rows; auto resolves as "
                        "ft serve's default does on a card's fast path (triton for bf16, block-FP8 and NVFP4 weights, "
                        "domain/prefill_choice.py) (default: the calibration's, reference)")
    p.add_argument("--host-experts-gb-s", type=parse_gb_s, metavar="GB/S",
                   help="the host lane (ADR 0030, the customer's 'hybrid' mode): compute a share of each decode "
                        "lookup's misses on the host CPU at this rate (GB/s of expert weight bytes, read once a "
                        "weight pass: up to 4 rows of one expert) while the link copies the rest (default: off)")
    p.add_argument("--host-permille", type=parse_permille_or_auto, metavar="N|auto",
                   help="the host lane's share of each lookup's misses, per mille (the last m x N / 1000 of m misses, "
                        "rounded, as the domain's lookup takes them); auto (the default with --host-experts-gb-s): "
                        "the balanced share, round(1000 x host / (host + link)) of the profile's host->device rate")
    p.add_argument("--host-call-us", type=parse_non_negative, metavar="US",
                   help="the host lane's fixed microseconds a lookup with host keys (the hand-over, the team's "
                        "wake-up; default 20; the H100 machine's host-kernel file fits 66.4 with --host-experts-gb-s "
                        "64.1, docs/simulator.md \"The host lane's request cost refit\")")
    p.add_argument("--host-row-factor", type=parse_non_negative, metavar="A",
                   help="a host weight pass serving n rows routed alike costs 1 + A x (n - 1) one-row passes "
                        "(default 0; the H100 machine's fit: 0.191)")
    p.add_argument("--host-wait-row-us", type=parse_non_negative, metavar="US",
                   help="the hand-off's GPU side: microseconds a routed row of a lookup with host keys keeps the GPU "
                        "past both lanes (the wait kernel; default 0; the H100 machine's bench_decode fit: 17.3, "
                        "docs/simulator.md \"The host lane's hand-off on the GPU\")")
    p.add_argument("--host-lane-rows", type=parse_count_or_zero, metavar="N",
                   help="the largest decode batch (a graph's padded rows) the host lane serves; larger ones copy "
                        f"every miss (default {HOST_LANE_MAX_ROWS}, ft serve's FLUXTIDE_HOST_LANE_ROWS default; 0: "
                        "every batch, as ft serve before session 44)")
    p.add_argument("--routing", default="locality", help="locality | uniform | trace:FILE")
    p.add_argument("--prompt-tokens", type=parse_count,
                   help="each benchmark request's prompt in tokens: the context its decode reads (default: the "
                        "calibration's, the customer's 24-token prompt; e.g. 64k for a long-context decode; see "
                        "steady_decode_tok_s_per_request)")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="every request its own prompt (independent users) instead of the benchmark's one prompt")
    p.add_argument("--ttft-prompt", type=parse_count, default=0,
                   help="also time the first token of one fresh prompt of this many tokens (slower)")
    p.add_argument("--calibration", help="calibration JSON file or name in simulator/calibration/ (e.g. h200_v1, or "
                                         "rtx3090_v2 for the customer's engine; default: h200_records_v6 on the "
                                         "H200 and the H100, else the newest fluxtide calibration of the hardware, else "
                                         "h200_records_v5 carried over)")
    p.add_argument("--seed", type=int, help="routing seed (default: the calibration's)")
    p.add_argument("--workers", type=parse_count, help="processes (default: up to 2)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per point")
    p.add_argument("--plot", help="write a PNG of tok/s against KV pool size per batch size")
    e = sub.add_parser("expert-parallel", help="predict bs1..bsN decode on 1..N GPUs with the experts split "
                                               "over them (docs/adr/0008-expert-parallel.md)")
    e.add_argument("--hardware", default="h200")
    e.add_argument("--model", default="qwen3.6-35b-a3b-fp8",
                   help=f"one of {sorted(BUILTIN_MODELS)}, synthetic-moe-155b, or a checkpoint directory")
    e.add_argument("--ranks", type=parse_list, default=[1, 2, 4], help="GPU counts, e.g. 1,2,4 (1 = the baseline)")
    e.add_argument("--gpu-cap-gib", type=parse_gib, default=24.0, help="memory of each GPU the engine may use")
    e.add_argument("--kv", type=parse_count, default=8192)
    e.add_argument("--batch", type=parse_count, default=1)
    e.add_argument("--routing", default="uniform", help="uniform (random-weight `ft synth` checkpoints) | locality | "
                                                        "trace:FILE")
    e.add_argument("--exchange-latency-us", type=float, default=20.0, help="one MoE layer's collective, fixed part")
    e.add_argument("--link-gb-s", type=float, default=150.0, help="collective bus bandwidth (NVLink; ~20 for PCIe)")
    e.add_argument("--host-gb-s", type=float, default=0.0, help="host memory bandwidth all links share (0: no cap)")
    e.add_argument("--calibration", default="h200_v1")
    e.add_argument("--json", action="store_true")
    m = sub.add_parser("mixed", help="predict `ft bench mixed` (issue 9): the gaps between the tokens of running "
                                     "streams while one long prompt prefills, and its TTFT, with --layered-prefill "
                                     "off and on (docs/simulator.md, 'Layered prefill')")
    add_mixed_arguments(m)
    from simulator.fit_records import add_arguments

    c = sub.add_parser("calibrate", help="fit a hardware profile to ft bench / bench_decode records and report "
                                         "held-out error (simulator/fit_records.py)")
    add_arguments(c)
    return parser


def expert_parallel_command(args) -> int:
    from simulator.expert_parallel import ExchangeParams, large_synthetic, predict_expert_parallel
    from simulator.routing import make_routing

    hardware = get_profile(args.hardware).replace(vram_bytes=int(args.gpu_cap_gib * GIB))
    if args.model == "synthetic-moe-155b":
        model_name, spec = args.model, large_synthetic()
    else:
        model_name, spec = resolve_model(args.model)
    calibration = Calibration.resolve(args.calibration)
    workload = Workload.from_dict(calibration.workload)
    routing = make_routing(args.routing, spec.num_layers, spec.num_experts, spec.top_k, calibration.seed,
                           calibration.locality_params())
    exchange = ExchangeParams(latency_s=args.exchange_latency_us * 1e-6, link_bytes_per_s=args.link_gb_s * 1e9,
                              host_bytes_per_s=args.host_gb_s * 1e9)
    results = [predict_expert_parallel(spec, model_name, hardware, calibration.deployment_params(),
                                       calibration.cost_params(), routing, n, exchange, args.kv, args.batch, workload)
               for n in args.ranks]
    base = next((r.decode_tok_s for r in results if r.extra["ranks"] == 1 and r.fits), None)
    rows = []
    for r in results:
        speedup = r.decode_tok_s / base if base and r.fits else None
        rows.append({**r.to_json(), "speedup": speedup})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        if not row["fits"]:
            print(f"{row['ranks']} GPU(s): does not fit: {row['reason']}")
            continue
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        print(f"{row['ranks']} GPU(s): {row['decode_tok_s']:.1f} tok/s ({speedup}), slots/rank "
              f"{row['expert_slots_per_rank']}, residency {row['residency']:.0%}, hit rate {row['hit_rate']:.1%}, "
              f"exchange {row['exchange_share']:.0%} of the time")
    return 0


def deployment_from_args(deployment: Deployment, args, spec: ModelSpec | None = None) -> Deployment:
    """The calibration's deployment with the `ft serve` pool flags given on the command line. `--prefill-kernels
    auto` is resolved for `spec` as `ft serve` resolves it on a CUDA card's fast path (the simulated executor);
    raises ValueError for auto without a spec."""
    changes = {name: getattr(args, name) for name in ("memory_ratio", "cache_type", "snapshot_slots",
                                                      "prefill_kernels", "max_prefill_length")
               if getattr(args, name) is not None}
    if changes.get("prefill_kernels") == "auto":
        if spec is None:
            raise ValueError("--prefill-kernels auto needs the model's formats to resolve")
        changes["prefill_kernels"] = resolve_prefill_kernels(
            "auto", device="cuda", fast_path=True, expert_format=spec.expert_format,
            dense_formats=[spec.dense_format]).kernels
    if args.gpu_budget_gib is not None:
        # NOTE: the card's cap replaces a calibration's fixed pool, if it had one: the budget is read as the server's
        changes.update(gpu_budget_bytes=cap_bytes(args.gpu_budget_gib), pool_bytes=None)
    if args.max_running_requests is not None:
        changes["state_slots"] = args.max_running_requests
    if args.staging_experts is not None:
        changes["staging_experts"] = None if args.staging_experts == "auto" else args.staging_experts
    if getattr(args, "serve_layered_prefill", None) is not None:  # predict's flag (mixed runs both modes itself)
        changes["layered_prefill"] = args.serve_layered_prefill == "on"
    if getattr(args, "serve_dense_copy", None) is not None:
        changes["dense_copy"] = args.serve_dense_copy == "on"
    if getattr(args, "serve_host_embedding", None) is not None:
        changes["host_embedding"] = args.serve_host_embedding == "on"
    return deployment.replace(**changes) if changes else deployment


def with_short_prompt_replays(deployment: Deployment, args, customer_engine: bool) -> Deployment:
    """`--short-prompt-replays N|auto` when given; else the deployment's (the server's default, auto), or 0 for the
    customer's engine, which has no such path (ADR 0026 is ours)."""
    given = getattr(args, "short_prompt_replays", None)
    if given is not None:
        return deployment.replace(short_prompt_replays=None if given == "auto" else given)
    return deployment.replace(short_prompt_replays=0) if customer_engine else deployment


def predict_command(args) -> int:
    extra = load_profiles(args.hardware_file) if args.hardware_file else None
    hardware = get_profile(args.hardware, extra)
    model_name, spec = resolve_model(args.model)
    calibration, measured_here = calibration_for(args.calibration, hardware.name)
    deployment = with_short_prompt_replays(deployment_from_args(calibration.deployment_params(), args, spec), args,
                                           calibration.customer_engine)
    workload = Workload.from_dict(calibration.workload).replace(same_prompt=not args.distinct_prompts,
                                                                ttft_prompt_tokens=args.ttft_prompt)
    if args.prompt_tokens is not None:
        workload = workload.replace(prompt_tokens=args.prompt_tokens)
    # NOTE: the simulated scheduler's budgets are the server's, from the deployment (Deployment.step_budgets):
    # --max-prefill-length alone (it also sizes the activations the plan holds), the mixed budget beside decodes
    label = calibration.name if measured_here else f"{calibration.name} (engine overheads carried over)"
    cost = with_host_lane(calibration.cost_params(), hardware, args.host_experts_gb_s, args.host_permille,
                          args.host_call_us, args.host_row_factor, args.host_wait_row_us, _host_lane_rows(args))
    cfg = SweepConfig(model_name, spec, hardware, deployment, cost, args.routing,
                      calibration.locality_params(), workload,
                      calibration.seed if args.seed is None else args.seed, label, calibration.predicts,
                      args.mixed_prefill_length)
    deployment.step_budgets(workload.max_step_tokens, args.mixed_prefill_length)  # ValueError before any point runs
    results = run_sweep(cfg, args.kv, args.batch, args.workers)
    if args.plot:
        from simulator.plot import plot_sweep

        plot_sweep(results, args.plot)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        from simulator.table import print_table

        lane = (f"; host lane (ADR 0030): up to {cost.host_permille / 10:g} % of each lookup's misses on the host at "
                f"{cost.host_expert_gb_s:g} GB/s" if cost.host_permille else "")
        print_table(results, title=f"{model_name} on {hardware.name} ({calibration.describe(hardware.name)}; "
                                   f"routing {args.routing}{lane})")
    return 0




def given_options(add_arguments: Callable[[argparse.ArgumentParser], None], argv: list[str]) -> set[str]:
    """The arguments (dests) argv sets itself, defaults aside. argparse fills a default only into a namespace that
    lacks the attribute, so every one is preset to a marker first; a flag given with its default value counts."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    unset = object()
    namespace = argparse.Namespace(**dict.fromkeys(vars(parser.parse_args(argv)), unset))
    return {dest for dest, value in vars(parser.parse_args(argv, namespace)).items() if value is not unset}


def mixed_command(args) -> int:
    from simulator.mixed import MixedConfig, MixedScenario, predict_mixed
    from simulator.routing import make_routing

    record = overridden = None
    if args.record:
        from simulator.mixed_record import read_record

        record = read_record(args.record)
        overridden = record.apply(args, given_options(add_mixed_arguments, args.argv[args.argv.index("mixed") + 1:]))
    modes = [m.strip() for m in args.layered_prefill.split(",") if m.strip()]
    if not modes or any(m not in ("off", "on") for m in modes):
        raise ValueError(f"--layered-prefill takes off, on or off,on, got {args.layered_prefill!r}")
    extra = load_profiles(args.hardware_file) if args.hardware_file else None
    hardware = get_profile(args.hardware, extra)
    model_name, spec = resolve_model(args.model)
    calibration, measured_here = calibration_for(args.calibration, hardware.name)  # predict's default rule too
    deployment = with_short_prompt_replays(deployment_from_args(calibration.deployment_params(), args, spec), args,
                                           calibration.customer_engine)
    workload = Workload.from_dict(calibration.workload)
    scenario = MixedScenario(streams=args.streams, prompt_tokens=args.prompt_tokens, stream_tokens=args.stream_tokens,
                             stream_prompt_tokens=args.stream_prompt_tokens or workload.prompt_tokens,
                             warmup_tokens=args.warmup_tokens, baseline_tokens=args.baseline_tokens,
                             repeats=args.repeats, warmup_repeats=args.warmup_repeats, same_prompt=args.same_prompt,
                             repeat_prompt_tokens=tuple(args.repeat_prompt_tokens or ()))
    scenario.check_valid()
    label = calibration.name if measured_here else f"{calibration.name} (engine overheads carried over)"
    from simulator.layering_policy import LayeringPolicy

    policy = LayeringPolicy(layer_streamed=args.layer_streamed_chunks, layer_faulting=args.layer_faulting_chunks,
                            group_tokens=None)
    cfg = MixedConfig(spec, model_name, hardware, deployment, calibration.cost_params(), args.kv, label,
                      routing=args.routing, mixed_prefill_length=args.mixed_prefill_length,
                      layer_group_length=args.layer_group_length,
                      page_size=workload.page_size, policy=None if policy.is_today else policy,
                      layer_short_prompts=args.layer_short_prompts == "auto")
    seed = calibration.seed if args.seed is None else args.seed
    results = []
    for mode in modes:
        # NOTE: a fresh routing model per mode: both see the same streams
        routing = make_routing(args.routing, spec.num_layers, spec.num_experts, spec.top_k, seed,
                               calibration.locality_params())
        result = {"command": "python -m simulator " + shlex.join(args.argv),
                  **predict_mixed(cfg, routing, scenario, layered=mode == "on")}
        if record is not None:
            result["compare"] = record.compare(result, overridden, spec.top_k, cfg.cost.lookup_max_keys)
        results.append(result)
    text = json.dumps(results, indent=2)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        from simulator.table import print_mixed

        print_mixed(results, title=f"ft bench mixed, predicted: {model_name} on {hardware.name}, "
                                   f"{calibration.describe(hardware.name)}; routing {args.routing}", steps=args.steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "predict":
            return predict_command(args)
        if args.command == "expert-parallel":
            return expert_parallel_command(args)
        if args.command == "mixed":
            return mixed_command(args)
        if args.command == "calibrate":
            from simulator.fit_records import run

            return run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 1


def run_main() -> int:
    """`python -m simulator`: main(), but a reader that closes stdout early (`... --json | head`) ends it quietly
    with 141 (128 + SIGPIPE, as a shell reports it and as `ft sim` does) instead of a BrokenPipeError traceback."""
    try:
        try:
            return main()
        finally:
            sys.stdout.flush()  # NOTE: buffered output meets the closed pipe here, not at the interpreter's exit
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush goes nowhere
        return 141


if __name__ == "__main__":
    sys.exit(run_main())
