"""Paged prefill attention: every prefill span of a step in one launch, causal (lower-right aligned after a
cached prefix), GQA, fp32 online softmax, K/V read straight from the paged pools.

Formula: softmax(q k^T * scale + causal mask) v per query head (Vaswani et al. 2017, "Attention is all you
need", eq. 1), computed block by block with the online softmax of FlashAttention-2 (Dao 2023, Algorithm 1):
running max m, running sum l, rescaled accumulator. The mask is torch's causal_lower_right(n, X): query i of
an n-token span with an X-token context (its cached prefix + itself) sees positions 0 .. X - n + i. Kv head m
serves query heads m*g .. m*g+g-1 (transformers' repeat_kv).

Why: prefill_spans.attention_spans ran a context gather, a lower-right mask and SDPA per span per layer: a
step of N short prompts paid N times every launch and its Python. Here a block table built on the host once
per step (step_plan.attention_tables) lists every span's query blocks; the grid is (blocks, kv heads).

Shape legend: T tokens of the step, N query heads, M kv heads, g = N/M, D head dim, P pages, G page size,
NB query blocks of the step, U tokens per block (block_tokens), BM rows of a block (U*g padded to a power of
two: a block packs U tokens x the g query heads of one kv head, so each K/V tile serves all of them), BN
context positions per inner step, PP page-list entries of the step.

A block-table row (BLOCK_FIELDS int32): (row of the step of the block's first token, its tokens (1..U), the
last context position its first token sees, the offset of its span's page list in `pages`). No integer
argument varies by step (the block count is the grid; counts and offsets are read from the tables), so
one binary per (dtype, geometry, page size) serves every step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from adapters.kernels.paged_decode_attention import check_paged_pools, require

BLOCK_FIELDS = 4  # int32 per block-table row: (first row, tokens, first token's last visible position, page offset)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, blocks_ptr, pages_ptr,
    stride_qt, stride_qn, stride_qd,
    stride_kp, stride_kg, stride_km, stride_kd,
    stride_vp, stride_vg, stride_vm, stride_vd,
    stride_ot, stride_on, stride_od,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (block b, kv head m): the block's tokens x the g query heads of kv head m over the causal part
    of their span's context. Row r of the tile is token r // g of the block, query head m*g + r % g."""
    blk = tl.program_id(0)
    kv_head = tl.program_id(1)
    row0 = tl.load(blocks_ptr + blk * 4)  # a BLOCK_FIELDS-wide row
    count = tl.load(blocks_ptr + blk * 4 + 1)
    base = tl.load(blocks_ptr + blk * 4 + 2)  # the last position the block's first token sees
    page_off = tl.load(blocks_ptr + blk * 4 + 3)

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = offs_r // GROUP  # [BM] token of the block
    heads = kv_head * GROUP + offs_r % GROUP  # [BM] query head
    live = tok < count  # NOTE: count <= U and U * GROUP <= BLOCK_M (the launcher): padding rows are dead
    d_mask = offs_d < HEAD_DIM
    q_mask = live[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (row0 + tok)[:, None] * stride_qt + heads[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)  # [BM, BD]
    if F32_DOT:
        q = q.to(tl.float32)
    last = base + tok  # [BM] last visible position of each row (dead rows: harmless, never stored)
    hi = base + count  # context positions the block reads: 0 .. hi-1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        pos = start + offs_n  # [BN] context positions
        n_mask = pos < hi
        page = tl.load(pages_ptr + page_off + pos // PAGE_SIZE, mask=n_mask, other=0)
        page = page.to(tl.int64)  # page * stride can pass 2**31 on big pools
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = page * stride_kp + (pos % PAGE_SIZE) * stride_kg + kv_head * stride_km
        k = tl.load(k_ptr + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)  # [BN, BD]
        if F32_DOT:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN]
        # NOTE: position 0 is visible to every row, so the first step leaves every m_i finite (no inf - inf)
        scores = tl.where(pos[None, :] <= last[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = page * stride_vp + (pos % PAGE_SIZE) * stride_vg + kv_head * stride_vm
        v = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)  # [BN, BD]
        if F32_DOT:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(live, l_i, 1.0)[:, None]
    tl.store(out_ptr + (row0 + tok)[:, None] * stride_ot + heads[:, None] * stride_on + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def launch_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(rows a block aims at, BLOCK_N, num_warps). The per-token page gather keeps a 64-bit pointer per
    [BN, D] element live (as paged_decode_attention), so the tiles stay small; an exact-fp32 ("ieee") dot runs
    on FMA units and needs the most registers. ptxas builds these for sm_90 without spills in Triton 3.6 and
    3.9 (D = 256 bf16 and fp32 in test_kernel_paged_prefill_attention; D = 128 bf16 checked once by hand,
    2026-12-02; 64 rows at D = 256 spill in 3.9, 64 x 32 with 4 warps spill at D = 128); not yet timed."""
    if dtype == torch.float32:
        return 16, 16, 4
    return (32, 32, 8) if head_dim > 128 else (64, 32, 8)


def block_tokens(group: int, head_dim: int, dtype: torch.dtype) -> int:
    """Tokens per query block U for g query heads per kv head: U*g rows fill launch_config's rows (at least
    one token). The block table (span_blocks) and the launch must agree on it."""
    return max(1, launch_config(dtype, head_dim)[0] // group)


def span_blocks(row: int, length: int, context: int, page_offset: int, tokens: int) -> list[int]:
    """The flattened block-table rows of one span: `length` query tokens at rows row.. of the step, the last
    `length` positions of a `context`-token context whose page list starts at `page_offset` in the step's
    pages; `tokens` per block (block_tokens)."""
    if not 1 <= length <= context or tokens < 1 or row < 0 or page_offset < 0:
        raise ValueError(f"bad span: row {row}, {length} tokens, context {context}, page offset {page_offset}, "
                         f"{tokens} tokens per block")
    first = context - length  # the position of the span's first token: it sees 0 .. first
    out: list[int] = []
    for i in range(0, length, tokens):
        out += [row + i, min(tokens, length - i), first + i, page_offset]
    return out


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                            pages: torch.Tensor, scale: float, tokens: int, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of every prefill span of a step in one launch, over the paged K/V.

    q [T, N, D] (bf16/fp16/fp32, any strides): each span's query rows; k_pool, v_pool [P, G, M, D] in q's
    dtype (one layer's pool view, any strides) holding every span's context, the span itself included;
    blocks int32 [NB, BLOCK_FIELDS] (span_blocks' rows of every span), pages int32 [PP] (each span's page
    list, position t of a span at page pages[offset + t // G], row t % G); tokens: the U the block table was
    built with (block_tokens); out [T, N, D] in q's dtype: each block's rows are written, no other row.
    scale: softmax scale (usually D**-0.5). Softmax and accumulation in fp32. Returns out.
    The tables' contents are not checked on the device (no host sync): rows, page ids and offsets must be in
    range. Raises ValueError on mismatched shapes, dtypes or devices.
    """
    page_size, kv_heads = check_paged_pools(q, k_pool, v_pool, "T")
    _, heads, head_dim = q.shape
    require(blocks.dim() == 2 and blocks.shape[1] == BLOCK_FIELDS and blocks.dtype == torch.int32
             and blocks.is_contiguous(),
             f"blocks must be a contiguous int32 [NB, {BLOCK_FIELDS}], got {blocks.dtype} {tuple(blocks.shape)}")
    require(pages.dim() == 1 and pages.dtype == torch.int32 and pages.stride(0) == 1,
             f"pages must be a unit-stride int32 [PP], got {pages.dtype} {tuple(pages.shape)}")
    require(out.shape == q.shape and out.dtype == q.dtype, f"out must be {q.dtype} {tuple(q.shape)}")
    require(len({t.device for t in (q, k_pool, v_pool, blocks, pages, out)}) == 1,
             "q, pools, tables and out must be on one device")
    group = heads // kv_heads
    rows, block_n, num_warps = launch_config(q.dtype, head_dim)
    require(1 <= tokens and tokens * group <= max(rows, group),
             f"{tokens} tokens per block x {group} heads exceed the tile's {rows} rows")
    if blocks.shape[0] == 0:
        return out
    f32_dot = not q.is_cuda  # NOTE: Triton's interpreter computes bf16 dots wrongly: fp32 operands there
    _paged_prefill_kernel[(blocks.shape[0], kv_heads)](
        q, k_pool, v_pool, out, blocks, pages,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *out.stride(),
        scale * math.log2(math.e),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        # NOTE: tl.dot needs >= 16 rows and a >= 16 reduction dim; padded rows/lanes are masked
        BLOCK_M=max(16, triton.next_power_of_2(tokens * group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n, F32_DOT=f32_dot,
        # fp32 stays fp32 in the dot products (the parity bound); tf32 is the default for 16-bit
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or f32_dot else "tf32",
        num_warps=num_warps,
    )
    return out
