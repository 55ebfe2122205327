"""Does the number of GPU threads polling the host's done word slow a host-lane hand-off (session 44)? Times CUDA-graph
replays of publish + wait for T = 1, 4, 8 rows, routed alike and with one row routed, with the wait kernel
(adapters/kernels/host_lane_wait.py) launched as its launcher does (one program of one warp a row: T pollers) and
with 4 warps a row (4 T pollers), checks the outputs agree, and prints µs a layer. Session 44's run, before the
launcher changed, also had the old launch (T x H/512 programs of 4 warps: 16 T pollers; the kernel no longer takes
that grid): docs/bench/2026-12-07-s44-h100-wait-pollers-ab.json. Usage (CUDA only):
PYTHONPATH=. python3 scripts/diag/wait_pollers_ab.py [--out F]"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_host_experts as bhe  # noqa: E402

from adapters.host_kernels import host_lane  # noqa: E402
from adapters.kernels import host_lane_wait as hw  # noqa: E402

K, M, N, REPLAYS = 8, 8, 32, 20


def wait_variant(lane: host_lane.HostLane, out: torch.Tensor, block: int, warps: int) -> None:
    """lane.wait_add(out) with `warps` warps a row's program and `block` columns a pass (the launcher's: 1, 2048)."""
    t, h = out.shape
    hw._wait_add_kernel[(t,)](lane.partial, out, lane.ctrl[host_lane.DONE:host_lane.DONE + 1],
                              lane.state, h, out.stride(0), lane.max_spins, TIMEOUT_CODE=hw.TIMEOUT,
                              HOST_CODE=hw.HOST_FAILED, BLOCK_H=block, ON_GPU=True, num_warps=warps)


def layer_pairs(lane: host_lane.HostLane, x: torch.Tensor, pairs: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                block: int, warps: int) -> None:
    """N hand-offs, one a row of pairs (one expert each), as a step's layers run them."""
    for i in range(N):
        lane.publish(x, pairs[i], w)
        wait_variant(lane, out, block, warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    bank, layout = bhe._paths(1, bhe.available(), 64)["_bank"]
    h = layout.hidden
    variants = {"row_1warp_T": (2048, 1), "row_4warps_4T": (2048, 4)}
    threads = max(1, (os.cpu_count() or 2) - 1)  # the executor's default team: every core but one
    results = {"gpu": torch.cuda.get_device_name(), "threads": threads, "replays": REPLAYS, "pairs": N, "us": {}}
    with host_lane.HostLane(bank, layout, torch.arange(bank.shape[0]), K, M, "cuda", threads=threads) as lane:
        lane.warm_up(requests=1500, experts=2)
        for rows in (1, 4, 8):
            x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
            w = torch.full((rows, K), 1.0 / K, device="cuda")
            for shape in ("alike", "one"):
                pairs = torch.full((N, rows, K), -1, dtype=torch.int64)
                if shape == "alike":
                    pairs[:, :, 0] = torch.arange(N)[:, None]
                else:
                    pairs[:, 0, 0] = torch.arange(N)
                pairs = pairs.reshape(N, -1).cuda()
                outs = {}
                for name, (block, warps) in variants.items():
                    out = torch.zeros(rows, h, device="cuda", dtype=torch.float32)

                    for _ in range(2):  # compile, warm the team
                        layer_pairs(lane, x, pairs, w, out, block, warps)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        layer_pairs(lane, x, pairs, w, out, block, warps)
                    out.zero_()
                    graph.replay()
                    torch.cuda.synchronize()
                    outs[name] = out.clone()
                    start = time.perf_counter()
                    for _ in range(REPLAYS):
                        graph.replay()
                    torch.cuda.synchronize()
                    us = (time.perf_counter() - start) / (REPLAYS * N) * 1e6
                    error = lane.device_error()
                    if error[0]:
                        raise RuntimeError(f"the lane failed: {error}, {lane.host_error()}")
                    results["us"][f"{shape}_x{rows}_{name}"] = round(us, 2)
                    print(f"{shape:5s} {rows} rows {name:14s} {us:8.1f} us/layer", flush=True)
                ref = outs["row_1warp_T"]
                for name, o in outs.items():
                    if not torch.equal(o, ref):
                        raise RuntimeError(f"{name} differs from the launcher's output at {shape} x{rows}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
