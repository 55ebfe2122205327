"""Dense quantized GEMM for decode-sized M (at most MAX_ROWS rows): y = x @ dequant(W)^T on tensor
cores with the K loop split over SPLIT_K programs per output tile, the last of them adding the partials.

Shape legend: M rows of x (decode batch), K in features, N out features, S splits of K.
  x [M, K] bf16/fp16/fp32; W a QTensor [N, K] (any quantized format dense_gemm reads); y [M, N] in x.dtype.
Grid: (cdiv(M, 16) * cdiv(N, BLOCK_N) * SPLIT_K,). Program (tile, s) runs K steps [s*per, (s+1)*per) of
tile's [16, BLOCK_N] block (per = cdiv(cdiv(K, BLOCK_K), SPLIT_K)), the same dequantize-and-dot step as
dense_gemm (dequant_tile.py), and writes its fp32 partial to a workspace [S, M, N]. It then adds one to the
tile's arrival counter; the program that arrives last sums the S partials in order s = 0..S-1 (the same
order whichever program is last: deterministic), applies the row scales, writes y and zeroes the counter
for the next launch (so a captured graph replays it as is). Why: at 16 rows the one-program-per-tile
dense_gemm is bound by its serial K loop, not by HBM: ~0.8-1.1 us per 128-column step whatever the rows
(H200, docs/bench/2026-12-01-bench-kernels-h200.json: K = 4096, N = 2048 took 24-25 us at 1-16 rows for
8.4 MB of weights, 0.33 TB/s, on 128 programs for 132 SMs). Splitting K gives S times the programs and
1/S of the chain; the partials cost 4*S*M*N bytes, a few % of the weight bytes at decode M.
Split-K GEMMs with a last-arriving fix-up are the standard remedy for skinny GEMMs (CUTLASS's "serial
split-K" semaphore, stream-K's fix-up).

W_LHS (constexpr; its tiles join the autotuned configs unless FLUXTIDE_PREFILL_W_LHS=0, as dense_gemm's): the
program computes the transposed tile acc_t [BLOCK_N, 16] = w @ x^T, the converted weight the dot's LEFT operand,
so on sm_90 the weight rows are the wgmma's M side (64 or 128) and the 16 rows its N: a wgmma with the weight in
registers instead of an mma.sync whose weight tile goes back through shared memory (what the right-operand tile
compiles to at 16 rows: `scripts/compile_probe.py`-style checks in docs/fast-decode.md). Block-FP8 scales are
folded into the tile (dequant_tile.w_tile_folded: the reference's rounding); the partials and the fix-up run on
the transposed tile, so the output and the summation order are the same per element.

NOTE: the counters are one buffer per device, shared by every launch: launches on one device must not run
concurrently (true here: the executor runs its steps, captured or eager, on one stream at a time; the
prefill's side stream only copies experts). It is allocated at the first launch on a device, which must
not be inside a CUDA graph capture (the graph warm-up launches first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.quant import QTensor
from adapters.kernels.dense_gemm import (
    SUPPORTED,
    check_placement,
    check_weight,
    global_scale,
    m_bucket,
    out_buffer,
)
from adapters.kernels.dequant_tile import (
    FOUR_BIT,
    MAX_W4_PER_THREAD,
    MAX_W_LHS_PER_THREAD,
    W_LHS_TUNING,
    block_scale,
    check_w_lhs,
    dot_modes,
    row_scale,
    row_scale_t,
    weight_step,
)
from adapters.kernels.packed_gemv import FORMAT_CODES, SCALE_GROUP
from adapters.kernels.pdl import launch_args, prefetch_rows, wait_previous, weight_mode

BLOCK_M = 16  # tl.dot's smallest row tile: every decode bucket is one row tile (two up to 32 rows, ...)
BLOCK_K = 128  # one 128x128 block-FP8 scale per K step, as in dense_gemm
MAX_ROWS = 64  # decode buckets and short prefill segments; more rows have enough row tiles already
MAX_SPLIT = 16
MIN_STEPS_PER_SPLIT = 2  # a split of one K step is all prologue and fix-up


# NOTE: M, M_BUCKET and SPLIT_K are runtime values (SPLIT_K only bounds loops), so the autotuner's splits
# share one binary per (BLOCK_N, warps, stages): a handful of compiles per shape, not one per split
@triton.jit(do_not_specialize=["M", "M_BUCKET", "SPLIT_K"])
def _dense_gemm_splitk_kernel(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, ws_ptr, cnt_ptr, M, M_BUCKET, stride_xm,
                              stride_ym, SPLIT_K, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr,
                              GROUP: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              W_LHS: tl.constexpr = False, USE_GDC: tl.constexpr = 0):
    # M_BUCKET: only an autotune key (the next power of two of M), like dense_gemm's
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = tile // tiles_n
    pid_n = tile % tiles_n
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok = m < M
    steps: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    per = (steps + SPLIT_K - 1) // SPLIT_K
    k_lo = split * per * BLOCK_K
    k_hi = tl.minimum((split + 1) * per * BLOCK_K, K)
    if USE_GDC:  # launched with PDL (pdl.py): this split's weight bytes are static, ask L2 for them first
        if USE_GDC == 2 and pid_m == 0 and FMT >= 1 and FMT <= 4:  # one byte per weight (FP8, INT8) in [N, K] rows
            prefetch_rows(w_ptr, tl.minimum(n, N - 1), K, k_lo, k_hi)
        wait_previous()
    # the tile in the arrangement of its dot: [BM, BN], or transposed [BN, BM] under W_LHS; offs and ok index
    # one split's [M, N] partial (and y) element for element in either
    if W_LHS:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        offs = m[None, :].to(tl.int64) * N + n[:, None]  # [BN, BM]
        out_ok = m_ok[None, :] & (n < N)[:, None]
        y_offs = m[None, :].to(tl.int64) * stride_ym + n[:, None]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        offs = m[:, None].to(tl.int64) * N + n[None, :]  # [BM, BN]
        out_ok = m_ok[:, None] & (n < N)[None, :]
        y_offs = m[:, None].to(tl.int64) * stride_ym + n[None, :]
    for k0 in range(k_lo, k_hi, BLOCK_K):  # empty for a split past the last step (its partial is zeros)
        kk = k0 + tl.arange(0, BLOCK_K)
        s = 1.0
        if FMT == 1:
            s = block_scale(s_ptr, pid_n * BLOCK_N, k0, K, GROUP)
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)  # [BM, BK]
        acc = weight_step(acc, a, w_ptr, s_ptr, n, k0, s, N, K, FMT, GROUP, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty,
                          F32_DOT, PRECISION, W_LHS)
    plane = M.to(tl.int64) * N
    tl.store(ws_ptr + split * plane + offs, acc, mask=out_ok)
    # NOTE: every thread's partial stores are ordered before the (one-thread, acq_rel, GPU-scope) arrival by
    # the barrier; the last arrival's acquire makes all S partials visible to its loads, which bypass L1
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if arrived == SPLIT_K - 1:
        total = tl.zeros_like(acc)
        for j in range(0, SPLIT_K):
            total += tl.load(ws_ptr + j * plane + offs, mask=out_ok, other=0.0, cache_modifier=".cg")
        if W_LHS:
            total = row_scale_t(total, s_ptr, g_ptr, n, N, FMT)
        else:
            total = row_scale(total, s_ptr, g_ptr, n, N, FMT)
        tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=out_ok)
        tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (or graph replay)


# (BLOCK_N, num_warps, num_stages) x SPLIT_K, measured per (M bucket, N, K, format, x dtype) on CUDA before use
TUNE_TILES = ((16, 4, 4), (32, 4, 4), (64, 4, 3), (16, 4, 2))
# W_LHS: the weight rows are the wgmma's M side, so 64 or 128 of them (one warpgroup: 4 warps); more stages keep
# more weight bytes in flight per program, which is what a skinny GEMM streams on (session 24, untimed)
W_LHS_TILES = ((64, 4, 4), (128, 4, 3), (128, 4, 4))
SPLITS = (1, 2, 4, 8, 16)
MAX_FMA_BLOCK_N = 32  # fp32 activations ("ieee" dots are FMA loops): 16 x 32 fp32 accumulators on 4 warps at most


def tune_configs(w_lhs: bool = W_LHS_TUNING) -> list:
    """The autotuned configs: TUNE_TILES x SPLITS, and W_LHS_TILES x SPLITS when w_lhs (by default, unless
    FLUXTIDE_PREFILL_W_LHS=0, as dense_gemm's and the grouped GEMMs' W_LHS tiles)."""
    return [triton.Config({"BLOCK_N": bn, "SPLIT_K": sk, "W_LHS": lhs}, num_warps=w, num_stages=st)
            for tiles, lhs in ((TUNE_TILES, False), (W_LHS_TILES if w_lhs else (), True))
            for bn, w, st in tiles for sk in SPLITS]


def _prune(configs, named_args, **kwargs):
    """early_config_prune: splits that leave every split MIN_STEPS_PER_SPLIT K steps and tiles no wider than
    the matrix (or than the FMA bound for fp32 activations, which never take a W_LHS tile), the 4-bit formats'
    dequantized tile and a W_LHS tile's register-held weight within their per-thread bounds (dequant_tile),
    num_stages at most a split's steps; at least one."""
    steps = -(-kwargs["K"] // BLOCK_K)
    n_cap = max(16, triton.next_power_of_2(kwargs["N"]))
    fma = kwargs["PRECISION"] == "ieee"
    if fma:
        n_cap = min(n_cap, MAX_FMA_BLOCK_N)
    four_bit = kwargs["FMT"] in FOUR_BIT
    kept, seen = [], set()
    for c in configs:
        split, bn, lhs = c.kwargs["SPLIT_K"], c.kwargs["BLOCK_N"], c.kwargs.get("W_LHS", False)
        if split > 1 and steps < split * MIN_STEPS_PER_SPLIT or bn > n_cap or (lhs and fma):
            continue
        per_thread = bn * BLOCK_K / (32 * c.num_warps)  # weight elements of one K step per thread
        if four_bit and per_thread > MAX_W4_PER_THREAD or lhs and per_thread > MAX_W_LHS_PER_THREAD:
            continue
        stages = min(c.num_stages, -(-steps // split))
        key = (bn, split, c.num_warps, stages, lhs)
        if key not in seen:
            seen.add(key)
            kept.append(triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=stages))
    return kept or [triton.Config({"BLOCK_N": 16, "SPLIT_K": 1, "W_LHS": False}, num_warps=4, num_stages=1)]


def _bench(fn, quantiles):
    # NOTE: a decode GEMM takes 3-25 us: 5 ms warm-up and 20 ms of repetitions decide as well as Triton's
    # default 25/100 ms, at a fifth of the tuning time (~30 configs per key, 20 keys at start-up)
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_TUNED = triton.autotune(
    configs=tune_configs(),
    key=["M_BUCKET", "N", "K", "FMT"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
    cache_results=True,
)(_dense_gemm_splitk_kernel)

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's arrival counters (int32, zero between launches), at least `tiles` of them.
    Raises RuntimeError when they must grow inside a CUDA graph capture (launch once before capturing)."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"dense_gemm_splitk: {tiles} arrival counters needed inside a graph capture; "
                               f"launch the shape once before capturing")
        have = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = have
    return have


def supports(q: QTensor, rows: int) -> bool:
    """True when dense_gemm_splitk reads q's format at `rows` rows (1..MAX_ROWS)."""
    return q.fmt in SUPPORTED and 1 <= rows <= MAX_ROWS


def dense_gemm_splitk(x: torch.Tensor, q: QTensor, out: torch.Tensor | None = None, block_n: int | None = None,
                      split_k: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                      w_lhs: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, 1 <= M <= MAX_ROWS) @ dequant(q)[N, K]^T -> [M, N] in x.dtype, fp32
    accumulation; the same tile arithmetic as dense_gemm (exact dequantization, block scales per 128-column
    step, row scales after the sum), the K loop split in split_k parts summed in order.

    out: optional [M, N] x.dtype with unit column stride, written in place. block_n / split_k: a fixed tile
    (block_n a power of two 16..128, split_k 1..MAX_SPLIT); None for both: on CUDA the measured best
    (triton.autotune over TUNE_TILES x SPLITS, and W_LHS_TILES unless FLUXTIDE_PREFILL_W_LHS=0), elsewhere 16
    columns x 2 splits (1 for K of fewer than 4 steps). w_lhs: a fixed-tile launch in the W_LHS arrangement
    (module docstring; the weight rows are its wgmma M side, so block_n 64 or 128 on a GPU).
    Raises ValueError for float or unknown formats, mismatched shapes, dtypes or devices, too many rows, bad
    tiles; RuntimeError for a first launch on a device inside a CUDA graph capture (see the module note).
    """
    check_weight(q, "dense_gemm_splitk")
    check_w_lhs(w_lhs, False, "dense_gemm_splitk")
    if x.dim() != 2 or x.shape[1] != q.shape[1] or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dense_gemm_splitk: x must be bf16/fp16/fp32 [M, {q.shape[1]}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    m, (n, k) = x.shape[0], q.shape
    if m > MAX_ROWS:
        raise ValueError(f"dense_gemm_splitk: {m} rows > {MAX_ROWS} (more rows belong to dense_gemm)")
    check_placement(x, q, "dense_gemm_splitk")
    if block_n is not None and (block_n < 16 or block_n > 128 or block_n & (block_n - 1)):
        raise ValueError(f"dense_gemm_splitk: block_n={block_n} must be a power of two in 16..128")
    if split_k is not None and not 1 <= split_k <= MAX_SPLIT:
        raise ValueError(f"dense_gemm_splitk: split_k={split_k} must be in 1..{MAX_SPLIT}")
    out = out_buffer(out, m, n, x.dtype, x.device, "dense_gemm_splitk")
    if m == 0:
        return out
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, 16)  # the most tiles any BLOCK_N gives
    cnt = counters(x.device, tiles)
    tuned = x.is_cuda and block_n is None and split_k is None
    # the workspace holds one partial per split: the most _prune admits for this K when tuned
    most = min(MAX_SPLIT, max(1, triton.cdiv(k, BLOCK_K) // MIN_STEPS_PER_SPLIT))
    bn, sk = block_n or 16, split_k or min(2, most)
    ws = torch.empty((most if tuned else sk, m, n), dtype=torch.float32, device=x.device)
    args = (x, q.data, q.scale, global_scale(q), out, ws, cnt, m, m_bucket(m), x.stride(0), out.stride(0))
    consts = dict(N=n, K=k, FMT=FORMAT_CODES[q.fmt], GROUP=SCALE_GROUP.get(q.fmt, 1), BLOCK_M=BLOCK_M,
                  BLOCK_K=BLOCK_K, **dot_modes(x), **launch_args(weight_mode(x)))
    tiles_m = triton.cdiv(m, BLOCK_M)
    if tuned:
        _TUNED[lambda meta: (tiles_m * triton.cdiv(n, meta["BLOCK_N"]) * meta["SPLIT_K"],)](*args, **consts)
    else:
        _dense_gemm_splitk_kernel[(tiles_m * triton.cdiv(n, bn) * sk,)](
            *args[:11], sk, **consts, BLOCK_N=bn, W_LHS=w_lhs, num_warps=num_warps,
            **({} if num_stages is None else {"num_stages": num_stages}))
    return out
