"""Gated DeltaNet prefill, step 3 of 3 in one kernel (the "fused" recurrence; prefill.py's default is the
split pair gdn_chunk_state + gdn_chunk_out, see there): the inter-chunk state recurrence and the output, walking the
64-token chunks of one sequence in order from the slot's fp32 state, writing the final state back.

Shape legend: T tokens of the chunk, C conv channels (2*Nk*Dk + Nv*Dv), Nk key heads, Nv value heads
(value head h reads key head h // (Nv/Nk)), Dk key head dim (<= 128), Dv value head dim, Q tokens per
chunk, KB key rows per half (64), BV value columns per program.

Per chunk, with w, u, gc from gdn_chunk_wy and h the [Dk, Dv] state entering the chunk (fp32):
  v' = u - w h
  o  = (q * exp(gc)) h + tril(q k^T * exp(gc_i - gc_j)) v'       (q = l2norm(q) * Dk**-0.5, k = l2norm(k))
  h  = h * exp(gc_last) + (k * exp(gc_last - gc))^T v'
Grid (Nv, Dv / BV): columns of the state are independent, so each program owns a [Dk, BV] state tile
in registers for the whole walk (no grid-wide sync, no per-chunk state stored, one launch per layer);
the small q k^T product is recomputed by the Dv / BV programs of a head instead of being stored.
The state tile and every [Q, Dk] operand are split into two named halves of 64 key rows (Dk = 128 as
in Qwen3.5/3.6): whole [Q, 128] fp32 tiles spill registers on sm_90 (checked with ptxas).
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.gdn_chunk_out import chunk_attention, chunk_output
from adapters.kernels.gdn_chunk_state import (
    CHUNK,
    check_recurrence_inputs,
    chunk_gates,
    core_buffer,
    load_state,
    store_state,
    tiles,
)
from adapters.kernels.gdn_chunk_wy import dot_precision, load_rows

LAUNCH = dict(num_warps=8, num_stages=1)  # see the launcher


@triton.jit
def _gdn_chunk_scan_kernel(
    mixed_ptr, w_ptr, u_ptr, gc_ptr, state_ptr, out_ptr,
    T, q_scale,
    stride_mt, stride_mc,
    stride_wh, stride_wt, stride_wk,
    stride_uh, stride_ut, stride_uv,
    stride_gh, stride_gt,
    stride_sh, stride_sk, stride_sv,
    stride_ot, stride_oh, stride_ov,
    KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_KB: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (h, v-block): state tile [Dk, BV] of value head h (halves h1, h2) through all chunks;
    out[t, h, v-block]. SPLIT: Dk > BLOCK_KB (h2 holds key rows BLOCK_KB..Dk-1)."""
    head = tl.program_id(0)
    vblock = tl.program_id(1)
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    offs_kb = tl.arange(0, BLOCK_KB)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_i = tl.arange(0, CHUNK)
    v_mask = offs_v < DV
    s_base = state_ptr + head * stride_sh
    h1, h2 = load_state(s_base, offs_kb, offs_v, stride_sk, stride_sv, DK, DV, BLOCK_KB, SPLIT)  # [KB, BV] fp32

    q_base = mixed_ptr + key_head * DK * stride_mc
    k_base = mixed_ptr + (KEY_HEADS * DK + key_head * DK) * stride_mc
    w_base = w_ptr + head * stride_wh
    for chunk in range(0, tl.cdiv(T, CHUNK)):
        t0 = chunk * CHUNK
        t_mask = t0 + offs_i < T
        g_last, gc = chunk_gates(gc_ptr + head * stride_gh, t0, T, stride_gt, CHUNK)  # padding carries g_last
        u = load_rows(u_ptr + head * stride_uh, t0, T, stride_ut, stride_uv, vblock * BLOCK_V, DV, CHUNK,
                      BLOCK_V)  # [Q, BV]
        w1 = load_rows(w_base, t0, T, stride_wt, stride_wk, 0, DK, CHUNK, BLOCK_KB)  # [Q, KB]
        v_new = u - tl.dot(w1, h1, input_precision=DOT_PRECISION)  # [Q, BV]
        if SPLIT:
            w2 = load_rows(w_base, t0, T, stride_wt, stride_wk, BLOCK_KB, DK, CHUNK, BLOCK_KB)
            v_new -= tl.dot(w2, h2, input_precision=DOT_PRECISION)
        attn, q1, q2, k1, k2, rq, rk = chunk_attention(q_base, k_base, t0, T, stride_mt, stride_mc, gc, q_scale,
                                                       DK, CHUNK, BLOCK_KB, SPLIT, DOT_PRECISION)
        o = chunk_output(attn, v_new, q1, q2, rq, gc, h1, h2, SPLIT, DOT_PRECISION)  # [Q, BV]
        k_row = rk * tl.exp(g_last - gc)
        decay_last = tl.exp(g_last)
        h1 = h1 * decay_last + tl.dot(tl.trans(k1 * k_row[:, None]), v_new, input_precision=DOT_PRECISION)
        if SPLIT:
            h2 = h2 * decay_last + tl.dot(tl.trans(k2 * k_row[:, None]), v_new, input_precision=DOT_PRECISION)
        o_ptrs = out_ptr + head * stride_oh + t0.to(tl.int64) * stride_ot + offs_i[:, None] * stride_ot \
            + offs_v[None, :] * stride_ov
        tl.store(o_ptrs, o, mask=t_mask[:, None] & v_mask[None, :])

    store_state(s_base, h1, h2, offs_kb, offs_v, stride_sk, stride_sv, DK, DV, BLOCK_KB, SPLIT)


