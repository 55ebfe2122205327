"""Routed experts for prefill, second half, on tensor cores: the weighted partial
y[t, k] = weights[t, k] * (h[t, k] @ down^T) of every (token, top-k) pair, its rows grouped by expert slot
(moe_align), down read straight from the expert's packed row and dequantized inside the K loop (all seven
formats, dequant_tile.py). moe_sum then adds the K partials of a token in order k = 0..K-1, exactly as
after the decode kernel (moe_down), so the two paths share their arithmetic order after the GEMMs.

Shape legend: T tokens, K top-k columns, H hidden, I expert intermediate, S slots, R row bytes,
BM rows per block, B blocks, P = B*BM padded rows.
  h [P, I] float (moe_grouped_gate_up's output); alignment (pairs int32 [P], block_slots int32 [B]);
  weights fp32 [T, K]; slots uint8 [S, R]; partials fp32 [T, K, H].
Grid: (B, cdiv(H, BLOCK_N)): one program multiplies the BM contiguous rows of h of one block by a
BLOCK_N-row tile of down, BLOCK_K = 128 columns per step, fp32 accumulation, and scatters each live row
to its pair's partial (padding rows and pairs not in the alignment are not written). Deterministic, no
atomics; a pair's partial depends only on its token and expert. No host syncs.
W_LHS (constexpr; not with e4m3 activations): the tile computed transposed, acc [BLOCK_N, BM] = down @ h^T with
the converted weight tile as the dot's left operand (kept in registers as the sm_90 wgmma A operand, the wgmma
waited for a step later instead of at once; dense_gemm.py says why); the row scales, the router weight and the
scatter applied to the transposed tile (the same partials). The block-FP8 scale is folded into the tile before
the cast to h.dtype: the reference's rounding of the weights (dequant_tile.w_tile_folded). The autotuner tries
dequant_tile.GROUPED_W_LHS_TILES next to GROUPED_TILES.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels.act_quant_fp8 import GROUP as A8_GROUP
from adapters.kernels.act_quant_fp8 import Fp8Rows
from adapters.kernels.dequant_tile import (
    A8_FORMATS,
    GROUPED_BLOCK_K,
    a8_dot_step,
    block_scale,
    check_w_lhs,
    dot_modes,
    dot_step,
    dot_step_t,
    fp8_rows,
    fp8_tile,
    grouped_configs,
    grouped_pruner,
    row_scale,
    row_scale_t,
    scale_dtype,
    w_tile,
    w_tile_folded,
)
from adapters.kernels.moe_align import Alignment, check_alignment
from adapters.kernels.packed_gemv import layout_consts


@triton.jit(do_not_specialize=["S"])  # S only feeds the debug assert: no recompiles on a pool resize
def _moe_grouped_down_kernel(h_ptr, hs_ptr, pairs_ptr, block_slots_ptr, weights_ptr, slots_ptr, y_ptr, S,
                             H: tl.constexpr, I: tl.constexpr, R: tl.constexpr,
                             D_DATA: tl.constexpr, D_SCALE: tl.constexpr, D_GSCALE: tl.constexpr,
                             W_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                             F32_DOT: tl.constexpr, PRECISION: tl.constexpr, A8: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             W_LHS: tl.constexpr):
    # W_LHS: the transposed tile acc_t [BN, BM], the weight the dot's left operand (module docstring)
    tl.static_assert(not (W_LHS and A8), "W_LHS is the bf16/fp16-activation path")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slots_ptr + pid_m)
    tl.device_assert(slot < S, "slot id past the pool")
    if slot >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        pair = tl.load(pairs_ptr + rows)  # [BM]; -1 on padding rows
        live = pair >= 0
        row = slots_ptr + slot.to(tl.int64) * R  # int64: S * R passes 2^31 at real pool sizes
        d_data = (row + D_DATA).to(tl.pointer_type(W_DTYPE))
        d_scale = (row + D_SCALE).to(tl.pointer_type(S_DTYPE))
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of down = columns of the output
        if W_LHS:
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            s = 1.0
            if FMT == 1:
                s = block_scale(d_scale, pid_n * BLOCK_N, k0, I, GROUP)
            # no row mask: a padding row of h only feeds its own output row, which is never stored
            if A8:  # e4m3 x e4m3; each step's sum times the rows' group scale (BLOCK_K = 128 = the group)
                h_rows = h_ptr.to(tl.pointer_type(tl.uint8)) + rows.to(tl.int64) * I  # [BM]
                a = fp8_rows(h_rows, kk, (kk < I)[None, :])  # [BM, BK]
                a_s = tl.load(hs_ptr + rows.to(tl.int64) * ((I + BLOCK_K - 1) // BLOCK_K) + k0 // BLOCK_K)[:, None]
                acc = a8_dot_step(acc, a, fp8_tile(d_data, n, k0, H, I, BLOCK_N, BLOCK_K), a_s * s, F32_DOT)
            else:
                a = tl.load(h_ptr + rows[:, None].to(tl.int64) * I + kk[None, :], mask=(kk < I)[None, :], other=0.0)
                dt = h_ptr.dtype.element_ty
                if W_LHS:  # block-FP8 scale folded into the tile: no per-step product on the dot's result
                    w = w_tile_folded(d_data, d_scale, n, k0, s, H, I, FMT, GROUP, BLOCK_N, BLOCK_K, dt)  # [BN, BK]
                    acc_t = dot_step_t(acc_t, a, w, F32_DOT, PRECISION)  # [BN, BM]
                else:
                    w = w_tile(d_data, d_scale, n, k0, H, I, FMT, GROUP, BLOCK_N, BLOCK_K, dt)  # [BN, BK]
                    acc = dot_step(acc, a, w, FMT, s, F32_DOT, PRECISION)
        weight = tl.load(weights_ptr + pair, mask=live, other=0.0)  # [BM]
        if W_LHS:
            part_t = row_scale_t(acc_t, d_scale, (row + D_GSCALE).to(tl.pointer_type(tl.float32)), n, H, FMT)  # [BN, BM]
            tl.store(y_ptr + pair[None, :].to(tl.int64) * H + n[:, None], weight[None, :] * part_t,
                     mask=live[None, :] & (n < H)[:, None])
        else:
            part = row_scale(acc, d_scale, (row + D_GSCALE).to(tl.pointer_type(tl.float32)), n, H, FMT)  # [BM, BN]
            tl.store(y_ptr + pair[:, None].to(tl.int64) * H + n[None, :], weight[:, None] * part,
                     mask=live[:, None] & (n < H)[None, :])


_TUNED = triton.autotune(configs=grouped_configs(), key=["H", "I", "R", "FMT", "BLOCK_M", "A8"],
                         prune_configs_by={"early_config_prune": grouped_pruner(1, n_dim="H", k_dim="I")},
                         cache_results=True)(_moe_grouped_down_kernel)


def moe_grouped_down(h: torch.Tensor | Fp8Rows, align: Alignment, weights: torch.Tensor, slots: torch.Tensor,
                     layout: ExpertLayout, partials: torch.Tensor, block_n: int | None = None, num_warps: int = 4,
                     num_stages: int | None = None, w_lhs: bool = False) -> torch.Tensor:
    """Write partials[t, k] = weights[t, k] * (h_row @ down^T) (fp32) for every pair of `align`; returns partials.

    h [P, I] bf16/fp16/fp32 contiguous: moe_grouped_gate_up's output for the same `align`, or that output as
    Fp8Rows (act_quant_fp8: the W8A8 path, FP8 block / tensor / channel layouts only); weights fp32 [T, K] router weights; slots uint8 [S, R] contiguous, rows packed by
    `layout`; partials contiguous fp32 [T, K, H]: pairs absent from `align` (slot -1) are left as they
    are (the caller zeroes them, fills them in another call, or has moe_sum skip them). block_n, num_warps,
    num_stages, w_lhs: as moe_grouped_gate_up.
    Raises ValueError on any shape, dtype, device or block-size mismatch.
    """
    a8 = isinstance(h, Fp8Rows)
    if a8:
        if layout_consts(layout).fmt_code not in A8_FORMATS:
            raise ValueError(f"moe_grouped_down: FP8 activations need an FP8 weight layout, got {layout.fmt}")
        if h.scales.shape != (h.q.shape[0], -(-h.q.shape[1] // A8_GROUP)) or not h.q.is_contiguous():
            raise ValueError(f"moe_grouped_down: Fp8Rows with q {tuple(h.q.shape)} and scales {tuple(h.scales.shape)}")
    elif h.dim() != 2 or h.dtype not in (torch.bfloat16, torch.float16, torch.float32) or not h.is_contiguous():
        raise ValueError(f"moe_grouped_down: h must be contiguous bf16/fp16/fp32 [P, I], got {h.dtype} {tuple(h.shape)}")
    rows = check_alignment(align, slots, "moe_grouped_down")
    if h.shape != (rows, layout.intermediate):
        raise ValueError(f"moe_grouped_down: h must be [{rows}, {layout.intermediate}] (the alignment's rows, "
                         f"the layout's I), got {tuple(h.shape)}")
    if slots.dtype != torch.uint8 or slots.dim() != 2 or slots.shape[1] != layout.row_bytes or not slots.is_contiguous():
        raise ValueError(f"moe_grouped_down: slots must be contiguous uint8 [S, {layout.row_bytes}], "
                         f"got {slots.dtype} {tuple(slots.shape)}")
    if weights.dtype != torch.float32 or weights.dim() != 2 or not weights.is_contiguous():
        raise ValueError(f"moe_grouped_down: weights must be contiguous fp32 [T, K], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    tokens, top_k = weights.shape
    if (partials.shape != (tokens, top_k, layout.hidden) or partials.dtype != torch.float32
            or not partials.is_contiguous()):
        raise ValueError(f"moe_grouped_down: partials must be contiguous fp32 [{tokens}, {top_k}, {layout.hidden}], "
                         f"got {partials.dtype} {tuple(partials.shape)}")
    if not h.device == weights.device == slots.device == partials.device:
        raise ValueError(f"moe_grouped_down: h on {h.device}, weights on {weights.device}, slots on {slots.device}, "
                         f"partials on {partials.device}")
    if block_n is not None and (block_n < 16 or block_n > 128 or block_n & (block_n - 1)):
        raise ValueError(f"moe_grouped_down: block_n={block_n} must be a power of two in 16..128")
    check_w_lhs(w_lhs, a8, "moe_grouped_down")
    if rows == 0 or tokens == 0:
        return partials
    c = layout_consts(layout)
    hidden = layout.hidden
    hq, hs = (h.q, h.scales) if a8 else (h, h)  # without A8 the scale pointer is never read
    args = (hq, hs, align.pairs, align.block_slots, weights, slots, partials, slots.shape[0])
    consts = dict(H=hidden, I=layout.intermediate, R=c.row_bytes,
                  D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale,
                  W_DTYPE=c.down.w_dtype, S_DTYPE=scale_dtype(c.fmt_code), FMT=c.fmt_code, GROUP=max(c.group, 1),
                  BLOCK_M=align.block_m, A8=a8, **dot_modes(hq))
    blocks = align.block_slots.numel()
    if slots.is_cuda and block_n is None and not w_lhs:
        _TUNED[lambda meta: (blocks, triton.cdiv(hidden, meta["BLOCK_N"]))](*args, **consts)
    else:
        bn = block_n or 64
        _moe_grouped_down_kernel[(blocks, triton.cdiv(hidden, bn))](*args, **consts, BLOCK_N=bn,
                                                                    BLOCK_K=GROUPED_BLOCK_K, W_LHS=w_lhs,
                                                                    num_warps=num_warps,
            **({} if num_stages is None else {"num_stages": num_stages}))
    return partials
