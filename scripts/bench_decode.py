"""Decode micro-benchmark of the fast path (no HTTP): times the graph-captured decode step of the full
Qwen3.6-35B-A3B geometry at several batch sizes and pool plans, breaks one step down by kernel family
from a profile, checks the fast path against the reference executor, and writes one JSON record with
the hardware profile.

    python scripts/bench_decode.py --out $OUT [--format fp8_block] [--batch 1,4,16] [--plans resident,24]
        [--splitk-max-rows 1,32] [--pairs-bucket-max 1,256]

Scenarios: `resident` holds all 10,240 experts; a number is a GPU budget in GiB planned by the domain
planner (MoE-first, --kv-tokens of KV). Each scenario: prefill one short prompt per row (--same-prompt: the same one
for every row, so rows route alike as ft bench sweep's do), warm up
(--warmup steps, fills the LRU), then time --steps decode steps through execute() (host clock, which
includes input staging and the one device->host copy) and the bare graph replay (CUDA events).
--splitk-max-rows / --pairs-bucket-max run every scenario once per value (the cross product when both are
given), the module constant set before its executor is built: `resident_splitk1` (1: no split-K GEMM, the
control), `resident_splitk32_pairs256`, ...; each scenario records the values it ran with.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_check import GiB, dense_bytes, device_kernels, hardware_profile, kernel_family  # noqa: E402

FAMILIES = [  # kernel name pattern -> component of the step
    ("embedding", r"embedding_gather"),  # the input rows from the host table (ADR 0029): not an expert miss
    ("moe", r"moe|fused_moe|gate_up|_down"),
    ("expert_gather", r"gather_rows"),
    ("attention", r"paged_decode|attention|combine"),
    ("gdn", r"gdn"),
    ("dense_gemv", r"dense_gemv"),
    ("cublas_gemm", r"gemm|gemv|cutlass|sm90|xmma|Kernel2"),
    ("residency_and_routing", r"topk|sort|scan|cumsum|index|scatter|gather|argsort|radix|unique"),
]


def classify(name: str) -> str:
    return kernel_family(name, FAMILIES, "elementwise_and_norms")


def kernel_summary(prof, steps: int, top: int = 15) -> dict:
    """A torch.profiler run of `steps` steps as device ms per step by kernel family, their sum, launches per step
    and the `top` kernels by device time."""
    by_family: dict[str, float] = {}
    per_kernel: list[tuple[float, int, str]] = []
    kernels = 0
    for key, dev_us, count in device_kernels(prof):
        fam = classify(key)
        by_family[fam] = by_family.get(fam, 0.0) + dev_us / steps / 1000.0
        per_kernel.append((dev_us / steps, count // steps, key))
        kernels += count
    return {"ms_per_step_by_family": {k: round(v, 4) for k, v in sorted(by_family.items())},
            "kernel_ms_per_step": round(sum(by_family.values()), 4), "kernels_per_step": kernels // steps,
            "top_kernels": [{"kernel": key[:90], "us_per_step": round(us, 1), "launches_per_step": n}
                            for us, n, key in sorted(per_kernel, reverse=True)[:top]]}


def profile_step(ex, rows: int, steps: int = 3) -> dict:
    """Device time per kernel family of one eager decode step (the same kernels the graph replays).
    NOTE: the steps repeat one token, but the GDN state moves on, so a partial pool's repeats can miss."""
    from torch.profiler import ProfilerActivity, profile

    buf = ex.inputs.view(rows)
    with torch.inference_mode():
        ex.model.decode_step(buf, ex.kv, ex.state, ex.experts)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                ex.model.decode_step(buf, ex.kv, ex.state, ex.experts)
            torch.cuda.synchronize()
    return kernel_summary(prof, steps, top=30)