def gdn_chunk_scan(mixed: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor, state: torch.Tensor,
                   num_k_heads: int, *, block_v: int = 32, precise: bool = True,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The chunked delta rule's recurrence and output for one sequence's prefill chunk.

    mixed fp32 [T, C] the conv output (q, k read from it and l2-normed here); w fp32 [Nv, T, Dk],
    u fp32 [Nv, T, Dv], gc fp32 [Nv, T] from gdn_chunk_wy; state fp32 [Nv, Dk, Dv] (Dk <= 128) the slot's
    recurrent state (pool.recurrent[layer, slot]), read as the state before token 0 and overwritten with
    the state after token T-1. block_v: value columns per program (power of two >= 16). precise:
    fp32-accurate products (3xTF32 on a GPU; fp32 models); False: one TF32 pass (bf16 models).
    out: optional fp32 [T, Nv, Dv] buffer. Returns core fp32 [T, Nv, Dv] (before the gated RMSNorm).
    T = 0: state untouched. Raises ValueError on mismatched shapes, dtypes or devices.
    """
    tokens, nv, dk, dv = check_recurrence_inputs(mixed, w, u, gc, state, num_k_heads, block_v)
    out = core_buffer(out, tokens, nv, dv, mixed.device)
    if tokens == 0:
        return out
    block_kb, block_v = tiles(dk, dv, block_v)
    _gdn_chunk_scan_kernel[(nv, triton.cdiv(dv, block_v))](
        mixed, w, u, gc, state, out, tokens, dk ** -0.5,
        *mixed.stride(), *w.stride(), *u.stride(), *gc.stride(), *state.stride(), *out.stride(),
        KEY_HEADS=num_k_heads, VALUE_HEADS=nv, DK=dk, DV=dv, CHUNK=CHUNK, BLOCK_KB=block_kb,
        SPLIT=dk > block_kb, BLOCK_V=block_v, DOT_PRECISION=dot_precision(precise),
        # NOTE: one stage: the chunk loop is a serial recurrence, and the pipeliner's prefetch buffers
        # (num_stages=3) take 288 KB of shared memory at Dk = Dv = 128, more than an H200 SM has.
        **LAUNCH,
    )
    return out
