"""GPU timing of one prefill step of N short prompts arriving together (the c1..c16 time-to-first-token case) on
the fast path with every expert resident and --prefill-kernels triton: the Qwen3.6-35B-A3B geometry at
--layers layers (3 Gated DeltaNet : 1 attention), block FP8, bf16, one executor step of N fresh prompts of
--tokens tokens each (projections, mixers, MoE, logits, sampling), median of --reps after two warm-up steps
per N (Triton compiles and autotunes there); then a mixed step of --mixed prompts and as many decode rows.

Why: a 16-prompt step cost ~40 ms more per extra prompt than one prompt (H200, HTTP, 2026-12-02: c1 0.117 s,
c16 0.74 s). The per-prompt slope of this step (ms per extra span) is what batching the token mixers over
the step's spans (adapters/cuda_exec/prefill_spans.py) should cut; run it on the code before that change
with --code DIR (a checkout's root put first on sys.path) for the other side.

Usage (CUDA): python scripts/diag/bench_prefill_spans.py --out FILE.json [--code DIR] [--synth-dir /tmp/q36L8]
    [--layers 8] [--tokens 20] [--spans 1,2,4,8,16] [--reps 10] [--mixed 8] [--prefill-graphs]
Prints and writes one JSON object. Also profiles one step of the fewest and of the most spans (torch.profiler):
device kernels and launch calls, device busy time against wall time, host syncs, the top kernels and host ops;
and the host's Python time of the fewest-span step by function (cProfile).
--device cpu runs the same logic on the tiny geometry in Triton's interpreter (a smoke run; its times mean
nothing). Run on the H200 on 2026-12-02 (docs/gpu-validation.md, session 14); the profile fields are newer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--code", default=None, help="the checkout whose adapters/ and domain/ run (default: this one)")
    p.add_argument("--synth-dir", default="/tmp/q36-spans")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--spans", default="1,2,4,8,16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--mixed", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="the MoE half of steps of up to 32 tokens from CUDA graphs (adapters/cuda_exec/prefill_graphs.py;"
                        " the prefill kernels are tuned first, as ft serve does, since a capture cannot autotune)")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    root = Path(args.code or Path(__file__).resolve().parents[2]).resolve()
    sys.path.insert(0, str(root))

    import torch

    from adapters.checkpoint.loader import load_checkpoint
    from adapters.checkpoint.synth import synthesize
    from adapters.checkpoint.synth_config import GEOMETRIES
    from adapters.cuda_exec.executor import CudaGraphExecutor
    from domain.budget import GpuBudget, PoolRequest, plan_pools
    from domain.ports import SequenceWork, StepBatch
    from domain.request import SamplingParams

    spans = [int(n) for n in args.spans.split(",")]
    most = max(max(spans), 2 * args.mixed)
    geometry = replace(GEOMETRIES["qwen3.6-35b-a3b" if cuda else "tiny"], num_hidden_layers=args.layers,
                       vocab_size=32768 if cuda else 256)
    out_dir = Path(args.synth_dir)
    if not (out_dir / "config.json").exists():
        synthesize(out_dir, geometry, "fp8_block", seed=0, tokenizer=False, progress=False, device=args.device)
    ckpt = load_checkpoint(out_dir, device=args.device, progress=False)
    spec = ckpt.spec
    pages = -(-(args.tokens + 2) // 16)
    plan = plan_pools(spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=16 * pages * most + 64, expert_slots=spec.total_experts, state_slots=most,
                                  page_size=16))
    graphs = {"prefill_graphs": True, "warm_prefill": True} if args.prefill_graphs else {}  # older --code: no such option
    ex = CudaGraphExecutor(ckpt, plan, args.device, torch.bfloat16 if cuda else torch.float32, max_decode_rows=16,
                           prefill_kernels=True,
                           max_step_tokens=most * args.tokens, **graphs)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)

    def work(i: int, start: int, length: int) -> SequenceWork:
        tokens = tuple((7919 * (i + 1) + 31 * j) % spec.vocab_size for j in range(start, start + length))
        return SequenceWork(f"r{i}", tokens, start, tuple(range(i * pages, (i + 1) * pages)), i, True, greedy, 0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(works, reps: int) -> list[float]:
        batch = StepBatch(tuple(works))
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            ex.execute(batch)
            sync()
            times.append(time.perf_counter() - t0)
        return times

    record: dict = {"code": str(root), "layers": args.layers, "tokens": args.tokens, "reps": args.reps,
                    "prefill_graphs": args.prefill_graphs,
                    "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "prefill_step_ms": {}}
    for n in spans:
        works = [work(i, 0, args.tokens) for i in range(n)]
        timed(works, 2)  # compiles, autotunes
        t = timed(works, args.reps)
        record["prefill_step_ms"][n] = round(1e3 * statistics.median(t), 2)
        print("spans", n, record["prefill_step_ms"][n], "ms", flush=True)
    one, top = min(spans), max(spans)
    record["ms_per_extra_span"] = round((record["prefill_step_ms"][top] - record["prefill_step_ms"][one])
                                        / (top - one), 3)
    # a mixed step: args.mixed prompts beside args.mixed decode rows (their prompts prefilled first)
    decodes = range(args.mixed, 2 * args.mixed)
    timed([work(i, 0, args.tokens) for i in decodes], 1)
    mixed = [work(i, 0, args.tokens) for i in range(args.mixed)] + [work(i, args.tokens, 1) for i in decodes]
    timed(mixed, 2)
    record["mixed_step_ms"] = round(1e3 * statistics.median(timed(mixed, args.reps)), 2)
    print("mixed", record["mixed_step_ms"], "ms", flush=True)
    if cuda:
        for n in sorted({one, top}):
            count_kernels(record, ex, [work(i, 0, args.tokens) for i in range(n)], timed)
    python_profile(record, [work(i, 0, args.tokens) for i in range(one)], timed, root)
    print(json.dumps(record), flush=True)
    if cuda:  # NOTE: last: importing gpu_check puts this checkout first on sys.path (it would shadow --code)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from gpu_check import hardware_profile

        record["hardware"] = hardware_profile("cuda")
    Path(args.out).write_text(json.dumps(record, indent=1))


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def count_kernels(record: dict, ex, works, timed) -> None:
    """Device kernels and launch calls of one step of `works` (torch.profiler), and where its time goes:
    the device's busy time (the sum of kernel times) against the step's wall time says whether the step is
    bound by the GPU or by the host issuing it; the host syncs (.item(), stream syncs) and the top kernels
    and host ops by time say what to cut."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(works, 1)[0]
    n = len(works)
    events = prof.events()
    record[f"device_kernels_{n}_spans"] = sum(e.device_type.name == "CUDA" for e in events)
    record[f"launch_calls_{n}_spans"] = sum(e.name in LAUNCH_EVENTS for e in events)
    averages = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0))

    kernels = [e for e in averages if e.device_type.name == "CUDA"]  # a host op's device time is its kernels'

    host = [e for e in averages if e.device_type.name == "CPU" and e.key not in LAUNCH_EVENTS]
    record[f"profile_{n}_spans"] = {
        "wall_ms": round(1e3 * wall, 3),
        "device_busy_ms": round(sum(device_us(e) for e in kernels) / 1e3, 3),
        "host_syncs": {k: sum(e.count for e in averages if e.key == k) for k in SYNC_EVENTS},
        "top_kernels_us": [(e.key[:90], e.count, round(device_us(e), 1))
                           for e in sorted(kernels, key=device_us, reverse=True)[:15]],
        "top_host_ops_self_us": [(e.key[:90], e.count, round(e.self_cpu_time_total, 1))
                                 for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]],
    }


def python_profile(record: dict, works, timed, root: Path, reps: int = 5) -> None:
    """Where the host's Python time of a step of `works` goes (cProfile over `reps` steps, per step): the
    functions with the most own time and the most cumulative time, named by path under `root` (or the
    library's file name). The step is host-bound when its wall time is well above the device's busy time
    (count_kernels); this says which code issues it. cProfile slows Python code down, not the device."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    timed(works, reps)
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}

    def where(key) -> str:
        path, line, name = key
        short = os.path.relpath(path, root) if path.startswith(str(root)) else Path(path).name
        return f"{short}:{line}({name})"

    def top(column: int) -> list:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][column], reverse=True)[:25]
        return [(where(k), v[0] // reps, round(1e3 * v[2] / reps, 3), round(1e3 * v[3] / reps, 3)) for k, v in ranked]

    total = sum(v[2] for v in stats.values()) / reps
    record[f"python_profile_{len(works)}_spans"] = {
        "note": "cProfile, per step: (function, calls, own ms, cumulative ms); cProfile inflates Python time",
        "total_ms": round(1e3 * total, 3), "top_own": top(2), "top_cumulative": top(3)}


if __name__ == "__main__":
    main()
