"""Decode kernels one by one on a CUDA device: device time per launch (CUDA-graph replays, so no
launch overhead) and the HBM bandwidth it reaches, at the full-size Qwen3.6-35B-A3B block-FP8 shapes.

    python3 scripts/bench_kernels.py --out DIR [--tokens 1,4,16] [--route-rows 1,2,4,8,16]
        [--variants scripts.scratch]
        [--only fusions|dedup|grouped|order|crossover|splitk-tiles|gdn-walk|gdn-out|dense-prefill]

Writes DIR/bench_kernels.json with the hardware profile. --variants names a package holding earlier
copies of the kernels (packed_gemv_v0, moe_gate_up_v0, moe_down_v0, dense_gemv_v0) to time beside the
current ones (an A/B of a kernel change on the same machine in one run). `fusions` holds each decode
fusion's A/B (the norm + router rows also name rms_norm_router's autotuned tile at each T and time every
candidate tile); `route_lookup` the router + lookup A/B at --route-rows (where moe_route_lookup.FUSED_MAX_TILE,
the decode step's crossover, belongs); --only fusions runs just those two. `grouped_decode` (--only grouped)
times the decode-sized MoE layer per pair and grouped by expert, part by part (whether grouping a bs16
step's pairs by expert pays: grouped_decode_points). `crossover` (also in the full run) times the dense
kernels per row count, dense_gemv / dense_gemm_splitk / dense_gemm and the one prefill_linear picks (where its
GEMV_MAX_ROWS / SPLITK_MAX_ROWS belong), then fused_moe vs grouped_moe; --only crossover runs the dense half.
`gdn_walk` (--only gdn-walk, not in the full run) times the Gated DeltaNet state walk (gdn_chunk_state) at each
launch configuration of --walk-configs (GDN_WALK_CONFIGS: BLOCK_V x warps x chunk-loop stages) over prompts of
--walk-tokens, as the prefill launches it, beside gdn_chunk_wy and gdn_chunk_out for context. `gdn_out`
(--only gdn-out) times gdn_chunk_out the same way at each launch of --out-configs (gdn_launch_ab.GDN_OUT_CONFIGS).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_launch_ab import (  # noqa: E402
    GDN_OUT_CONFIGS,
    QWEN36_GDN,
    first_build,
    gdn_out_points,
    max_rel,
    out_window,
    prompt_walk,
    walk,
    with_default_first,
)
from gpu_check import hardware_profile  # noqa: E402

HIDDEN, INTER, TOP_K = 2048, 512, 9  # 8 routed + the resident shared expert
SLOTS = 2048  # 6.4 GB of slots: far past the 60 MB L2, as in serving
DENSE = {"gdn_qkvz": (12288, 2048), "gdn_out": (2048, 4096), "attn_qkv": (9216, 2048), "attn_o": (2048, 4096)}


def bench_us(fn) -> float:
    """Median device microseconds per call of fn, replayed from a CUDA graph (no launch gaps)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


def random_pool(layout, device: str = "cuda") -> torch.Tensor:
    """uint8 [S, R]: fp8 data bytes kept finite (no 0x7f/0xff NaNs), scales set to 1/64."""
    from adapters.kernels.packed_gemv import layout_consts

    pool = torch.randint(0, 0x7E, (SLOTS, layout.row_bytes), dtype=torch.uint8, device=device)
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


CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode buckets and short prefill steps


def prefill_kernel(rows: int, q) -> str:
    """The kernel prefill_linear runs for `rows` rows of q (bf16 activations, a8 off, its constants as they are
    now): "gemv", "splitk" or "gemm"."""
    from adapters.cuda_exec import prefill_linear as pl

    if pl.use_gemv(rows, q.shape[1]) and pl.gemv.supports(q):
        return "gemv"
    return "splitk" if pl.use_splitk(rows, q) else "gemm"


def _tuned_choice(tuner) -> dict | None:
    """The autotuner's last choice (its kwargs, warps and stages): which of TUNE_TILES x SPLITS win, so the
    split-K GEMM's tuning space (its start-up cost) can be pruned from a record. None where it never ran (the
    interpreter launches the untuned kernel)."""
    cfg = getattr(tuner, "best_config", None)
    return None if cfg is None else {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def dense_crossover_points(dev: str = "cuda", timer=None, rows: tuple[int, ...] = CROSSOVER_ROWS) -> list[dict]:
    """dense_gemv vs dense_gemm_splitk vs dense_gemm per row count at the DENSE shapes (block FP8): where
    prefill_linear's GEMV_MAX_ROWS / SPLITK_MAX_ROWS belong. `chosen`: the kernel prefill_linear runs today;
    `best`: the fastest, when all three timed (the split-K GEMM takes at most its MAX_ROWS rows: None
    past them). dev/timer let a CPU test run the same code at tiny shapes in Triton's interpreter."""
    from adapters.checkpoint.quantize import quantize
    from adapters.kernels import dense_gemm_splitk as sk
    from adapters.kernels.dense_gemm import dense_gemm
    from adapters.kernels.dense_gemv import dense_gemv
    from domain.model_spec import WeightFormat

    timer = timer or _timed
    points = []
    for shape_name, (n, k) in DENSE.items():
        q = quantize(torch.randn(n, k) * 0.05, WeightFormat.FP8_BLOCK).to(dev)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"matrix": shape_name, "rows": m, "chosen": prefill_kernel(m, q)}
            row["gemv_us"] = timer(lambda x=x, q=q: dense_gemv(x, q))
            # at its autotuned tile and split on CUDA, as prefill_linear runs it (a fixed tile elsewhere)
            row["splitk_us"] = (timer(lambda x=x, q=q: sk.dense_gemm_splitk(x, q))
                                if m <= sk.MAX_ROWS else None)
            row["splitk_tile"] = _tuned_choice(sk._TUNED) if m <= sk.MAX_ROWS else None
            row["gemm_us"] = timer(lambda x=x, q=q: dense_gemm(x, q))
            times = {name: row[f"{name}_us"] for name in ("gemv", "splitk", "gemm")}
            if all(isinstance(t, float) for t in times.values()):
                row["best"] = min(times, key=times.get)
            points.append(row)
            print(row, flush=True)
    return points


PREFILL_ROWS = (1024, 8192, 16384)  # prefill chunk sizes (--only dense-prefill; 16384 shares 8192's tuning bucket)