def profile_replay(graph, replays: int = 5) -> dict:
    """Device time per kernel family of `replays` replays of a captured decode graph, beside the device time the
    replays span (the difference is the graph's idle time between kernels)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return {"span_ms_per_step": round(start.elapsed_time(end) / replays, 4), **kernel_summary(prof, replays)}


def profile_execute(ex, seqs: list[dict], greedy, steps: int = 3) -> dict:
    """Device time per kernel family of `steps` decode steps through ex.execute (graph replays with their
    misses: new tokens route to new experts), beside their wall time; advances `seqs` as the timed loop does."""
    from torch.profiler import ProfilerActivity, profile

    from domain.ports import SequenceWork, StepBatch

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            works = tuple(SequenceWork(s["id"], (s["tok"],), s["pos"], s["pages"], i, True, greedy, s["out"])
                          for i, s in enumerate(seqs))
            out = ex.execute(StepBatch(works))
            for s in seqs:
                s["tok"], s["pos"], s["out"] = out[s["id"]].token_id, s["pos"] + 1, s["out"] + 1
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) * 1e3 / steps
    return {"wall_ms_per_step": round(wall_ms, 4), **kernel_summary(prof, steps)}


def preload_all(ex) -> None:
    """Fill the expert pool layer by layer through the residency and the gather kernel."""
    from adapters.kernels.expert_gather import gather_rows

    pool, e = ex.experts, ex.bank.num_experts
    for layer in range(ex.bank.num_layers):
        keys = torch.arange(layer * e, (layer + 1) * e, device="cuda")
        found = pool.residency.lookup_flat(keys, pin=False)
        gather_rows(pool.bank.rows, pool.slots, found.fill_keys, found.fill_slots)
    torch.cuda.synchronize()


def run_scenario(args, ckpt, name: str, budget_gib: float | None, record: dict) -> None:
    from adapters.cuda_exec.executor import CudaGraphExecutor
    from domain.budget import GpuBudget, PoolRequest, plan_pools
    from domain.ports import SequenceWork, StepBatch
    from domain.request import SamplingParams

    spec = ckpt.spec
    rows_max = max(args.batch)
    scen: dict = record["scenarios"].setdefault(name, {"budget_gib": budget_gib})
    total = spec.num_layers * spec.num_experts
    if budget_gib is None:
        request = PoolRequest(kv_tokens=args.kv_tokens, expert_slots=total, state_slots=rows_max)
        budget = GpuBudget(total_bytes=1 << 40, weights_bytes=dense_bytes(ckpt))
    else:
        request = PoolRequest(kv_tokens=args.kv_tokens, state_slots=rows_max)
        budget = GpuBudget(total_bytes=int(budget_gib * GiB), weights_bytes=dense_bytes(ckpt),
                           fixed_bytes=int(args.fixed_gib * GiB))
    plan = plan_pools(spec, budget, request)
    if not hasattr(plan, "expert_slots"):
        raise RuntimeError(f"plan refused: {plan}")
    scen["plan"] = asdict(plan)
    scen["residency"] = round(min(plan.expert_slots, total) / total, 4)
    t = time.perf_counter()
    ex = CudaGraphExecutor(ckpt, plan, "cuda", torch.bfloat16, max_decode_rows=rows_max,
                           prefill_kernels=args.prefill_kernels == "triton", host_experts=args.host_experts)
    lane = ex.host_lane
    scen["host_experts"] = {"asked": args.host_experts, "share": lane.share if lane else 0,
                            "measured": ex.host_lane_rates, "threads": lane.threads if lane else None,
                            "team": lane.team if lane else None, "max_rows": lane.max_rows if lane else None}
    scen["init_and_capture_seconds"] = round(time.perf_counter() - t, 2)
    scen["capture_seconds"] = round(ex.capture_seconds, 2)
    scen["graph_buckets"] = sorted(ex.graphs)
    scen["expert_gather"] = ex.expert_gather  # how fast misses land from the bank (gather kernel, copy engine)
    print(name, "expert_gather", ex.expert_gather, flush=True)
    scen["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    if budget_gib is None:  # resident: every expert in its slot before timing (no cold misses)
        t = time.perf_counter()
        preload_all(ex)
        scen["preload_seconds"] = round(time.perf_counter() - t, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 8)
    prompt_len = 16
    for rows in args.batch:
        point: dict = {}
        scen.setdefault("batches", {})[str(rows)] = point
        try:
            ctx = prompt_len + args.warmup + args.steps + 2 + 3  # + profile_execute's 3 steps
            pages_each = -(-ctx // plan.page_size)
            seqs = []
            t = time.perf_counter()
            for r in range(rows):
                # NOTE: --same-prompt gives every row one prompt, so greedy rows route alike as the customer's
                # benchmark's requests do (ft bench sweep: one prompt, temperature 0); else each row its own
                shift = 0 if args.same_prompt else 31 * r
                prompt = tuple((7919 * (i + 1) + shift) % spec.vocab_size for i in range(prompt_len))
                pages = tuple(range(r * pages_each, (r + 1) * pages_each))
                work = SequenceWork(f"s{r}", prompt, 0, pages, r, True, greedy, 0)
                tok = ex.execute(StepBatch((work,)))[f"s{r}"].token_id
                seqs.append({"id": f"s{r}", "pages": pages, "pos": prompt_len, "tok": tok, "out": 1})
            point["prefill_seconds_per_row"] = round((time.perf_counter() - t) / rows, 4)
            hits0, misses0 = ex.expert_hits, ex.expert_misses
            step_s = []
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    hits0, misses0 = ex.expert_hits, ex.expert_misses
                works = tuple(SequenceWork(s["id"], (s["tok"],), s["pos"], s["pages"], i, True, greedy, s["out"])
                              for i, s in enumerate(seqs))
                t = time.perf_counter()
                out = ex.execute(StepBatch(works))
                dt = time.perf_counter() - t
                if step >= args.warmup:
                    step_s.append(dt)
                for s in seqs:
                    s["tok"], s["pos"], s["out"] = out[s["id"]].token_id, s["pos"] + 1, s["out"] + 1
            hits, misses = ex.expert_hits - hits0, ex.expert_misses - misses0
            if budget_gib is not None and rows in (1, rows_max):
                # the kernels of steps that miss (the eager profile below repeats one step: every key hits)
                point["miss_profile"] = profile_execute(ex, seqs, greedy)
            med = statistics.median(step_s)
            point.update({
                "execute_median_ms": round(med * 1e3, 4), "execute_p90_ms": round(sorted(step_s)[int(0.9 * len(step_s))] * 1e3, 4),
                "aggregate_tok_s": round(rows / med, 1), "per_request_tok_s": round(1 / med, 1),
                "measured_steps": len(step_s), "hit_rate": round(hits / max(1, hits + misses), 4),
                "miss_bytes_per_step": misses * ex.experts.layout.row_bytes / len(step_s),
            })
            bucket = min(b for b in ex.graphs if b >= rows)
            graph = ex.graphs[bucket][0]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            hits0, misses0 = ex.expert_counters()
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            point["graph_replay_ms"] = round(start.elapsed_time(end) / 20, 4)
            hits, misses = ex.expert_counters()
            # NOTE: the replays repeat one step's inputs, but the GDN state moves on, so a partial pool's replays
            # may miss (its replay has measured ~2.4x its eager kernels' sum): counted, not assumed
            point["replay_misses_per_step"] = round((misses - misses0) / 20, 2)
            point["replay_hits_per_step"] = round((hits - hits0) / 20, 2)
            if budget_gib is not None and rows in (1, rows_max):
                point["replay_profile"] = profile_replay(graph)
            # NOTE: replays repeat one step's inputs, so after the first every expert hits: with misses in
            # the measured steps this difference is miss time plus host time, not host time alone
            point["execute_minus_replay_ms"] = round(point["execute_median_ms"] - point["graph_replay_ms"], 4)
            if rows in (1, rows_max):
                point["profile"] = profile_step(ex, rows)
        except Exception as exc:  # a failed point is recorded, not dropped
            point["error"] = f"{type(exc).__name__}: {exc}"
            point["traceback"] = traceback.format_exc()[-3000:]
        _save(args, record)
        print(name, rows, {k: v for k, v in point.items() if k not in ("profile", "traceback")}, flush=True)
    del ex
    torch.cuda.empty_cache()


# A/B knobs: (option dest, scenario name tag, module, constant). The executor reads the constants while it builds
# (prefill warm-up, graph capture: autotune keys, kernel choice), so a variant sets them before building it.
KNOBS = (("splitk_max_rows", "splitk", "adapters.cuda_exec.prefill_linear", "SPLITK_MAX_ROWS"),
         ("pairs_bucket_max", "pairs", "adapters.kernels.packed_gemv", "PAIRS_BUCKET_MAX"))


def knob_variants(args) -> list[dict[str, int]]:
    """One {dest: value} per variant: the cross product of the knob options given ([{}]: none given)."""
    given = [(dest, getattr(args, dest)) for dest, *_ in KNOBS if getattr(args, dest)]
    return [dict(zip([dest for dest, _ in given], values, strict=True))
            for values in itertools.product(*(vals for _, vals in given))]


def run_variants(args, ckpt, name: str, budget_gib: float | None, record: dict) -> None:
    """run_scenario once per knob variant, the knobs' constants set for its executor and restored after (a
    failed variant is recorded, the others still run). Each scenario records every knob's value it ran with,
    under `name` plus a tag per given knob (`resident_splitk32_pairs256`; the plain name with no knob given)."""
    knobs = {dest: (tag, importlib.import_module(mod), const) for dest, tag, mod, const in KNOBS}
    defaults = {dest: getattr(mod, const) for dest, (_, mod, const) in knobs.items()}
    for variant in knob_variants(args):
        scen_name = name + "".join(f"_{knobs[dest][0]}{v}" for dest, v in variant.items())
        values = {**defaults, **variant}
        try:
            for dest, (_, mod, const) in knobs.items():
                setattr(mod, const, values[dest])
            record["scenarios"].setdefault(scen_name, {"budget_gib": budget_gib}).update(values)
            run_scenario(args, ckpt, scen_name, budget_gib, record)
        except Exception as exc:
            record["scenarios"].setdefault(scen_name, {})["error"] = traceback.format_exc()[-3000:]
            print("scenario failed:", scen_name, exc, flush=True)
        finally:  # the next variant, and the parity run, start from the modules' values
            for dest, (_, mod, const) in knobs.items():
                setattr(mod, const, defaults[dest])
        _save(args, record)


def run_parity(args, ckpt, record: dict) -> None:
    """Greedy tokens and logits of the fast path against the reference executor, full size, in fp32 (both
    paths' only differences are then summation order; in bf16 a random 40-layer model amplifies the two
    paths' different rounding points far beyond a meaningful bound)."""
    from adapters.cuda_exec.executor import CudaGraphExecutor
    from adapters.torch_exec.executor import TorchExecutor
    from domain.budget import GpuBudget, PoolRequest, plan_pools
    from domain.ports import SequenceWork, StepBatch
    from domain.request import SamplingParams

    spec = ckpt.spec
    torch.backends.cuda.matmul.allow_tf32 = False
    plan = plan_pools(spec, GpuBudget(total_bytes=1 << 40, weights_bytes=dense_bytes(ckpt)),
                      PoolRequest(kv_tokens=4096, expert_slots=2048, state_slots=2))
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    prompt = tuple((7919 * (i + 1)) % spec.vocab_size for i in range(12))
    pages = tuple(range(8))
    res: dict = {}
    dtype = torch.float32
    for label, make in (("reference", lambda: TorchExecutor(ckpt, plan, "cuda", dtype)),
                        ("fast", lambda: CudaGraphExecutor(ckpt, plan, "cuda", dtype, max_decode_rows=2,
                                                           prefill_kernels=args.prefill_kernels == "triton",
                                                           host_experts=args.host_experts))):
        ex = make()
        logits, tokens = [], []
        row = ex.compute_logits(StepBatch((SequenceWork("p", prompt, 0, pages, 0, True, greedy, 0),)))["p"][0]
        for i in range(args.parity_steps):
            logits.append(row.float().cpu())
            tokens.append(int(row.argmax()))
            # teacher-forced on the reference's tokens: every step compares logits of the same context
            feed = res["reference"][1][i] if "reference" in res else tokens[-1]
            work = SequenceWork("p", (feed,), len(prompt) + i, pages, 0, True, greedy, i + 1)
            row = ex.compute_logits(StepBatch((work,)))["p"][0]
        res[label] = (logits, tokens)
        del ex
        torch.cuda.empty_cache()
    (ref_l, ref_t), (fast_l, fast_t) = res["reference"], res["fast"]
    errs = [((a - b).norm() / b.norm()).item() for a, b in zip(fast_l, ref_l, strict=True)]
    record["parity"] = {"steps": args.parity_steps, "dtype": "float32", "reference_tokens": ref_t, "fast_tokens": fast_t,
                        "norm_rel_err_per_step": [round(e, 6) for e in errs],
                        "leading_tokens_equal": next((i for i, (a, b) in enumerate(zip(ref_t, fast_t, strict=True)) if a != b),
                                                     len(ref_t))}


def _save(args, record: dict) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_decode.json").write_text(json.dumps(record, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--synth-dir", default="/tmp/qwen36-35b-a3b")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--format", default="fp8_block")
    p.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--plans", default="resident,24", help="comma list: resident and/or GPU budgets in GiB")
    p.add_argument("--kv-tokens", type=int, default=8192)
    p.add_argument("--fixed-gib", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--same-prompt", action="store_true",
                   help="one prompt for every row (greedy rows then route alike, as ft bench sweep's requests do); "
                        "default: a prompt per row")
    p.add_argument("--parity-steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--host-experts", type=lambda v: v if v == "auto" else int(v), default=0, metavar="PERMILLE|auto",
                   help="ADR 0030's host lane: the executor's host_experts (0: off)")
    p.add_argument("--prefill-kernels", default="reference", choices=("reference", "triton"),
                   help="as ft serve: triton also takes the tensor-core GEMM for the projections of decode "
                        "buckets from a few rows up (prefill_linear), reference keeps the GEMV")
    p.add_argument("--dedup-min-pairs", type=int, default=None,
                   help="MoE layers of this many routed pairs and more take the expert-deduplicated GEMVs "
                        "(expert_pool.DEDUP_MIN_PAIRS; default: the module's, off)")
    p.add_argument("--grouped-decode-min-pairs", type=int, default=None,
                   help="decode MoE layers of this many routed pairs and more run the grouped GEMMs over their "
                        "pairs aligned by expert (expert_pool.GROUPED_DECODE_MIN_PAIRS; default: the module's, off)")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--splitk-max-rows", type=ints, default=None, metavar="LIST",
                   help="run every scenario once per value of prefill_linear.SPLITK_MAX_ROWS (the most rows the "
                        "split-K GEMM takes; 1: none, 2+ rows take dense_gemm, the control); default: the module's")
    p.add_argument("--pairs-bucket-max", type=ints, default=None, metavar="LIST",
                   help="run every scenario once per value of packed_gemv.PAIRS_BUCKET_MAX (the per-pair MoE "
                        "GEMVs' largest autotune pairs bucket; 1: one key for every pair count); default: the "
                        "module's. With --splitk-max-rows: the cross product")
    args = p.parse_args(argv)
    if args.dedup_min_pairs is not None or args.grouped_decode_min_pairs is not None:
        from adapters.cuda_exec import expert_pool

        # read by every pool built from here on
        if args.dedup_min_pairs is not None:
            expert_pool.DEDUP_MIN_PAIRS = args.dedup_min_pairs
        if args.grouped_decode_min_pairs is not None:
            expert_pool.GROUPED_DECODE_MIN_PAIRS = args.grouped_decode_min_pairs

    from dataclasses import replace

    from adapters.checkpoint.loader import load_checkpoint
    from adapters.checkpoint.synth import synthesize
    from adapters.checkpoint.synth_config import GEOMETRIES

    record: dict = {"kind": "bench_decode", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "hardware": hardware_profile("cuda"), "args": vars(args), "scenarios": {},
                    "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLUXTIDE_")}}
    try:
        geometry = GEOMETRIES["qwen3.6-35b-a3b"]
        if args.layers:
            geometry = replace(geometry, num_hidden_layers=args.layers)
        record["geometry"], record["format"] = asdict(geometry), args.format
        out_dir = Path(args.synth_dir)
        if not (args.reuse and (out_dir / "config.json").exists()):
            t = time.perf_counter()
            synthesize(out_dir, geometry, args.format, seed=0, tokenizer=False, progress=False, device="cuda")
            record["synth_seconds"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        ckpt = load_checkpoint(out_dir, device="cuda", progress=False)
        record["load_seconds"] = round(time.perf_counter() - t, 1)
        record["bank_pinned"] = ckpt.experts.pinned
        record["row_bytes"] = ckpt.experts.layout.row_bytes
        _save(args, record)
        for plan in args.plans.split(","):
            run_variants(args, ckpt, f"budget_{plan}gib" if plan != "resident" else "resident",
                         None if plan == "resident" else float(plan), record)
        if args.parity_steps:
            try:
                run_parity(args, ckpt, record)
            except Exception:
                record["parity_error"] = traceback.format_exc()[-3000:]
    except Exception:
        record["error"] = traceback.format_exc()[-3000:]
    _save(args, record)
    print(json.dumps({k: v for k, v in record.items() if k not in ("hardware", "geometry")}, default=str)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
