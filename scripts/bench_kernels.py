"""Decode kernels one by one on a CUDA device: device time per launch (CUDA-graph replays, so no
launch overhead) and the HBM bandwidth it reaches, at the full-size Qwen3.6-35B-A3B block-FP8 shapes.

    python3 scripts/bench_kernels.py --out DIR [--tokens 1,4,16] [--variants scripts.scratch]

Writes DIR/bench_kernels.json with the hardware profile. --variants names a package holding earlier
copies of the kernels (packed_gemv_v0, moe_gate_up_v0, moe_down_v0, dense_gemv_v0) to time beside the
current ones (an A/B of a kernel change on the same machine in one run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_check import hardware_profile  # noqa: E402

HIDDEN, INTER, TOP_K = 2048, 512, 9  # 8 routed + the resident shared expert
SLOTS = 2048  # 6.4 GB of slots: far past the 60 MB L2, as in serving
DENSE = {"gdn_qkvz": (12288, 2048), "gdn_out": (2048, 4096), "attn_qkv": (9216, 2048), "attn_o": (2048, 4096)}


def bench_us(fn) -> float:
    """Median device microseconds per call of fn, replayed from a CUDA graph (no launch gaps)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


def random_pool(layout) -> torch.Tensor:
    """uint8 [S, R]: fp8 data bytes kept finite (no 0x7f/0xff NaNs), scales set to 1/64."""
    from adapters.kernels.packed_gemv import layout_consts

    pool = torch.randint(0, 0x7E, (SLOTS, layout.row_bytes), dtype=torch.uint8, device="cuda")
    c = layout_consts(layout)
    for m in (c.gate, c.up, c.down):
        n_scales = -(-m.rows // 128) * -(-m.cols // 128)
        pool[:, m.scale:m.scale + 4 * n_scales].view(torch.float32).fill_(1 / 64)
    return pool


def moe_points(mods: dict, tokens: list[int]) -> list[dict]:
    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.kernels.moe_sum import moe_sum
    from domain.model_spec import WeightFormat

    layout = ExpertLayout(WeightFormat.FP8_BLOCK, HIDDEN, INTER, torch.bfloat16)
    pool = random_pool(layout)
    points = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in tokens:
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = torch.randperm(SLOTS, device="cuda", generator=gen)[:t * TOP_K].view(t, TOP_K).to(torch.int32)
        weights = torch.rand(t, TOP_K, device="cuda", generator=gen)
        pairs = t * TOP_K
        gu_bytes = pairs * 2 * INTER * HIDDEN
        dn_bytes = pairs * HIDDEN * INTER
        for name, (gate_up, down) in mods.items():
            h = gate_up.moe_gate_up(x, ids, pool, layout)  # autotunes on first call
            y = torch.empty(t, TOP_K, HIDDEN, device="cuda", dtype=torch.float32)
            down.moe_down(h, ids, weights, pool, layout, partials=y)
            out = torch.empty_like(x)
            torch.cuda.synchronize()
            us_gu = bench_us(lambda: gate_up.moe_gate_up(x, ids, pool, layout, out=h))  # noqa: B023
            us_dn = bench_us(lambda: down.moe_down(h, ids, weights, pool, layout, partials=y))  # noqa: B023
            us_sum = bench_us(lambda: moe_sum(y, out))  # noqa: B023
            points.append({"variant": name, "tokens": t, "pairs": pairs,
                           "gate_up_us": round(us_gu, 2), "gate_up_gb_s": round(gu_bytes / us_gu / 1e3, 1),
                           "down_us": round(us_dn, 2), "down_gb_s": round(dn_bytes / us_dn / 1e3, 1),
                           "sum_us": round(us_sum, 2),
                           "layer_us": round(us_gu + us_dn + us_sum, 2)})
            print(points[-1], flush=True)
    return points


def dense_points(mods: dict) -> list[dict]:
    import torch.nn.functional as F

    from adapters.checkpoint.quantize import quantize
    from domain.model_spec import WeightFormat

    points = []
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for shape_name, (n, k) in DENSE.items():
        q = quantize(torch.randn(n, k) * 0.05, WeightFormat.FP8_BLOCK).to("cuda")
        xs = x[:, :k].contiguous()
        for name, mod in mods.items():
            mod.dense_gemv(xs, q)
            torch.cuda.synchronize()
            us = bench_us(lambda: mod.dense_gemv(xs, q))  # noqa: B023
            points.append({"variant": name, "matrix": shape_name, "shape": [n, k], "us": round(us, 2),
                           "gb_s": round(n * k / us / 1e3, 1)})
            print(points[-1], flush=True)
    head = torch.randn(248320, 2048, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(256, 2048, device="cuda", dtype=torch.float32)
    h = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    us = bench_us(lambda: F.linear(h, head))
    points.append({"variant": "cublas", "matrix": "lm_head_bf16", "shape": [248320, 2048], "us": round(us, 2),
                   "gb_s": round(head.nbytes / us / 1e3, 1)})
    us = bench_us(lambda: F.linear(h.float(), router))
    points.append({"variant": "cublas", "matrix": "router_fp32", "shape": [256, 2048], "us": round(us, 2),
                   "gb_s": round(router.nbytes / us / 1e3, 1)})
    print(points[-2:], flush=True)
    return points


def _timed(fn) -> float | str:
    """bench_us after one warm-up call (autotuning), or the error a failed kernel raised."""
    try:
        fn()
        torch.cuda.synchronize()
        return round(bench_us(fn), 2)
    except Exception as exc:  # a failed kernel is recorded, not fatal to the run
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def crossover_points() -> dict:
    """Where the tensor-core kernels overtake the per-row GEMVs: dense_gemv vs dense_gemm per row count
    (decode buckets and short prefill) and fused_moe (per-pair GEMV) vs grouped_moe per token count."""
    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.checkpoint.quantize import quantize
    from adapters.kernels.dense_gemm import dense_gemm
    from adapters.kernels.dense_gemv import dense_gemv
    from adapters.kernels.fused_moe import fused_moe
    from adapters.kernels.grouped_moe import grouped_moe
    from domain.model_spec import WeightFormat

    dense = []
    for shape_name, (n, k) in DENSE.items():
        q = quantize(torch.randn(n, k) * 0.05, WeightFormat.FP8_BLOCK).to("cuda")
        for m in (1, 2, 4, 8, 16, 32, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"matrix": shape_name, "rows": m}
            for name, fn in (("gemv", dense_gemv), ("gemm", dense_gemm)):
                row[f"{name}_us"] = _timed(lambda f=fn, x=x, q=q: f(x, q))
            dense.append(row)
            print(row, flush=True)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, HIDDEN, INTER, torch.bfloat16)
    pool = random_pool(layout)
    gen = torch.Generator(device="cuda").manual_seed(1)
    moe = []
    for t in (4, 16, 28, 32, 64, 256):
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        # 8 routed experts of 256 per token (real collisions) + one shared slot for every token
        ids = torch.stack([torch.randperm(256, device="cuda", generator=gen)[:8] for _ in range(t)])
        ids = torch.cat((ids, torch.full((t, 1), 300, device="cuda")), 1).to(torch.int32)
        weights = torch.rand(t, 9, device="cuda", generator=gen)
        row = {"tokens": t, "pairs": t * 9}
        for name, fn in (("gemv", fused_moe), ("grouped", grouped_moe)):
            row[f"{name}_us"] = _timed(lambda f=fn, x=x, i=ids, w=weights: f(x, i, w, pool, layout))
        moe.append(row)
        print(row, flush=True)
    return {"dense": dense, "moe": moe}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    p.add_argument("--variants", default=None, help="package with *_v0 copies of the kernels to compare")
    args = p.parse_args(argv)
    from adapters.kernels import dense_gemv, moe_down, moe_gate_up

    moe_mods = {"current": (moe_gate_up, moe_down)}
    dense_mods = {"current": dense_gemv}
    if args.variants:
        v = lambda name: importlib.import_module(f"{args.variants}.{name}")  # noqa: E731
        moe_mods["v0"] = (v("moe_gate_up_v0"), v("moe_down_v0"))
        dense_mods["v0"] = v("dense_gemv_v0")
    record = {"kind": "bench_kernels", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "hardware": hardware_profile("cuda"), "args": vars(args),
              "moe": moe_points(moe_mods, args.tokens), "dense": dense_points(dense_mods),
              "crossover": crossover_points()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_kernels.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