def dense_prefill_points(dev: str = "cuda", timer=None, rows: tuple[int, ...] = PREFILL_ROWS) -> list[dict]:
    """The prefill's dense projections at chunk sizes: dense_gemm (autotuned, block FP8 dequantized in its K
    loop) against cuBLAS bf16 on the same weight dequantized once (quant.dequantize: the weights the W_LHS tiles
    round to), that dequantization's own time (dequant_weight, a Triton kernel) and the two in a row. Says whether
    a per-layer bf16 copy of the dense weights would pay at prefill sizes: the 8k chunk's dense GEMMs were ~35 % of
    the H100's bf16 peak (docs/prefill-kernels.md). `tflops`: 2 M N K / time; `max_rel_diff`: the two results'
    largest difference over the largest |y| (accumulation order only)."""
    import torch.nn.functional as F

    from adapters.checkpoint.quant import dequantize
    from adapters.checkpoint.quantize import quantize
    from adapters.kernels.dense_gemm import _TUNED, dense_gemm
    from adapters.kernels.dequant_weight import dequant_weight
    from domain.model_spec import WeightFormat

    timer = timer or _timed
    points = []
    for shape_name, (n, k) in DENSE.items():
        q = quantize(torch.randn(n, k) * 0.05, WeightFormat.FP8_BLOCK).to(dev)
        w = dequantize(q, torch.bfloat16)  # [N, K]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"matrix": shape_name, "shape": [n, k], "rows": m}
            row["gemm_us"] = timer(lambda x=x, q=q: dense_gemm(x, q))
            row["gemm_tile"] = _tuned_choice(_TUNED)
            row["cublas_us"] = timer(lambda x=x, w=w: F.linear(x, w))
            row["dequant_us"] = timer(lambda q=q, w=w: dequant_weight(q, w))  # the Triton kernel, into the copy
            row["dequant_cublas_us"] = timer(lambda x=x, q=q, w=w: F.linear(x, dequant_weight(q, w)))
            for name in ("gemm", "cublas", "dequant_cublas"):
                if isinstance(row[f"{name}_us"], float):
                    row[f"{name}_tflops"] = round(2 * m * n * k / row[f"{name}_us"] / 1e6, 1)
            a, b = dense_gemm(x, q).float(), F.linear(x, w).float()
            row["max_rel_diff"] = float((a - b).abs().max() / b.abs().max())
            points.append(row)
            print(row, flush=True)
    return points


MOE_PREFILL_TOKENS = (2048, 8192)


