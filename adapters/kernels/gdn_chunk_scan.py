"""Gated DeltaNet prefill, step 3 of 3: the inter-chunk state recurrence and the output, walking the
64-token chunks of one sequence in order from the slot's fp32 state, writing the final state back.

Shape legend: T tokens of the chunk, C conv channels (2*Nk*Dk + Nv*Dv), Nk key heads, Nv value heads
(value head h reads key head h // (Nv/Nk)), Dk key head dim, Dv value head dim, Q tokens per chunk,
BV value columns per program.

Per chunk, with w, u, gc from gdn_chunk_wy and h the [Dk, Dv] state entering the chunk (fp32):
  v' = u - w h
  o  = (q * exp(gc)) h + tril(q k^T * exp(gc_i - gc_j)) v'       (q = l2norm(q) * Dk**-0.5, k = l2norm(k))
  h  = h * exp(gc_last) + (k * exp(gc_last - gc))^T v'
Grid (Nv, Dv / BV): columns of the state are independent, so each program owns a [Dk, BV] state tile
in registers for the whole walk (no grid-wide sync, one launch per layer); the small q k^T product is
recomputed by the Dv / BV programs of a head instead of being stored.
"""

import torch
import triton
import triton.language as tl

CHUNK = 64


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
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (h, v-block): state tile [Dk, BV] of value head h through all chunks; out[t, h, v-block]."""
    head = tl.program_id(0)
    vblock = tl.program_id(1)
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_i = tl.arange(0, CHUNK)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    causal = offs_i[:, None] >= offs_i[None, :]

    tile = head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    tile_mask = k_mask[:, None] & v_mask[None, :]
    h = tl.load(state_ptr + tile, mask=tile_mask, other=0.0)  # [BK, BV] fp32

    for chunk in range(0, tl.cdiv(T, CHUNK)):
        offs_t = chunk * CHUNK + offs_i
        t_mask = offs_t < T
        t64 = offs_t.to(tl.int64)[:, None]
        qk_mask = t_mask[:, None] & k_mask[None, :]
        q = tl.load(mixed_ptr + t64 * stride_mt + (key_head * DK + offs_k[None, :]) * stride_mc,
                    mask=qk_mask, other=0.0).to(tl.float32)  # [Q, BK]
        k = tl.load(mixed_ptr + t64 * stride_mt + (KEY_HEADS * DK + key_head * DK + offs_k[None, :]) * stride_mc,
                    mask=qk_mask, other=0.0).to(tl.float32)  # [Q, BK]
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * q_scale)[:, None]
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        # the decay through the chunk's last real token: padding has g = 0 (the reference's gc_last), so
        # padded rows carry it too (keeps every exponent below <= 0; their outputs are not stored)
        g_last = tl.load(gc_ptr + head * stride_gh + tl.minimum(chunk * CHUNK + CHUNK, T) * stride_gt - stride_gt)
        gc = tl.load(gc_ptr + head * stride_gh + offs_t * stride_gt, mask=t_mask, other=0.0)  # [Q]
        gc = tl.where(t_mask, gc, g_last)
        w = tl.load(w_ptr + head * stride_wh + t64 * stride_wt + offs_k[None, :] * stride_wk,
                    mask=qk_mask, other=0.0)  # [Q, BK]
        u = tl.load(u_ptr + head * stride_uh + t64 * stride_ut + offs_v[None, :] * stride_uv,
                    mask=t_mask[:, None] & v_mask[None, :], other=0.0)  # [Q, BV]

        v_new = u - tl.dot(w, h, input_precision=DOT_PRECISION)  # [Q, BV]
        # NOTE: exp only on the causal half: there gc_i - gc_j <= 0, above it it could overflow.
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))
        attn = tl.where(causal, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay, 0.0)  # [Q, Q]
        o = tl.dot(q * tl.exp(gc)[:, None], h, input_precision=DOT_PRECISION)
        o = o + tl.dot(attn, v_new, input_precision=DOT_PRECISION)  # [Q, BV]
        tl.store(out_ptr + t64 * stride_ot + head * stride_oh + offs_v[None, :] * stride_ov, o,
                 mask=t_mask[:, None] & v_mask[None, :])
        k_decayed = k * tl.exp(g_last - gc)[:, None]  # [Q, BK]
        h = h * tl.exp(g_last) + tl.dot(tl.trans(k_decayed), v_new, input_precision=DOT_PRECISION)

    tl.store(state_ptr + tile, h, mask=tile_mask)


def gdn_chunk_scan(mixed: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor, state: torch.Tensor,
                   num_k_heads: int, *, block_v: int = 32, precise: bool = True,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The chunked delta rule's recurrence and output for one sequence's prefill chunk.

    mixed fp32 [T, C] the conv output (q, k read from it and l2-normed here); w fp32 [Nv, T, Dk],
    u fp32 [Nv, T, Dv], gc fp32 [Nv, T] from gdn_chunk_wy; state fp32 [Nv, Dk, Dv] the slot's recurrent
    state (pool.recurrent[layer, slot]), read as the state before token 0 and overwritten with the state
    after token T-1. block_v: value columns per program (power of two >= 16). precise: fp32 products in
    full precision; False lets the GPU use tf32. out: optional fp32 [T, Nv, Dv] buffer.
    Returns core fp32 [T, Nv, Dv] (before the gated RMSNorm). T = 0: state untouched.
    Raises ValueError on mismatched shapes, dtypes or devices.
    """
    if state.dim() != 3 or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [Nv, Dk, Dv], got {state.dtype} {tuple(state.shape)}")
    nv, dk, dv = state.shape
    tokens = mixed.shape[0] if mixed.dim() == 2 else -1
    if mixed.dtype != torch.float32 or tokens < 0 or mixed.shape[1] != 2 * num_k_heads * dk + nv * dv:
        raise ValueError(f"mixed must be fp32 [T, 2*{num_k_heads}*{dk} + {nv}*{dv}], got {mixed.dtype} "
                         f"{tuple(mixed.shape)}")
    if num_k_heads <= 0 or nv % num_k_heads:
        raise ValueError(f"value heads {nv} not a multiple of key heads {num_k_heads}")
    for name, t, shape in (("w", w, (nv, tokens, dk)), ("u", u, (nv, tokens, dv)), ("gc", gc, (nv, tokens))):
        if t.shape != shape or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 {shape}, got {t.dtype} {tuple(t.shape)}")
    if len({t.device for t in (mixed, w, u, gc, state)}) != 1:
        raise ValueError("all gdn_chunk_scan tensors must be on one device")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if out is None:
        out = torch.empty(tokens, nv, dv, dtype=torch.float32, device=mixed.device)
    if out.shape != (tokens, nv, dv) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [T, Nv, Dv] = {(tokens, nv, dv)}, got {out.dtype} {tuple(out.shape)}")
    if tokens == 0:
        return out
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    _gdn_chunk_scan_kernel[(nv, triton.cdiv(dv, block_v))](
        mixed, w, u, gc, state, out, tokens, dk ** -0.5,
        *mixed.stride(), *w.stride(), *u.stride(), *gc.stride(), *state.stride(), *out.stride(),
        KEY_HEADS=num_k_heads, VALUE_HEADS=nv, DK=dk, DV=dv, CHUNK=CHUNK,
        BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v,
        DOT_PRECISION="ieee" if precise else "tf32", num_warps=4,
    )
    return out
