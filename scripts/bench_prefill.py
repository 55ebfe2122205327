"""Prefill micro-benchmark of the fast path (no HTTP): time to first token of long prompts with the expert
pool resident, at --moe-slots (20 % of Qwen3.6's experts) with the streamed prefill, and the same without
staging (the expert-LRU path it replaces); each prompt's PCIe bound (bytes of routed experts not resident
/ link rate, from the executor's prefill_stats) against the issue's target of 1.2 x that bound; a profile
of one prefill by component (PCIe, MoE, GDN, attention, dense projections); one JSON record with the
hardware profile (docs/adr/0010-streamed-prefill.md).

    python scripts/bench_prefill.py --out $OUT [--prompts 4096,8192,32768] [--scenarios resident,slots,lru]
        [--moe-slots 2048] [--chunk 8192] [--staging auto|N] [--staging-copy engine|kernel]
        [--gdn-recurrence split|fused] [--wy-inverse blocked|substitution] [--fp8-activations]
        [--format fp8_block] [--layers N]

Scenarios: `resident` holds every expert (preloaded; nothing streams); `slots` holds --moe-slots experts
(preloaded evenly over the layers: a warm cache at that residency) with --staging rows; `lru` the same
slots with no staging (every miss through the residency, which a long prompt flushes); `budget` as
many experts as --gpu-budget-gib leaves after the KV the prompts need, with --staging
rows, warm (the issue's "8k prompt, cache warm" at 24 GiB). Each prompt is a
fresh sequence prefilled in --chunk-token steps, the last one sampled; TTFT is the host clock around
those steps (CUDA synchronised). The pool is preloaded again before every prompt.
--fp8-activations runs the prefill's FP8 GEMMs on e4m3 activations (ADR 0018) and records, per scenario,
how far one prompt's last-token logits move from the bf16-activation path (`a8_logits`).
The CPU run (--device cpu --geometry tiny) exercises the same logic at tiny scale for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_check import GiB, dense_bytes, device_kernels, hardware_profile, kernel_family  # noqa: E402

from adapters.cuda_exec.step_summary import union  # noqa: E402

TARGET_RATIO = 1.2  # issue 9: a prefill that must stream experts takes <= 1.2 x its PCIe bound
COMPONENTS = [  # kernel name pattern -> component of a prefill
    ("pcie", r"gather_rows|Memcpy HtoD"),
    ("moe", r"moe|align|_sum_kernel"),
    ("gdn", r"gdn|gated_rms"),
    ("attention", r"flash|attention|sdpa|qk_norm_rope|fmha|softmax"),
    ("dense", r"dense_gemm|dense_gemv|gemm|cutlass|sm90|xmma|Kernel2"),
]


def component(name: str) -> str:
    return kernel_family(name, COMPONENTS, "other")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def preload(ex, slots: int) -> None:
    """Fill the pool with `slots` experts spread evenly over the layers (the first slots/L of each),
    through the residency and the gather kernel: a warm cache at that residency. A pool that holds every
    expert is filled as `ft serve` fills it at start (DeviceExpertPool.preload), which also lets the prefill's
    set lookups skip their victim choice, as the server's do."""
    from adapters.kernels.expert_gather import gather_rows

    pool, layers, experts = ex.experts, ex.bank.num_layers, ex.bank.num_experts
    pool.residency.resize(pool.num_slots)  # empty, so every prompt starts from the same contents
    if slots >= layers * experts and pool.holds_every_key():
        pool.preload()
        return
    each = min(experts, slots // layers)
    extra = slots - each * layers
    for layer in range(layers):
        n = min(experts, each + (1 if layer < extra else 0))
        keys = torch.arange(layer * experts, layer * experts + n, device=pool.device)
        found = pool.residency.lookup_flat(keys, pin=False)
        gather_rows(pool.bank.rows, pool.slots, found.fill_keys, found.fill_slots)
    _sync(str(pool.device))


def prefill_once(ex, spec, length: int, chunk: int, seed: int) -> float:
    """Seconds from the first chunk to the sampled first token of one fresh prompt of `length` tokens."""
    from domain.ports import SequenceWork, StepBatch
    from domain.request import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [(7919 * (i + 1) + 104729 * seed) % spec.vocab_size for i in range(length)]
    pages = tuple(range(-(-length // ex.plan.page_size) + 1))
    _sync(str(ex.device))
    start = time.perf_counter()
    for s in range(0, length, chunk):
        part = tuple(prompt[s:s + chunk])
        done = s + len(part) == length
        ex.execute(StepBatch((SequenceWork(f"p{seed}", part, s, pages, 0, done, greedy, 0),)))
    _sync(str(ex.device))
    return time.perf_counter() - start


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the overlap of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_overlap(activities) -> dict:
    """How much of a prefill's device time copies and computes at once, from its device activities
    (name, start µs, duration µs, stream): copies are the `pcie` component (gather kernel, memcpy HtoD),
    compute is every other kernel. copy_busy_ms / compute_busy_ms: time with at least one of the kind
    running (union of intervals); overlap_ms: both at once; span_ms: first start to last end;
    link_idle_ms: span - copy_busy (what a PCIe-bound prefill should drive to ~0); serial_ms: copy_busy +
    compute_busy - overlap (the span if nothing else idles the GPU). Streams: the stream ids each kind ran on
    (copies on the compute stream would show here)."""
    copy, compute, streams = [], [], {"copy": set(), "compute": set()}
    for name, start, dur, stream in activities:
        kind = "copy" if component(name) == "pcie" else "compute"
        (copy if kind == "copy" else compute).append((start, start + dur))
        streams[kind].add(stream)
    if not copy and not compute:
        return {}
    copy_u, compute_u = union(copy), union(compute)
    both = _intersection(copy_u, compute_u)
    first = min(s for s, _ in copy + compute)
    last = max(e for _, e in copy + compute)
    out = {"copy_busy_ms": _length(copy_u) / 1e3, "compute_busy_ms": _length(compute_u) / 1e3,
           "overlap_ms": both / 1e3, "span_ms": (last - first) / 1e3}
    out["link_idle_ms"] = out["span_ms"] - out["copy_busy_ms"]
    out["serial_ms"] = out["copy_busy_ms"] + out["compute_busy_ms"] - out["overlap_ms"]
    out = {k: round(v, 3) for k, v in out.items()}
    out["copy_streams"], out["compute_streams"] = sorted(streams["copy"]), sorted(streams["compute"])
    return out


def trace_activities(trace: dict):
    """(name, start µs, duration µs, stream) of every kernel and memcpy in a torch.profiler chrome trace."""
    for evt in trace.get("traceEvents", []):
        if evt.get("ph") == "X" and evt.get("cat") in ("kernel", "gpu_memcpy"):
            yield evt.get("name", ""), float(evt["ts"]), float(evt.get("dur", 0.0)), evt.get("args", {}).get("stream")


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def host_summary(trace: dict, sites: int = 10) -> dict:
    """Where a prefill waits on the host, from a torch.profiler chrome trace: `syncs` (the runtime's
    synchronize calls) and `sync_ms` (the host time inside them: the launch queue drained each time),
    `launches`, `h2d_pageable` (copies from pageable host memory: each synchronises the stream),
    `gpu_busy_ms` (union of kernels, copies and memsets), `gpu_idle_ms` (span - busy: what a host-bound
    prefill adds to the device time). With Python stacks in the trace (--profile-stacks), `sync_sites`:
    the innermost frame under adapters/ or app/ enclosing each sync, the most frequent first."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    syncs = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in SYNC_CALLS]
    device = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out: dict = {"syncs": len(syncs), "sync_ms": round(sum(float(e.get("dur", 0.0)) for e in syncs) / 1e3, 3),
                 "launches": sum(e.get("name") in LAUNCH_CALLS for e in events),
                 "h2d_pageable": sum(e.get("cat") == "gpu_memcpy" and "Pageable" in e.get("name", "")
                                     and "HtoD" in e.get("name", "") for e in events)}
    if device:
        busy = _length(union(device))
        span = max(b for _, b in device) - min(a for a, _ in device)
        out.update(gpu_busy_ms=round(busy / 1e3, 3), gpu_idle_ms=round((span - busy) / 1e3, 3))
    frames = [e for e in events if e.get("cat") == "python_function"
              and ("adapters/" in e.get("name", "") or "app/" in e.get("name", ""))]
    if frames and syncs:
        counts: dict[str, int] = {}
        for sync in syncs:
            t, tid = float(sync["ts"]), sync.get("tid")
            around = [f for f in frames if f.get("tid") == tid and float(f["ts"]) <= t
                      <= float(f["ts"]) + float(f.get("dur", 0.0))]
            if around:  # the innermost: the shortest enclosing frame
                site = min(around, key=lambda f: float(f.get("dur", 0.0)))["name"]
                counts[site] = counts.get(site, 0) + 1
        out["sync_sites"] = [{"site": k[:160], "syncs": n}
                             for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:sites]]
    return out


def profile_prefill(ex, spec, length: int, chunk: int, slots: int, trace_path: Path | None = None,
                    stacks: bool = False) -> dict:
    """Device time by component of one prefill (CUDA only): copies on the side stream overlap compute, so
    the components add up to more than the wall time when streaming hides the link. `timeline` measures
    that overlap from the trace (timeline_overlap), `host` where the host made the device wait
    (host_summary); trace_path: where the gzipped chrome trace is kept. stacks: also the CPU ops with
    Python stacks (slower, bigger trace), for host_summary's sync_sites."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    preload(ex, slots)
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if stacks else [])]
    with profile(activities=activities, with_stack=stacks) as prof:
        wall = prefill_once(ex, spec, length, chunk, seed=99)
    by: dict[str, float] = {}
    kernels = sorted(device_kernels(prof), key=lambda k: -k[1])
    for key, dev_us, _ in kernels:
        by[component(key)] = by.get(component(key), 0.0) + dev_us / 1000.0
    result = {"prompt_tokens": length, "wall_ms": round(wall * 1e3, 3),
              "device_ms_by_component": {k: round(v, 3) for k, v in sorted(by.items())},
              # which kernel of a component to make faster next (the components alone did not say
              # how GDN's 67 ms split between conv, WY, scan and norm)
              "top_kernels": [{"kernel": key[:90], "component": component(key), "ms": round(dev_us / 1000.0, 3),
                               "launches": n} for key, dev_us, n in kernels[:25]]}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            text = raw.read_text()
        trace = json.loads(text)
        result["timeline"] = timeline_overlap(trace_activities(trace))
        result["host"] = host_summary(trace)
        if trace_path is not None:
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            trace_path.write_bytes(gzip.compress(text.encode()))
            result["trace"] = trace_path.name
    except Exception:  # the component sums above stand without the timeline
        result["timeline_error"] = traceback.format_exc()[-2000:]
    return result


def scenario_plan(args, spec, name: str, budget):
    from domain.budget import PoolRequest, plan_pools

    total = spec.total_experts
    kv = max(args.prompts) + args.chunk + 64
    staging = None if args.staging == "auto" else int(args.staging)
    slots, staging = {"resident": (total, 0), "slots": (min(args.moe_slots, total), staging),
                      "lru": (min(args.moe_slots, total), 0), "budget": (None, staging)}[name]
    plan = plan_pools(spec, budget, PoolRequest(kv_tokens=kv, expert_slots=slots, state_slots=1,
                                                staging_experts=staging))
    if not hasattr(plan, "expert_slots"):
        raise RuntimeError(f"plan refused: {plan}")
    if name == "slots" and staging is None and plan.staging_experts == 0:  # auto gives none when all fit
        plan = plan_pools(spec, budget, PoolRequest(kv_tokens=kv, expert_slots=slots, state_slots=1,
                                                    staging_experts=2))
    return plan


def last_logits(ex, spec, length: int, chunk: int, seed: int) -> torch.Tensor:
    """fp32 [V]: the logits of the last token of one fresh prompt (prefill_once's prompt and chunks)."""
    from domain.ports import SequenceWork, StepBatch
    from domain.request import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = [(7919 * (i + 1) + 104729 * seed) % spec.vocab_size for i in range(length)]
    pages = tuple(range(-(-length // ex.plan.page_size) + 1))
    for s in range(0, length, chunk):
        part = tuple(prompt[s:s + chunk])
        work = SequenceWork(f"l{seed}", part, s, pages, 0, s + len(part) == length, greedy, 0)
        if s + len(part) < length:
            ex.execute(StepBatch((work,)))
        else:
            return ex.compute_logits(StepBatch((work,)))[work.request_id][0].float().cpu()
    raise ValueError("an empty prompt has no logits")


def a8_logits(ex, spec, length: int, chunk: int) -> dict:
    """How far the e4m3-activation prefill moves one prompt's last-token logits from the bf16 path (the same
    executor with the option switched off between the two runs): relative L2 error, the largest error over the
    logits' scale, whether the top-1 token agrees and the overlap of the top-5, and the same L2 error between
    two bf16 runs (control_rel_l2)."""
    def run(a8: bool) -> torch.Tensor:
        ex.model.fp8_activations = ex.experts.fp8_activations = a8
        return last_logits(ex, spec, length, chunk, seed=7)

    plain, a8, again = run(False), run(True), run(False)
    top5 = len(set(plain.topk(5).indices.tolist()) & set(a8.topk(5).indices.tolist()))
    # the control: the bf16 path run again after the a8 run. Non-zero means the harness (state left behind
    # by a run, a non-deterministic kernel) moves the logits, not the activations' rounding.
    return {"tokens": length, "rel_l2": round(((a8 - plain).norm() / plain.norm()).item(), 5),
            "max_abs_over_scale": round(((a8 - plain).abs().max() / plain.abs().max()).item(), 5),
            "top1_agrees": bool(plain.argmax() == a8.argmax()), "top5_overlap": top5,
            "control_rel_l2": round(((again - plain).norm() / plain.norm()).item(), 5)}


def run_scenario(args, ckpt, name: str, record: dict, link_bytes_per_s: float) -> None:
    from adapters.cuda_exec.executor import CudaGraphExecutor
    from adapters.kernels.dequant_tile import W_LHS_TUNING
    from adapters.kernels.tuned_tiles import tuned_tiles, w_lhs_wins
    from domain.budget import GpuBudget
    from domain.streamed_prefill import pcie_bound_s

    spec = ckpt.spec
    scen: dict = record["scenarios"].setdefault(name, {})
    budget = GpuBudget(total_bytes=1 << 40, weights_bytes=dense_bytes(ckpt, args.device))
    if name == "budget":  # the card: experts sized by the planner under --gpu-budget-gib
        budget = GpuBudget(total_bytes=int(args.gpu_budget_gib * GiB), weights_bytes=dense_bytes(ckpt, args.device),
                           fixed_bytes=int(args.fixed_gib * GiB))
    plan = scenario_plan(args, spec, name, budget)
    scen["plan"] = asdict(plan)
    scen["residency"] = round(plan.expert_slots / spec.total_experts, 4)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    ex = CudaGraphExecutor(ckpt, plan, args.device, dtype, max_decode_rows=1,
                           prefill_kernels=args.prefill_kernels == "triton", fp8_activations=args.fp8_activations)
    ex.link_bytes_per_s = link_bytes_per_s
    ex.experts.staging_copy = args.staging_copy
    if args.device.startswith("cuda"):  # warm-up: compiles and autotunes the prefill kernels once
        preload(ex, plan.expert_slots)
        prefill_once(ex, spec, min(args.prompts[0], args.chunk), args.chunk, seed=0)
    for length in args.prompts:
        point: dict = {}
        scen.setdefault("prompts", {})[str(length)] = point
        try:
            preload(ex, plan.expert_slots)
            res = ex.experts.residency
            keys_before = res.key_of_slot.clone()
            stats0, misses0 = ex.prefill_stats(), ex.expert_misses
            ttft = prefill_once(ex, spec, length, args.chunk, seed=length)
            stats1 = ex.prefill_stats()
            streamed_not_resident = stats1["bytes_not_resident"] - stats0["bytes_not_resident"]
            lru_misses = ex.expert_misses - misses0
            # NOTE: the LRU path's misses are its bytes not resident only while nothing it fills is evicted
            # before reuse (per chunk); on a small pool it moves more than the streamed path's bound.
            not_resident = streamed_not_resident + lru_misses * ex.bank.layout.row_bytes
            bound = pcie_bound_s(not_resident, link_bytes_per_s)
            point.update({
                "ttft_s": round(ttft, 4), "prefill_tok_s": round(length / ttft, 1),
                "bytes_not_resident": not_resident, "pcie_bound_s": round(bound, 4),
                "bytes_staged": stats1["bytes_staged"] - stats0["bytes_staged"],
                "lru_miss_bytes": lru_misses * ex.bank.layout.row_bytes,
                "streamed_steps": stats1["steps"] - stats0["steps"],
                "ttft_over_bound": round(ttft / bound, 3) if bound else None,
                "meets_target": (ttft <= TARGET_RATIO * bound) if bound else None,
                "cache_unchanged": bool(torch.equal(keys_before, res.key_of_slot)),
                # the server's state with every expert in a slot: the set lookups choose no victims
                "every_key_resident": res.every_key_resident,
            })
        except Exception as exc:  # a failed point is recorded, not dropped
            point["error"] = f"{type(exc).__name__}: {exc}"
            point["traceback"] = traceback.format_exc()[-3000:]
        _save(args, record)
        print(name, length, {k: v for k, v in point.items() if k != "traceback"}, flush=True)
    # which tile won each autotune key: the W_LHS A/B's answer (FLUXTIDE_PREFILL_W_LHS=1 adds those tiles)
    scen["w_lhs_tuning"] = W_LHS_TUNING
    scen["tuned_tiles"] = tuned_tiles()
    scen["w_lhs_wins"] = dict(zip(("w_lhs", "keys"), w_lhs_wins(scen["tuned_tiles"]), strict=True))
    if args.fp8_activations:
        try:
            preload(ex, plan.expert_slots)
            scen["a8_logits"] = a8_logits(ex, spec, min(args.prompts[0], args.chunk), args.chunk)
            print(name, "a8_logits", scen["a8_logits"], flush=True)
        except Exception:
            scen["a8_logits_error"] = traceback.format_exc()[-3000:]
        ex.model.fp8_activations = ex.experts.fp8_activations = True  # the profile below runs the option
    if args.device.startswith("cuda") and args.profile_tokens:
        try:
            scen["profile"] = profile_prefill(ex, spec, args.profile_tokens, args.chunk, plan.expert_slots,
                                              Path(args.out) / f"prefill_trace_{name}.json.gz", args.profile_stacks)
        except Exception:
            scen["profile_error"] = traceback.format_exc()[-3000:]
    del ex
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def overlap_floors(record: dict) -> None:
    """For each streamed point whose prompt the `resident` scenario also ran: floor_s = max(PCIe bound,
    resident TTFT), what perfect overlap of copies and compute could reach (the compute of a streamed prefill
    is at least the resident one's), its ratio to the bound, and whether the 1.2 x target is reachable
    without faster compute (docs/prefill-kernels.md, "Overlap of copies and compute")."""
    resident = record["scenarios"].get("resident", {}).get("prompts", {})
    for name, scen in record["scenarios"].items():
        for length, point in scen.get("prompts", {}).items():
            base, bound = resident.get(length, {}).get("ttft_s"), point.get("pcie_bound_s")
            if name == "resident" or not base or not bound:
                continue
            floor = max(bound, base)
            point["overlap_floor_s"] = round(floor, 4)
            point["floor_over_bound"] = round(floor / bound, 3)
            point["ttft_over_floor"] = round(point["ttft_s"] / floor, 3)
            point["target_reachable"] = base <= TARGET_RATIO * bound


def _save(args, record: dict) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_prefill.json").write_text(json.dumps(record, indent=1, default=str))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--geometry", default="qwen3.6-35b-a3b")
    p.add_argument("--synth-dir", default="/tmp/qwen36-35b-a3b")
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--format", default="fp8_block")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompts", type=_ints, default=[4096, 8192, 32768])
    p.add_argument("--scenarios", default="resident,slots,lru,budget")
    p.add_argument("--moe-slots", type=int, default=2048)
    p.add_argument("--gpu-budget-gib", type=float, default=24.0, help="the `budget` scenario's card")
    p.add_argument("--fixed-gib", type=float, default=1.0, help="the `budget` scenario's non-pool memory")
    p.add_argument("--staging", default="auto", help="staging rows of the `slots` and `budget` scenarios, or auto")
    p.add_argument("--staging-copy", default="engine", choices=("engine", "kernel"),
                   help="how staging rounds known on the host are copied: copy engine (no SM) or UVA gather kernel")
    p.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step (--max-prefill-length)")
    p.add_argument("--prefill-kernels", default="triton", choices=("triton", "reference"),
                   help="the token mixers' prefill (the MoE streams either way)")
    p.add_argument("--gdn-recurrence", default="split", choices=("split", "fused"),
                   help="Gated DeltaNet recurrence: state walk + parallel output (default) or the one-kernel scan")
    p.add_argument("--wy-inverse", default="blocked", choices=("blocked", "substitution"),
                   help="Gated DeltaNet WY inverse: block doubling on tensor cores (default) or row substitution")
    p.add_argument("--fp8-activations", action="store_true",
                   help="e4m3 activations into the prefill's FP8 GEMMs (--prefill-fp8-activations, ADR 0018)")
    p.add_argument("--link-gbps", type=float, default=None, help="link rate of the bound (default: measured)")
    p.add_argument("--profile-tokens", type=int, default=4096, help="prompt of the per-component profile; 0: none")
    p.add_argument("--profile-stacks", action="store_true",
                   help="profile the CPU side with Python stacks too: the profile's host.sync_sites")
    args = p.parse_args(argv)
    if args.device == "cpu":  # the kernels run in Triton's interpreter (set before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from dataclasses import replace

    from adapters.checkpoint.loader import load_checkpoint
    from adapters.checkpoint.synth import synthesize
    from adapters.checkpoint.synth_config import GEOMETRIES
    from adapters.cuda_exec import prefill
    from adapters.kernels import gdn_chunk_wy
    from domain.streamed_prefill import LINK_BYTES_PER_S

    prefill.GDN_RECURRENCE = args.gdn_recurrence  # A/B knobs of the modules, read at every call
    gdn_chunk_wy.BLOCKED_INVERSE = args.wy_inverse == "blocked"

    hardware = hardware_profile(args.device)
    measured = hardware.get("h2d_pinned_gbps")
    link = (args.link_gbps or measured or LINK_BYTES_PER_S / 1e9) * 1e9
    record: dict = {"kind": "bench_prefill", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "hardware": hardware, "args": vars(args), "link_bytes_per_s": link,
                    "target": f"ttft <= {TARGET_RATIO} x pcie_bound_s where experts stream", "scenarios": {}}
    try:
        geometry = GEOMETRIES[args.geometry]
        if args.layers:
            geometry = replace(geometry, num_hidden_layers=args.layers)
        record["geometry"], record["format"] = asdict(geometry), args.format
        out_dir = Path(args.synth_dir)
        if not (args.reuse and (out_dir / "config.json").exists()):
            synthesize(out_dir, geometry, args.format, seed=0, tokenizer=False, progress=False, device=args.device)
        ckpt = load_checkpoint(out_dir, device=args.device, progress=False)
        record["row_bytes"] = ckpt.experts.layout.row_bytes
        _save(args, record)
        for name in args.scenarios.split(","):
            try:
                run_scenario(args, ckpt, name, record, link)
            except Exception as exc:
                record["scenarios"].setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
                print("scenario failed:", name, exc, flush=True)
            _save(args, record)
        overlap_floors(record)
    except Exception:
        record["error"] = traceback.format_exc()[-3000:]
    _save(args, record)
    print(json.dumps({k: v for k, v in record.items() if k not in ("hardware", "geometry")}, default=str)[:6000])
    return record


if __name__ == "__main__":
    main()
    raise SystemExit(0)
