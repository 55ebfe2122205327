"""The token mixers of a whole prefill or mixed step at once: several sequences' prompt chunks (spans) and the
one-token rows of a mixed step. What needs no per-sequence state runs once over every token of the step (the
projections, q/k norms + rotary + the K/V writes, the sigmoid gate, the gated RMSNorm, the output
projections); the attention of every span of up to step_plan.PAGED_PREFILL_MAX_PAIRS query-context pairs in
one launch (paged_prefill_attention, K/V read from the pages); per span only the attention of a bigger span
(the context gather and SDPA); Gated DeltaNet: its conv, WY form and state walk take every span of
the step in one launch each; the one-token rows all together through the decode kernels
(paged_decode_attention, gdn_decode_step). The tables these read are built once per step (step_plan.py).

Why: run span by span (prefill.attention_prefill / gdn_prefill), a step of N short prompts issued every
launch of every mixer N times. On the H200 (Qwen3.6-35B-A3B resident, --prefill-kernels triton, HTTP,
2026-12-02) each extra ~20-token span cost ~40 ms: time to first token 0.117 s for one prompt, 0.74 s for
16 arriving together, although the scheduler put all 16 into one step. With the projections, norms, conv and
WY form step-wide but the state walk and the attention's gather + SDPA still per span, each extra span cost
~3.1 ms per 8 layers (scripts/diag/bench_prefill_spans.py, H200, 2026-12-02): hence the walk over every span
(prefill.delta_rule_walks) and paged_prefill_attention.

Opt-in (FLUXTIDE_GDN_SHORT_SPANS, GDN_SHORT_SPAN_TOKENS below; off by default): a GDN group whose spans are all
short runs, after its conv, the recurrence token by token in one gdn_recurrent_spans launch instead of the WY form
and the state walk (3+ launches): ADR 0025's tail step (a few prompt tokens beside decodes) is host-bound.

Each entry point keeps its reference's contract for the step (FullAttention.forward;
MoeDecoder._linear_attention with the snapshot cuts); numerics as prefill.py's per-span entry points, the
projections over more rows (a GEMM's rows are independent; its tile choice may differ by row count).

Shape legend: T tokens of the step, B one-token rows, H hidden, N query heads, M kv heads, D head dim, R rotary
dim, X context tokens of a span (its cached prefix + the span), C conv channels, Nv value heads, Dv value
head dim.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from adapters.cuda_exec import prefill
from adapters.cuda_exec.prefill import check_gdn_slot, delta_rule, delta_rule_walks
from adapters.cuda_exec.step_plan import AttentionTables, GdnGroup
from adapters.kernels.gated_rms_norm import gated_rms_norm
from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy
from adapters.kernels.gdn_conv_prefill import gdn_conv_prefill_spans
from adapters.kernels.gdn_decode import gdn_decode_step
from adapters.kernels.gdn_recurrent_spans import gdn_recurrent_spans
from adapters.kernels.paged_decode_attention import paged_decode_attention
from adapters.kernels.paged_prefill_attention import paged_prefill_attention
from adapters.kernels.qk_norm_rope import qk_norm_rope
from adapters.torch_exec.full_attention import FullAttention
from adapters.torch_exec.gated_deltanet import GatedDeltaNet, LinearStatePool
from adapters.torch_exec.paged_attention import PagedKVCache

Linear = Callable[[torch.Tensor, object], torch.Tensor]  # (x [T, I], weight [O, I] or QTensor) -> [T, O]
Projections = Callable[[torch.Tensor], list]  # x [T, H] -> the named projections' outputs [T, O_i]

# NOTE: the SDPA backends a long span's attention may take. cuDNN is left out (unless CUDNN_ATTENTION): torch
# would run a span from position 0 (query length == context length, plain causal) through cuDNN on sm_90, whose
# graph torch builds and caches per shape, i.e. per prompt length: ~90 ms on the first prompt of every new length
# and ~2 s on the first one of the process (H200, HTTP, 2026-12-04; docs/prefill-kernels.md, "First requests").
# A span after a cached prefix already took the flash kernel (torch's lower-right causal dispatch calls it
# directly), which builds nothing per shape. Efficient and math stay as fallbacks (the CPU, odd head dims).
CUDNN_ATTENTION = False
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# NOTE: GDN groups whose spans are all at most this many tokens run the recurrence token by token, in one
# gdn_recurrent_spans launch after the conv, instead of gdn_chunk_wy + the state walk (gdn_chunk_state +
# gdn_chunk_out): ADR 0025 profiled a 4-token tail step beside 3 decodes on the H100 as host-bound (83 of 84 ms
# the GPU waiting on Python's launches). 0 (the default) keeps every group on the chunked path: the kernel passed
# its GPU tests on an H100 (session 28), but 32 did not shorten that tail step in the server (52.8 / 62.0 ms against
# 48.2 / 40.9 without it, docs/gpu-validation.md). At most one 64-token chunk (SHORT_SPAN_MAX), a bound, not a measured
# crossover: the kernel walks a span's tokens one after another, the chunked form its chunks in parallel.
# Numerics: plain fp32 products (no tl.dot), so at least as accurate as the chunked path, which a bf16/fp16 model
# runs in one TF32 pass (precise=False); both are the exact delta rule, equal within fp32 rounding, not bitwise.
SHORT_SPAN_MAX = 64


def _short_span_tokens(value: str) -> int:
    """FLUXTIDE_GDN_SHORT_SPANS: a decimal integer 0..SHORT_SPAN_MAX ("0", or unset: off). Anything else (a sign,
    spaces, "off", "") is refused, not read as off. ValueError."""
    if not (value.isascii() and value.isdigit()) or int(value) > SHORT_SPAN_MAX:
        raise ValueError(f"FLUXTIDE_GDN_SHORT_SPANS must be an integer 0..{SHORT_SPAN_MAX} (0: off), got {value!r}")
    return int(value)


GDN_SHORT_SPAN_TOKENS = _short_span_tokens(os.environ.get("FLUXTIDE_GDN_SHORT_SPANS", "0"))


def span_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one span's queries q [n, N, D] over its context k, v [X, M, D] (X >= n: a cached
    prefix, then the span; lower-right aligned), GQA as transformers' repeat_kv (kv head m serves query heads
    m*N/M ..). Returns [n, N, D]. SDPA over the backends above (with CUDNN_ATTENTION, torch's own choice)."""
    n, end = q.shape[0], k.shape[0]
    with contextlib.nullcontext() if CUDNN_ATTENTION else sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=causal_lower_right(n, end),
                                             scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, N, D]


