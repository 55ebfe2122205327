"""Gated DeltaNet prefill, step 3b of the split recurrence: every chunk's output at once, from the state
entering the chunk and its corrected values v' (both written by gdn_chunk_state).

Shape legend: T tokens of the window, C conv channels (2*Nk*Dk + Nv*Dv), Nk key heads, Nv value heads
(value head h reads key head h // (Nv/Nk)), Dk key head dim (<= 128), Dv value head dim, Q tokens per
chunk, NT chunks (cdiv(T, Q)), KB key rows per half (64), BV value columns per program.

Per chunk, value head and block of value columns (q = l2norm(q) * Dk**-0.5, k = l2norm(k), h = hs[chunk]):
  o = tril(q k^T * exp(gc_i - gc_j)) v' + (q * exp(gc)) h
the same operations, in the same order, as gdn_chunk_scan's output, so o is bitwise its value.
Grid (NT, Nv, Dv / BV): no dependency between programs (the serial part is gdn_chunk_state's).
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.gdn_chunk_state import (
    CHUNK,
    check_launch,
    check_recurrence_inputs,
    chunk_gates,
    core_buffer,
    load_state,
    tiles,
)
from adapters.kernels.gdn_chunk_wy import dot_precision, load_rows

# 64 value columns, 4 warps: 2.34x the former 32 x 8 warps at 4k and 8k tokens on an H100 (session 30, Triton 3.6:
# 239 registers, no spill; docs/bench/2026-12-06-s30-h100-bench-kernels-gdn-out.json). At 32 columns each of a
# chunk's 4 programs recomputed q k^T and re-read q, k; at 64 two do. Read at call time, as BLOCK_V:
# scripts/bench_kernels.py --only gdn-out times the others (docs/prefill-kernels.md, "The output's launch
# configuration").
LAUNCH = dict(num_warps=4, num_stages=1)
BLOCK_V = 64


@triton.jit
def chunk_attention(q_base, k_base, t0, T, stride_t, stride_c, gc, q_scale, DK: tl.constexpr, CHUNK: tl.constexpr,
                    BLOCK_KB: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The chunk's intra-chunk attention attn [Q, Q] = tril(q k^T * exp(gc_i - gc_j)) with q, k l2-normed
    (q also scaled), and what the output and the state update reuse: the raw [Q, KB] halves q1, q2, k1, k2
    (q2 = q1, k2 = k1 when not SPLIT) and the row factors rq [Q] (|q|^-1 * q_scale), rk [Q] (|k|^-1).
    q_base/k_base: the head's first column in the conv output; gc: chunk_gates' [Q]."""
    offs_i = tl.arange(0, CHUNK)
    causal = offs_i[:, None] >= offs_i[None, :]
    q1 = load_rows(q_base, t0, T, stride_t, stride_c, 0, DK, CHUNK, BLOCK_KB)  # [Q, KB]
    k1 = load_rows(k_base, t0, T, stride_t, stride_c, 0, DK, CHUNK, BLOCK_KB)
    sq = tl.sum(q1 * q1, 1)
    sk = tl.sum(k1 * k1, 1)
    qk = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)  # [Q, Q] before the norms
    if SPLIT:
        q2 = load_rows(q_base, t0, T, stride_t, stride_c, BLOCK_KB, DK, CHUNK, BLOCK_KB)
        k2 = load_rows(k_base, t0, T, stride_t, stride_c, BLOCK_KB, DK, CHUNK, BLOCK_KB)
        sq += tl.sum(q2 * q2, 1)
        sk += tl.sum(k2 * k2, 1)
        qk += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
    else:
        q2, k2 = q1, k1
    rq = tl.rsqrt(sq + 1e-6) * q_scale  # [Q] l2norm then Dk**-0.5
    rk = tl.rsqrt(sk + 1e-6)
    # NOTE: exp only on the causal half: there gc_i - gc_j <= 0, above it it could overflow.
    decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))
    attn = tl.where(causal, qk * (rq[:, None] * rk[None, :]) * decay, 0.0)  # [Q, Q]
    return attn, q1, q2, k1, k2, rq, rk


