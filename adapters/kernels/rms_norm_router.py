"""The MoE block's entry in one launch: residual add + RMSNorm (rms_norm.py's numerics) and the fp32 router
GEMV on the normalised row, logits = norm(x + residual).float() @ router^T.

Shape legend: T rows, D hidden (normalised width), E experts, BR rows per program, BE experts per program,
BH columns per step.

Why: the decode step ran the norm (one launch), then the router as a cuBLAS fp32 GEMV (`gemvx`, ~3 us
for a 2 MiB [256, 2048] matrix on the H200, launch-bound), 40 times a step. Here program (row block,
e-block) computes each of its BR rows' statistics over the whole row (one row at a time, rms_norm's
reduction), then streams BE router rows against the BR normalised rows, rebuilt chunk by chunk from x and
residual (L1/L2 hits) with the very operations that produced the stored output, so the logits read exactly
the values `out` holds, widened to fp32 (what the router read before: the norm's fp32 copy). The programs
of e-block 0 store the sums and the normalised rows.
Row blocks: with one row a program (BR = 1) each row's programs read the whole router, T reads of it per
launch from L2 (2 MiB at the Qwen3.6 shape: 32 MiB at T = 16). Measured on the H100 (docs/bench/
2026-12-06-s34-h100-decode-resident-adr27.json): 307 us a step at T = 16 (40 launches, ~7.7 us each)
against 138 us at T = 1. A program applies each router tile it loads to all its BR rows, so the router is
read cdiv(T, BR) times a launch (2 MiB at T = 16 with BR = 16); the rows' x and residual are still read
once per e-block. Predicted, not measured: the 8-16 row buckets pick a BR > 1 tile and get cheaper; the
one-row bucket keeps a BR = 1 tile (the code it ran before, a unit row axis added).

Grid (cdiv(T, BR), cdiv(E, BE)), from shapes only (graph-capturable). The tile is chosen per (T, D, E) by
measurement on CUDA (triton.autotune over TUNE_TILES), because one fixed tile cannot suit both ends of the
decode buckets. Measured on the H200 with the old fixed BE=4, BH=512 (run 6, 2026-12-01, Qwen3.6): at
batch 1 the kernel cost 6.7 us a launch (266 us a step) where the norm + cuBLAS gemvx it replaced cost
~57 us a step less, while at batch 16 it won. At T=1 that tile gives only 64 programs (256 / 4) for 132
SMs, each streaming 4 router rows (32 KiB fp32) one after the other behind its own statistics pass: a
latency chain, not bandwidth. BE=1 or 2 gives 256 or 128 programs at T=1 (every SM busy, one or two
8 KiB rows each); at T=16 the grid is large anyway and bigger BE amortise the per-program statistics
(and BR > 1 the router reads, above).
Expected (not yet measured): bs1 picks BE <= 2 (grid >= 128 programs) and drops below the unfused pair;
bs16 keeps a BE >= 4 tile. scripts/bench_kernels.py records the chosen tile per T.
Tuning never runs inside a CUDA graph capture: the executor's eager warm-up step per decode bucket
(CudaGraphExecutor._capture) launches this kernel at every bucket's T first; a launch that would tune
during a capture runs the default tile instead (with a warning), so a missed warm-up costs speed, never a
start. All tiles of one D run the same warp count (rms_norm.py's rule) and every BR reduces one row at a
time at rms_norm's BLOCK_D, so the statistics, and so `total` and `out`, have the same bits under every tile
(NOTE: the engine's bitwise-identical output across pool sizes rests on it: other paths run rms_norm); only
the logits' summation order depends on the tile (within the tolerance below, at every batch size).
"""

import functools
import logging

import torch
import triton
import triton.language as tl

from adapters.kernels.rms_norm import norm_warps

log = logging.getLogger(__name__)