def attention_spans(mixer: FullAttention, x: torch.Tensor, kv: PagedKVCache, tables: AttentionTables,
                    cos_sin: tuple[torch.Tensor, torch.Tensor], *, qkv_fn: Projections,
                    linear_fn: Linear) -> torch.Tensor:
    """FullAttention.forward for a whole step: x [T, H] (the model dtype), every span's tokens at their rows.
    qkv_fn(x) -> [q, k, v] projections [T, N*D (N*2D with the output gate)], [T, M*D] x2, biases added (views
    of one stacked GEMM are fine); cos_sin [T, R] at each token's position; tables from attention_tables for
    this step and kv's page size. Writes every token's K/V into its pages (layer mixer.kv_layer) before any
    span reads its context, which is safe: a step's sequences write disjoint pages (shared prefix pages are
    only read). A span of more than one token attends causally over its whole context (lower-right aligned
    after a prefix, as attention_prefill): every small span (step_plan.PAGED_PREFILL_MAX_PAIRS) in one
    paged_prefill_attention launch, a bigger one through SDPA; the one-token rows together through paged_decode_attention. Then the
    sigmoid output gate and o_proj once. Returns [T, H] in x's dtype.
    Raises ValueError on an empty x or tables of another step size."""
    geo, tokens = mixer.geo, x.shape[0]
    if x.dim() != 2 or tokens == 0 or tables.kv_rows.shape != (tokens,):
        raise ValueError(f"x must be a non-empty [T, H] for tables of {tables.kv_rows.shape[0]} tokens, "
                         f"got {tuple(x.shape)}")
    q, k, v = qkv_fn(x)
    gate = None
    if geo.output_gate:  # a strided view, applied below over every token at once
        q, gate = torch.chunk(q.view(tokens, geo.num_heads, 2 * geo.head_dim), 2, dim=-1)  # [T, N, D] x2
    q = q.reshape(tokens, geo.num_heads, geo.head_dim)  # [T, N, D]
    k = k.reshape(tokens, geo.num_kv_heads, geo.head_dim)  # [T, M, D]
    v = v.reshape(tokens, geo.num_kv_heads, geo.head_dim)  # [T, M, D]
    layer, scale = mixer.kv_layer, geo.head_dim ** -0.5
    k_pool, v_pool = kv.k[layer], kv.v[layer]
    # q/k norms, rotary at each token's own position, and every token's K/V into its page: one launch
    q = qk_norm_rope(q, k, v, mixer.w["q_norm.weight"], mixer.w["k_norm.weight"], geo.eps, geo.unit_offset_norm,
                     *cos_sin, k_pool, v_pool, tables.kv_rows)  # [T, N, D]
    if tables.decode_all:
        out = paged_decode_attention(q, k_pool, v_pool, tables.page_table, tables.seq_lens, scale, tables.num_splits)
    else:
        out = torch.empty_like(q)  # [T, N, D]
        if tables.blocks is not None:  # every span over a short context: one launch
            paged_prefill_attention(q, k_pool, v_pool, tables.blocks, tables.block_pages, scale, tables.block_tokens,
                                    out)
        for span in tables.prefill:  # a long context: SDPA's flash kernel, span by span (step_plan.py says why)
            k_ctx, v_ctx = kv.read(layer, span.context)  # [X, M, D]
            out[span.rows] = span_sdpa(q[span.rows], k_ctx.to(q.dtype), v_ctx.to(q.dtype), scale)  # [n, N, D]
        if tables.decode_rows is not None:
            rows = tables.decode_rows
            out[rows] = paged_decode_attention(q[rows], k_pool, v_pool, tables.page_table, tables.seq_lens, scale,
                                               tables.num_splits)  # [B, N, D]
    if gate is not None:
        out = out * torch.sigmoid(gate)  # each rounded to the model dtype, as the reference's ops
    out = linear_fn(out.reshape(tokens, -1), mixer.w["o_proj.weight"])  # [T, H]
    return out if mixer.bias["o_proj"] is None else out + mixer.bias["o_proj"]