@triton.jit
def chunk_output(attn, v_new, q1, q2, rq, gc, h1, h2, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """o [Q, BV] = attn v' + (q * rq * exp(gc)) h for the state halves h1, h2 entering the chunk."""
    o = tl.dot(attn, v_new, input_precision=DOT_PRECISION)  # [Q, BV]
    q_row = rq * tl.exp(gc)
    o += tl.dot(q1 * q_row[:, None], h1, input_precision=DOT_PRECISION)
    if SPLIT:
        o += tl.dot(q2 * q_row[:, None], h2, input_precision=DOT_PRECISION)
    return o


# chunk0 varies with the launch: one binary for every step
@triton.jit(do_not_specialize=["chunk0"])
def _gdn_chunk_out_kernel(
    mixed_ptr, v_ptr, gc_ptr, hs_ptr, out_ptr, starts_ptr, ends_ptr,
    T, chunk0, q_scale,
    stride_mt, stride_mc,
    stride_vh, stride_vt, stride_vv,
    stride_gh, stride_gt,
    stride_hh, stride_hc, stride_hk, stride_hv,
    stride_ot, stride_oh, stride_ov,
    KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_KB: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPANS: tl.constexpr,
):
    """Program (chunk, h, v-block): out[chunk rows, h, v-block] for hs chunk `chunk`. SPANS: its rows are
    chunk chunk0 + chunk of the (starts, ends) table (rows starts .. min(starts + 64, ends) - 1); else rows
    chunk*64 .. of 0..T-1. SPLIT: Dk > BLOCK_KB (two key halves)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    vblock = tl.program_id(2)
    if SPANS:
        t0 = tl.load(starts_ptr + chunk0 + chunk).to(tl.int32)  # rows as the one-sequence kernel has them
        T = tl.load(ends_ptr + chunk0 + chunk).to(tl.int32)
    else:
        t0 = chunk * CHUNK
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    offs_kb = tl.arange(0, BLOCK_KB)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_i = tl.arange(0, CHUNK)
    t_mask = t0 + offs_i < T

    _, gc = chunk_gates(gc_ptr + head * stride_gh, t0, T, stride_gt, CHUNK)  # [Q]
    q_base = mixed_ptr + key_head * DK * stride_mc
    k_base = mixed_ptr + (KEY_HEADS * DK + key_head * DK) * stride_mc
    attn, q1, q2, _, _, rq, _ = chunk_attention(q_base, k_base, t0, T, stride_mt, stride_mc, gc, q_scale, DK,
                                                CHUNK, BLOCK_KB, SPLIT, DOT_PRECISION)
    v_new = load_rows(v_ptr + head * stride_vh, t0, T, stride_vt, stride_vv, vblock * BLOCK_V, DV, CHUNK,
                      BLOCK_V)  # [Q, BV]
    h1, h2 = load_state(hs_ptr + head * stride_hh + chunk.to(tl.int64) * stride_hc, offs_kb, offs_v, stride_hk,
                        stride_hv, DK, DV, BLOCK_KB, SPLIT)  # [KB, BV] the state entering the chunk
    o = chunk_output(attn, v_new, q1, q2, rq, gc, h1, h2, SPLIT, DOT_PRECISION)
    o_ptrs = out_ptr + head * stride_oh + t0.to(tl.int64) * stride_ot + offs_i[:, None] * stride_ot \
        + offs_v[None, :] * stride_ov
    tl.store(o_ptrs, o, mask=t_mask[:, None] & (offs_v < DV)[None, :])


def gdn_chunk_out(mixed: torch.Tensor, v_new: torch.Tensor, gc: torch.Tensor, states: torch.Tensor,
                  num_k_heads: int, *, block_v: int | None = None, precise: bool = True,
                  out: torch.Tensor | None = None,
                  chunks: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """The chunked delta rule's output for one window, every chunk in parallel.

    mixed fp32 [T, C] the conv output (q, k read from it and l2-normed here); v_new fp32 [Nv, T, Dv] and
    states fp32 [Nv, NT, Dk, Dv] as gdn_chunk_state leaves them (its u and its return value); gc fp32
    [Nv, T] from gdn_chunk_wy; views with any strides are fine. block_v (default BLOCK_V), precise: as
    gdn_chunk_state's. num_warps, num_stages: the launch (default LAUNCH's, read at call time; the ranges of
    gdn_chunk_state.check_launch). Any block_v / num_warps / num_stages gives the same values within fp32 rounding
    (the same operations per element, tiled otherwise across programs).
    out: optional fp32 [T, Nv, Dv] (a view is fine). Returns core fp32 [T, Nv, Dv] (before the gated
    RMSNorm).
    chunks: (starts, ends, chunk0) for a walk over several spans' pieces (gdn_chunk_state's walk): hs chunk i
    is rows starts[chunk0 + i] .. min(+64, ends[chunk0 + i]) - 1 (gdn_chunk_wy's chunk table, int64 [NC]);
    only those rows of out are written. Not checked on the host (that would sync): chunks inside [0, T).
    Raises ValueError on mismatched shapes, dtypes or devices, or a launch outside those ranges (before anything
    is written).
    """
    num_warps, num_stages = check_launch(LAUNCH["num_warps"] if num_warps is None else num_warps,
                                         LAUNCH["num_stages"] if num_stages is None else num_stages)
    block_v = BLOCK_V if block_v is None else block_v
    if states.dim() != 4:
        raise ValueError(f"states must be fp32 [Nv, NT, Dk, Dv], got {tuple(states.shape)}")
    count = states.shape[1]
    # one chunk's entry state carries the [Nv, Dk, Dv] shape the shared checks want (a size-0 view at T = 0)
    tokens, nv, dk, dv = check_recurrence_inputs(mixed, None, v_new, gc, states.select(1, 0) if count
                                                 else states.sum(1), num_k_heads, block_v)
    if chunks is None and count != triton.cdiv(tokens, CHUNK):
        raise ValueError(f"states has {count} chunks, T={tokens} needs {triton.cdiv(tokens, CHUNK)}")
    if chunks is not None:
        starts, ends, chunk0 = chunks
        for name, t in (("starts", starts), ("ends", ends)):
            if t.dim() != 1 or t.dtype != torch.int64 or t.device != mixed.device or t.stride(0) != 1:
                raise ValueError(f"chunk {name} must be a unit-stride int64 [NC] on {mixed.device}, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if chunk0 < 0 or chunk0 + count > starts.shape[0] or ends.shape != starts.shape:
            raise ValueError(f"chunks {chunk0}+{count} outside a chunk table of {tuple(starts.shape)} / "
                             f"{tuple(ends.shape)}")
    out = core_buffer(out, tokens, nv, dv, mixed.device)
    if tokens == 0 or count == 0:
        return out
    block_kb, block_v = tiles(dk, dv, block_v)
    # NOTE: the table is unread without SPANS; with it a constant T keeps one binary for every step size
    table, t_arg, chunk0 = ((mixed, mixed), tokens, 0) if chunks is None else (chunks[:2], 0, chunks[2])
    _gdn_chunk_out_kernel[(count, nv, triton.cdiv(dv, block_v))](
        mixed, v_new, gc, states, out, *table, t_arg, chunk0, dk ** -0.5,
        *mixed.stride(), *v_new.stride(), *gc.stride(), *states.stride(), *out.stride(),
        KEY_HEADS=num_k_heads, VALUE_HEADS=nv, DK=dk, DV=dv, CHUNK=CHUNK, BLOCK_KB=block_kb,
        SPLIT=dk > block_kb, BLOCK_V=block_v, DOT_PRECISION=dot_precision(precise), SPANS=chunks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
