"""GEMV of one packed expert matrix, dequantized inside the K loop (a Triton device function shared by
the MoE kernels), and the host-side plumbing that turns an ExpertLayout into kernel constants.

Shape legend: N output rows of a tile (BLOCK_N), C input columns (ROWS x COLS matrix), BK columns per
K step (BLOCK_K), G columns per scale group, R row bytes of one packed expert.
Formats (canonical forms of adapters/checkpoint/quant.py), as the FMT constexpr:
  0 BF16 (W_DTYPE bf16/fp16/fp32)   1 FP8_BLOCK (fp32 scale per 128x128)   2 FP8_TENSOR (fp32 [1, 1])
  3 FP8_CHANNEL (fp32 [O, 1])       4 INT8_CHANNEL (fp32 [O, 1])
  5 NVFP4 (e2m1 nibbles, e4m3 scale per 16 columns, fp32 global)   6 MXFP4 (e2m1, e8m0 per 32 columns)
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.quant import FP8_BLOCK, MXFP4_GROUP, NVFP4_GROUP
from domain.model_spec import WeightFormat

_log = logging.getLogger(__name__)

FORMAT_CODES = {
    WeightFormat.BF16: 0, WeightFormat.FP8_BLOCK: 1, WeightFormat.FP8_TENSOR: 2, WeightFormat.FP8_CHANNEL: 3,
    WeightFormat.INT8_CHANNEL: 4, WeightFormat.NVFP4: 5, WeightFormat.MXFP4: 6,
}
# columns sharing one scale along K; a K step must cover whole groups
SCALE_GROUP = {WeightFormat.FP8_BLOCK: FP8_BLOCK, WeightFormat.NVFP4: NVFP4_GROUP, WeightFormat.MXFP4: MXFP4_GROUP}
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float8_e4m3fn: tl.float8e4nv, torch.int8: tl.int8, torch.uint8: tl.uint8}


@dataclass(frozen=True)
class MatrixConsts:
    """Kernel constants of one matrix (gate, up or down) of a layout; offsets are bytes into the row."""

    rows: int
    cols: int
    data: int
    scale: int  # 0 when the format has no scale (bf16)
    global_scale: int  # 0 unless NVFP4
    w_dtype: tl.dtype  # element type of the data segment


@dataclass(frozen=True)
class LayoutConsts:
    fmt_code: int
    group: int  # scale group along K (0: none)
    row_bytes: int
    gate: MatrixConsts
    up: MatrixConsts
    down: MatrixConsts


@functools.lru_cache(maxsize=64)
def layout_consts(layout: ExpertLayout) -> LayoutConsts:
    """Kernel constants of `layout` (cached: launchers are called once per layer per step)."""
    if layout.fmt not in FORMAT_CODES:
        raise ValueError(f"no MoE kernel for weight format {layout.fmt!r}")
    mats = {}
    for matrix in ("gate", "up", "down"):
        segs = {s.part: s for s in layout.segments if s.matrix == matrix}
        rows, cols = layout.shapes[matrix]
        scale, glob = segs.get("scale"), segs.get("global_scale")
        mats[matrix] = MatrixConsts(rows, cols, segs["data"].offset, scale.offset if scale else 0,
                                    glob.offset if glob else 0, _TL_DTYPES[segs["data"].dtype])
    return LayoutConsts(FORMAT_CODES[layout.fmt], SCALE_GROUP.get(layout.fmt, 0), layout.row_bytes, **mats)


def default_block_k(layout: ExpertLayout) -> int:
    """Columns per K step: 128 (a 128x128 FP8 block; 256 bytes per bf16 row), 256 for the 4-bit formats so a
    row of the tile is still 128 bytes (one 16-byte load per thread at BLOCK_N=16, 4 warps)."""
    return 256 if layout.fmt in (WeightFormat.NVFP4, WeightFormat.MXFP4) else 128


def check_block_k(layout: ExpertLayout, block_k: int) -> None:
    """BLOCK_K must be a power of two covering whole scale groups (128 columns for block FP8)."""
    group = SCALE_GROUP.get(layout.fmt, 1)
    if block_k < 2 or block_k & (block_k - 1) or block_k % group:
        raise ValueError(f"BLOCK_K={block_k} must be a power of two and a multiple of {layout.fmt.value}'s "
                         f"scale group ({group} columns)")


def check_pool(slot_ids: torch.Tensor, slots: torch.Tensor, layout: ExpertLayout, tokens: int, where: str) -> int:
    """Shape/dtype checks shared by the launchers (host metadata only, no sync); returns K."""
    if slots.dtype != torch.uint8 or slots.dim() != 2 or slots.shape[1] != layout.row_bytes:
        raise ValueError(f"{where}: slots must be uint8 [S, {layout.row_bytes}] for {layout}, "
                         f"got {slots.dtype} {tuple(slots.shape)}")
    if not slots.is_contiguous():
        raise ValueError(f"{where}: slots must be contiguous (rows are addressed as slot * {layout.row_bytes})")
    if slot_ids.dtype != torch.int32 or slot_ids.dim() != 2 or slot_ids.shape[0] != tokens:
        raise ValueError(f"{where}: slot_ids must be int32 [T={tokens}, K], got {slot_ids.dtype} "
                         f"{tuple(slot_ids.shape)}")
    if slot_ids.shape[1] < 1:
        raise ValueError(f"{where}: slot_ids needs at least one top-k column, got {tuple(slot_ids.shape)}")
    if slot_ids.device != slots.device:
        raise ValueError(f"{where}: slot_ids on {slot_ids.device}, slots on {slots.device}")
    return int(slot_ids.shape[1])


def check_dense_operands(x: torch.Tensor, q) -> None:
    """The dense GEMVs' operand checks (dense_gemv, dense_gemv_fp4): x [M, K] with unit column stride for a
    QTensor q of logical shape [N, K], its data and scales contiguous. Raises ValueError."""
    if x.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"x must be [M, {q.shape[1]}], got {tuple(x.shape)}")
    if x.stride(1) != 1 or not q.data.is_contiguous() or not q.scale.is_contiguous():
        raise ValueError("x rows, q.data and q.scale must be contiguous")


@triton.jit
def _e2m1(code):
    """e2m1 code in the low 4 bits (sign bit 3) -> fp32: 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives, exactly.
    NOTE: the code's 3 magnitude bits placed at fp16's exponent/mantissa boundary (bits 9-11, sign at 15) are
    the fp16 number value * 2^-14 (codes 0 and 1 land on fp16 subnormals, which the fp16 -> fp32 convert keeps
    exact), so two masks, two shifts and one convert decode a nibble; the arithmetic decode this replaces took
    ~6x the instructions per weight byte of block FP8 in the decode GEMVs (PTX of the sm_90 build)."""
    c = code.to(tl.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e2m1_bytes(b, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 [N, BK/2] of packed e2m1 pairs (low nibble = even column) -> fp32 [N, BK] in column order,
    each value * 2^-14 (the caller scales a group's sum by 2^14: one multiply per group, not per weight).
    NOTE: _e2m1's fp16 placement for both nibbles straight from the byte (the sign and magnitude bits shifted
    into place and masked: no nibble extraction first)."""
    c = b.to(tl.uint16)
    lo = ((c << 9) & 0x0E00) | ((c << 12) & 0x8000)
    hi = ((c << 5) & 0x0E00) | ((c << 8) & 0x8000)
    w = tl.join(lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)).to(tl.float32)  # [N, BK/2, 2]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _e8m0(s):
    """uint8 e8m0 -> fp32 2^(s-127), built from the exponent bits (s=0: 2^-127, s=255: inf, as the reference)."""
    bits = tl.where(s == 0, 1 << 22, s.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _group_scaled(prod, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """prod [N, BK] times s [N, BK/G], each scale repeated over its G consecutive columns."""
    return tl.reshape(tl.reshape(prod, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None], (BLOCK_N, BLOCK_K))


@triton.constexpr_function
def acc_cols(FMT, BLOCK_K, GROUP):
    """Columns of packed_gemv's accumulator: BLOCK_K, or the K step's scale groups for the 4-bit formats
    (their term sums each group before scaling it)."""
    return BLOCK_K // GROUP if FMT == 5 or FMT == 6 else BLOCK_K


@triton.jit
def load_x(x_ptr, k0, kk, COLS: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        x = tl.load(x_ptr + k0 + kk).to(tl.float32)  # [BK]
    else:
        x = tl.load(x_ptr + k0 + kk, mask=k0 + kk < COLS, other=0.0).to(tl.float32)  # [BK]
    return x


@triton.jit
def term(w, x, s, FMT: tl.constexpr, FOLD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          GROUP: tl.constexpr):
    """What packed_gemv adds to its accumulator for one K step: w [N, BK] fp32, x [BK], s the step's scales
    ([BK] when FOLD, [N, BK/G] for group-scaled formats, unused otherwise). [N, BK], or [N, BK/G] for the
    4-bit formats (acc_cols)."""
    if FMT == 5 or FMT == 6:
        # [N, BK/G]: each group's products summed, then its scale (w carries 2^-14: _e2m1_bytes) applied once
        t = tl.sum(tl.reshape(w * x[None, :], (BLOCK_N, BLOCK_K // GROUP, GROUP)), axis=2) * 16384.0 * s
    elif FMT == 1:
        if FOLD:
            t = w * (x * s)[None, :]
        else:
            t = _group_scaled(w * x[None, :], s, BLOCK_N, BLOCK_K, GROUP)
    else:
        t = w * x[None, :]
    return t


@triton.jit
def row_scale(acc, row_ptr, n, n_ok, SCALE: tl.constexpr, GSCALE: tl.constexpr, FMT: tl.constexpr):
    """packed_gemv's epilogue: the scales constant along a row, applied once after the reduction."""
    if FMT == 2:
        acc = acc * tl.load((row_ptr + SCALE).to(tl.pointer_type(tl.float32)))
    elif FMT == 3 or FMT == 4:
        acc = acc * tl.load((row_ptr + SCALE).to(tl.pointer_type(tl.float32)) + n, mask=n_ok, other=0.0)
    elif FMT == 5:
        acc = acc * tl.load((row_ptr + GSCALE).to(tl.pointer_type(tl.float32)))
    return acc


@triton.jit
def load_fp4_tile(data_ptr, scale_ptr, n, n_ok, k0, gi, COLS: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                  EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of a 4-bit matrix: w [N, BK] fp32 (the e2m1 values times 2^-14, _e2m1_bytes) and its group
    scales s [N, BK/G] fp32; zeros outside the matrix. data_ptr: uint8 [ROWS, COLS/2]; scale_ptr: e4m3 (NVFP4)
    or uint8 e8m0 (MXFP4) [ROWS, COLS/G]; n [N] int32 rows, gi = arange(BK/G)."""
    jb = tl.arange(0, BLOCK_K // 2)  # byte j of the tile holds columns 2j (low nibble), 2j+1 (high)
    b_ptrs = data_ptr + n[:, None].to(tl.int64) * (COLS // 2) + (k0 // 2 + jb)[None, :]
    s_ptrs = scale_ptr + n[:, None].to(tl.int64) * (COLS // GROUP) + (k0 // GROUP + gi)[None, :]  # [N, BK/G]
    if EVEN:  # the tile divides the matrix: no masks (the lean loop, as for the 8-bit formats)
        b = tl.load(b_ptrs)
        if FMT == 5:
            s = tl.load(s_ptrs).to(tl.float32)
        else:
            s = _e8m0(tl.load(s_ptrs))
    else:
        b = tl.load(b_ptrs, mask=n_ok[:, None] & (k0 // 2 + jb < COLS // 2)[None, :], other=0)
        s_ok = n_ok[:, None] & (k0 // GROUP + gi < COLS // GROUP)[None, :]
        if FMT == 5:
            s = tl.where(s_ok, tl.load(s_ptrs, mask=s_ok).to(tl.float32), 0.0)
        else:
            s = tl.where(s_ok, _e8m0(tl.load(s_ptrs, mask=s_ok, other=0)), 0.0)
    return _e2m1_bytes(b, BLOCK_N, BLOCK_K), s


@triton.jit
def load_tile(row_ptr, n, n_ok, n0, k0, kk, gi, DATA: tl.constexpr, SCALE: tl.constexpr, COLS: tl.constexpr,
              W_DTYPE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr,
              FOLD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step's weight tile w [N, BK] fp32 (rows n, columns k0 + kk, dequantized but unscaled; the 4-bit
    formats' values times 2^-14, which term takes back) and its scales s: [BK] when FOLD (block FP8, the tile
    inside one scale row), [N, BK/G] for the group-scaled formats (block FP8, NVFP4, MXFP4), 0.0 where the
    scale is constant along a row (row_scale applies it)."""
    k_ok = k0 + kk < COLS
    if FMT == 5 or FMT == 6:
        if FMT == 5:
            w, s = load_fp4_tile(row_ptr + DATA, (row_ptr + SCALE).to(tl.pointer_type(tl.float8e4nv)), n, n_ok, k0,
                                 gi, COLS, FMT, GROUP, EVEN, BLOCK_N, BLOCK_K)
        else:
            w, s = load_fp4_tile(row_ptr + DATA, row_ptr + SCALE, n, n_ok, k0, gi, COLS, FMT, GROUP, EVEN, BLOCK_N,
                                 BLOCK_K)
    else:
        w_ptrs = (row_ptr + DATA).to(tl.pointer_type(W_DTYPE)) + n[:, None] * COLS + (k0 + kk)[None, :]
        if EVEN:
            w = tl.load(w_ptrs).to(tl.float32)  # [N, BK]
        else:
            w_ok = n_ok[:, None] & k_ok[None, :]
            # no `other`: the interpreter cannot cast a fill value to fp8; masked lanes are zeroed after
            w = tl.where(w_ok, tl.load(w_ptrs, mask=w_ok).to(tl.float32), 0.0)  # [N, BK]
        if FMT == 1:  # block FP8: one fp32 scale per (128 rows, 128 columns)
            KB: tl.constexpr = (COLS + GROUP - 1) // GROUP
            scales = (row_ptr + SCALE).to(tl.pointer_type(tl.float32))
            if FOLD:  # the tile lies in one scale row: term scales x, not the products
                s = tl.load(scales + (n0 // GROUP) * KB + (k0 + kk) // GROUP)  # [BK]
            else:
                s_ok = n_ok[:, None] & (k0 // GROUP + gi < KB)[None, :]
                s_off = (n // GROUP)[:, None] * KB + (k0 // GROUP + gi)[None, :]  # [N, BK/G]
                s = tl.load(scales + s_off, mask=s_ok, other=0.0)
        else:
            s = 0.0
    return w, s


@triton.jit
def packed_gemv(row_ptr, x_ptr, n0, ROWS: tl.constexpr, COLS: tl.constexpr, DATA: tl.constexpr,
                SCALE: tl.constexpr, GSCALE: tl.constexpr, W_DTYPE: tl.constexpr, FMT: tl.constexpr,
                GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[N] (fp32) = W[n0 : n0 + BLOCK_N, :] @ x for one row tile of one packed matrix (n0 a multiple
    of BLOCK_N).

    row_ptr: uint8 pointer to the expert's row in the pool; x_ptr: x [COLS] in any float dtype.
    Each K step dequantizes one [BLOCK_N, BLOCK_K] tile in registers (nothing is written back) and adds
    it into a [BLOCK_N, BLOCK_K] fp32 accumulator; the one cross-thread reduction happens after the loop.
    Scales constant along a row (per tensor / per channel / NVFP4 global) are applied once at the end.
    NOTE: decode GEMVs of 8-bit weights are bound by instructions per weight byte as much as by HBM
    (one byte per element, ~18 B/clock/SM needed at full bandwidth), so the common shapes take a lean
    loop: no masks when the tile divides the matrix (EVEN), and a block-FP8 tile of at most 128 rows
    (one scale row) folds its scales into x ([BK] multiplies) instead of scaling every product, leaving
    one convert and one FMA per weight.
    """
    n = n0 + tl.arange(0, BLOCK_N)  # [N]
    n_ok = n < ROWS  # [N]
    EVEN: tl.constexpr = (ROWS % BLOCK_N == 0) and (COLS % BLOCK_K == 0)
    kk = tl.arange(0, BLOCK_K)
    gi = tl.arange(0, BLOCK_K // GROUP)
    FOLD: tl.constexpr = FMT == 1 and EVEN and BLOCK_N <= GROUP
    acc2 = tl.zeros([BLOCK_N, acc_cols(FMT, BLOCK_K, GROUP)], dtype=tl.float32)
    for k0 in range(0, COLS, BLOCK_K):
        w, s = load_tile(row_ptr, n, n_ok, n0, k0, kk, gi, DATA, SCALE, COLS, W_DTYPE, FMT, GROUP, EVEN, FOLD,
                         BLOCK_N, BLOCK_K)  # [N, BK]
        acc2 += term(w, load_x(x_ptr, k0, kk, COLS, EVEN), s, FMT, FOLD, BLOCK_N, BLOCK_K, GROUP)
    return row_scale(tl.sum(acc2, axis=1), row_ptr, n, n_ok, SCALE, GSCALE, FMT)  # [N]


# Tiles tried on CUDA (once per shape, format and pairs bucket, by measurement, before any graph capture);
# the 4-bit formats need BLOCK_K >= 256 (16-byte loads), block FP8 a multiple of 128. The interpreter runs
# the launcher's default tile instead.
TUNE_TILES = ((16, 128, 4, 1), (16, 256, 4, 3), (8, 256, 4, 3), (8, 512, 4, 3), (4, 512, 4, 3),
              (16, 512, 8, 2), (32, 256, 8, 3), (4, 1024, 4, 2))


# The per-pair GEMVs' (moe_gate_up, moe_down) autotune key holds the launch's pair count as a bucket (PAIRS_BUCKET):
# the first of PAIRS_BUCKETS up to PAIRS_BUCKET_MAX that holds T*K pairs; launches of more pairs (prefill chunks)
# share the first bucket's key, the tile tuned at bs1 that every launch ran before the buckets; PAIRS_BUCKET_MAX 1:
# one key for every pair count (off). Why buckets: the best tile depends on the grid's pairs (programs per SM).
# H200 (session 19), with buckets up to 1024 (prefill chunks then had their own): moe_down 36.0 us at 16 tokens
# (bench_kernels --only order; session 18 measured 50.3 with the one key); the decode step (graph replay) bs16
# 8.86 -> 8.37 ms, bs4 4.38 -> 4.30, bs1 2.43 -> 2.51 (docs/bench/2026-12-04-bench-decode-h200-splitk-pairs-ab.json).
# NOTE: off by default: through HTTP, with those buckets and the split-K GEMM on, the resident ladder's c8/c16 TTFT
# doubled (0.08 -> 0.15-0.18 s) against a control run (ADR 0022), cause not established (one run each; c16's TTFT
# has ranged 0.06-0.15 s across sessions). The buckets now stop at the decode sizes (16: bs1; 64: bs2-bs7; 256:
# bs8-bs28, bs16's 144 pairs), so turning them on changes only decode-sized launches and an HTTP A/B isolates them
# (docs/gpu-validation.md). Each is tuned before any capture (a capture cannot tune: launch's guard).
PAIRS_BUCKETS = (16, 64, 256)
PAIRS_BUCKET_MAX = 1


def pairs_bucket(pairs: int) -> int:
    """The PAIRS_BUCKET autotune key of a per-pair GEMV launch over `pairs` (token, top-k) pairs: the first of
    PAIRS_BUCKETS up to PAIRS_BUCKET_MAX that holds them; more pairs than the largest: the first bucket (bs1's tile);
    1 when PAIRS_BUCKET_MAX admits none. Only a key: the kernels do not read it (nor specialize on it: no
    recompiles). NOTE: buckets may pick different tiles, and a tile of another BLOCK_K sums in another order, so
    results can differ in the last bits between buckets (as dense_gemm's M buckets); the dedup kernels look up the
    same bucket's choice (dedup_gemv.per_pair_tile), so they stay bitwise per-pair."""
    allowed = [b for b in PAIRS_BUCKETS if b <= PAIRS_BUCKET_MAX]
    if not allowed:
        return 1
    return next((b for b in allowed if pairs <= b), allowed[0])


# dtypes of the per-pair kernels' pointer parameters by name ("act": the activations' float dtype)
_PTR_DTYPES = {"x_ptr": "act", "h_ptr": "act", "out_ptr": "act", "slot_ids_ptr": torch.int32,
               "slots_ptr": torch.uint8, "weights_ptr": torch.float32, "y_ptr": torch.float32}


def autotune_key(tuner, act: torch.dtype, values: dict) -> tuple:
    """The key triton.autotune files a per-pair launch under (Triton 3.x: the `key` arguments' values in
    order, then str(dtype) of each tensor argument in argument order; all tensors are `*_ptr` parameters).
    Raises RuntimeError on a pointer parameter this table does not know (a renamed per-pair kernel)."""
    key = [values[k] for k in tuner.keys]
    for name in tuner.arg_names:
        if name.endswith("_ptr"):
            if name not in _PTR_DTYPES:
                raise RuntimeError(f"per-pair tile lookup: unknown per-pair kernel parameter {name!r}")
            dtype = _PTR_DTYPES[name]
            key.append(str(act if dtype == "act" else dtype))
    return tuple(key)


def captured_tile(tuner, act: torch.dtype, values: dict):
    """The triton.Config a per-pair launch inside a CUDA graph capture runs (tuned_tile); None outside a capture
    (the autotuner runs as usual)."""
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return None
    return tuned_tile(tuner, act, values)


def tuned_tile(tuner, act: torch.dtype, values: dict):
    """The autotuner's choice (triton.Config) for this launch's key, else (a pair bucket no warm-up tuned) its
    choice for the nearest tuned PAIRS_BUCKET of the same shape, logged. Raises RuntimeError when no bucket of
    the shape is tuned: a capture cannot measure tiles (tune before capturing, as DeviceExpertPool.tune does)."""
    key = autotune_key(tuner, act, values)
    cfg = tuner.cache.get(key)
    if cfg is not None:
        return cfg
    at = tuner.keys.index("PAIRS_BUCKET")
    same_shape = [(abs(k[at].bit_length() - key[at].bit_length()), k[at], k) for k in tuner.cache
                  if len(k) == len(key) and k[:at] + k[at + 1:] == key[:at] + key[at + 1:]]
    if not same_shape:
        raise RuntimeError(f"per-pair GEMV: no tile tuned for {key} before a CUDA graph capture")
    near = min(same_shape)[2]
    _log.warning("per-pair GEMV: pair bucket %s not tuned before a capture; running bucket %s's tile", key[at],
                 near[at])
    return tuner.cache[near]


def tune_configs() -> list:
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in TUNE_TILES]


def prune_tiles(configs, named_args, **kwargs):
    """Drop tiles the format cannot use (BLOCK_K below 256 for 4-bit data, or not a multiple of the group)."""
    fmt, group = named_args.get("FMT", kwargs.get("FMT")), named_args.get("GROUP", kwargs.get("GROUP", 1))
    keep = [c for c in configs if c.kwargs["BLOCK_K"] % max(group, 1) == 0
            and (fmt not in (5, 6) or c.kwargs["BLOCK_K"] >= 256)]
    return keep or configs[:1]


def untuned_block_n(rows: int | None, on_cuda: bool) -> int:
    """The BLOCK_N of an untuned launch over `rows` output rows: 16 on CUDA. Off CUDA (Triton's interpreter,
    which runs the programs one after another in Python) the widest power of two up to 128 that divides rows,
    so a tiny test shape takes 1-8 programs a row instead of 5-24. Rows that 16 does not divide keep 16: the
    kernels' EVEN and FOLD paths (BLOCK_N divides the rows and 128) are the same as with 16, and each output
    row's sum runs the same K steps, so the results are bitwise those of 16-row tiles."""
    block_n = 16
    while not on_cuda and rows is not None and block_n < 128 and rows % (2 * block_n) == 0:
        block_n *= 2
    return block_n


def resolve_tiles(layout: ExpertLayout, block_n: int | None, block_k: int | None, on_cuda: bool,
                  where: str, rows: int | None = None) -> tuple[bool, int, int]:
    """(tuned, block_n, block_k): no tile given on CUDA means the measured best tile for the shape and
    format (triton.autotune); otherwise the given tile or the default untuned_block_n(rows) x
    default_block_k, checked. Raises ValueError for a block_n that is not a power of two or a block_k the
    format cannot use."""
    tuned = on_cuda and block_n is None and block_k is None
    block_k = default_block_k(layout) if block_k is None else block_k
    block_n = untuned_block_n(rows, on_cuda) if block_n is None else block_n
    check_block_k(layout, block_k)
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"{where}: block_n={block_n} must be a power of two")
    return tuned, block_n, block_k


def launch(tuned_kernel, kernel, tuned: bool, rows: int, cols: int, block_n: int, block_k: int, num_warps: int,
           *args, **constants) -> None:
    """Launch over (rows, cdiv(cols, BLOCK_N)): the autotuned kernel picks its own tile (inside a CUDA graph
    capture, the tile captured_tile reads from its cache: a capture cannot measure), the plain one runs the given
    tile. The per-pair kernels pass PAIRS_BUCKET among the constants; args[0] holds the activations."""
    cfg = captured_tile(tuned_kernel, args[0].dtype, constants) if tuned else None
    if tuned and cfg is None:
        tuned_kernel[lambda meta: (rows, triton.cdiv(cols, meta["BLOCK_N"]))](*args, **constants)
    elif cfg is not None:
        kernel[(rows, triton.cdiv(cols, cfg.kwargs["BLOCK_N"]))](*args, **constants, **cfg.kwargs,
                                                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        kernel[(rows, triton.cdiv(cols, block_n))](*args, **constants, BLOCK_N=block_n, BLOCK_K=block_k,
                                                   num_warps=num_warps)
