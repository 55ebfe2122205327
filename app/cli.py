"""`ft` console script: `ft serve`, `ft check DIR`, `ft ctl ...`, `ft shell`, `ft bench ...`, `ft synth ...`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from app.units import parse_count
from domain.arrival_window import DEFAULT_MAX_MS as DEFAULT_ARRIVAL_WINDOW_MS


def _count(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count_or_auto(text: str) -> int | None:
    return None if text == "auto" else _count(text)


def _permille_or_auto(text: str) -> int | str:
    """--host-experts: "auto" as it is (the executor measures), else a whole number of per mille in 0..1000."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a share in per mille: {text!r} (use 0 to 1000, or auto)") from None
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"a share in per mille must be 0 to 1000 (or auto), got {value}")
    return value


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    p.add_argument("--model", default=None, metavar="DIR", help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=1919,
                   help="TCP port (default 1919; 0: any free port, named by the 'listening on' line)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id /v1/models lists and clients send (default: the checkpoint folder's name)")
    p.add_argument("--max-running-requests", type=int, default=4, metavar="N",
                   help="sequences decoding at once (default 4), fixed for the server's life; also the number of GDN "
                        "state slots")
    p.add_argument("--max-prefill-length", type=_count, default=8192, metavar="TOKENS",
                   help="token budget of a step with no decode running (a long prompt's chunk; time to first token; "
                        "default 8192)")
    p.add_argument("--mixed-prefill-length", type=_count, default=None, metavar="TOKENS",
                   help="token budget of a step that carries decodes, decodes included (the gap the running "
                        "streams see); default 512, at most --max-prefill-length (docs/adr/0011-mixed-step-budget.md)")
    p.add_argument("--layered-prefill", choices=("on", "off"), default="on",
                   help="on (default): a prompt longer than the mixed budget that arrives while streams decode runs as one chunk "
                        "of up to --max-prefill-length, a few layers per step beside the decodes (each step keeps the "
                        "mixed budget's token x layers), so its experts stream over PCIe once per chunk instead of "
                        "once per short chunk (docs/adr/0024-layered-prefill.md); off: short chunks (H200, 24 GiB, 3 streams beside an 8k "
                        "prompt: gaps p99 97 ms with it on)")
    p.add_argument("--layer-group-length", type=_count, default=None, metavar="TOKENS",
                   help="with --layered-prefill on: the budget, decodes included, that sizes a layer group beside "
                        "decodes (default 1024, at least --mixed-prefill-length, at most --max-prefill-length: 4 of "
                        "Qwen3.6's 40 layers a step for an 8k chunk); --mixed-prefill-length still decides which "
                        "prompts are layered (docs/adr/0024-layered-prefill.md)")
    p.add_argument("--layer-short-prompts", choices=("auto", "off"), default="off",
                   help="auto: with --layered-prefill on, on a plan that does not hold every expert (expert slots < "
                        "the model's experts, at start and after each live resize), every prompt that arrives while "
                        "streams decode runs as layer groups, however short, and other prompts wait while one is "
                        "part-way. It smooths the streams and delays the prompt (H100, 24 GiB, 3 streams, a 36-token "
                        "prompt: gap p99 342 -> 110 ms, the prompt's first token 0.40 -> 0.98 s). off (default): only "
                        "prompts longer than --mixed-prefill-length are layered (docs/adr/0024-layered-prefill.md)")
    p.add_argument("--arrival-window-ms", type=float, default=DEFAULT_ARRIVAL_WINDOW_MS, metavar="MS",
                   help=f"an idle server's first step waits up to this long for the rest of a burst of requests, so "
                        f"they share one prefill step (default {DEFAULT_ARRIVAL_WINDOW_MS:g}; 0: never; "
                        f"docs/adr/0021-arrival-window.md)")
    p.add_argument("--memory-ratio", type=float, default=0.9, metavar="R",
                   help="share of the device's memory (or of --gpu-budget-gib) the weights and pools may use "
                        "(default 0.9)")
    p.add_argument("--gpu-budget-gib", type=float, default=None, metavar="GIB",
                   help="cap device memory, to emulate a smaller card (default: the card's memory; 0.5 on the CPU)")
    p.add_argument("--kv-tokens", type=_count, default=None, metavar="TOKENS",
                   help="KV pool size in tokens (8k, 1.5m ...); default: --kv-reserve-tokens while expert slots are "
                        "sized from the budget and not every expert fits, else what the budget leaves (at most "
                        "--max-running-requests x the model's context)")
    p.add_argument("--moe-slots", type=_count, default=None, metavar="N",
                   help="expert cache slots (default: what the budget leaves, up to every expert)")
    p.add_argument("--kv-reserve-tokens", type=_count, default=8192, metavar="TOKENS",
                   help="the KV pool's size when --kv-tokens is not given and the experts take the rest (default 8192)")
    p.add_argument("--device", default="auto", help="auto (default: cuda where torch sees one, else cpu) | cpu | cuda | "
                                                    "cuda:N")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default FT_API_KEY; unset: no key)")
    p.add_argument("--debug", action="store_true", help="check every invariant whenever the engine idles")
    p.add_argument("--cpu-threads", type=int, default=1, metavar="N", help="torch threads when running on the CPU "
                                                                          "(default 1)")
    p.add_argument("--record-routing", default=None, metavar="FILE",
                   help="record the experts every token routes to (JSON lines; python -m simulator --routing trace:FILE)")
    p.add_argument("--routing-replay", default=None, metavar="SPEC",
                   help="benchmark only: replace the routers' expert choice by the simulator's locality model or a "
                        "recorded trace: locality[:NAME=VALUE,...] | uniform[:seed=N] | trace:FILE (docs/serving.md)")
    p.add_argument("--mmap-experts", action="store_true",
                   help="keep expert weights memory-mapped from the checkpoint files when host RAM is short")
    p.add_argument("--executor", default="auto", choices=("auto", "reference", "cuda-graph"),
                   help="cuda-graph: captured decode steps, device-side expert cache, Triton kernels (CUDA only); "
                        "reference: the plain torch path (CPU, parity oracle); auto (default): cuda-graph where it can "
                        "run")
    p.add_argument("--prefill-kernels", default="auto", choices=("auto", "reference", "triton"),
                   help="the fast path's prefill: reference (the torch token mixers and projections) or triton "
                        "(GDN chunk kernels, flash attention over the pages, tensor-core projections; GPU-tested "
                        "with bf16 and block-FP8 checkpoints (H200) and NVFP4 (H100, since session 30), the MXFP4 GEMM "
                        "paths not yet: docs/prefill-kernels.md); auto (default): triton on the CUDA fast path for "
                        "bf16/fp16/fp32, block-FP8 and NVFP4 weights, else reference (the choice and its reason are "
                        "logged at start-up and in /v1/stats; docs/adr/0020-prefill-kernels-auto.md)")
    # NOTE: nargs="?" keeps a bare --prefill-graphs (the store_true flag it was before auto) meaning on
    p.add_argument("--prefill-graphs", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                   help="prefill and mixed steps of up to 32 tokens replay each layer's MoE half from a CUDA graph "
                        "(the token mixers stay eager): less host time for short prompts (H200, 2026-12-04: c1 time "
                        "to first token 0.080 -> ~0.03 s; adapters/cuda_exec/prefill_graphs.py). auto (default): on "
                        "wherever the CUDA fast path runs the Triton prefill without --routing-replay or "
                        "--expert-parallel, else off (logged at start-up); on (a bare --prefill-graphs): refused "
                        "where it cannot run; off: never")
    p.add_argument("--prefill-fp8-activations", action="store_true",
                   help="with the Triton prefill (--prefill-kernels triton, or auto where it picks triton) and an "
                        "FP8 checkpoint: prefill GEMMs quantize their inputs to "
                        "e4m3 per 128 columns (the checkpoints' declared dynamic activation scheme) and run on FP8 "
                        "tensor cores; faster long prompts, logits no longer bitwise those of the bf16 path. "
                        "Experimental: on the full synthetic Qwen3.6 the last-token logits moved far from the bf16 "
                        "path's (not yet explained) (docs/adr/0018-fp8-prefill-activations.md)")
    p.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                   help="qwen3_xml (alias qwen3_coder) | hermes | none (default auto: by architecture: Qwen3.5/3.6 "
                        "qwen3_xml, Qwen3 hermes)")
    p.add_argument("--reasoning-parser", default="auto", metavar="NAME",
                   help="qwen3 (alias deepseek_r1: <think>...</think> is reasoning) | none (default auto: qwen3)")
    p.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="comma-separated origins browser clients may call from (CORS), '*' for any; "
                        "preflight requests never need the API key")
    p.add_argument("--verify-weights", action="store_true",
                   help="scan every weight for NaN/Inf before serving (quantization scales are always checked)")
    p.add_argument("--cache-type", default="radix", choices=("radix", "none"),
                   help="prefix cache: radix (default) = resume repeated prefixes (multi-turn) from cached KV pages "
                        "and Gated DeltaNet state snapshots; none = recompute every prompt")
    p.add_argument("--snapshot-slots", type=_count, default=None, metavar="N",
                   help="GDN state snapshots the prefix cache may hold (default: 4 per running request)")
    p.add_argument("--staging-experts", type=_count_or_auto, default=None, metavar="N|auto",
                   help="fast path: expert rows a prefill chunk stages non-resident experts in (double-buffered, "
                        "past the expert cache, which it leaves alone); 0 = prefill through the expert cache; "
                        "auto (default): sized from the link rate and expert size (130 for Qwen3.6 FP8, 390 MiB), "
                        "0 when every expert is resident")
    p.add_argument("--host-experts", type=_permille_or_auto, default=None, metavar="PERMILLE|auto",
                   help="fast path: compute this share, in per mille (0-1000), of each decode layer's expert misses "
                        "on the host CPU while the PCIe link copies the rest (docs/adr/0030-host-expert-compute.md); "
                        "needs the CUDA fast path and a block-FP8 checkpoint. Outputs are then no longer bitwise "
                        "those at other expert-slot counts (the host sums in another order; within fp32 1e-4). "
                        "auto: measure the host kernel's and the link's rates at start-up and balance them; 0, or "
                        "unset (the default): off")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=("debug", "info", "warning", "error", "critical"), help="default info (any case)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="N engines, one per GPU (or N CPU workers), each its own process, behind this port "
                        "(default 1)")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                   help="one model over N GPUs (or N CPU processes): the experts split between them, the dense "
                        "layers on each; this process serves HTTP (default 1; docs/adr/0008-expert-parallel.md)")
    p.add_argument("--ep-rank", type=int, default=0, help=argparse.SUPPRESS)  # the ranks --expert-parallel starts
    p.add_argument("--ep-address", default=None, help=argparse.SUPPRESS)
    return p


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="check a checkpoint directory as `ft serve` would load it, without serving")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--no-verify-weights", dest="verify_weights", action="store_false",
                   help="skip the scan of every value (headers, shapes, formats and scales are still checked)")


