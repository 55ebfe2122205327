"""paged_prefill_attention (adapters/kernels/paged_prefill_attention.py): every prefill span of a step in one
launch against a plain torch reference (repeat_kv + a lower-right causal mask + softmax in fp32) over the
same paged K/V; and the sm_90 build at the Qwen3.6 shape.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at tiny
shapes. Unused pool slots hold NaN: a read outside a span's context shows up in its output. Error measure:
relative Frobenius norm per span; fp32 1e-5 (only summation order differs), bf16 1e-2 (the output's
rounding to bf16, ~4e-3).
"""

from __future__ import annotations

import math

import pytest
import torch

from adapters.kernels.paged_prefill_attention import (
    BLOCK_FIELDS,
    block_tokens,
    paged_prefill_attention,
    span_blocks,
)
from adapters.torch_exec.paged_attention import PagedKVCache
from tests.adapters.sm90 import build_for_sm90
from tests.adapters.test_kernels_attention_gdn import DEVICE, rel_err


def make_step(spans, heads, kv_heads, head_dim, page_size, dtype, tokens, seed=0, gap=1):
    """spans: (cached prefix, length) each. Their rows follow one another in the step with `gap` foreign rows
    (a decode row's, say) before each; every span gets its own shuffled pages, the K/V of its whole context
    written there, NaN everywhere else. Returns (q [T, N, D], kv, blocks, pages, rows per span, contexts
    as (page ids, X) per span)."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil((p + n) / page_size) for p, n in spans]
    kv = PagedKVCache(1, sum(need) + 3, page_size, kv_heads, head_dim, dtype, DEVICE)
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    order = torch.randperm(kv.num_pages, generator=gen).tolist()
    rows, contexts, blocks, pages, row = [], [], [], [], 0
    for (prefix, n), count in zip(spans, need, strict=True):
        ids, order = order[:count], order[count:]
        x = prefix + n
        row += gap
        rows.append(slice(row, row + n))
        contexts.append((ids, x))
        blocks += span_blocks(row, n, x, len(pages), tokens)
        pages += ids
        row += n
        slots = kv.flat_slots(torch.tensor(ids, device=DEVICE), torch.arange(x, device=DEVICE))
        kv.write(0, slots, torch.randn(x, kv_heads, head_dim, generator=gen).to(DEVICE),
                 torch.randn(x, kv_heads, head_dim, generator=gen).to(DEVICE))
    q = torch.randn(row + gap, heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    blocks = torch.tensor(blocks, dtype=torch.int32, device=DEVICE).view(-1, BLOCK_FIELDS)
    return q, kv, blocks, torch.tensor(pages, dtype=torch.int32, device=DEVICE), rows, contexts


def reference(q, kv, ids, x, scale):
    """q [n, N, D] (the span's last n positions of an x-token context) in fp32: repeat_kv, causal mask
    aligned lower right, softmax, times v."""
    n, heads = q.shape[:2]
    k, v = kv.read(0, kv.flat_slots(torch.tensor(ids, device=q.device), torch.arange(x, device=q.device)))
    group = heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [X, N, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qnd,knd->nqk", q.float(), k) * scale  # [N, n, X]
    seen = torch.arange(x, device=q.device)[None, :] <= torch.arange(x - n, x, device=q.device)[:, None]  # [n, X]
    probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("nqk,knd->qnd", probs, v)  # [n, N, D]


CASES = {  # (heads, kv heads, head dim, page size, [(prefix, length)])
    # GQA; spans from 0 and after prefixes that end mid-page, one shorter than a page, one of a token
    "gqa": (4, 2, 16, 4, [(0, 5), (9, 7), (3, 2), (0, 13), (6, 1)]),
    # MQA with 3 heads (g not a power of two), D = 24 (lanes masked), pages of 3
    "mqa": (3, 1, 24, 3, [(2, 11), (0, 4), (10, 6)]),
    # one kv head per query head, a long prefix over many pages
    "mha": (2, 2, 16, 5, [(37, 9), (0, 20)]),
}


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("small_blocks", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_span_matches_the_torch_reference(case, small_blocks, dtype, bound):
    """One launch; each span's rows match the reference over its own context, the rows between them (not in
    the block table) stay as they were. small_blocks: 2 tokens per block, so spans take several blocks."""
    heads, kv_heads, head_dim, page_size, spans = CASES[case]
    tokens = 2 if small_blocks else block_tokens(heads // kv_heads, head_dim, dtype)
    q, kv, blocks, pages, rows, contexts = make_step(spans, heads, kv_heads, head_dim, page_size, dtype, tokens)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    got = paged_prefill_attention(q, kv.k[0], kv.v[0], blocks, pages, scale, tokens, out)
    assert got is out and got.dtype == dtype
    written = torch.zeros(q.shape[0], dtype=torch.bool)
    for r, (ids, x) in zip(rows, contexts, strict=True):
        assert torch.isfinite(got[r]).all(), r
        assert rel_err(got[r], reference(q[r], kv, ids, x, scale)) < bound, (r, x)
        written[r] = True
    assert torch.isnan(got[~written.to(DEVICE)]).all()


def test_a_step_without_prefill_spans_launches_nothing():
    q, kv, blocks, pages, _, _ = make_step([(0, 3)], 2, 1, 16, 4, torch.float32, 4)
    out = torch.zeros_like(q)
    assert paged_prefill_attention(q, kv.k[0], kv.v[0], blocks[:0], pages, 0.25, 4, out) is out
    assert not out.any()


def test_the_block_table_covers_each_span_in_order():
    # 5 tokens at rows 7.. after a 4-token prefix, 2 per block: (row, tokens, last position seen, page offset)
    assert span_blocks(7, 5, 9, 3, 2) == [7, 2, 4, 3, 9, 2, 6, 3, 11, 1, 8, 3]
    assert span_blocks(0, 1, 1, 0, 8) == [0, 1, 0, 0]
    # 16 query heads over 2 kv heads of 256 in bf16: 4 tokens x 8 heads; fp32 tiles are 16 rows
    assert block_tokens(8, 256, torch.bfloat16) == 4 and block_tokens(1, 128, torch.bfloat16) == 64
    assert block_tokens(2, 16, torch.float32) == 8 and block_tokens(32, 16, torch.float32) == 1
    for bad in [(0, 0, 4, 0, 2), (0, 5, 4, 0, 2), (-1, 2, 4, 0, 2), (0, 2, 4, -1, 2), (0, 2, 4, 0, 0)]:
        with pytest.raises(ValueError):
            span_blocks(*bad)


def test_bad_input_is_rejected():
    q, kv, blocks, pages, _, _ = make_step([(2, 3)], 4, 2, 16, 4, torch.float32, 2)  # 2 blocks
    k, v, out = kv.k[0], kv.v[0], torch.empty_like(q)
    good = dict(q=q, k_pool=k, v_pool=v, blocks=blocks, pages=pages, scale=0.25, tokens=2, out=out)
    bad = [
        dict(q=q[0]),  # not [T, N, D]
        dict(v_pool=v[:, :2]),  # pools differ
        dict(q=q[..., :8].contiguous(), out=out[..., :8].contiguous()),  # head dim differs
        dict(q=q[:, :3].contiguous(), out=out[:, :3].contiguous()),  # 3 heads over 2 kv heads
        dict(q=q.double(), out=out.double()),  # unsupported dtype
        dict(q=q.bfloat16(), out=out.bfloat16()),  # pool dtype differs
        dict(blocks=blocks.long()), dict(blocks=blocks[:, :3]), dict(blocks=blocks.t().contiguous().t()),
        dict(pages=pages.long()), dict(pages=pages[None]), dict(pages=torch.stack([pages, pages], 1)[:, 0]),
        dict(out=out[:-1]), dict(out=out.bfloat16()),
        dict(tokens=0), dict(tokens=9),  # 9 tokens x 2 heads: past fp32's 16-row tile
    ]
    for change in bad:
        with pytest.raises(ValueError):
            paged_prefill_attention(**(good | change))
    paged_prefill_attention(**good)  # the unchanged call runs


# ---------------------------------------------------------------- CPU: compiled for sm_90 by ptxas

_SM90_COMPILE = r"""
import json

