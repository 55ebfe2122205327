"""Times the pair alignment of a prefill MoE layer (issue 9): the torch reference (align_by_slot_torch, ~25
launches) against the Triton kernels (align_by_slot_triton, 3 launches). CUDA only; prints one JSON object.

Per path and shape: host_us, the host's time per call (time.perf_counter around each call, no sync: what
a host-bound prefill pays); stream_us, CUDA-event time per call over `iters` back-to-back calls (host and
GPU together, as an eager prefill sees it); graph_us, one call captured in a CUDA graph and replayed
(device time alone, no launch overhead; null when capture fails). Both paths are checked bitwise equal
first. Default shape: a 4k Qwen3.6 prefill: P = 4096 tokens x 9 columns = 36,864 pairs, G = 257 groups
(256 experts + the shared one), BLOCK_M 64, max_groups = G (as DeviceExpertPool.align_by_expert).

Usage: python scripts/diag/bench_moe_align.py [--tokens 4096 8192] [--experts 256] [--block-m 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adapters.kernels.moe_align import align_by_slot_torch, align_by_slot_triton


def routing(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """slot_ids int32 [T, K + 1] on CUDA: top-k distinct random experts and the shared expert (id E)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    top = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(dim=1)[:, :top_k]
    shared = torch.full((tokens, 1), experts, device="cuda")
    return torch.cat([top, shared], dim=1).to(torch.int32).contiguous()


def time_path(fn, ids: torch.Tensor, groups: int, block_m: int, iters: int) -> dict:
    for _ in range(5):  # compile / cache warm-up
        fn(ids, groups, block_m, groups)
    torch.cuda.synchronize()
    host = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(ids, groups, block_m, groups)
        host.append(time.perf_counter() - t0)
    stop.record()
    torch.cuda.synchronize()
    out = {"host_us": round(1e6 * statistics.median(host), 2), "host_us_mean": round(1e6 * statistics.fmean(host), 2),
           "stream_us": round(1e3 * start.elapsed_time(stop) / iters, 2), "graph_us": None}
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(ids, groups, block_m, groups)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            fn(ids, groups, block_m, groups)
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            graph.replay()
        stop.record()
        torch.cuda.synchronize()
        out["graph_us"] = round(1e3 * start.elapsed_time(stop) / iters, 2)
    except Exception as exc:  # noqa: BLE001 - a diagnosis: report why, keep the other numbers
        out["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--block-m", type=int, default=64)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_align: needs a CUDA device")
    groups = args.experts + 1
    results = []
    for tokens in args.tokens:
        ids = routing(tokens, args.experts, args.top_k, seed=tokens)
        ref, got = align_by_slot_torch(ids, groups, args.block_m, groups), align_by_slot_triton(ids, groups, args.block_m, groups)
        equal = torch.equal(ref.pairs, got.pairs) and torch.equal(ref.block_slots, got.block_slots)
        row = {"tokens": tokens, "pairs": ids.numel(), "groups": groups, "block_m": args.block_m, "bitwise_equal": equal}
        for name, fn in (("torch", align_by_slot_torch), ("triton", align_by_slot_triton)):
            row[name] = time_path(fn, ids, groups, args.block_m, args.iters)
        results.append(row)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "iters": args.iters, "results": results}, indent=1))


if __name__ == "__main__":
    main()