def _check(args) -> int:
    from app.containers import check_checkpoint_dir

    try:
        print(check_checkpoint_dir(args.model, args.verify_weights))
    except (ValueError, OSError) as exc:  # NOTE: OSError: FileNotFoundError, and a file it cannot read
        print(f"ft check: {exc}", file=sys.stderr)
        return 1
    return 0


def _serve(args, parser) -> int:
    import logging

    from app.containers import (
        Container,
        check_device,
        check_routing_replay,
        check_step_profiler,
        environment_api_key,
        model_dir_problem,
    )
    from app.serving import RunningServer, say, stopped_line
    from app.settings import ServeSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = ServeSettings(
            model_dir=args.model,
            served_model_name=args.served_model_name,
            mmap_experts=args.mmap_experts,
            verify_weights=args.verify_weights,
            host=args.host,
            port=args.port,
            device=args.device,
            max_running_requests=args.max_running_requests,
            max_prefill_length=args.max_prefill_length,
            mixed_prefill_length=args.mixed_prefill_length,
            layer_group_length=args.layer_group_length,
            layered_prefill=args.layered_prefill == "on",
            layer_short_prompts=args.layer_short_prompts,
            arrival_window_ms=args.arrival_window_ms,
            memory_ratio=args.memory_ratio,
            gpu_budget_gib=args.gpu_budget_gib,
            kv_tokens=args.kv_tokens,
            moe_slots=args.moe_slots,
            kv_reserve_tokens=args.kv_reserve_tokens,
            api_key=args.api_key if args.api_key is not None else environment_api_key(),
            debug=args.debug,
            cpu_threads=args.cpu_threads,
            record_routing=args.record_routing,
            routing_replay=args.routing_replay,
            executor=args.executor,
            prefill_kernels=args.prefill_kernels,
            prefill_fp8_activations=args.prefill_fp8_activations,
            prefill_graphs=args.prefill_graphs,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
            cache_type=args.cache_type,
            snapshot_slots=args.snapshot_slots,
            staging_experts=args.staging_experts,
            host_experts=args.host_experts,
            expert_parallel=args.expert_parallel,
            ep_rank=args.ep_rank,
            ep_address=args.ep_address,
        )
        if args.data_parallel != 1 and args.expert_parallel != 1:
            raise ValueError("--data-parallel and --expert-parallel cannot be combined yet")
        if args.data_parallel != 1 and settings.host_experts:  # NOTE: 0 (off) and None pass; "auto" does not
            raise ValueError("--host-experts cannot run with --data-parallel yet: ADR 0030 computes one GPU's "
                             "misses on the host (N workers would share its cores)")
        if problem := model_dir_problem(settings):
            raise ValueError(problem)
        check_routing_replay(settings)
        check_step_profiler()  # FLUXTIDE_PROFILE_*: refused here, not after a model's load
        if args.data_parallel == 1 and args.expert_parallel == 1:  # NOTE: those assign devices (and say so) their way
            check_device(settings)
    except ValueError as exc:
        print(f"ft serve: {exc}", file=sys.stderr)
        return 2
    if args.expert_parallel != 1:
        from app.expert_parallel import serve_expert_parallel

        return serve_expert_parallel(args, parser, settings)
    if args.data_parallel != 1:
        from app.data_parallel.serve import serve_data_parallel

        return serve_data_parallel(args, parser, settings)
    server = RunningServer(Container(), settings, echo=True)
    try:
        server.start()
    except RuntimeError as exc:
        print(f"ft serve: {exc}", file=sys.stderr)
        return 1
    auth = "on" if settings.api_key else "off"
    say(f"listening on {server.base_url} (API key {auth}); loading the model ...")  # the loader runs: one write
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # NOTE: a failed load ends the process (exit 1), as vLLM and SGLang do: what fails it (pools that do not fit, a
    # damaged checkpoint, a device that cannot run it) fails the same way on every try, nothing reloads a model, and a
    # process left answering 503 looked hung to an operator and alive to a supervisor. The reason is on stderr
    # ("load failed: ..."), naming what to change.
    while not stop.wait(0.5):
        if not server.http.thread.is_alive() or server.runtime.status == "error":
            break
    stopping = time.monotonic()
    server.stop()
    say(stopped_line(server.runtime, time.monotonic() - stopping))
    return 0 if server.runtime.status != "error" else 1