import torch
import triton

from adapters.kernels import paged_prefill_attention as ppa
from tests.adapters.sm90_usage import resource_usage

fn = ppa._paged_prefill_kernel
out = {}
# Qwen3.6-35B-A3B: 16 query heads over 2 kv heads of 256, pages of 16; bf16 (the served model) and fp32
for name, dtype, elem in (("bf16", torch.bfloat16, "*bf16"), ("fp32", torch.float32, "*fp32")):
    group, head_dim = 8, 256
    _, block_n, warps = ppa.launch_config(dtype, head_dim)
    rows = ppa.block_tokens(group, head_dim, dtype) * group
    consts = dict(GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=16,
                  BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_D=head_dim,
                  BLOCK_N=block_n, F32_DOT=False, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")
    pointers = dict(q_ptr=elem, k_ptr=elem, v_ptr=elem, out_ptr=elem, blocks_ptr="*i32", pages_ptr="*i32")
    out[name] = resource_usage(fn, pointers, consts, {"num_warps": warps},
                               lambda n: "fp32" if n == "qk_scale" else "i32")
print(json.dumps(out))
"""

# ptxas at the Qwen3.6 shape, 2026-12-02: bf16 182 / 237 registers (Triton 3.9 / 3.6), fp32 175 / 254, no
# spill in either; 64-row bf16 tiles spilled 192 bytes in 3.9
_STACK_BOUND = {"bf16": 0, "fp32": 0}


@pytest.mark.slow
def test_kernel_compiles_for_sm90_at_the_qwen36_shape():
    """The interpreter proves the math, not that the kernel builds: ptxas builds it for sm_90 with the
    launcher's settings in a fresh process (no TRITON_INTERPRET); it fits an H200 SM's shared memory and
    does not spill."""
    import json

    usage = json.loads(build_for_sm90(_SM90_COMPILE, timeout=300).strip().splitlines()[-1])
    assert set(usage) == set(_STACK_BOUND)
    for name, found in usage.items():
        assert found["SMEM"] <= 227 * 1024, (name, found)
        assert found["STACK"] <= _STACK_BOUND[name], (name, found)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_qwen36_geometry(dtype, bound):
    """Compiled, at the Qwen3.6 shape (16 query heads over 2 kv heads of 256, pages of 16): spans of 300 from
    0 and 200 after a 300-token prefix beside short ones, one launch."""
    spans = [(0, 300), (300, 200), (0, 20), (5, 17), (40, 2)]
    tokens = block_tokens(8, 256, dtype)
    q, kv, blocks, pages, rows, contexts = make_step(spans, 16, 2, 256, 16, dtype, tokens, seed=3)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, kv.k[0], kv.v[0], blocks, pages, 256 ** -0.5, tokens, out)
    for r, (ids, x) in zip(rows, contexts, strict=True):
        assert rel_err(out[r], reference(q[r], kv, ids, x, 256 ** -0.5)) < bound, (r, x)
