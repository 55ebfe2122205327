"""Gated DeltaNet prefill, step 2 of 3: per chunk of Q = 64 tokens and value head, the gates and the WY
(UT-transform) form of the chunk's delta-rule updates; every chunk independent (fully parallel), so one launch
can also take the chunks of several sequences (a chunk table: each chunk's first row and its sequence's end).

Shape legend: T tokens of the chunk, C conv channels (2*Nk*Dk + Nv*Dv), Nk key heads, Nv value heads
(value head h reads key head h // (Nv/Nk)), Dk key head dim, Dv value head dim, Q tokens per chunk.

Math (adapters/torch_exec/gated_deltanet.py chunked_delta_rule, per chunk and head, fp32):
  beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), gc = cumsum of g inside the chunk,
  k = l2norm(k), A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j) for i > j else 0,
  X = (I + A)^-1, u = X (v * beta), w = X (k * beta * exp(gc)),
  and for the split recurrence's state walk ks = |k|^-1 * exp(gc_last - gc) (gc_last: the chunk's last
  real token's), the factor that normalises a key and decays it to its chunk's end.
The inverse by block doubling (BLOCKED_INVERSE, the default: six rounds of M <- M - M C M on tensor
cores, not yet timed on a GPU) or by forward substitution over the rows of the [Q, Q] tile (X is unit lower triangular, each row a
combination of the rows above it); the products on tensor cores.
Tokens past T in the last chunk act as the reference's zero padding (g = 0, beta = 0, k = v = 0).
"""

import torch
import triton
import triton.language as tl

CHUNK = 64
LAUNCH = dict(num_warps=8, num_stages=1)  # see the launcher
TILE = 64  # key / value columns per tile
# (I + A)^-1 by block doubling on tensor cores (True) or by row-by-row forward substitution (False, the
# original; kept for A/B runs: scripts/bench_prefill.py --wy-inverse substitution). Not yet timed on a GPU.
BLOCKED_INVERSE = True


def dot_precision(precise: bool) -> str:
    """tl.dot's input precision: 3xTF32 (fp32-accurate on tensor cores; plain "ieee" fp32 dots run on the
    FMA units and spill kilobytes of registers at these shapes) or one TF32 pass for bf16/fp16 models."""
    return "tf32x3" if precise else "tf32"


