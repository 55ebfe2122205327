"""Routed experts for prefill, first half, on tensor cores: h = silu(x @ gate^T) * (x @ up^T) for the
(token, top-k) pairs grouped by expert slot (moe_align), gate and up read straight from the expert's
packed row in the slot pool and dequantized inside the K loop (all seven formats, dequant_tile.py).

Shape legend: T tokens, K top-k columns, H hidden, I expert intermediate, S slots, R row bytes,
BM rows per block, B blocks, P = B*BM padded rows.
  x [T, H] float; alignment (pairs int32 [P], block_slots int32 [B]); slots uint8 [S, R];
  h [P, I] in x.dtype, row p belonging to pair pairs[p] (padding rows: zeros).
Grid: (B, cdiv(I, BLOCK_N)): one program multiplies the BM gathered rows of x of one block (all of one
slot) by a BLOCK_N-row tile of gate and of up, BLOCK_K = 128 columns per step, fp32 accumulators.
Blocks whose slot is -1 (past the last used block) exit at once. A row's result depends only on its
token and its expert, not on the other rows of its block (so not on the pool size or the grouping).
No host syncs.
W_LHS (constexpr; not with e4m3 activations): both tiles computed transposed, acc [BLOCK_N, BM] = w @ x^T with
the converted gate/up tiles as the dots' left operands (kept in registers as the sm_90 wgmma A operand, the wgmma
waited for a step later instead of at once; dense_gemm.py says why), silu(g) * u taken on the transposed tiles
and stored transposed (the same h). The block-FP8 scale is folded into the tiles before the cast to x.dtype:
the reference's rounding of the weights (dequant_tile.w_tile_folded). It also gives BM = 16 blocks a wgmma
(BLOCK_N is its M). The autotuner tries dequant_tile.GROUPED_W_LHS_TILES next to GROUPED_TILES.
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
def _moe_grouped_gate_up_kernel(x_ptr, xs_ptr, pairs_ptr, block_slots_ptr, slots_ptr, h_ptr, S,
                                K: tl.constexpr, H: tl.constexpr, I: tl.constexpr, R: tl.constexpr,
                                G_DATA: tl.constexpr, G_SCALE: tl.constexpr, G_GSCALE: tl.constexpr,
                                U_DATA: tl.constexpr, U_SCALE: tl.constexpr, U_GSCALE: tl.constexpr,
                                W_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, FMT: tl.constexpr,
                                GROUP: tl.constexpr, F32_DOT: tl.constexpr, PRECISION: tl.constexpr, A8: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                W_LHS: tl.constexpr):
    # W_LHS: transposed tiles acc_t [BN, BM], the weight the dot's left operand (module docstring)
    tl.static_assert(not (W_LHS and A8), "W_LHS is the bf16/fp16-activation path")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slots_ptr + pid_m)
    tl.device_assert(slot < S, "slot id past the pool")
    if slot >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        pair = tl.load(pairs_ptr + rows)  # [BM]; -1 on padding rows
        live = pair >= 0
        tok = tl.where(live, pair // K, 0).to(tl.int64)  # [BM]
        x_rows = x_ptr + tok * H  # [BM] token rows of x (A8: of its e4m3 values)
        row = slots_ptr + slot.to(tl.int64) * R  # int64: S * R passes 2^31 at real pool sizes
        g_data = (row + G_DATA).to(tl.pointer_type(W_DTYPE))
        u_data = (row + U_DATA).to(tl.pointer_type(W_DTYPE))
        g_scale = (row + G_SCALE).to(tl.pointer_type(S_DTYPE))
        u_scale = (row + U_SCALE).to(tl.pointer_type(S_DTYPE))
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of gate/up = columns of h
        if W_LHS:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            s_g = 1.0
            s_u = 1.0
            if FMT == 1:
                s_g = block_scale(g_scale, pid_n * BLOCK_N, k0, H, GROUP)
                s_u = block_scale(u_scale, pid_n * BLOCK_N, k0, H, GROUP)
            if A8:  # e4m3 x e4m3; each step's sum times the rows' group scale (BLOCK_K = 128 = the group)
                a = fp8_rows(x_rows.to(tl.pointer_type(tl.uint8)), kk, live[:, None] & (kk < H)[None, :])  # [BM, BK]
                a_s = tl.load(xs_ptr + tok * ((H + BLOCK_K - 1) // BLOCK_K) + k0 // BLOCK_K)[:, None]  # [BM, 1]
                acc_g = a8_dot_step(acc_g, a, fp8_tile(g_data, n, k0, I, H, BLOCK_N, BLOCK_K), a_s * s_g, F32_DOT)
                acc_u = a8_dot_step(acc_u, a, fp8_tile(u_data, n, k0, I, H, BLOCK_N, BLOCK_K), a_s * s_u, F32_DOT)
            else:
                a = tl.load(x_rows[:, None] + kk[None, :], mask=live[:, None] & (kk < H)[None, :], other=0.0)  # [BM, BK]
                dt = x_ptr.dtype.element_ty
                if W_LHS:  # block-FP8 scales folded into the tiles: no per-step product on the dots' results
                    w_g = w_tile_folded(g_data, g_scale, n, k0, s_g, I, H, FMT, GROUP, BLOCK_N, BLOCK_K, dt)  # [BN, BK]
                    w_u = w_tile_folded(u_data, u_scale, n, k0, s_u, I, H, FMT, GROUP, BLOCK_N, BLOCK_K, dt)  # [BN, BK]
                    acc_g = dot_step_t(acc_g, a, w_g, F32_DOT, PRECISION)  # [BN, BM]
                    acc_u = dot_step_t(acc_u, a, w_u, F32_DOT, PRECISION)  # [BN, BM]
                else:
                    w_g = w_tile(g_data, g_scale, n, k0, I, H, FMT, GROUP, BLOCK_N, BLOCK_K, dt)  # [BN, BK]
                    w_u = w_tile(u_data, u_scale, n, k0, I, H, FMT, GROUP, BLOCK_N, BLOCK_K, dt)  # [BN, BK]
                    acc_g = dot_step(acc_g, a, w_g, FMT, s_g, F32_DOT, PRECISION)
                    acc_u = dot_step(acc_u, a, w_u, FMT, s_u, F32_DOT, PRECISION)
        g_gscale = (row + G_GSCALE).to(tl.pointer_type(tl.float32))
        u_gscale = (row + U_GSCALE).to(tl.pointer_type(tl.float32))
        if W_LHS:
            g = row_scale_t(acc_g, g_scale, g_gscale, n, I, FMT)
            u = row_scale_t(acc_u, u_scale, u_gscale, n, I, FMT)
        else:
            g = row_scale(acc_g, g_scale, g_gscale, n, I, FMT)
            u = row_scale(acc_u, u_scale, u_gscale, n, I, FMT)
        h = (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty)  # W_LHS [BN, BM], else [BM, BN]; the decode's expression
        if W_LHS:
            tl.store(h_ptr + rows[None, :].to(tl.int64) * I + n[:, None], h, mask=(n < I)[:, None])
        else:
            tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n[None, :], h, mask=(n < I)[None, :])


_TUNED = triton.autotune(configs=grouped_configs(), key=["K", "H", "I", "R", "FMT", "BLOCK_M", "A8"],
                         prune_configs_by={"early_config_prune": grouped_pruner(2, n_dim="I", k_dim="H")},
                         cache_results=True)(_moe_grouped_gate_up_kernel)


def moe_grouped_gate_up(x: torch.Tensor | Fp8Rows, align: Alignment, top_k: int, slots: torch.Tensor,
                        layout: ExpertLayout, out: torch.Tensor | None = None, block_n: int | None = None,
                        num_warps: int = 4, num_stages: int | None = None,
                        out_dtype: torch.dtype = torch.bfloat16, w_lhs: bool = False) -> torch.Tensor:
    """h [P, I]: silu(x[t] @ gate^T) * (x[t] @ up^T) for each padded row of `align`, t = pair // top_k,
    gate/up those of the block's slot; fp32 accumulation, h rounded once to its dtype (as the decode path).

    x [T, H] bf16/fp16/fp32 contiguous (h in x.dtype), or Fp8Rows (act_quant_fp8: the W8A8 path, FP8 block /
    tensor / channel layouts only; h in out_dtype); align: moe_align.align_by_slot(slot_ids [T, top_k], S, BM)
    with BM >= 16 (pair indices must be < T * top_k, slots < S: checked on the device only in debug builds);
    slots uint8 [S, R] contiguous, rows packed by `layout`. out: optional contiguous [P, I] of h's dtype.
    block_n: a fixed tile width (power of two, 16..128); None: on CUDA the measured best tile, else 64.
    num_warps/num_stages: the fixed tile's launch options (num_stages None: Triton's default).
    w_lhs: compute the tiles transposed, the weight as the dots' left operand (module docstring; not with
    Fp8Rows); True always launches a fixed tile (block_n None: 64); the autotuner (w_lhs False, block_n None,
    CUDA) measures both arrangements itself.
    Rows of blocks past the last used one are left unwritten. Raises ValueError on any mismatch.
    """
    a8 = isinstance(x, Fp8Rows)
    if a8:
        if layout_consts(layout).fmt_code not in A8_FORMATS:
            raise ValueError(f"moe_grouped_gate_up: FP8 activations need an FP8 weight layout, got {layout.fmt}")
        if x.q.dim() != 2 or x.scales.shape != (x.q.shape[0], -(-x.q.shape[1] // A8_GROUP)):
            raise ValueError(f"moe_grouped_gate_up: Fp8Rows with q {tuple(x.q.shape)} and scales {tuple(x.scales.shape)}")
    elif x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"moe_grouped_gate_up: x must be bf16/fp16/fp32 [T, H], got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != layout.hidden:
        raise ValueError(f"moe_grouped_gate_up: x has H={x.shape[1]}, layout has H={layout.hidden}")
    if slots.dtype != torch.uint8 or slots.dim() != 2 or slots.shape[1] != layout.row_bytes or not slots.is_contiguous():
        raise ValueError(f"moe_grouped_gate_up: slots must be contiguous uint8 [S, {layout.row_bytes}], "
                         f"got {slots.dtype} {tuple(slots.shape)}")
    if x.device != slots.device:
        raise ValueError(f"moe_grouped_gate_up: x on {x.device}, slots on {slots.device}")
    if top_k < 1:
        raise ValueError(f"moe_grouped_gate_up: top_k must be >= 1, got {top_k}")
    if block_n is not None and (block_n < 16 or block_n > 128 or block_n & (block_n - 1)):
        raise ValueError(f"moe_grouped_gate_up: block_n={block_n} must be a power of two in 16..128")
    check_w_lhs(w_lhs, a8, "moe_grouped_gate_up")
    rows = check_alignment(align, slots, "moe_grouped_gate_up")
    inter = layout.intermediate
    h_dtype = out_dtype if a8 else x.dtype
    if out is None:
        out = torch.empty((rows, inter), dtype=h_dtype, device=x.device)
    elif out.shape != (rows, inter) or out.dtype != h_dtype or not out.is_contiguous():
        raise ValueError(f"moe_grouped_gate_up: out must be contiguous {h_dtype} [{rows}, {inter}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    if rows == 0:
        return out
    c = layout_consts(layout)
    xq, xs = (x.q, x.scales) if a8 else (x.contiguous(), x)  # without A8 the scale pointer is never read
    args = (xq, xs, align.pairs, align.block_slots, slots, out, slots.shape[0])
    consts = dict(K=top_k, H=layout.hidden, I=inter, R=c.row_bytes,
                  G_DATA=c.gate.data, G_SCALE=c.gate.scale, G_GSCALE=c.gate.global_scale,
                  U_DATA=c.up.data, U_SCALE=c.up.scale, U_GSCALE=c.up.global_scale,
                  W_DTYPE=c.gate.w_dtype, S_DTYPE=scale_dtype(c.fmt_code), FMT=c.fmt_code, GROUP=max(c.group, 1),
                  BLOCK_M=align.block_m, A8=a8, **dot_modes(xq))
    blocks = align.block_slots.numel()
    if slots.is_cuda and block_n is None and not w_lhs:
        _TUNED[lambda meta: (blocks, triton.cdiv(inter, meta["BLOCK_N"]))](*args, **consts)
    else:
        bn = block_n or 64
        _moe_grouped_gate_up_kernel[(blocks, triton.cdiv(inter, bn))](*args, **consts, BLOCK_N=bn,
                                                                      BLOCK_K=GROUPED_BLOCK_K, W_LHS=w_lhs,
                                                                      num_warps=num_warps,
            **({} if num_stages is None else {"num_stages": num_stages}))
    return out