@triton.jit
def _normed(x_ptr, res_ptr, w_ptr, row_off, offs, mask, rstd, SUM_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
            UNIT_OFFSET: tl.constexpr):
    """(x + res rounded to SUM_DTYPE, its normalised value rounded to OUT_DTYPE) at columns offs [BD] of one
    row (row_off, rstd scalars) or of several (row_off, rstd [BR, 1]: results [BR, BH]): the same element-wise
    operations as _rms_norm_kernel, so every call gives the same bits for a column."""
    s = (tl.load(x_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)).to(SUM_DTYPE)
    xn = s.to(tl.float32) * rstd
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        y = xn * (1.0 + w)
    else:
        y = xn.to(OUT_DTYPE).to(tl.float32) * w
    return s, y.to(OUT_DTYPE)


# T (rows) is the autotune key and bounds the last row block; not specialised on, so its value never compiles
# another variant
@triton.jit(do_not_specialize=["T"])
def _rms_norm_router_kernel(x_ptr, res_ptr, w_ptr, r_ptr, sum_ptr, out_ptr, logits_ptr, T, D, E, eps,
                            UNIT_OFFSET: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    rb = tl.program_id(0)
    eb = tl.program_id(1)
    SUM_DTYPE: tl.constexpr = sum_ptr.dtype.element_ty
    OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    r_idx = tl.arange(0, BLOCK_R)  # [BR]
    rstd = tl.zeros((BLOCK_R,), dtype=tl.float32)  # [BR]
    # NOTE: one 1-D reduction per row, rms_norm's code at its BLOCK_D and warp count, so every row's rstd
    # (and so `total` and `out`) has rms_norm's bits whatever BLOCK_R; a [BR, BD] reduction would sum in
    # another order. Rows past T repeat row T-1 (in bounds, never stored).
    for i in tl.static_range(BLOCK_R):
        row = tl.minimum(rb * BLOCK_R + i, T - 1)
        row_off = row.to(tl.int64) * D
        s = (tl.load(x_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)
             + tl.load(res_ptr + row_off + offs, mask=mask, other=0.0).to(tl.float32)).to(SUM_DTYPE)
        sf = s.to(tl.float32)
        row_rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / D + eps)
        if (eb == 0) & (rb * BLOCK_R + i < T):
            total, y = _normed(x_ptr, res_ptr, w_ptr, row_off, offs, mask, row_rstd, SUM_DTYPE, OUT_DTYPE,
                               UNIT_OFFSET)
            tl.store(sum_ptr + row_off + offs, total, mask=mask)
            tl.store(out_ptr + row_off + offs, y, mask=mask)
        rstd = tl.where(r_idx == i, row_rstd, rstd)
    rows = rb * BLOCK_R + r_idx  # [BR]
    rows_off = tl.minimum(rows, T - 1).to(tl.int64)[:, None] * D  # [BR, 1]
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
    e_ok = offs_e < E
    acc = tl.zeros((BLOCK_R, BLOCK_E, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, D, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)  # [BH]
        h_ok = offs_h < D
        # element-wise, so the same bits as the stored `out` whatever the [BR, BH] layout
        _, y = _normed(x_ptr, res_ptr, w_ptr, rows_off, offs_h, h_ok, rstd[:, None], SUM_DTYPE, OUT_DTYPE,
                       UNIT_OFFSET)  # [BR, BH]
        # the router tile is read once per step for all BR rows: the router crosses L2 cdiv(T, BR) times. Loaded
        # 3-D so the accumulator takes the load's layout (a [BE, BH] load expanded to 3-D was converted every
        # step in the sm_90 build; now only the smaller y is, as in the one-row form)
        r = tl.load(r_ptr + offs_e[None, :, None].to(tl.int64) * D + offs_h[None, None, :],
                    mask=e_ok[None, :, None] & h_ok[None, None, :], other=0.0)  # [1, BE, BH] fp32
        acc += r * y.to(tl.float32)[:, None, :]
    logits = tl.sum(acc, axis=2)  # [BR, BE]
    tl.store(logits_ptr + rows.to(tl.int64)[:, None] * E + offs_e[None, :], logits,
             mask=(rows < T)[:, None] & e_ok[None, :])


DEFAULT_BLOCK_R, DEFAULT_BLOCK_E, DEFAULT_BLOCK_H = 1, 4, 512  # the interpreter's tile; given tiles' defaults
# (BR, BE, BH) tried on CUDA, once per (T, D, E, dtypes) before any graph capture. One row a program: BE 1-2
# for the one-row buckets (>= 128 programs at E = 256), the old fixed 4 x 512, larger BE for the 8-16 row
# buckets (fewer programs repeating the row statistics). Row blocks for the 4-16 row buckets (pruned where
# BR > T): the router crosses L2 cdiv(T, BR) times instead of T; BE 2-8 (64-512 programs at T 16, E 256),
# BR x BE x BH <= 8192 fp32 accumulators (<= 64 a thread at 4 warps; no spills in sm_90 builds at D 2048,
# Triton 3.6 and 3.9).
# Each at rms_norm.py's warp count for D only (see tune_warps).
TUNE_TILES = ((1, 1, 512), (1, 1, 1024), (1, 2, 512), (1, 2, 1024), (1, 4, 512), (1, 8, 256), (1, 8, 512),
              (1, 16, 256), (4, 2, 512), (4, 4, 512), (4, 8, 256), (8, 2, 512), (8, 4, 256), (16, 2, 256),
              (16, 4, 128))


def tune_warps(d: int) -> int:
    """Warps per program at width d, for every tile: rms_norm's own (norm_warps), so the row statistics
    reduce in the same order as rms_norm's whatever the tile."""
    return norm_warps(d)


def _prune(configs, named_args, **kwargs):
    """The tiles at D's warp count with BR <= T (a larger row block only repeats row T-1) whose BH does not
    pass the padded row (a wider step only masks); for a row narrower than every BH (tiny test models), those
    of the narrowest BH."""
    warps = [c for c in configs if c.num_warps == tune_warps(named_args["D"])
             and c.kwargs["BLOCK_R"] <= named_args["T"]]
    fit = [c for c in warps if c.kwargs["BLOCK_H"] <= kwargs["BLOCK_D"]]
    return fit or [c for c in warps if c.kwargs["BLOCK_H"] == min(w.kwargs["BLOCK_H"] for w in warps)]


_TUNED = triton.autotune(
    configs=[triton.Config({"BLOCK_R": br, "BLOCK_E": be, "BLOCK_H": bh}, num_warps=w) for br, be, bh in TUNE_TILES
             for w in (4, 8)],
    key=["T", "D", "E"],  # + every tensor argument's dtype (Triton adds them; see tune_key)
    prune_configs_by={"early_config_prune": _prune},
    cache_results=True,  # a restart on this machine reads the tunings from Triton's cache dir
)(_rms_norm_router_kernel)


def tune_key(x: torch.Tensor, weight: torch.Tensor, router: torch.Tensor) -> tuple:
    """The key triton.autotune files a launch on x [T, D] under (Triton 3.x: the `key` arguments' values,
    then str(dtype) of each tensor argument in order: x, residual, weight, router, sum, out, logits)."""
    act = str(x.dtype)
    return (x.shape[0], x.shape[1], router.shape[0], act, act, str(weight.dtype), str(router.dtype), act, act,
            str(torch.float32))


def tuned_tile(x: torch.Tensor, weight: torch.Tensor, router: torch.Tensor) -> dict | None:
    """{"block_r", "block_e", "block_h", "num_warps"} the autotuner chose for a launch on these shapes and
    dtypes, or None while that key is untuned (always None off CUDA, where the default tile runs)."""
    key = tune_key(x, weight, router)
    cfg = _TUNED.cache.get(key)
    if cfg is None:  # another Triton's key layout: match on the key values (T, D, E) and x's dtype
        cfg = next((c for k, c in _TUNED.cache.items() if tuple(k[:3]) == key[:3] and key[3] in k[3:]), None)
    if cfg is None:
        return None
    return {"block_r": cfg.kwargs["BLOCK_R"], "block_e": cfg.kwargs["BLOCK_E"],
            "block_h": cfg.kwargs["BLOCK_H"], "num_warps": cfg.num_warps}


def _tunes(x: torch.Tensor) -> bool:
    """Whether a launch without a given tile is autotuned: on CUDA only (the interpreter runs the default)."""
    return x.is_cuda


@functools.cache
def _warn_untuned(t: int, d: int, e: int, dtype: torch.dtype) -> None:
    log.warning("rms_norm_router: no tuned tile for T=%d, D=%d, E=%d (%s) inside a CUDA graph capture; "
                "the default %dx%dx%d tile runs in this graph", t, d, e, dtype, DEFAULT_BLOCK_R, DEFAULT_BLOCK_E,
                DEFAULT_BLOCK_H)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def rms_norm_router(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, router: torch.Tensor,
                    eps: float, *, unit_offset: bool, block_r: int | None = None, block_e: int | None = None,
                    block_h: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + residual, norm(x + residual), logits fp32 [T, E]) for x, residual [T, D] (same dtype).

    The first two are rms_norm(x, weight, eps, unit_offset=..., residual=residual)'s, in x.dtype; logits =
    norm(...).float() @ router^T with fp32 accumulation (order the kernel's own, set by the tile: within
    ~1e-6 relative of torch's F.linear). weight [D] (any float dtype); router fp32 [E, D] contiguous.
    block_r: rows per program, block_e: router rows per program, block_h: columns per step (powers of two).
    None given on CUDA: the measured best tile for (T, D, E) and the dtypes (TUNE_TILES; tuned on the first
    launch of a key, which must not be inside a CUDA graph capture); otherwise the given tile, the missing
    sides from the default 1 x 4 x 512.
    An untuned key met during a CUDA graph capture runs the default tile (a warning; the executor's eager
    warm-up step per bucket tunes every key first).
    Raises ValueError on mismatched shapes or dtypes or a block size that is not a power of two.
    """
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"x and residual must be [T, D] of one dtype, got {x.dtype} {tuple(x.shape)} and "
                         f"{residual.dtype} {tuple(residual.shape)}")
    t, d = x.shape
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    if router.dim() != 2 or router.shape[1] != d or router.dtype != torch.float32 or not router.is_contiguous():
        raise ValueError(f"router must be a contiguous fp32 [E, {d}], got {router.dtype} {tuple(router.shape)}")
    tuned = _tunes(x) and block_r is None and block_e is None and block_h is None
    block_r = DEFAULT_BLOCK_R if block_r is None else block_r
    block_e = DEFAULT_BLOCK_E if block_e is None else block_e
    block_h = DEFAULT_BLOCK_H if block_h is None else block_h
    for name, v in (("block_r", block_r), ("block_e", block_e), ("block_h", block_h)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    e = router.shape[0]
    x, residual = x.contiguous(), residual.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    if not t:
        return total, out, logits
    args = (x, residual, weight, router, total, out, logits, t, d, e, eps)
    block_d = triton.next_power_of_2(d)
    if tuned and _capturing() and tuned_tile(x, weight, router) is None:
        # never benchmark inside a capture (the timing launches would be recorded into the graph); the
        # executor's eager warm-up step tunes every bucket first, so this is a missed warm-up: run the
        # default tile, correct and capturable, and say so once
        _warn_untuned(t, d, e, x.dtype)
        tuned = False
    if tuned:
        _TUNED[lambda meta: (triton.cdiv(t, meta["BLOCK_R"]), triton.cdiv(e, meta["BLOCK_E"]))](
            *args, UNIT_OFFSET=unit_offset, BLOCK_D=block_d)
    else:
        _rms_norm_router_kernel[(triton.cdiv(t, block_r), triton.cdiv(e, block_e))](
            *args, UNIT_OFFSET=unit_offset, BLOCK_D=block_d, BLOCK_E=block_e, BLOCK_H=min(block_h, block_d),
            BLOCK_R=block_r, num_warps=tune_warps(d))
    return total, out, logits
