"""Decode attention prologue in one launch: per-head RMSNorm of q and k, rotary on their first R channels
(rotate-half form), and the writes of the rotated k and the raw v into one layer's paged KV pools.

Shape legend: B decode rows, N query heads, M kv heads, D head dim, R rotary dim (even, <= D),
P pages, G tokens per page; a pool [P, G, M, D] is addressed as [P*G, M, D] by flat row = page*G + offset.

Numerics follow adapters/cuda_exec/fast_decoder.py `_attention_decode` (norms.rms_norm, then
rotary.apply_rotary, then `pool[kv_rows] = k.to(pool.dtype)`) with the same rounding points: the norm
statistics in fp32 and its output cast to x's dtype ((1 + w) scaling in fp32 before the cast, or w
after it), then x*cos, rotate_half(x)*sin and their sum each rounded to x's dtype as torch's bf16
elementwise ops are. Only the sum of squares is reduced in the kernel's own order.
Grid (B, N + M): program (b, h) handles q head h for h < N, else kv head h - N (k and v). No host
sync; kv_rows are read on the device (padded rows point at a scratch row, the caller's business).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kp_ptr, vp_ptr, rows_ptr,
                         qo_ptr, N, M, D, R, eps, sq_b, sq_n, sk_b, sk_n, sv_b, sv_n, scs_b,
                         UNIT_OFFSET: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m = head - N  # kv head (negative for q programs, whose kv accesses are all masked off)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    heads = offs * 0 + head  # [BD], as a vector so that masks combine elementwise
    mq = mask & (heads < N)
    mk = mask & (heads >= N)
    half = R // 2
    # rotate-half partner of channel d < R, and its sign: out = x*cos + sign * x[partner] * sin
    partner = tl.where(offs < half, offs + half, tl.where(offs < R, offs - half, offs))
    q_src = q_ptr + b * sq_b + head * sq_n
    k_src = k_ptr + b * sk_b + m * sk_n
    # NOTE: branch-free: each load is masked to the one program kind it belongs to; the other reads 0
    x = (tl.load(q_src + offs, mask=mq, other=0.0)
         + tl.load(k_src + offs, mask=mk, other=0.0)).to(tl.float32)
    xp = (tl.load(q_src + partner, mask=mq, other=0.0)
          + tl.load(k_src + partner, mask=mk, other=0.0)).to(tl.float32)
    w = (tl.load(qw_ptr + offs, mask=mq, other=0.0).to(tl.float32)
         + tl.load(kw_ptr + offs, mask=mk, other=0.0).to(tl.float32))
    wp = (tl.load(qw_ptr + partner, mask=mq, other=0.0).to(tl.float32)
          + tl.load(kw_ptr + partner, mask=mk, other=0.0).to(tl.float32))
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    dt = qo_ptr.dtype.element_ty
    if UNIT_OFFSET:
        y = (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
        yp = (xp * rstd * (1.0 + wp)).to(dt).to(tl.float32)
    else:
        y = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        yp = ((xp * rstd).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
    rot = offs < R
    c = tl.load(cos_ptr + b * scs_b + offs, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + b * scs_b + offs, mask=rot, other=0.0).to(tl.float32)
    yp = tl.where(offs < half, -yp, yp)
    out = ((y * c).to(dt).to(tl.float32) + (yp * s).to(dt).to(tl.float32)).to(dt)
    out = tl.where(rot, out, y.to(dt))  # channels >= R pass through
    tl.store(qo_ptr + b * N * D + head * D + offs, out, mask=mq)
    row = tl.load(rows_ptr + b)
    dst = row * M * D + m * D + offs
    tl.store(kp_ptr + dst, out.to(kp_ptr.dtype.element_ty), mask=mk)
    v = tl.load(v_ptr + b * sv_b + m * sv_n + offs, mask=mk, other=0.0)
    tl.store(vp_ptr + dst, v.to(vp_ptr.dtype.element_ty), mask=mk)


def _check_heads(name: str, t: torch.Tensor, b: int, d: int) -> None:
    if t.dim() != 3 or t.shape[0] != b or t.shape[2] != d or t.stride(2) != 1:
        raise ValueError(f"{name} must be [{b}, heads, {d}] with unit last stride, got {tuple(t.shape)} "
                         f"strides {t.stride()}")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor,
                 k_norm_w: torch.Tensor, eps: float, unit_offset: bool, cos: torch.Tensor, sin: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, kv_rows: torch.Tensor, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Normed, rotated q [B, N, D] (q's dtype); writes rotated k and raw v at pool row kv_rows[b].

    q [B, N, D], k, v [B, M, D] in one float dtype (any head/row strides, unit last stride: q may be a
    chunk of the gated q projection); q_norm_w, k_norm_w [D]; cos, sin [B, R] in q's dtype; k_pool,
    v_pool contiguous [P, G, M, D] (one layer; written in their own dtype); kv_rows int64 [B] flat rows
    in [0, P*G) (not checked on the host: that would sync). out: optional contiguous [B, N, D].
    Raises ValueError on mismatched shapes or dtypes.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, N, D], got {tuple(q.shape)}")
    b, n, d = q.shape
    _check_heads("q", q, b, d)
    _check_heads("k", k, b, d)
    if v.shape != k.shape or v.stride(2) != 1:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} with unit last stride")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    m = k.shape[1]
    for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        if w.shape != (d,) or not w.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{d}], got {tuple(w.shape)}")
    if cos.dim() != 2 or cos.shape[0] != b or sin.shape != cos.shape or cos.stride() != sin.stride() \
            or cos.stride(1) != 1:
        raise ValueError(f"cos, sin must be [{b}, R] with equal strides, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    r = cos.shape[1]
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"rotary dim {r} must be even and in 1..{d}")
    if cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise ValueError(f"cos, sin must be in q's dtype {q.dtype}, got {cos.dtype}, {sin.dtype}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dim() != 4 or pool.shape[2:] != (m, d) or not pool.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [P, G, {m}, {d}], got {tuple(pool.shape)}")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ")
    if kv_rows.shape != (b,) or kv_rows.dtype != torch.int64:
        raise ValueError(f"kv_rows must be int64 [{b}], got {kv_rows.dtype} {tuple(kv_rows.shape)}")
    if out is None:
        out = torch.empty((b, n, d), dtype=q.dtype, device=q.device)
    assert out.shape == (b, n, d) and out.dtype == q.dtype and out.is_contiguous(), "out must be [B, N, D]"
    if b == 0:
        return out
    _qk_norm_rope_kernel[(b, n + m)](q, k, v, q_norm_w, k_norm_w, cos, sin, k_pool, v_pool, kv_rows, out,
                                     n, m, d, r, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                     v.stride(0), v.stride(1), cos.stride(0), UNIT_OFFSET=unit_offset,
                                     BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 128 else 2)
    return out
