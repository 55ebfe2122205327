"""GPU tile sweep of the split Gated DeltaNet recurrence (ADR 0016) at the Qwen3.6-35B-A3B geometry: the state
walk (gdn_chunk_state) at BLOCK_V 16/32/64 and the output (gdn_chunk_out) at 32/64, each at num_stages 1 and 2,
timed per GDN_WINDOW window with CUDA events and checked against the default tiles' results.

Why: run 3 (docs/prefill-kernels.md) measured the walk at 22.4 ms and the output at 13.1 ms of a 4k prefill;
the walk's 16-column programs each re-read the chunk's w and k, and the output recomputes q kᵀ per value block.

Usage (CUDA): python scripts/diag/bench_gdn_tiles.py [--tokens 2048] [--reps 20] [--out FILE.json]
Prints one JSON object: per variant the median ms, the relative error against the default tiles, or the error
a variant raised (a tile that does not build is a result too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

import torch

from adapters.cuda_exec.prefill import GDN_WINDOW
from adapters.kernels import gdn_chunk_out as out_mod
from adapters.kernels import gdn_chunk_state as state_mod
from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy

NK, NV, DK, DV = 16, 32, 128, 128  # Qwen3.6-35B-A3B's linear attention: key heads, value heads, head dims


def _time(fn, reps: int) -> float:
    """Median ms of fn over reps runs: CUDA events on a GPU, wall time elsewhere (the interpreter smoke run)."""
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=GDN_WINDOW, help="tokens of one window (default GDN_WINDOW)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script under TRITON_INTERPRET=1")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gdn_tiles needs a CUDA device")
    dev, t = args.device, args.tokens
    gen = torch.Generator(device=dev).manual_seed(0)
    mixed = torch.randn(t, 2 * NK * DK + NV * DV, device=dev, generator=gen)
    a, b = torch.randn(t, NV, device=dev, generator=gen), torch.randn(t, NV, device=dev, generator=gen)
    neg_a, dt_bias = -torch.rand(NV, device=dev, generator=gen) - 0.5, torch.randn(NV, device=dev, generator=gen)
    w, u0, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, NK, DK, DV, precise=False)
    state0 = torch.randn(NV, DK, DV, device=dev, generator=gen) * 0.1
    default_launch = dict(state_mod.LAUNCH), dict(out_mod.LAUNCH)

    def walk(block_v):
        u, state = u0.clone(), state0.clone()
        hs = state_mod.gdn_chunk_state(mixed, w, u, gc, ks, state, NK, block_v=block_v, precise=False)
        return u, state, hs

    def run_walk(u_in, st, block_v, hs):
        """One timed walk: the inputs reset first (the walk overwrites u and the state; `reset_copy_ms`)."""
        u_in.copy_(u0)
        st.copy_(state0)
        state_mod.gdn_chunk_state(mixed, w, u_in, gc, ks, st, NK, block_v=block_v, precise=False, states=hs)

    ref_u, ref_state, ref_hs = walk(state_mod.BLOCK_V)
    ref_core = out_mod.gdn_chunk_out(mixed, ref_u, gc, ref_hs, NK, precise=False)
    result = {"kind": "bench_gdn_tiles", "tokens": t, "geometry": [NK, NV, DK, DV], "reps": args.reps,
              "device": torch.cuda.get_device_name() if dev == "cuda" else dev, "torch": torch.__version__,
              "defaults": {"state_block_v": state_mod.BLOCK_V, "launch": default_launch[0]}, "state": [], "out": []}
    for block_v in (16, 32, 64):
        for stages in (1, 2):
            row = {"block_v": block_v, "num_stages": stages}
            state_mod.LAUNCH.update(num_stages=stages)
            try:
                u, state, hs = walk(block_v)
                row["rel_err_state"], row["rel_err_u"] = _rel(state, ref_state), _rel(u, ref_u)
                row["ms"] = _time(partial(run_walk, u0.clone(), state0.clone(), block_v, hs), args.reps)
            except Exception as err:  # noqa: BLE001 - a tile that does not build or run is recorded, not fatal
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            result["state"].append(row)
            print(json.dumps(row), flush=True)
    state_mod.LAUNCH.clear()
    state_mod.LAUNCH.update(default_launch[0])
    for block_v in (32, 64):
        for stages in (1, 2):
            row = {"block_v": block_v, "num_stages": stages}
            out_mod.LAUNCH.update(num_stages=stages)
            try:
                core = out_mod.gdn_chunk_out(mixed, ref_u, gc, ref_hs, NK, block_v=block_v, precise=False)
                row["rel_err"] = _rel(core, ref_core)
                row["ms"] = _time(partial(out_mod.gdn_chunk_out, mixed, ref_u, gc, ref_hs, NK, block_v=block_v,
                                          precise=False, out=core), args.reps)
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            result["out"].append(row)
            print(json.dumps(row), flush=True)
    out_mod.LAUNCH.clear()
    out_mod.LAUNCH.update(default_launch[1])
    # the copies inside the state walk's timing (u and the state reset) are timed alone and reported
    u_in, st = u0.clone(), state0.clone()
    result["reset_copy_ms"] = _time(lambda: (u_in.copy_(u0), st.copy_(state0)), args.reps)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