# 128 + SIGPIPE: what a shell reports for a command whose reader went away (`cat big | head`), so a script
# under `set -o pipefail` sees ft exactly as it sees the standard tools; quiet, but not "all printed"
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run one `ft` command; its exit code. A reader that closes stdout early (`ft ctl stats | head`) ends the
    command quietly with EXIT_BROKEN_PIPE instead of a BrokenPipeError traceback."""
    try:
        try:
            return _main(argv)
        finally:
            # NOTE: output still buffered meets the closed pipe here, not at the interpreter's exit where the
            # error could only be printed; a SystemExit (argparse's --help) passes through the same flush
            sys.stdout.flush()
    except BrokenPipeError:
        # the usual idiom: point stdout at /dev/null so the interpreter's own final flush has nowhere to fail
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """`ft`'s parser and its `serve` subparser (which --data-parallel and --expert-parallel read their workers'
    arguments back from)."""
    parser = argparse.ArgumentParser(prog="ft", description="fluxtide: edge-native MoE serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = _add_serve(sub)
    _add_check(sub)
    from app.ctl import add_ctl_parser

    add_ctl_parser(sub)
    from app.shell import add_shell_parser

    add_shell_parser(sub)
    from app.bench.cli import add_bench_parser

    add_bench_parser(sub)
    sub.add_parser("synth", help="synthesise a checkpoint (arguments go to the synthesiser: ft synth --help)")
    sub.add_parser("sim", help="the simulator: predict, calibrate, expert-parallel, mixed (arguments go to "
                               "`python -m simulator`: ft sim --help)")
    return parser, serve_parser


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["synth"]:
        from app.containers import synth_main

        return int(synth_main(argv[1:]) or 0)
    if argv[:1] == ["sim"]:
        from app.containers import sim_main

        return int(sim_main(argv[1:]) or 0)
    parser, serve_parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, serve_parser)
    if args.command == "check":
        return _check(args)
    if args.command == "ctl":
        from app.ctl import run_ctl

        return run_ctl(args)
    if args.command == "shell":
        from app.shell import run_shell

        return run_shell(args)
    if args.command == "bench":
        from app.bench.cli import run_bench

        return run_bench(args)
    return 2