def moe_prefill_points(dev: str = "cuda", timer=None, tokens: tuple[int, ...] = MOE_PREFILL_TOKENS,
                       experts: int = 256) -> list[dict]:
    """The prefill's routed experts at chunk sizes: today's grouped GEMMs over block-FP8 slots (gate/up + down into
    fp32 partials, as grouped_moe runs them) against torch._grouped_mm (CUTLASS, bf16) over bf16 expert weights,
    pairs sorted by expert and each group padded to 16 rows, and the cost of dequantizing a whole layer's experts
    into such weights (dequant_weight over the [E*2I, H] and [E*H, I] stacks). Says whether a per-layer bf16 copy of
    the experts would pay where every expert is resident. Random routing (K of E distinct per token)."""
    import torch.nn.functional as F

    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.checkpoint.quantize import quantize
    from adapters.kernels.dequant_weight import dequant_weight
    from adapters.kernels.grouped_moe import grouped_gemms
    from adapters.kernels.moe_align import align_by_slot, choose_block_m
    from domain.model_spec import WeightFormat

    timer = timer or _timed
    top_k = TOP_K - 1  # routed experts only
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, HIDDEN, INTER, torch.bfloat16)
    pool = random_pool(layout, dev)[:experts].contiguous()
    w1 = torch.randn(experts, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.05  # [E, 2I, H]
    w2 = torch.randn(experts, HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * 0.05  # [E, H, I]
    q1 = quantize(torch.randn(experts * 2 * INTER, HIDDEN) * 0.05, WeightFormat.FP8_BLOCK).to(dev)
    q2 = quantize(torch.randn(experts * HIDDEN, INTER) * 0.05, WeightFormat.FP8_BLOCK).to(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    points = []
    for t in tokens:
        x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(t, experts, device=dev, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)  # [T, K]
        weights = torch.rand(t, top_k, device=dev, generator=gen)
        partials = torch.empty(t, top_k, HIDDEN, device=dev, dtype=torch.float32)
        align = align_by_slot(ids, experts, choose_block_m(t * top_k, experts), experts)
        row = {"tokens": t, "pairs": t * top_k, "experts": experts,
               "grouped_us": timer(lambda x=x, align=align, weights=weights, partials=partials:
                                   grouped_gemms(x, align, weights, pool, layout, partials))}
        # pairs sorted by expert, each group padded to 16 rows (the grouped GEMM's alignment)
        flat = ids.reshape(-1).long()
        counts = torch.bincount(flat, minlength=experts)
        padded = (counts + 15) // 16 * 16
        offs = padded.cumsum(0).to(torch.int32)  # [E] group ends
        order = flat.argsort(stable=True)
        starts = (offs - padded).long()  # [E]
        rank = torch.arange(flat.numel(), device=dev) - (counts.cumsum(0) - counts)[flat[order]]
        dest = starts[flat[order]] + rank  # row of each sorted pair in the padded layout
        rows_total = int(offs[-1])
        src = torch.zeros(rows_total, dtype=torch.long, device=dev)
        src[dest] = order // top_k  # the token of each padded row (padding reads token 0, never summed)

        def grouped_mm(x=x, src=src, offs=offs):
            h = torch._grouped_mm(x[src], w1.transpose(-2, -1), offs=offs)  # [P, 2I]
            g, u = h.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)  # [P, H]

        row["grouped_mm_us"] = timer(grouped_mm)
        row["padded_rows"] = rows_total
        flops = 2 * t * top_k * 3 * HIDDEN * INTER
        for name in ("grouped", "grouped_mm"):
            if isinstance(row[f"{name}_us"], float):
                row[f"{name}_tflops"] = round(flops / row[f"{name}_us"] / 1e6, 1)
        points.append(row)
        print(row, flush=True)
    c1 = torch.empty(q1.shape, dtype=torch.bfloat16, device=dev)
    c2 = torch.empty(q2.shape, dtype=torch.bfloat16, device=dev)
    layer = {"dequant_layer_us": timer(lambda: (dequant_weight(q1, c1), dequant_weight(q2, c2))),
             "layer_weight_bytes_bf16": c1.nbytes + c2.nbytes}
    points.append(layer)
    print(layer, flush=True)
    return points


# The split-K study (--only splitk-tiles): every fixed tile, split, warp count and stage count at the decode row
# counts, to see what the autotuner's space (TUNE_TILES x SPLITS) misses. Session 19 measured the tuned kernel at
# ~1.7 TB/s on gdn_qkvz (14.6 us for 25 MB at 4-16 rows) where the one-row GEMV streams 3.2 TB/s; BLOCK_N 128
# and 8 warps are outside the tuned space.
SPLITK_STUDY_ROWS = (4, 16, 32)


def _gb_s(nbytes: int, us) -> float | None:
    """GB/s of nbytes streamed in `us` microseconds; None where the timer recorded a failure (a string)."""
    return round(nbytes / us / 1e3, 1) if isinstance(us, float) else None
SPLITK_STUDY_TILES = tuple((bn, w, st) for bn in (16, 32, 64, 128) for w in (4, 8) for st in (3, 4))


def splitk_tile_points(dev: str = "cuda", timer=None, rows: tuple[int, ...] = SPLITK_STUDY_ROWS,
                       shapes: dict | None = None, tiles=SPLITK_STUDY_TILES) -> list[dict]:
    """dense_gemm_splitk at each fixed (BLOCK_N, warps, stages) x split that _prune admits for the shape, per
    matrix and row count, beside the autotuned launch and the GEMV; `gb_s`: weight bytes / time (the kernels
    are bound by streaming the weight). Every fixed launch's output is checked against the autotuned one's
    (max relative difference, fp32 sums in another order). dev/timer/shapes: a CPU test's tiny run."""
    import triton

    from adapters.checkpoint.quantize import quantize
    from adapters.kernels import dense_gemm_splitk as sk
    from adapters.kernels.dense_gemv import dense_gemv
    from domain.model_spec import WeightFormat

    timer = timer or _timed
    points = []
    for shape_name, (n, k) in (shapes or DENSE).items():
        q = quantize(torch.randn(n, k) * 0.05, WeightFormat.FP8_BLOCK).to(dev)
        weight_bytes = q.data.numel() * q.data.element_size() + q.scale.numel() * q.scale.element_size()
        steps = -(-k // sk.BLOCK_K)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = sk.dense_gemm_splitk(x, q).float()
            row = {"matrix": shape_name, "rows": m, "weight_bytes": weight_bytes,
                   "gemv_us": timer(lambda x=x, q=q: dense_gemv(x, q)),
                   "tuned_us": timer(lambda x=x, q=q: sk.dense_gemm_splitk(x, q)),
                   "tuned_tile": _tuned_choice(sk._TUNED), "tiles": []}
            for bn, warps, stages in tiles:
                if bn > max(16, triton.next_power_of_2(n)):
                    continue
                for split in sk.SPLITS:
                    if split > 1 and steps < split * sk.MIN_STEPS_PER_SPLIT:
                        continue
                    run = functools.partial(sk.dense_gemm_splitk, x, q, block_n=bn, split_k=split, num_warps=warps,
                                            num_stages=min(stages, -(-steps // split)))
                    got = run().float()
                    diff = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                    us = timer(run)
                    row["tiles"].append({"block_n": bn, "split_k": split, "num_warps": warps, "num_stages": run.keywords["num_stages"],
                                         "us": us, "max_rel_diff": diff,
                                         "gb_s": _gb_s(weight_bytes, us)})
            timed = [t for t in row["tiles"] if isinstance(t["us"], float)]
            row["best"] = min(timed, key=lambda t: t["us"]) if timed else None
            for name in ("gemv", "tuned"):
                row[f"{name}_gb_s"] = _gb_s(weight_bytes, row[f"{name}_us"])
            points.append(row)
            best = row["best"] or {}
            print({k: row[k] for k in ("matrix", "rows", "gemv_us", "tuned_us", "tuned_tile")},
                  {k: best.get(k) for k in ("block_n", "split_k", "num_warps", "num_stages", "us", "gb_s")}, flush=True)
    return points


def moe_crossover_points() -> list[dict]:
    """fused_moe (per-pair GEMV) vs grouped_moe per token count."""
    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.kernels.fused_moe import fused_moe
    from adapters.kernels.grouped_moe import grouped_moe
    from domain.model_spec import WeightFormat

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
    return moe


def crossover_points(dev: str = "cuda", timer=None, moe: bool = True) -> dict:
    """Where the tensor-core kernels overtake the per-row GEMVs: the dense kernels per row count (decode
    buckets and short prefill: dense_crossover_points, on dev with timer) and, unless moe is False (--only
    crossover: the MoE half is slow; CUDA only), fused_moe vs grouped_moe per token count."""
    return {"dense": dense_crossover_points(dev, timer), **({"moe": moe_crossover_points()} if moe else {})}


def decode_layer_inputs(t: int, experts: int, gen: torch.Generator, dev: str):
    """One decode-sized MoE layer's inputs: x bf16 [T, H], the expert keys int32 [T, K+1] (TOP_K - 1 distinct
    random routed experts per token, then the shared one as key E = experts) and router weights fp32 [T, K+1]."""
    x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
    ids = torch.stack([torch.randperm(experts, device=dev, generator=gen)[:TOP_K - 1] for _ in range(t)])
    keys = torch.cat((ids, torch.full((t, 1), experts, device=dev)), 1).to(torch.int32)
    return x, keys, torch.rand(t, TOP_K, device=dev, generator=gen)


def grouped_decode_points(tokens: list[int], dev: str = "cuda", experts: int = 256, timer=None) -> list[dict]:
    """The decode-sized MoE layer both ways, part by part, on the same inputs (Qwen3.6 shapes: 8 of 256
    experts + the resident shared one, block FP8, a pool of SLOTS rows far past L2):

    * per-pair (what the decode graphs run): moe_gate_up, moe_down's partials, moe_sum: every (token, k) pair
      streams its expert, so a layer's duplicate experts are read once per pair;
    * grouped by expert (what `_routed_set` does for a prefill chunk): align_by_slot over the E + 1 expert keys
      (the three Triton launches: E + 1 <= MAX_TRITON_SLOTS), the blocks' keys mapped to slots, the two
      tensor-core GEMMs with BLOCK_M 16, moe_sum: each distinct expert is read once per 16 of its pairs.

    At 16 tokens random routing gives ~100 distinct experts for 128 routed pairs, so the grouped side streams
    ~72 % of the per-pair side's weight bytes: the prize for bs16 decode (docs/fast-decode.md). bench_kernels'
    `crossover` rows timed grouped_moe aligned by pool slot (SLOTS > MAX_TRITON_SLOTS: the ~25-launch torch
    alignment), which is not the path a decode step could take; these rows time the one it could, and each part
    alone, so the record says where the grouped side's time goes. `max_rel_diff`: the two sides' outputs
    (bf16 between the GEMMs on both) relative to the per-pair output's largest value. dev/experts/timer let a
    CPU test run the same code at tiny shapes in Triton's interpreter."""
    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.kernels.grouped_moe import grouped_gemms
    from adapters.kernels.moe_align import align_by_slot, choose_block_m, uses_triton
    from adapters.kernels.moe_down import moe_down
    from adapters.kernels.moe_gate_up import moe_gate_up
    from adapters.kernels.moe_sum import moe_sum
    from adapters.kernels.tuned_tiles import tuned_tiles
    from domain.model_spec import WeightFormat

    timer = timer or _timed
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, HIDDEN, INTER, torch.bfloat16)
    pool = random_pool(layout, dev)
    gen = torch.Generator(device=dev).manual_seed(4)
    groups = experts + 1  # the routed experts and the shared one (key E)
    # each expert key's slot, and -1 at the end (key -1 reads it): the lookup's slot map, as `_routed_set` gets it
    slot_map = torch.cat((torch.randperm(SLOTS, device=dev, generator=gen)[:groups],
                          torch.full((1,), -1, device=dev))).to(torch.int32)
    points = []
    for t in tokens:
        x, keys, weights = decode_layer_inputs(t, experts, gen, dev)
        slot_ids = slot_map[keys]  # [T, K+1] int32
        block_m = choose_block_m(keys.numel(), groups)
        row = {"tokens": t, "pairs": keys.numel(), "distinct_experts": int(torch.unique(keys).numel()),
               "block_m": block_m, "triton_align": uses_triton(keys, groups)}
        # per-pair: the decode graphs' kernels, each part alone and the three together
        h_pp = moe_gate_up(x, slot_ids, pool, layout)  # [T, K, I]; autotunes on CUDA
        y_pp = torch.zeros(t, TOP_K, HIDDEN, device=dev, dtype=torch.float32)
        out_pp = torch.empty_like(x)

        def per_pair(x=x, slot_ids=slot_ids, weights=weights, h=h_pp, y=y_pp, out=out_pp):
            moe_gate_up(x, slot_ids, pool, layout, out=h)
            moe_down(h, slot_ids, weights, pool, layout, partials=y)
            return moe_sum(y, out)

        row["per_pair_gate_up_us"] = timer(lambda x=x, s=slot_ids, h=h_pp: moe_gate_up(x, s, pool, layout, out=h))
        row["per_pair_down_us"] = timer(lambda h=h_pp, s=slot_ids, w=weights, y=y_pp: moe_down(h, s, w, pool, layout,
                                                                                              partials=y))
        row["per_pair_sum_us"] = timer(lambda y=y_pp, out=out_pp: moe_sum(y, out))
        row["per_pair_layer_us"] = timer(per_pair)
        # grouped by expert key, its blocks' keys mapped to slots (-1 past the last used block)
        align = align_by_slot(keys, groups, block_m, groups)
        mapped = align._replace(block_slots=slot_map[align.block_slots])
        y_g = torch.zeros(t, TOP_K, HIDDEN, device=dev, dtype=torch.float32)
        h_g = grouped_gemms(x, mapped, weights, pool, layout, y_g)  # [P, I]; autotunes on CUDA
        out_g = torch.empty_like(x)

        def grouped(x=x, keys=keys, weights=weights, y=y_g, h=h_g, out=out_g, block_m=block_m):
            a = align_by_slot(keys, groups, block_m, groups)
            y.zero_()
            grouped_gemms(x, a._replace(block_slots=slot_map[a.block_slots]), weights, pool, layout, y, h)
            return moe_sum(y, out)

        row["grouped_align_us"] = timer(lambda keys=keys, block_m=block_m: align_by_slot(keys, groups, block_m, groups))
        row["grouped_gemms_us"] = timer(lambda x=x, a=mapped, w=weights, y=y_g, h=h_g: grouped_gemms(
            x, a, w, pool, layout, y, h))
        row["grouped_layer_us"] = timer(grouped)
        ref, got = per_pair().float(), grouped().float()
        row["max_rel_diff"] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        # the grouped GEMMs' tuned tiles so far (W_LHS ones only with FLUXTIDE_PREFILL_W_LHS=1); empty in the interpreter
        row["grouped_tiles"] = {k: v for k, v in tuned_tiles().items() if k.startswith("moe_grouped")}
        points.append(row)
        print(row, flush=True)
    return points


def fusion_points(tokens: list[int], dev: str = "cuda", experts: int = 256, geo=None, timer=None) -> list[dict]:
    """Each decode-step fusion A/B on the same inputs: the fused kernel against the unfused sequence it
    replaced (both replayed from CUDA graphs, so the saving shown is device time; launch gaps come on top
    of the unfused side in the real step). Qwen3.6-35B-A3B shapes: H 2048, 256 experts, GDN 16 key / 32
    value heads of 128 (geo None), attention 16 query / 2 kv heads of 256 over 64 tokens. The router +
    lookup fusion has its own rows (route_lookup_points); moe_down's summing mode is gone (slower on the
    H200: docs/fast-decode.md), its per-pair + moe_sum timing is moe_points'. The norm + router rows also
    name the tile rms_norm_router's autotuner chose at that T (`norm_router_tile`, CUDA only) and time each
    candidate tile it tries at that T (BR <= T) alone (`norm_router_tiles_us`, "BRxBExBH"). dev/experts/
    geo/timer (default _timed) let a CPU test run the same code at tiny shapes in Triton's interpreter."""
    import torch.nn.functional as F

    from adapters.kernels.gdn_decode import gdn_decode_step
    from adapters.kernels.paged_decode_attention import paged_decode_attention
    from adapters.kernels.rms_norm import rms_norm
    from adapters.kernels.rms_norm_router import TUNE_TILES, rms_norm_router, tuned_tile
    from adapters.torch_exec.gated_deltanet import GdnGeometry, LinearStatePool

    gen = torch.Generator(device=dev).manual_seed(2)
    router = torch.randn(experts, HIDDEN, device=dev, generator=gen) * 0.02
    norm_w = torch.randn(HIDDEN, device=dev, generator=gen).bfloat16()
    geo = geo or GdnGeometry(16, 32, 128, 128, 4)
    timer = timer or _timed
    states = LinearStatePool(1, max(tokens), geo, torch.bfloat16, dev)
    ab_w = (torch.randn(2 * geo.num_v_heads, HIDDEN, device=dev, generator=gen) * 0.02).bfloat16()
    w_b, w_a = ab_w[:geo.num_v_heads], ab_w[geo.num_v_heads:]  # [Nv, H] each, as prepare_fast_path leaves them
    conv_w = torch.randn(geo.conv_channels, 4, device=dev, generator=gen).bfloat16()
    neg_a = -torch.rand(geo.num_v_heads, device=dev, generator=gen)
    dt_bias = torch.randn(geo.num_v_heads, device=dev, generator=gen)
    k_pool, v_pool = (torch.randn(64, 16, 2, 256, device=dev, generator=gen).bfloat16() for _ in range(2))
    points = []
    for t in tokens:
        bf = lambda *shape: torch.randn(*shape, device=dev, generator=gen).bfloat16()  # noqa: E731
        x, res = bf(t, HIDDEN), bf(t, HIDDEN)
        row = {"tokens": t}

        def norm_then_gemv(x=x, res=res):
            _, _, h32 = rms_norm(x, norm_w, 1e-6, unit_offset=True, residual=res, fp32_copy=True)
            return F.linear(h32, router)

        row["norm_router_unfused_us"] = timer(norm_then_gemv)
        row["norm_router_fused_us"] = timer(lambda x=x, res=res: rms_norm_router(x, res, norm_w, router, 1e-6,
                                                                                 unit_offset=True))
        # the tile the autotuner picked for this T on CUDA (None elsewhere: the interpreter runs the default),
        # and every candidate tile timed alone, so a run shows whether the pick is the fastest
        row["norm_router_tile"] = tuned_tile(x, norm_w, router) if x.is_cuda else None
        row["norm_router_tiles_us"] = {
            f"{br}x{be}x{bh}": timer(lambda x=x, res=res, br=br, be=be, bh=bh: rms_norm_router(
                x, res, norm_w, router, 1e-6, unit_offset=True, block_r=br, block_e=be, block_h=bh))
            for br, be, bh in TUNE_TILES if br <= t}
        # GDN: the [64, 2048] bf16 a/b GEMV (cuBLAS) + the recurrence, or the recurrence projecting a/b
        slots = torch.arange(t, dtype=torch.int32, device=dev)
        qkv = bf(t, geo.conv_channels)

        def ab_gemv_then_gdn(x=x, qkv=qkv, slots=slots):
            b, a = torch.split(F.linear(x, ab_w), geo.num_v_heads, dim=-1)
            return gdn_decode_step(qkv, a, b, states.conv[0], states.recurrent[0], slots, conv_w, neg_a, dt_bias, geo)

        row["gdn_ab_unfused_us"] = timer(ab_gemv_then_gdn)
        row["gdn_ab_fused_us"] = timer(lambda x=x, qkv=qkv, slots=slots: gdn_decode_step(
            qkv, None, None, states.conv[0], states.recurrent[0], slots, conv_w, neg_a, dt_bias, geo,
            project_ab=(x, w_a, w_b)))
        # attention output gate: combine then the gate's copy, sigmoid and product, or inside the combine
        pages = torch.randperm(64, device=dev, generator=gen)[:t * 4].view(t, 4).to(torch.int32)
        lens = torch.full((t,), 4 * 16, dtype=torch.int32, device=dev)
        q, qg = bf(t, 16, 256), bf(t, 16, 512)

        def attend_then_gate(q=q, qg=qg, pages=pages, lens=lens):
            out = paged_decode_attention(q, k_pool, v_pool, pages, lens, 256 ** -0.5)
            return out.reshape(q.shape[0], -1) * torch.sigmoid(qg[:, :, 256:].reshape(q.shape[0], -1))

        row["attn_gate_unfused_us"] = timer(attend_then_gate)
        row["attn_gate_fused_us"] = timer(lambda q=q, qg=qg, pages=pages, lens=lens: paged_decode_attention(
            q, k_pool, v_pool, pages, lens, 256 ** -0.5, gate=qg[:, :, 256:]).reshape(q.shape[0], -1))
        points.append(row)
        print(row, flush=True)
    return points


def route_lookup_points(rows: list[int], dev: str = "cuda", experts: int = 256, timer=None) -> list[dict]:
    """The router + layer lookup A/B per row count: moe_route_lookup (one program, the whole [T, E] tile)
    against moe_router (grid (T,)) then the lookup kernel, from the same logits, on twin residencies that
    hold every routed expert after the first call (all hits, as resident serving). `step_takes` is the
    side the decode step picks today (moe_route_lookup.pays, FUSED_MAX_TILE): the rows where the fused
    side is faster say where that constant belongs. Qwen3.6 shapes: H 2048, 256 experts, top-8 + a
    resident shared expert with its bf16 sigmoid gate. Each row also records the two sides' slot ids
    (`same_slots`: the decisions must not depend on the side)."""
    from adapters.cuda_exec.device_residency import DeviceResidency
    from adapters.kernels.moe_route_lookup import FUSED_MAX_TILE, pays
    from adapters.kernels.moe_router import moe_router

    layers, routed = 40, TOP_K - 1
    gen = torch.Generator(device=dev).manual_seed(3)
    router = torch.randn(experts, HIDDEN, device=dev, generator=gen) * 0.02
    gate = (torch.randn(1, HIDDEN, device=dev, generator=gen) * 0.02).bfloat16()
    timer = timer or _timed
    points = []
    for t in rows:
        h = torch.randn(t, HIDDEN, device=dev, generator=gen).bfloat16()
        logits = torch.randn(t, experts, device=dev, generator=gen)
        valid = torch.ones(t, dtype=torch.bool, device=dev)
        unfused_res, fused_res = (DeviceResidency(SLOTS, layers, experts, dev) for _ in range(2))

        def unfused(h=h, logits=logits, valid=valid, r=unfused_res):
            w, ids = moe_router(h, router, routed, True, gate, logits=logits)
            return w, r.lookup_layer(3, ids[:, :routed], valid, SLOTS + 3)[2]

        def fused(h=h, logits=logits, valid=valid, r=fused_res):
            w, slot_ids, _, _ = r.route_layer(3, logits, h, routed, True, gate, valid, SLOTS + 3)
            return w, slot_ids

        row = {"rows": t, "tile": t * experts, "fused_max_tile": FUSED_MAX_TILE,
               "step_takes": "fused" if pays(t, experts) else "unfused"}
        row["unfused_us"], row["fused_us"] = timer(unfused), timer(fused)
        try:
            row["same_slots"] = bool(torch.equal(unfused()[1], fused()[1]))
        except Exception as exc:  # recorded like a failed timing, not fatal to the run
            row["same_slots"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        points.append(row)
        print(row, flush=True)
    return points


def routing(kind: str, tokens: int, gen: torch.Generator, dev: str = "cuda", experts: int = 256,
            hot: int = 24) -> torch.Tensor:
    """int32 [T, TOP_K] slot ids of one layer: TOP_K - 1 distinct experts per token, from all `experts`
    ("random": a random router) or from `hot` of them ("local": a trained router's repeats, most experts
    picked by several tokens of a batch), then the resident shared expert (slot SLOTS - 1) in every row."""
    pool = experts if kind == "random" else hot
    slot_of = torch.randperm(SLOTS - 1, device=dev, generator=gen)[:experts]  # the layer's experts' slots
    picks = torch.stack([torch.randperm(pool, device=dev, generator=gen)[:TOP_K - 1] for _ in range(tokens)])
    shared = torch.full((tokens, 1), SLOTS - 1, device=dev, dtype=torch.int64)
    return torch.cat((slot_of[picks], shared), 1).to(torch.int32)


def dedup_points(tokens: list[int], dev: str = "cuda", timer=None, hidden: int = HIDDEN, inter: int = INTER,
                 experts: int = 256, hot: int = 24) -> list[dict]:
    """Per-pair GEMVs against the expert-deduplicated ones (moe_gate_up_dedup, moe_down_dedup: each distinct
    slot's weights streamed once for up to PAIRS of its pairs) at the decode row counts, with random and
    local routing: device time of each kernel, of PAIRS 1..4, of the whole layer (fused_moe, dedup off/on),
    the distinct slots against the pairs, and whether the outputs are bitwise equal (they must be).
    Block FP8 at the Qwen3.6 shapes unless hidden/inter/experts say otherwise (a CPU test runs tiny shapes)."""
    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.kernels.fused_moe import fused_moe
    from adapters.kernels.moe_down import moe_down
    from adapters.kernels.moe_down_dedup import moe_down_dedup
    from adapters.kernels.moe_gate_up import moe_gate_up
    from adapters.kernels.moe_gate_up_dedup import moe_gate_up_dedup
    from adapters.kernels.moe_sum import moe_sum
    from domain.model_spec import WeightFormat

    timer = timer or bench_us
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, hidden, inter, torch.bfloat16)
    pool = random_pool(layout, dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    points = []
    for kind in ("random", "local"):
        for t in tokens:
            x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
            ids = routing(kind, t, gen, dev, experts, hot)
            weights = torch.rand(t, TOP_K, device=dev, generator=gen)
            distinct = int(torch.unique(ids).numel())
            row = {"routing": kind, "tokens": t, "pairs": t * TOP_K, "distinct_slots": distinct,
                   "weight_bytes_ratio": round(distinct / (t * TOP_K), 3)}
            h = moe_gate_up(x, ids, pool, layout)  # autotunes the per-pair kernels (the dedup ones read them)
            y = torch.zeros(t, TOP_K, hidden, device=dev)
            moe_down(h, ids, weights, pool, layout, partials=y)
            h_dd = moe_gate_up_dedup(x, ids, pool, layout)
            y_dd = moe_down_dedup(h, ids, weights, pool, layout)
            out = torch.empty_like(x)
            row["bitwise_equal"] = bool(torch.equal(h, h_dd) and torch.equal(y, y_dd) and torch.equal(
                fused_moe(x, ids, weights, pool, layout), fused_moe(x, ids, weights, pool, layout, dedup=True)))
            row["gate_up_us"] = timer(lambda x=x, ids=ids, h=h: moe_gate_up(x, ids, pool, layout, out=h))
            row["down_us"] = timer(lambda h=h, ids=ids, w=weights, y=y: moe_down(h, ids, w, pool, layout, partials=y))
            row["sum_us"] = timer(lambda y=y, out=out: moe_sum(y, out))
            for pairs in (None, 1, 2, 3, 4):
                tag = "" if pairs is None else f"_p{pairs}"
                row[f"gate_up_dedup{tag}_us"] = timer(lambda x=x, ids=ids, h=h_dd, p=pairs: moe_gate_up_dedup(
                    x, ids, pool, layout, out=h, pairs=p))
                row[f"down_dedup{tag}_us"] = timer(lambda h=h, ids=ids, w=weights, y=y_dd, p=pairs: moe_down_dedup(
                    h, ids, w, pool, layout, partials=y, pairs=p))
            row["layer_us"] = timer(lambda x=x, ids=ids, w=weights, out=out: fused_moe(x, ids, w, pool, layout,
                                                                                       out=out))
            row["layer_dedup_us"] = timer(lambda x=x, ids=ids, w=weights, out=out: fused_moe(
                x, ids, w, pool, layout, out=out, dedup=True))
            row = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
            points.append(row)
            print(row, flush=True)
    return points


def pair_order_points(tokens: list[int], dev: str = "cuda", experts: int = 256, timer=None) -> list[dict]:
    """The decode graphs' per-pair MoE GEMVs (moe_gate_up, moe_down's partials) on one layer's pairs in three
    launch orders, the kernels unchanged (Qwen3.6 shapes, block FP8, 8 of 256 experts + the shared one):

    * `launched`: [T, K + 1] as the decode step launches them (the pair index runs fastest in the grid, so
      programs that run together are different tokens' pairs, mostly different experts);
    * `sorted`: the same pairs flattened to [P, 1] and sorted by slot, so the pairs of one expert are adjacent
      in the grid and the second and later reads of a shared weight tile can come from L2 (50 MB on the H200);
    * `shuffled`: flattened to [P, 1] in a random order: the control for the [P, 1] launch shape itself.

    Why: at bs16 ~100 distinct experts serve 144 pairs a layer, and the per-pair GEMVs stream every pair's expert
    from HBM (docs/fast-decode.md: the next bs16 idea). If `sorted` beats `launched` and `shuffled` ties it, a
    permutation written beside the slot ids would pay. The rows time the GEMVs only: building the permutation
    (a sort of P slot ids) and gathering x would add to `sorted`. `max_rel_diff`: `sorted`'s partials put back in
    pair order against `launched`'s, relative to their largest value (the [P, 1] shape has its own autotune key,
    so the tile, and the bits, may differ). dev/experts/timer let a CPU test run the same code at tiny shapes."""
    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.kernels.moe_down import moe_down
    from adapters.kernels.moe_gate_up import moe_gate_up
    from domain.model_spec import WeightFormat

    timer = timer or _timed
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, HIDDEN, INTER, torch.bfloat16)
    pool = random_pool(layout, dev)
    gen = torch.Generator(device=dev).manual_seed(5)
    slot_map = torch.randperm(SLOTS, device=dev, generator=gen)[:experts + 1].to(torch.int32)  # key E: shared
    points = []
    for t in tokens:
        x, keys, weights = decode_layer_inputs(t, experts, gen, dev)
        slot_ids = slot_map[keys]  # [T, K+1] int32
        pairs = slot_ids.numel()
        flat = slot_ids.reshape(-1)
        token_of = torch.arange(t, device=dev).repeat_interleave(TOP_K)  # [P]
        orders = {"sorted": torch.sort(flat, stable=True).indices,
                  "shuffled": torch.randperm(pairs, device=dev, generator=gen)}
        row = {"tokens": t, "pairs": pairs, "distinct_experts": int(torch.unique(flat).numel())}
        h = moe_gate_up(x, slot_ids, pool, layout)  # [T, K, I]; autotunes on CUDA
        y = torch.zeros(t, TOP_K, HIDDEN, device=dev, dtype=torch.float32)
        row["launched_gate_up_us"] = timer(lambda x=x, s=slot_ids, h=h: moe_gate_up(x, s, pool, layout, out=h))
        row["launched_down_us"] = timer(lambda h=h, s=slot_ids, w=weights, y=y: moe_down(h, s, w, pool, layout,
                                                                                       partials=y))
        for name, perm in orders.items():
            xs = x[token_of[perm]]  # [P, H]: each pair's token row, in the new order
            ss = flat[perm].reshape(pairs, 1).contiguous()  # [P, 1]
            ws = weights.reshape(-1)[perm].reshape(pairs, 1).contiguous()
            hs = moe_gate_up(xs, ss, pool, layout)  # [P, 1, I]; its own autotune key (K = 1)
            ys = torch.zeros(pairs, 1, HIDDEN, device=dev, dtype=torch.float32)
            row[f"{name}_gate_up_us"] = timer(lambda xs=xs, ss=ss, hs=hs: moe_gate_up(xs, ss, pool, layout, out=hs))
            row[f"{name}_down_us"] = timer(lambda hs=hs, ss=ss, ws=ws, ys=ys: moe_down(hs, ss, ws, pool, layout,
                                                                                     partials=ys))
            if name == "sorted":
                back = torch.empty_like(ys)
                back[perm] = ys
                ref = y.reshape(pairs, HIDDEN)
                row["max_rel_diff"] = float((back.reshape(pairs, HIDDEN) - ref).abs().max()
                                            / ref.abs().max().clamp_min(1e-30))
        for name in ("launched", *orders):
            row[f"{name}_us"] = row[f"{name}_gate_up_us"] + row[f"{name}_down_us"] \
                if isinstance(row[f"{name}_gate_up_us"], float) and isinstance(row[f"{name}_down_us"], float) else None
        points.append(row)
        print(row, flush=True)
    return points


# The state walk's A/B (--only gdn-walk; docs/prefill-kernels.md, "The state walk's launch configuration"):
# (BLOCK_V, num_warps, num_stages of the chunk loop), today's launch first (32x8x1 since session 27: 1.79x the
# walk of 16x8x1 on an H100). The others are those of BLOCK_V {16, 32} x warps {4, 8} x stages {1, 2, 3} whose
# sm_90 build (bf16 model, over a span table: what the prefill launches) spills at most GDN_WALK_SPILL_BOUND bytes
# a thread under both Triton 3.6 (the device's) and 3.9 (measured 2026-12-05, session 25; 3.6 / 3.9 in this
# order: 160 / 168, 0 / 24, 160 / 96, 80 / 152). The bound is the 168 B the kernel's comment recorded for the
# 16-column launch over one sequence (Triton 3.9), not its 0 B over a span table at 3.6: that would have left no
# candidate. Every 4-warp build spills 264 B or more, every BLOCK_V 32
# build with stages 256 B or more. tests/adapters/test_gdn_walk_launch.py's slow test keeps them within it.
GDN_WALK_CONFIGS = ((32, 8, 1), (16, 8, 1), (16, 8, 2), (16, 8, 3))
GDN_WALK_SPILL_BOUND = 168  # bytes a thread of ptxas spill stack (cuobjdump's STACK)
GDN_WALK_TOKENS = (4096, 8192)


def _walk_config(text: str) -> tuple[int, int, int]:
    """'32x8x2' -> (block_v 32, num_warps 8, num_stages 2)."""
    parts = text.lower().split("x")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"a walk config is BLOCK_VxWARPSxSTAGES (e.g. 32x8x2), got {text!r}")
    return tuple(int(v) for v in parts)


def gdn_walk_points(tokens=GDN_WALK_TOKENS, configs=GDN_WALK_CONFIGS, dev: str = "cuda", timer=None,
                    geometry=QWEN36_GDN, window: int | None = None, precise: bool = False) -> list[dict]:
    """The Gated DeltaNet state walk at each launch configuration (block_v, num_warps, num_stages), one row per
    (prompt length, config). Each prompt is one sequence walked as the fast path's prefill does it
    (gdn_launch_ab.prompt_walk: gdn_chunk_wy over its chunk table, then per window of `window` tokens
    (prefill.GDN_WINDOW) one gdn_chunk_state over a span table and one gdn_chunk_out); bf16-model products
    (one TF32 pass) unless precise. `walk_us`: all of a prompt's walk launches, the reset of u and the state
    they overwrite (`reset_us`, timed alone) taken off; `wy_us` / `out_us`: the other two kernels, the same for
    every config (context). `max_rel_diff`: v', the last window's entry states and the final state against the
    default config's, relative to their largest value (0 or fp32 rounding: the same operations per element).
    `compiled`: the walk binary's registers, spill and shared memory as loaded (None if unknown).
    dev/timer/geometry/window let a CPU test run the same code at tiny shapes in Triton's interpreter."""
    from adapters.kernels import gdn_chunk_state as walk_mod
    from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy

    timer = timer or _timed
    default, configs = with_default_first(walk_mod, configs)
    gen = torch.Generator(device=dev).manual_seed(6)
    points, stats = [], {}  # stats: config -> its binary's compiled_stats, taken when it first compiles
    for t in tokens:
        p = prompt_walk(t, geometry, window, precise, dev, gen)

        def run_walk(cfg, p=p):
            first_build(stats, cfg, walk_mod._gdn_chunk_state_kernel, lambda: walk(p, cfg))

        def run_out(p=p):
            for _, _, chunk0, chunks in p.launches:
                out_window(p, chunk0, chunks)

        context = {"wy_us": timer(lambda p=p: gdn_chunk_wy(*p.wy_args, precise=precise, chunks=p.chunk_table))}
        p.reset()
        run_walk(default)
        ref = (p.u.clone(), p.hs.clone(), p.state.clone())  # the default's v', last window's entry states, final state
        context["out_us"] = timer(run_out)
        context["reset_us"] = timer(p.reset)
        base_us = None
        for cfg in configs:
            block_v, warps, stages = cfg
            row = {"tokens": t, "block_v": block_v, "num_warps": warps, "num_stages": stages,
                   "default": tuple(cfg) == default,
                   "programs": p.nv * -(-p.dv // walk_mod.tiles(p.dk, p.dv, block_v)[1]),
                   "launches": len(p.launches), "chunks": -(-t // 64)}
            try:
                p.reset()
                run_walk(cfg)
                row["max_rel_diff"] = {name: max_rel(got, want)
                                       for name, got, want in zip(("v_new", "hs", "state"), (p.u, p.hs, p.state),
                                                                  ref, strict=True)}
            except Exception as exc:  # a config that does not build or launch is a result, not the end of the run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                points.append({**row, **context})
                print(points[-1], flush=True)
                continue
            row["compiled"] = stats.get(cfg)
            total = timer(lambda cfg=cfg, p=p: (p.reset(), run_walk(cfg)))
            if isinstance(total, float) and isinstance(context["reset_us"], float):
                row["walk_us"] = round(total - context["reset_us"], 2)
                row["us_per_chunk_step"] = round(row["walk_us"] / row["chunks"], 3)
                if row["default"]:
                    base_us = row["walk_us"]
                # None where either difference is not positive (noise at tiny sizes, a fake timer)
                row["speedup_vs_default"] = round(base_us / row["walk_us"], 3) if base_us and row["walk_us"] > 0 else None
            else:
                row["walk_us"] = total
            points.append({**row, **context})
            print(points[-1], flush=True)
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16])
    p.add_argument("--variants", default=None, help="package with *_v0 copies of the kernels to compare")
    p.add_argument("--route-rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8, 16],
                   help="row counts of the router + lookup A/B (the fused kernel's crossover)")
    p.add_argument("--walk-configs", type=lambda s: [_walk_config(v) for v in s.split(",")],
                   default=list(GDN_WALK_CONFIGS),
                   help="gdn-walk: the state walk's launches as BLOCK_VxWARPSxSTAGES, comma-separated (today's "
                        "16x8x1 always runs first)")
    p.add_argument("--walk-tokens", type=lambda s: [int(v) for v in s.split(",")], default=list(GDN_WALK_TOKENS),
                   help="gdn-walk, gdn-out: prompt lengths (one sequence each)")
    p.add_argument("--out-configs", type=lambda s: [_walk_config(v) for v in s.split(",")],
                   default=list(GDN_OUT_CONFIGS),
                   help="gdn-out: gdn_chunk_out's launches as BLOCK_VxWARPSxSTAGES, comma-separated (today's always "
                        "runs first)")
    p.add_argument("--only", choices=("fusions", "dedup", "grouped", "order", "crossover", "splitk-tiles",
                                      "gdn-walk", "gdn-out", "dense-prefill"),
                   default=None,
                   help="fusions: only the fused-vs-unfused decode kernels (about 30 s); dedup: only the per-pair "
                        "vs expert-deduplicated MoE GEMVs; grouped: only the per-pair vs grouped-by-expert MoE "
                        "layer at decode sizes, part by part; order: only the per-pair GEMVs launched as the "
                        "decode step does, sorted by expert, and shuffled; crossover: only the dense GEMV vs "
                        "split-K GEMM vs GEMM per row count (the MoE half of the crossover is slow); "
                        "splitk-tiles: only the split-K GEMM at every fixed tile, split, warp and stage count "
                        "(SPLITK_STUDY_TILES, 4-32 rows; ~4 min), against its autotuned launch and the GEMV; "
                        "gdn-walk: only the Gated DeltaNet state walk per launch configuration (--walk-configs, "
                        "--walk-tokens), with gdn_chunk_wy and gdn_chunk_out beside it (~1 min); gdn-out: only "
                        "the GDN output kernel per launch configuration (--out-configs, --walk-tokens; ~1 min); "
                        "dense-prefill: only the dense projections at prefill chunk sizes, dense_gemm against "
                        "cuBLAS bf16 on a dequantized copy, and the routed experts' grouped GEMMs against "
                        "torch._grouped_mm on bf16 experts (~2 min)")
    args = p.parse_args(argv)
    from adapters.kernels import dense_gemv, moe_down, moe_gate_up

    moe_mods = {"current": (moe_gate_up, moe_down)}
    dense_mods = {"current": dense_gemv}
    if args.variants:
        v = lambda name: importlib.import_module(f"{args.variants}.{name}")  # noqa: E731
        moe_mods["v0"] = (v("moe_gate_up_v0"), v("moe_down_v0"))
        dense_mods["v0"] = v("dense_gemv_v0")
    record = {"kind": "bench_kernels", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "hardware": hardware_profile("cuda"), "args": vars(args)}
    if args.only in (None, "dedup"):
        record["dedup"] = dedup_points(args.tokens if args.only is None else sorted({1, 4, 8, 16, *args.tokens}))
    if args.only in (None, "grouped"):
        record["grouped_decode"] = grouped_decode_points(sorted({1, 4, 8, 16, *args.tokens}))
    if args.only in (None, "order"):
        record["pair_order"] = pair_order_points(sorted({1, 4, 8, 16, *args.tokens}))
    if args.only in (None, "fusions"):
        record["fusions"] = fusion_points(args.tokens)
        record["route_lookup"] = route_lookup_points(args.route_rows)
    if args.only is None:
        record.update(moe=moe_points(moe_mods, args.tokens), dense=dense_points(dense_mods),
                      crossover=crossover_points())
    elif args.only == "crossover":
        record["crossover"] = crossover_points(moe=False)
    elif args.only == "splitk-tiles":
        record["splitk_tiles"] = splitk_tile_points()
    elif args.only == "gdn-walk":
        record["gdn_walk"] = gdn_walk_points(args.walk_tokens, args.walk_configs)
    elif args.only == "dense-prefill":
        record["dense_prefill"] = dense_prefill_points()
        record["moe_prefill"] = moe_prefill_points()
    elif args.only == "gdn-out":
        record["gdn_out"] = gdn_out_points(_timed, args.walk_tokens, args.out_configs)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_kernels.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