def gdn_spans(mixer: GatedDeltaNet, x: torch.Tensor, groups: tuple[GdnGroup, ...], pool: LinearStatePool,
              layer: int, *, qkvz_fn: Projections, ab_fn: Projections, linear_fn: Linear,
              snapshots: LinearStatePool | None = None,
              decode: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """MoeDecoder._linear_attention for a whole step through the prefill kernels: x [T, H] (the model dtype);
    groups (step_plan.gdn_groups) cover the rows of the spans of more than one token, decode = (rows int64
    [B], state slots int32 [B], distinct) the one-token rows; together every row of x. qkvz_fn(x) -> [qkv
    [T, C], z [T, Nv*Dv]], ab_fn(x) -> [b, a] ([T, Nv] each): the projections, once for all rows (views of
    stacked GEMMs are fine). Per group one conv launch (gdn_conv_prefill_spans) and one WY launch
    (gdn_chunk_wy over its chunk table), then the state walks of all its spans (prefill.delta_rule_walks:
    one gdn_chunk_state and one gdn_chunk_out launch per GDN_WINDOW tokens of chunks); every span
    continues its slot's conv and recurrent state (pool layer `layer`) and leaves there the state after it,
    as gdn_prefill on the span alone (with GDN_SHORT_SPAN_TOKENS > 0, a group of spans no longer than that takes
    one gdn_recurrent_spans launch instead of the WY form and the walks); a group with a snapshot slot (a piece
    of a cut span) has that state copied into `snapshots` at once, before the span's next piece. The one-token
    rows take one recurrent step together. Then the gated RMSNorm and out_proj once. Returns [T, H] in x's dtype.
    Scratch per group: the conv output and WY form of all T rows (gdn_prefill's, for a T-token span).
    Raises ValueError, before any state is touched, on an empty x, a bad layer or slot, Dk > 128, or a
    snapshot without a snapshot pool."""
    geo, w, tokens = mixer.geo, mixer.w, x.shape[0]
    if x.dim() != 2 or tokens == 0:
        raise ValueError(f"x must be a non-empty [T, H], got {tuple(x.shape)}")
    for group in groups:
        for _, slot in group.spans:
            check_gdn_slot(mixer, pool, layer, slot)
        if group.snapshot is not None and snapshots is None:
            raise ValueError("a piece asks for a snapshot and there is no snapshot pool")
    qkv, z = qkvz_fn(x)  # [T, C], [T, Nv*Dv]
    b, a = ab_fn(x)  # [T, Nv] each
    core = torch.empty(tokens, geo.num_v_heads, geo.v_head_dim, dtype=torch.float32, device=x.device)
    precise = x.dtype == torch.float32
    conv_weight = getattr(mixer, "conv_weight_2d", None)  # [C, W] once fast_decoder prepared it
    if conv_weight is None:
        conv_weight = w["conv1d.weight"][:, 0, :]
    nk = geo.num_k_heads
    for group in groups:  # NOTE: only this carries sequences' state; the rest of the layer is batched
        mixed = gdn_conv_prefill_spans(qkv, pool.conv[layer], conv_weight, group.starts, group.lengths, group.slots,
                                       group.max_len)  # [T, C] fp32, the group's rows written
        if GDN_SHORT_SPAN_TOKENS and group.max_len <= GDN_SHORT_SPAN_TOKENS:  # one launch, token by token
            # NOTE: max_len the fixed threshold, not the group's (no span is longer): one binary for every step
            gdn_recurrent_spans(mixed, a, b, pool.recurrent[layer], group.starts, group.lengths, group.slots,
                                mixer.neg_a, mixer.dt_bias, geo, max_len=GDN_SHORT_SPAN_TOKENS, out=core)
        else:
            wy = gdn_chunk_wy(mixed, a, b, mixer.neg_a, mixer.dt_bias, nk, geo.k_head_dim, geo.v_head_dim,
                              precise=precise, chunks=(group.chunk_starts, group.chunk_ends))  # the group's rows
            if prefill.GDN_RECURRENCE == "split":  # every span's walk in one launch (a few for long spans)
                delta_rule_walks(mixed, *wy, pool.recurrent[layer], group.walk_table, group.walks,
                                 (group.chunk_starts, group.chunk_ends), nk, precise=precise, out=core)
            else:  # the fused walk (A/B runs only): span by span
                for r, slot in group.spans:
                    delta_rule(mixed[r], *(t[:, r] for t in wy), pool.recurrent[layer, slot], nk, precise=precise,
                               out=core[r])
            del wy
        if group.snapshot is not None:
            pool.copy_slot(group.spans[0][1], snapshots, group.snapshot, layer)
        del mixed  # NOTE: before the next group allocates its own: one T-row scratch at a time
    if decode is not None:
        rows, slots = decode
        core[rows] = gdn_decode_step(qkv[rows], a[rows], b[rows], pool.conv[layer], pool.recurrent[layer], slots,
                                     conv_weight, mixer.neg_a, mixer.dt_bias, geo)  # [B, Nv, Dv]
    normed = gated_rms_norm(core, z.reshape(tokens, geo.num_v_heads, geo.v_head_dim), w["norm.weight"], mixer.eps,
                            dtype=x.dtype)  # [T, Nv, Dv]
    return linear_fn(normed.reshape(tokens, -1), w["out_proj.weight"])  # [T, H]