@triton.jit
def load_rows(base, t0, T, stride_t, stride_c, col0, COLS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """[ROWS, BLOCK] fp32 tile: rows t0.. (< T) and columns col0.. (< COLS) of a row-major view; zeros outside
    (the reference's zero padding of the last chunk)."""
    offs_r = tl.arange(0, ROWS)
    offs_c = col0 + tl.arange(0, BLOCK)
    ptrs = base + t0.to(tl.int64) * stride_t + offs_r[:, None] * stride_t + offs_c[None, :] * stride_c
    mask = ((t0 + offs_r) < T)[:, None] & (offs_c < COLS)[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gdn_chunk_wy_kernel(
    mixed_ptr, a_ptr, b_ptr, neg_a_ptr, dt_bias_ptr, w_ptr, u_ptr, gc_ptr, ks_ptr, starts_ptr, ends_ptr,
    T,
    stride_mt, stride_mc,
    stride_at, stride_ah,
    stride_bt, stride_bh,
    stride_wh, stride_wt, stride_wk,
    stride_uh, stride_ut, stride_uv,
    stride_gh, stride_gt,
    KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCKED_INVERSE: tl.constexpr, LOG2_CHUNK: tl.constexpr, SPANS: tl.constexpr,
):
    """Program (chunk, value head): writes gc [Q], ks [Q], w [Q, Dk], u [Q, Dv] of its rows (fp32). Key and value
    columns go in tiles of TILE (whole [Q, 128] fp32 tiles spill registers on sm_90)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    if SPANS:  # the chunk's first row and its sequence's end (exclusive) from the chunk table
        t0 = tl.load(starts_ptr + chunk).to(tl.int32)
        end = tl.load(ends_ptr + chunk).to(tl.int32)
    else:
        t0 = chunk * CHUNK
        end = T
    offs_i = tl.arange(0, CHUNK)
    offs_t = t0 + offs_i
    t_mask = offs_t < end
    k_base = mixed_ptr + (KEY_HEADS * DK + key_head * DK) * stride_mc
    v_base = mixed_ptr + (2 * KEY_HEADS * DK + head * DV) * stride_mc

    beta = tl.sigmoid(tl.load(b_ptr + offs_t * stride_bt + head * stride_bh, mask=t_mask, other=0.0).to(tl.float32))
    beta = tl.where(t_mask, beta, 0.0)
    x = tl.load(a_ptr + offs_t * stride_at + head * stride_ah, mask=t_mask, other=0.0).to(tl.float32)
    x = x + tl.load(dt_bias_ptr + head)
    # softplus with torch's threshold 20 (linear above it)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = tl.where(t_mask, tl.load(neg_a_ptr + head) * softplus, 0.0)
    gc = tl.cumsum(g, 0)  # [Q] log decay from the chunk start through token i

    # k k^T and the row norms over key-column tiles; normalising after the product is the same math
    sk = tl.zeros((CHUNK,), dtype=tl.float32)
    kk = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    for k0 in tl.static_range(0, BLOCK_K, TILE):
        kt = load_rows(k_base, t0, end, stride_mt, stride_mc, k0, DK, CHUNK, TILE)  # [Q, TILE]
        sk += tl.sum(kt * kt, 1)
        kk += tl.dot(kt, tl.trans(kt), input_precision=DOT_PRECISION)
    rk = tl.rsqrt(sk + 1e-6)  # [Q] l2norm of k

    lower = offs_i[:, None] > offs_i[None, :]  # strictly lower
    # NOTE: exp only where i > j: gc_i - gc_j <= 0 there; above the diagonal it could overflow.
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
    neg = tl.where(lower, -kk * ((beta * rk)[:, None] * rk[None, :]) * decay, 0.0)  # -A

    eye = tl.where(offs_i[:, None] == offs_i[None, :], 1.0, 0.0)
    if BLOCKED_INVERSE:
        # Block doubling: M holds the inverses of L = I + A's diagonal blocks of size b (b = 1: I). Joining
        # the two halves of every 2b block, [[X1, 0], [C, X2]]^-1's corner is -X2 C X1, i.e. for all blocks
        # at once M <- M - M C M, C the L entries of the joins. log2(Q) = 6 rounds of two [Q, Q] products on
        # tensor cores instead of Q - 1 dependent row updates with cross-warp reductions, at the w and u
        # products' precision (3xTF32 for fp32 models; one TF32 pass for bf16/fp16 ones, whose rounding stays
        # below the model dtype's; 3xTF32 there spilled 392 B a thread on sm_90). The exact block-triangular
        # inverse, not a series: in fp32 it came closer to a float64 inverse than the substitution did
        # (7.7e-7 against 3.2e-6 on nearly parallel keys, test_wy_inverse_by_doubling_or_substitution_...).
        rows, cols = offs_i[:, None], offs_i[None, :]
        inv = eye
        for level in range(LOG2_CHUNK):  # not unrolled: six unrolled rounds spill ~2 KiB a thread
            # (i, j) in one block of 2^(level+1) rows, i in its lower half, j in its upper half
            join = (rows >> (level + 1) == cols >> (level + 1)) & (rows >> level == (cols >> level) + 1)
            c = tl.where(join, -neg, 0.0)  # A's entries there (L = I + A off the diagonal)
            inv = inv - tl.dot(tl.dot(inv, c, input_precision=DOT_PRECISION), inv, input_precision=DOT_PRECISION)
    else:
        # Forward substitution: row i of N = X - I is -A[i] + sum_{j<i} (-A[i, j]) N[j]; rows above i
        # already hold N, rows below still hold -A.
        for i in range(1, CHUNK):
            pick = offs_i == i
            row = tl.sum(tl.where(pick[:, None], neg, 0.0), 0)  # [Q] = -A[i]
            row = row + tl.sum(row[:, None] * neg, 0) * (offs_i < i)
            neg = tl.where(pick[:, None], row[None, :], neg)
        inv = neg + eye  # X = (I + A)^-1

    t64 = offs_t.to(tl.int64)[:, None]
    offs_c = tl.arange(0, TILE)
    k_scale = beta * rk * tl.exp(gc)  # [Q]
    for k0 in tl.static_range(0, BLOCK_K, TILE):
        kt = load_rows(k_base, t0, end, stride_mt, stride_mc, k0, DK, CHUNK, TILE)
        w = tl.dot(inv, kt * k_scale[:, None], input_precision=DOT_PRECISION)  # [Q, TILE]
        tl.store(w_ptr + head * stride_wh + t64 * stride_wt + (k0 + offs_c)[None, :] * stride_wk, w,
                 mask=t_mask[:, None] & ((k0 + offs_c) < DK)[None, :])
    for v0 in tl.static_range(0, BLOCK_V, TILE):
        vt = load_rows(v_base, t0, end, stride_mt, stride_mc, v0, DV, CHUNK, TILE)
        u = tl.dot(inv, vt * beta[:, None], input_precision=DOT_PRECISION)  # [Q, TILE]
        tl.store(u_ptr + head * stride_uh + t64 * stride_ut + (v0 + offs_c)[None, :] * stride_uv, u,
                 mask=t_mask[:, None] & ((v0 + offs_c) < DV)[None, :])
    tl.store(gc_ptr + head * stride_gh + offs_t * stride_gt, gc, mask=t_mask)
    # padded rows have g = 0, so the cumsum's last entry is the last real token's: the walk's g_last
    g_last = tl.sum(tl.where(offs_i == CHUNK - 1, gc, 0.0), 0)
    tl.store(ks_ptr + head * stride_gh + offs_t * stride_gt, rk * tl.exp(g_last - gc), mask=t_mask)


def gdn_chunk_wy(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor,
                 dt_bias: torch.Tensor, num_k_heads: int, k_head_dim: int, v_head_dim: int, *,
                 precise: bool = True, chunks: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gates and WY form of one sequence's prefill chunk, per 64-token chunk and value head.

    mixed fp32 [T, C] the conv output ([q | k | v] channels, q and k not yet normalised); a, b [T, Nv]
    in_proj_a / in_proj_b outputs (any float dtype); neg_a = -exp(A_log), dt_bias fp32 [Nv].
    precise: fp32-accurate products (3xTF32 on a GPU; fp32 models); False: one TF32 pass (bf16 models).
    Returns (w fp32 [Nv, T, Dk], u fp32 [Nv, T, Dv], gc fp32 [Nv, T], ks fp32 [Nv, T]) as defined in the
    module docstring; gc restarts at every 64-token boundary.
    chunks: several sequences' chunks in one launch (the rows of a whole step): (starts, ends) int64 [NC] on
    mixed's device, chunk c is rows starts[c] .. min(starts[c] + 64, ends[c]) - 1 with ends[c] its sequence's
    end (exclusive); a sequence's chunks start 64 rows apart from its first row, as the one-sequence call's
    do from row 0, so each row gets what that call on the sequence alone gives it. Rows in no chunk are not
    written. Not checked on the host (that would sync): chunks inside [0, T), disjoint.
    Raises ValueError on mismatched shapes, dtypes or devices.
    """
    if mixed.dim() != 2 or mixed.dtype != torch.float32:
        raise ValueError(f"mixed must be fp32 [T, C], got {mixed.dtype} {tuple(mixed.shape)}")
    tokens = mixed.shape[0]
    nv = neg_a.shape[0] if neg_a.dim() == 1 else -1
    if nv <= 0 or num_k_heads <= 0 or nv % num_k_heads:
        raise ValueError(f"value heads {nv} must be a positive multiple of key heads {num_k_heads}")
    if mixed.shape[1] != 2 * num_k_heads * k_head_dim + nv * v_head_dim:
        raise ValueError(f"mixed has {mixed.shape[1]} channels, need 2*{num_k_heads}*{k_head_dim} + {nv}*{v_head_dim}")
    if a.shape != (tokens, nv) or b.shape != (tokens, nv):
        raise ValueError(f"a and b must be [T, Nv] = {(tokens, nv)}, got {tuple(a.shape)} and {tuple(b.shape)}")
    for name, t in (("neg_a", neg_a), ("dt_bias", dt_bias)):
        if t.shape != (nv,) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [Nv={nv}], got {t.dtype} {tuple(t.shape)}")
    if len({t.device for t in (mixed, a, b, neg_a, dt_bias)}) != 1:
        raise ValueError("all gdn_chunk_wy tensors must be on one device")
    if chunks is not None:
        starts, ends = chunks
        count = starts.shape[0] if starts.dim() == 1 else -1
        for name, t in (("starts", starts), ("ends", ends)):
            if t.shape != (count,) or t.dtype != torch.int64 or t.device != mixed.device or not t.is_contiguous():
                raise ValueError(f"chunk {name} must be a contiguous int64 [NC] on {mixed.device}, got {t.dtype} "
                                 f"{tuple(t.shape)}")
    dev = mixed.device
    w = torch.empty(nv, tokens, k_head_dim, dtype=torch.float32, device=dev)
    u = torch.empty(nv, tokens, v_head_dim, dtype=torch.float32, device=dev)
    gc = torch.empty(nv, tokens, dtype=torch.float32, device=dev)
    ks = torch.empty_like(gc)  # same strides as gc: the kernels index both with gc's
    grid = (triton.cdiv(tokens, CHUNK), nv) if chunks is None else (count, nv)
    if tokens == 0 or grid[0] == 0:
        return w, u, gc, ks
    # NOTE: the table is unread without SPANS and T with it; a constant T keeps one binary for every step size
    table, t_arg = ((mixed, mixed), tokens) if chunks is None else (chunks, 0)
    block_k = max(16, triton.next_power_of_2(k_head_dim))
    block_v = max(16, triton.next_power_of_2(v_head_dim))
    # NOTE: at least 32 columns a tile: with 16-column tiles the blocked inverse at 3xTF32 hit an illegal
    # address on sm_90 (Triton 3.6, 2026-12-01; the substitution and one-pass TF32 did not); wider tiles are
    # masked past Dk / Dv like the last tile of any head.
    tile = min(TILE, max(32, min(block_k, block_v)))
    _gdn_chunk_wy_kernel[grid](
        mixed, a, b, neg_a, dt_bias, w, u, gc, ks, *table, t_arg,
        *mixed.stride(), *a.stride(), *b.stride(), *w.stride(), *u.stride(), *gc.stride(),
        KEY_HEADS=num_k_heads, VALUE_HEADS=nv, DK=k_head_dim, DV=v_head_dim, CHUNK=CHUNK,
        BLOCK_K=block_k, BLOCK_V=block_v, TILE=tile, DOT_PRECISION=dot_precision(precise),
        BLOCKED_INVERSE=BLOCKED_INVERSE, LOG2_CHUNK=CHUNK.bit_length() - 1, SPANS=chunks is not None, **LAUNCH,
    )
    return w, u, gc, ks
