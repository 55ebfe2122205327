"""Paged decode attention (flash-decoding): one query token per sequence over its paged K/V, GQA,
fp32 softmax; the KV range is cut into a static number of splits, merged by paged_decode_combine.

Shape legend: B sequences (batch rows, padded rows included), N query heads, M kv heads, g = N/M query
heads per kv head, D head dim, P pages, G page size (tokens per page), W page-table width (max pages per
sequence), S splits of the KV range.

CUDA-graph safe: the grid is (B, M, S), all static; the loop bound inside a program is the row's runtime
seq_len, so a short context does little work whatever W is.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from adapters.kernels.paged_decode_combine import paged_decode_combine


@triton.jit
def _paged_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qn, stride_qd,
    stride_kp, stride_kg, stride_km, stride_kd,
    stride_vp, stride_vg, stride_vm, stride_vd,
    stride_tb, stride_tw,
    stride_ob, stride_on, stride_os, stride_od,
    stride_lb, stride_ln, stride_ls,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MAX_PAGES: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (b, m, s): the g query heads of kv head m attend over split s of row b's context.
    Writes the split's normalised output part_o [B, N, S, D] and its log2-sum-exp part_lse [B, N, S]
    (-inf for an empty split)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + row)
    # NOTE: clamped to what the table can address, so a bad length never reads past the table row.
    seq_len = tl.minimum(tl.maximum(seq_len, 0), MAX_PAGES * PAGE_SIZE)
    # Every split gets an equal, BLOCK_N-aligned share of this row's tokens (runtime, not W).
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # query heads served by this kv head
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] token positions
        n_mask = pos < hi
        page = tl.load(table_ptr + row * stride_tb + (pos // PAGE_SIZE) * stride_tw, mask=n_mask, other=0)
        page = page.to(tl.int64)  # page * stride can pass 2**31 on big pools
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = page * stride_kp + (pos % PAGE_SIZE) * stride_kg + kv_head * stride_km
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every block holds >= 1 live token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = page * stride_vp + (pos % PAGE_SIZE) * stride_vg + kv_head * stride_vm
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    live = l_i > 0.0  # false for an empty split (short context or padded row)
    l_safe = tl.where(live, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(live, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(part_o_ptr + row * stride_ob + heads[:, None] * stride_on + split * stride_os
             + offs_d[None, :] * stride_od, out, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + row * stride_lb + heads * stride_ln + split * stride_ls, lse, mask=h_mask)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter/CPU: few splits keep the tests fast
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device,
                       block_n: int = 64) -> int:
    """Static split count: about two programs per SM over the (B, M) grid, never more splits than
    BLOCK_N blocks of the longest context the table can hold, at most 64."""
    want = math.ceil(2 * _sm_count(device) / max(1, batch * kv_heads))
    return max(1, min(want, math.ceil(max_context / block_n), 64))


def launch_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps). The per-token gather keeps a 64-bit pointer per [BLOCK_N, D] element live, so
    the tile is kept small: these compile without register spills for sm_90 (ptxas; D = 256 in the tests,
    D = 128 checked once by hand); they are not yet timed on a GPU."""
    if dtype == torch.float32:
        return 16, 8  # an exact-fp32 ("ieee") dot runs on FMA units and needs the most registers
    return 32, 8 if head_dim > 128 else 4


def require(cond: bool, msg: str) -> None:
    """Raises ValueError(msg) unless cond: the launchers' argument checks."""
    if not cond:
        raise ValueError(msg)


def check_paged_pools(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: str) -> tuple[int, int]:
    """The checks every paged attention launcher makes of q [rows, N, D] against one layer's K/V pools
    [P, G, M, D] (shapes, head dims, GQA grouping, dtypes); rows names q's first dim in the messages.
    Returns (page size G, kv heads M). Raises ValueError on a mismatch."""
    require(q.dim() == 3, f"q must be [{rows}, N, D], got {tuple(q.shape)}")
    require(k_pool.dim() == 4 and k_pool.shape == v_pool.shape,
             f"k_pool/v_pool must both be [P, G, M, D], got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}")
    _, heads, head_dim = q.shape
    _, page_size, kv_heads, pool_dim = k_pool.shape
    require(pool_dim == head_dim, f"head dim differs: q {head_dim}, pool {pool_dim}")
    require(heads % kv_heads == 0, f"query heads {heads} not a multiple of kv heads {kv_heads}")
    require(q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported q dtype {q.dtype}")
    require(k_pool.dtype == q.dtype and v_pool.dtype == q.dtype,
             f"pool dtype {k_pool.dtype}/{v_pool.dtype} differs from q dtype {q.dtype}")
    return page_size, kv_heads


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, *, block_n: int | None = None,
                           out: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one token per row over its paged context.

    q [B, N, D] (bf16/fp16/fp32); k_pool, v_pool [P, G, M, D] in q's dtype (one layer's pool view, any
    strides); page_table int32 [B, W]: row b's position t lives at page page_table[b, t // G], offset t % G
    (entries past the context are never read); seq_lens int32 [B]: context length including the current
    token, 0 for a padded row (its output is zeros). Kv head m serves query heads m*g .. m*g+g-1.
    scale: softmax scale (usually D**-0.5). num_splits: static KV splits (default: default_num_splits).
    block_n: tokens per inner step (default: launch_config). out: optional [B, N, D] buffer in
    q's dtype (for CUDA graphs). gate: optional [B, N, D] in q's dtype (any strides): the sigmoid output
    gate, applied by the combine step (see paged_decode_combine). Returns out [B, N, D] in q's dtype;
    softmax and accumulation in fp32.
    Page ids must lie in [0, P) and seq_len <= W*G (longer lengths are clamped to W*G); neither is checked
    on the device (no host sync). Raises ValueError on mismatched shapes, dtypes or devices.
    """
    page_size, kv_heads = check_paged_pools(q, k_pool, v_pool, "B")
    batch, heads, head_dim = q.shape
    require(page_table.dim() == 2 and page_table.shape[0] == batch and page_table.dtype == torch.int32,
             f"page_table must be int32 [B={batch}, W], got {page_table.dtype} {tuple(page_table.shape)}")
    require(seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32,
             f"seq_lens must be int32 [B={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    require(len({t.device for t in (q, k_pool, v_pool, page_table, seq_lens)}) == 1,
             "q, pools, page_table and seq_lens must be on one device")
    max_pages = page_table.shape[1]
    require(max_pages > 0, "page_table needs at least one column")
    default_block_n, num_warps = launch_config(q.dtype, head_dim)
    block_n = default_block_n if block_n is None else block_n
    require(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_pages * page_size, q.device, block_n)
    require(1 <= num_splits <= 1024, f"num_splits must be in 1..1024, got {num_splits}")
    if out is None:
        out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    require(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
             f"out must be {q.dtype} {tuple(q.shape)} on {q.device}")
    if batch == 0:
        return out

    part_o = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    _paged_decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_pool, v_pool, page_table, seq_lens, part_o, part_lse,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *page_table.stride(),
        *part_o.stride(), *part_lse.stride(),
        scale * math.log2(math.e),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, MAX_PAGES=max_pages, NUM_SPLITS=num_splits,
        # NOTE: tl.dot needs >= 16 rows and a >= 16 reduction dim; padded rows/lanes are masked.
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        # fp32 stays fp32 in the dot products (the 1e-4 parity bound); tf32 is the default for 16-bit.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    return paged_decode_combine(part_o, part_lse, out, gate)
