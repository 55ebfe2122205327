"""Tensor-core operand tiles of a quantized weight matrix (Triton device functions shared by the prefill
GEMMs: dense_gemm, moe_grouped_gate_up, moe_grouped_down). No kernel of its own.

Shape legend: N rows of a tile (BLOCK_N), BK columns per K step (BLOCK_K), ROWS x COLS the matrix,
G columns per scale group.
Formats: the FMT codes of packed_gemv.FORMAT_CODES (0 float, 1 FP8 block, 2 FP8 tensor, 3 FP8 channel,
4 INT8 channel, 5 NVFP4, 6 MXFP4), canonical forms of adapters/checkpoint/quant.py.

Split of the dequantization so that the tile fed to tl.dot is EXACT in bf16 (no rounding added):
  * the tile (w_tile) carries the raw values (e4m3 and int8 are subsets of bf16) or, for the 4-bit
    formats, e2m1 x group scale (at most 5 significant bits: exact in bf16);
  * a block-FP8 scale is one scalar per (128-row, 128-column) block: the caller multiplies the dot of
    each K step by it (block_scale; needs BLOCK_K == 128 and BLOCK_N dividing 128);
  * scales constant along a row (tensor, channel, NVFP4 global) are applied once after the K loop
    (row_scale).

Weight as the left operand (W_LHS, the kernels' constexpr; bf16/fp16 activations, not the A8 path): the
kernels may compute the transposed tile acc_t [N, M] = w [N, BK] @ a[M, BK]^T (dot_step_t). On sm_90 Triton
then keeps the converted weight tile in registers as the wgmma A operand (no write back to shared memory) and
waits for each wgmma one K step later (async), overlapping the tensor cores with the next tile's loads and
conversion. A per-step scale on the dot result would force the wait, so under W_LHS the block-FP8 scale is
folded into the tile instead (w_tile_folded: fp32 e4m3 x scale, rounded once to the activations' dtype): the
reference's own rounding (adapters/checkpoint/quant.py `_dequant_cols`: `(values * scale).to(dtype)`), element
for element; the one exception to the exact split above (the other formats' tiles are the same in both
arrangements). row_scale_t applies the per-row scales to the transposed accumulator (W's rows are its rows).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from adapters.kernels.packed_gemv import _e2m1, _e8m0, _group_scaled


@triton.jit
def w_tile(data_ptr, scale_ptr, n, k0, ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr,
           GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """[N, BK] tile of W[n, k0:k0+BK] in OUT_DTYPE; zeros outside the matrix.

    data_ptr: typed pointer to the data ([ROWS, COLS] elements, or uint8 [ROWS, COLS/2] for 4-bit);
    scale_ptr: typed pointer to the scales (fp32 for FMT 1-4, e4m3 [ROWS, COLS/16] for NVFP4, uint8 e8m0
    [ROWS, COLS/32] for MXFP4; unused for FMT 0-4 here). n: int32 row indices [N].
    """
    n_ok = n < ROWS  # [N]
    kk = k0 + tl.arange(0, BLOCK_K)  # [BK]
    if FMT == 5 or FMT == 6:
        jb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte j holds columns 2j (low nibble) and 2j+1 (high)
        b_ok = n_ok[:, None] & (jb < COLS // 2)[None, :]
        b = tl.load(data_ptr + n[:, None].to(tl.int64) * (COLS // 2) + jb[None, :], mask=b_ok, other=0)
        w = tl.reshape(_e2m1(tl.join(b & 15, b >> 4)), (BLOCK_N, BLOCK_K))  # [N, BK] fp32
        gi = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s_ok = n_ok[:, None] & (gi < COLS // GROUP)[None, :]
        s_off = n[:, None].to(tl.int64) * (COLS // GROUP) + gi[None, :]  # [N, BK/G]
        if FMT == 5:
            s = tl.load(scale_ptr + s_off, mask=s_ok)
            s = tl.where(s_ok, s.to(tl.float32), 0.0)
        else:
            s = tl.where(s_ok, _e8m0(tl.load(scale_ptr + s_off, mask=s_ok, other=0)), 0.0)
        return _group_scaled(w, s, BLOCK_N, BLOCK_K, GROUP).to(OUT_DTYPE)
    else:
        w_ok = n_ok[:, None] & (kk < COLS)[None, :]
        # no `other`: the interpreter cannot cast a fill value to fp8; masked lanes are zeroed after
        w = tl.load(data_ptr + n[:, None].to(tl.int64) * COLS + kk[None, :], mask=w_ok)  # [N, BK]
        if FMT == 4:  # int8 through fp32: the interpreter's int8 -> bf16 cast is a bit copy
            w = w.to(tl.float32)
        return tl.where(w_ok, w.to(OUT_DTYPE), 0.0)


@triton.jit
def block_scale(scale_ptr, n0, k0, COLS: tl.constexpr, GROUP: tl.constexpr):
    """fp32 scale of the 128x128 block holding W[n0, k0] (block FP8; scale_ptr fp32 [ceil(ROWS/128),
    ceil(COLS/128)])."""
    kb: tl.constexpr = (COLS + GROUP - 1) // GROUP
    return tl.load(scale_ptr + (n0 // GROUP) * kb + k0 // GROUP)


@triton.jit
def row_scale(acc, scale_ptr, gscale_ptr, n, ROWS: tl.constexpr, FMT: tl.constexpr):
    """acc [M, N] (fp32, columns = rows n of W) times the scales that are constant along a row of W."""
    if FMT == 2:
        acc = acc * tl.load(scale_ptr)
    elif FMT == 3 or FMT == 4:
        acc = acc * tl.load(scale_ptr + n, mask=n < ROWS, other=0.0)[None, :]
    elif FMT == 5:
        acc = acc * tl.load(gscale_ptr)
    return acc


@triton.jit
def dot_step(acc, a, w, FMT: tl.constexpr, s, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc [M, N] fp32 += a [M, BK] @ w[N, BK]^T (times the block-FP8 scalar s when FMT == 1).

    F32_DOT: both operands cast to fp32 first (Triton's interpreter computes bf16 dots wrongly)."""
    if F32_DOT:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if FMT == 1:
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION) * s
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def w_tile_folded(data_ptr, scale_ptr, n, k0, s, ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """w_tile with the block-FP8 scale s folded in when FMT == 1: (e4m3 in fp32 * s) rounded once to OUT_DTYPE,
    the reference's dequantization element for element (quant.py `_dequant_cols`); w_tile for the other
    formats (their scales are in the tile already or constant along a row: row_scale_t). [N, BK]."""
    if FMT == 1:
        kk = k0 + tl.arange(0, BLOCK_K)  # [BK]
        w_ok = (n < ROWS)[:, None] & (kk < COLS)[None, :]
        # no `other`: the interpreter cannot cast a fill value to fp8; masked lanes are zeroed after
        w = tl.load(data_ptr + n[:, None].to(tl.int64) * COLS + kk[None, :], mask=w_ok)  # [N, BK] e4m3
        return tl.where(w_ok, (w.to(tl.float32) * s).to(OUT_DTYPE), 0.0)
    else:
        return w_tile(data_ptr, scale_ptr, n, k0, ROWS, COLS, FMT, GROUP, BLOCK_N, BLOCK_K, OUT_DTYPE)


@triton.jit
def dot_step_t(acc_t, a, w, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc_t [N, M] fp32 += w [N, BK] @ a [M, BK]^T: the transposed tile, the weight as the left operand (on sm_90
    the wgmma A operand, kept in registers). Scales: folded into w (w_tile_folded) or after the loop
    (row_scale_t). F32_DOT: both operands cast to fp32 first (the interpreter)."""
    if F32_DOT:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(w, tl.trans(a), acc_t, input_precision=PRECISION)


@triton.jit
def weight_step(acc, a, data_ptr, scale_ptr, n, k0, s, ROWS: tl.constexpr, COLS: tl.constexpr, FMT: tl.constexpr,
                GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr,
                F32_DOT: tl.constexpr, PRECISION: tl.constexpr, W_LHS: tl.constexpr):
    """One K step of a dense GEMM tile from float rows a [M, BK] (dense_gemm's and dense_gemm_splitk's): the weight
    tile w [N, BK] of rows n at k0, then acc [M, N] += a @ w^T (dot_step, s the block-FP8 scale) or, under W_LHS,
    the transposed acc [N, M] += w @ a^T with s folded into w (w_tile_folded, dot_step_t)."""
    if W_LHS:
        w = w_tile_folded(data_ptr, scale_ptr, n, k0, s, ROWS, COLS, FMT, GROUP, BLOCK_N, BLOCK_K, OUT_DTYPE)
        acc = dot_step_t(acc, a, w, F32_DOT, PRECISION)
    else:
        w = w_tile(data_ptr, scale_ptr, n, k0, ROWS, COLS, FMT, GROUP, BLOCK_N, BLOCK_K, OUT_DTYPE)
        acc = dot_step(acc, a, w, FMT, s, F32_DOT, PRECISION)
    return acc


@triton.jit
def row_scale_t(acc_t, scale_ptr, gscale_ptr, n, ROWS: tl.constexpr, FMT: tl.constexpr):
    """row_scale for a transposed accumulator acc_t [N, M] (rows = rows n of W); the same products."""
    if FMT == 2:
        acc_t = acc_t * tl.load(scale_ptr)
    elif FMT == 3 or FMT == 4:
        acc_t = acc_t * tl.load(scale_ptr + n, mask=n < ROWS, other=0.0)[:, None]
    elif FMT == 5:
        acc_t = acc_t * tl.load(gscale_ptr)
    return acc_t


@triton.jit
def fp8_tile(data_ptr, n, k0, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[N, BK] e4m3 tile of W[n, k0:k0+BK] exactly as stored (FP8 formats 1-3, the W8A8 path); zeros outside the
    matrix. data_ptr: pointer to the e4m3 data, of any element type (read as bytes: the interpreter cannot
    cast a fill value to fp8)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    ok = (n < ROWS)[:, None] & (kk < COLS)[None, :]
    b = tl.load(data_ptr.to(tl.pointer_type(tl.uint8)) + n[:, None].to(tl.int64) * COLS + kk[None, :], mask=ok, other=0)
    return b.to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp8_rows(row_ptrs, kk, ok):
    """[M, BK] e4m3 activations at row_ptrs[:, None] + kk[None, :] (byte pointers), zeros where not ok."""
    return tl.load(row_ptrs[:, None] + kk[None, :], mask=ok, other=0).to(tl.float8e4nv, bitcast=True)


@triton.jit
def a8_dot_step(acc, a, w, scale, F32_DOT: tl.constexpr):
    """acc [M, N] fp32 + (a [M, BK] e4m3 @ w [N, BK]^T e4m3) * scale: FP8 x FP8 tensor-core products (wgmma
    k32 on sm_90), the step's fp32 sum scaled by the activations' group scale times the weight block's
    (scale [M, 1] or [M, N]). F32_DOT: exact fp32 operands instead (the interpreter)."""
    if F32_DOT:
        d = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        d = tl.dot(a, tl.trans(w))
    return acc + d * scale


A8_FORMATS = (1, 2, 3)  # FMT codes whose weight tiles are raw e4m3 (block, tensor, channel scales): W8A8-able


def dot_modes(x: torch.Tensor) -> dict:
    """Launch constants of dot_step for activations x: exact fp32 products ("ieee", not TF32) when x is
    fp32 (the fp32 parity bound), fp32 operands under the interpreter (no CUDA tensor)."""
    return {"F32_DOT": not x.is_cuda, "PRECISION": "ieee" if x.dtype == torch.float32 or not x.is_cuda else "tf32"}


def check_w_lhs(w_lhs: bool, a8: bool, where: str) -> None:
    """Refuses a fixed W_LHS launch the kernels do not run: with e4m3 activations (Fp8Rows: the W8A8 dot keeps
    the activations as its left operand). ValueError. (Tiles narrower than 16 rows the launchers refuse for both
    arrangements.)"""
    if not isinstance(w_lhs, bool):
        raise ValueError(f"{where}: w_lhs must be a bool, got {w_lhs!r}")
    if w_lhs and a8:
        raise ValueError(f"{where}: w_lhs does not apply to FP8 activations (Fp8Rows): the W8A8 path keeps the "
                         "activations as the left operand")


def scale_dtype(fmt_code: int) -> tl.dtype:
    """Element type w_tile reads scales as: e4m3 (NVFP4), uint8 e8m0 (MXFP4), fp32 otherwise."""
    return {5: tl.float8e4nv, 6: tl.uint8}.get(fmt_code, tl.float32)


# Tiles of the grouped MoE GEMMs tried on CUDA, (BLOCK_N, num_warps, num_stages); BLOCK_M is fixed by the
# alignment (moe_align) and BLOCK_K = 128 (one block-FP8 scale per step; BLOCK_N <= 128 divides 128).
# Tensor-core tiles (bf16/fp16 activations) and FMA tiles (fp32 activations: "ieee" dots become FMA loops
# unrolled over BLOCK_K = 128, so each accumulator costs many registers; the parity path, not the served one).
GROUPED_TILES = ((64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (32, 4, 4))
GROUPED_FMA_TILES = ((16, 4, 3), (32, 4, 3), (16, 8, 3), (32, 8, 3))
# W_LHS tiles (the weight as the wgmma A operand, module docstring): BLOCK_N is the wgmma M (>= 64), the
# alignment's BLOCK_M its N (16..128); tensor-core family only (bf16/fp16 activations, not A8: pruned there).
GROUPED_W_LHS_TILES = ((64, 4, 3), (64, 8, 3), (128, 4, 3), (128, 8, 3))
# NOTE: the W_LHS tiles join the autotuned configs (here, dense_gemm's and the split-K GEMM's) by default since session
# 25 timed them (H100, docs/bench/2026-12-05-h100-prefill-resident-wlhs{0,1}.json): the resident prefill +7.3 % at 4k
# and +5.4 % at 32k, the captured decode step unchanged within 1 % at bs1/4/16 (-decode-wlhs{0,1}.json); they won 25
# of the 39 tuned GEMM keys of a served start. FLUXTIDE_PREFILL_W_LHS=0 leaves them out (the A/B's control). Where one
# wins, block-FP8 weights round as the reference rounds them (module docstring), not as the unfolded tiles do.
def _w_lhs_tuning(value: str) -> bool:
    """FLUXTIDE_PREFILL_W_LHS: "1" (or unset: the default) or "0"; anything else is refused, not read as either.
    ValueError."""
    if value not in ("0", "1"):
        raise ValueError(f"FLUXTIDE_PREFILL_W_LHS must be 0 or 1, got {value!r}")
    return value == "1"


W_LHS_TUNING = _w_lhs_tuning(os.environ.get("FLUXTIDE_PREFILL_W_LHS", "1"))
GROUPED_BLOCK_K = 128
# Register budgets per thread (of 255) beyond which ptxas spills, measured for sm_90 with Triton 3.6's ptxas
# (scripts/compile_probe.py; tests/adapters/test_kernels_moe_grouped.py checks the admitted tiles):
MAX_ACC_PER_THREAD = 64  # fp32 accumulators of a tensor-core tile
MAX_FMA_ACC_PER_THREAD = 4  # per accumulator of an FMA tile: 8 spill 3 KB of stack (dense 32x32 or grouped down
#                             64x16 on 4 warps), 16 spill 4.5 KB (gate_up 64x16 on 4 warps)
MAX_W4_PER_THREAD = 64  # dequantized 4-bit weight elements per thread: 128 (BLOCK_N 128, 4 warps) spill 0.2-0.6 KB
MAX_W_LHS_PER_THREAD = 128  # W_LHS: converted weight elements held in registers per thread, all weight tiles together
#                             (Triton 3.9 ptxas, session 23): gate_up's two 128x128 tiles on 4 warps (256) spill
#                             136-272 B at BLOCK_M 16; down's one (128) does not
FOUR_BIT = (5, 6)


def grouped_configs(w_lhs: bool = W_LHS_TUNING) -> list:
    """The grouped GEMMs' autotuned configs: GROUPED_TILES and GROUPED_FMA_TILES, and GROUPED_W_LHS_TILES when
    w_lhs (by default unless FLUXTIDE_PREFILL_W_LHS=0)."""
    return ([triton.Config({"BLOCK_N": bn, "BLOCK_K": GROUPED_BLOCK_K, "W_LHS": False}, num_warps=w, num_stages=st)
             for bn, w, st in GROUPED_TILES + GROUPED_FMA_TILES]
            + [triton.Config({"BLOCK_N": bn, "BLOCK_K": GROUPED_BLOCK_K, "W_LHS": True}, num_warps=w, num_stages=st)
               for bn, w, st in (GROUPED_W_LHS_TILES if w_lhs else ())])


def _tile_key(c) -> tuple:
    return c.kwargs.get("BLOCK_M"), c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


def _w_lhs(c) -> bool:
    return bool(c.kwargs.get("W_LHS", False))


def prune_tiles(configs: list, fma_tiles: set, *, fma: bool, fmt: int, block_m, n_cols: int, k_cols: int,
                accumulators: int = 1, m_cap: int | None = None, a8: bool = False) -> list:
    """The autotune configs worth compiling for one GEMM shape (early_config_prune's work, shared by the three
    prefill GEMMs), in order, at least one:

    * fma (fp32 activations): only the FMA tiles (`fma_tiles`, keys (BLOCK_M or None, BLOCK_N, warps, stages)),
      else only the others; W_LHS tiles (config kwarg W_LHS) belong to the tensor-core family, never with a8
      (e4m3 activations: the W8A8 path keeps the activations as the left operand);
    * no tile wider than the problem: BLOCK_N <= max(16, next_pow2(n_cols)), BLOCK_M <= max(16, m_cap);
    * no tile that spills: accumulators * BLOCK_M * BLOCK_N per thread within MAX_ACC_PER_THREAD (tensor
      cores), BLOCK_M * BLOCK_N per thread within MAX_FMA_ACC_PER_THREAD (FMA), for the 4-bit formats
      the dequantized [BLOCK_N, BLOCK_K] weight tile within MAX_W4_PER_THREAD per thread, and for W_LHS tiles
      (whose weight tiles stay in registers as wgmma operands) accumulators * BLOCK_N * BLOCK_K per thread
      within MAX_W_LHS_PER_THREAD;
    * num_stages at most the K loop's trip count cdiv(k_cols, BLOCK_K) (more stages only prefetch nothing,
      and Triton's pipeliner is least exercised with a prologue longer than the loop).
    block_m: the fixed BLOCK_M (grouped GEMMs) or None (the config's). If nothing fits, the family's tile
    with the fewest accumulators per thread is kept (clamped likewise)."""
    family = [c for c in configs if (not _w_lhs(c) and _tile_key(c) in fma_tiles) == fma
              and not (a8 and _w_lhs(c))] or [c for c in configs if not _w_lhs(c)]
    # FMA tiles: the bound holds per accumulator (gate_up's two 16x32 tiles on 4 warps do not spill, one
    # 64x16 tile of down does); tensor-core tiles: for all accumulators together
    acc_cap = MAX_FMA_ACC_PER_THREAD * accumulators if fma else MAX_ACC_PER_THREAD

    def bm(c):
        return c.kwargs.get("BLOCK_M", block_m)

    def per_thread(c):
        return accumulators * bm(c) * c.kwargs["BLOCK_N"] / (32 * c.num_warps)

    n_cap = max(16, triton.next_power_of_2(n_cols))
    fits = [c for c in family
            if c.kwargs["BLOCK_N"] <= n_cap and (m_cap is None or bm(c) <= max(16, m_cap))
            and per_thread(c) <= acc_cap
            and (fmt not in FOUR_BIT or c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] / (32 * c.num_warps)
                 <= MAX_W4_PER_THREAD)
            and (not _w_lhs(c) or accumulators * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] / (32 * c.num_warps)
                 <= MAX_W_LHS_PER_THREAD)]
    if not fits:
        fits = [min(family, key=per_thread)]
    kept, seen = [], set()
    for c in fits:
        steps = max(1, -(-k_cols // c.kwargs["BLOCK_K"]))
        if c.num_stages > steps:
            c = triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=steps, num_ctas=c.num_ctas)
        if _tile_key(c) + (_w_lhs(c),) not in seen:
            seen.add(_tile_key(c) + (_w_lhs(c),))
            kept.append(c)
    return kept


def grouped_pruner(accumulators: int, n_dim: str, k_dim: str):
    """early_config_prune for a grouped GEMM with `accumulators` fp32 [BLOCK_M, BLOCK_N] accumulators (gate_up
    holds two) whose output columns are the constexpr `n_dim` and whose K loop runs over `k_dim`
    (prune_tiles at the alignment's BLOCK_M)."""
    fma_tiles = {(None, bn, w, st) for bn, w, st in GROUPED_FMA_TILES}

    def prune(configs, named_args, **kwargs):
        def arg(name):
            return kwargs[name] if name in kwargs else named_args[name]

        return prune_tiles(configs, fma_tiles, fma=arg("PRECISION") == "ieee", fmt=arg("FMT"),
                           block_m=arg("BLOCK_M"), n_cols=arg(n_dim), k_cols=arg(k_dim), accumulators=accumulators,
                           a8=bool(kwargs.get("A8", named_args.get("A8", False))))

    return prune
