"""Launches dense_gemm once per tile (BLOCK_M, BLOCK_N, warps, stages), each tile by itself with no autotuner, at
the shapes the H200 run of 2026-12-01 failed or hung on, and prints per tile the relative error against a
float64 reference and the seconds of its first call (compile + run) and of one more call. GPU diagnosis of
issue 8/9's open GEMM failures: which tile is wrong (test_prefill_linear fp8_block: N=48, K=256, M=6/40) and
which one takes the time (the FP4 hangs). A tile stuck for 90 s dumps every thread's stack to stderr.

    python scripts/gemm_tile_sweep.py [--tiles all|tuned] [--fmt fp8_block,nvfp4,mxfp4] [--act fp32,bf16]

--tiles all: TUNE_TILES and FMA_TILES in both activation dtypes (the tiles the autotuner tried before the
pruning of 2026-12-01 included); tuned: only the family the autotuner now uses for the dtype.
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from adapters.checkpoint.quant import dequantize  # noqa: E402
from adapters.checkpoint.quantize import quantize  # noqa: E402
from adapters.kernels.dense_gemm import FMA_TILES, TUNE_TILES, dense_gemm  # noqa: E402
from domain.model_spec import WeightFormat  # noqa: E402

SHAPES = ((6, 48, 256), (40, 48, 256), (37, 200, 384), (40, 4096, 2048))  # (M, N, K)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", choices=("all", "tuned"), default="all")
    ap.add_argument("--fmt", default="fp8_block,nvfp4,mxfp4")
    ap.add_argument("--act", default="fp32,bf16")
    args = ap.parse_args()
    for fmt in map(WeightFormat, args.fmt.split(",")):
        for act in [{"fp32": torch.float32, "bf16": torch.bfloat16}[a] for a in args.act.split(",")]:
            family = FMA_TILES if act == torch.float32 else TUNE_TILES
            tiles = sorted(set(TUNE_TILES + FMA_TILES)) if args.tiles == "all" else family
            for m, n, k in SHAPES:
                gen = torch.Generator().manual_seed(m + n + k)
                q = quantize(torch.randn(n, k, generator=gen) * 0.05, fmt)
                x = torch.randn(m, k, generator=gen).to(act)
                exact = x.double() @ dequantize(q, torch.float64).T
                xq, qq = x.cuda(), q.to("cuda")
                for bm, bn, warps, stages in tiles:
                    faulthandler.dump_traceback_later(90, exit=False)
                    try:
                        t0 = time.perf_counter()
                        out = dense_gemm(xq, qq, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                        torch.cuda.synchronize()
                        t1 = time.perf_counter()
                        dense_gemm(xq, qq, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                        torch.cuda.synchronize()
                        t2 = time.perf_counter()
                        err = ((out.double().cpu() - exact).norm() / exact.norm()).item()
                        bound = 1e-5 if act == torch.float32 else 8e-3
                        verdict = "ok" if err < bound else "WRONG"
                        print(f"{fmt.value} {str(act)[6:]} M={m} N={n} K={k} tile {bm}x{bn} w{warps} s{stages}: "
                              f"err {err:.2e} {verdict}, first call {t1 - t0:.1f} s, then {1e3 * (t2 - t1):.2f} ms",
                              flush=True)
                    except OutOfResources as e:
                        print(f"{fmt.value} {str(act)[6:]} M={m} N={n} K={k} tile {bm}x{bn} w{warps} s{stages}: "
                              f"does not launch ({e})", flush=True)
                    finally:
                        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
