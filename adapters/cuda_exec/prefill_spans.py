"""The token mixers of a whole prefill or mixed step at once: several sequences' prompt chunks (spans) and the
one-token rows of a mixed step. What needs no per-sequence state runs once over every token of the step (the
projections, q/k norms + rotary + the K/V writes, the sigmoid gate, the gated RMSNorm, the output
projections); per span only what reads its own context or state (attention: the context gather and SDPA;
Gated DeltaNet: conv, WY form and delta rule, prefill.gdn_core); the one-token rows all together through
the decode kernels (paged_decode_attention, gdn_decode_step).

Why: run span by span (prefill.attention_prefill / gdn_prefill), a step of N short prompts issued every
launch of every mixer N times. On the H200 (Qwen3.6-35B-A3B resident, --prefill-kernels triton, HTTP,
2026-12-02) each extra ~20-token span cost ~40 ms: time to first token 0.117 s for one prompt, 0.74 s for
16 arriving together, although the scheduler put all 16 into one step.

Each entry point keeps its reference's contract for the step (FullAttention.forward;
MoeDecoder._linear_attention with the snapshot cuts); numerics as prefill.py's per-span entry points, the
projections over more rows (a GEMM's rows are independent; its tile choice may differ by row count).

Shape legend: T tokens of the step, S spans, B one-token rows, H hidden, N query heads, M kv heads, D head
dim, R rotary dim, X context tokens of a span (its cached prefix + the span), G page size, W page-table
width, C conv channels, Nv value heads, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from adapters.cuda_exec.prefill import check_gdn_slot, gdn_core
from adapters.kernels.gated_rms_norm import gated_rms_norm
from adapters.kernels.gdn_decode import gdn_decode_step
from adapters.kernels.paged_decode_attention import default_num_splits, paged_decode_attention
from adapters.kernels.qk_norm_rope import qk_norm_rope
from adapters.torch_exec.full_attention import FullAttention
from adapters.torch_exec.gated_deltanet import GatedDeltaNet, LinearStatePool
from adapters.torch_exec.paged_attention import PagedKVCache
from adapters.torch_exec.rotary import Rotary
from adapters.torch_exec.step_inputs import StepInputs

Linear = Callable[[torch.Tensor, object], torch.Tensor]  # (x [T, I], weight [O, I] or QTensor) -> [T, O]
Projections = Callable[[torch.Tensor], list]  # x [T, H] -> the named projections' outputs [T, O_i]


@dataclass(frozen=True)
class PrefillSpan:
    rows: slice  # the span's rows of the step
    context: torch.Tensor  # int64 [X]: flat KV row (page * G + offset) of positions 0 .. end-1


@dataclass(frozen=True)
class AttentionTables:
    """What every attention layer of one step reads, built on the host once per step (two uploads)."""

    kv_rows: torch.Tensor  # int64 [T]: flat KV row each token's K/V is written to
    prefill: tuple[PrefillSpan, ...]  # spans of more than one token
    decode_rows: torch.Tensor | None  # int64 [B]: rows of the one-token spans; None when there are none
    decode_all: bool  # every row is a one-token span (rows 0..T-1 in order): q is used as it is
    page_table: torch.Tensor | None  # int32 [B, W] of the one-token rows
    seq_lens: torch.Tensor | None  # int32 [B]: each one-token row's context, itself included
    num_splits: int  # paged_decode_attention's static split count


def attention_tables(inp: StepInputs, page_size: int, table_width: int, kv_heads: int) -> AttentionTables:
    """The step's AttentionTables. table_width: the page-table width W of the one-token rows (0: the smallest
    power of two that holds their pages). NOTE: W and the split count are compile-time constants of
    paged_decode_attention: a fixed W (the decode graphs') and a split count from the row count rounded up
    to a power of two keep mixed steps on the binaries the graph capture and the prefill warm-up built.
    Raises ValueError when a span's pages do not cover its positions or a row's context exceeds W pages."""
    device = inp.token_ids.device
    g = page_size
    offsets = torch.arange(g, dtype=torch.int64)  # [G]
    kv_rows, contexts, spans, decodes = [], [], [], []
    for s in inp.spans:
        start, end = s.start_position, s.end_position
        pages = s.work.page_ids
        if len(pages) * g < end:
            raise ValueError(f"{s.work.request_id}: {len(pages)} pages of {g} do not cover positions 0..{end - 1}")
        # NOTE: on the host: every position's flat row from the page list (a few microseconds per span), so
        # no layer computes slots on the device
        flat = (torch.tensor(pages[: -(-end // g)], dtype=torch.int64)[:, None] * g + offsets).reshape(-1)[:end]
        kv_rows.append(flat[start:])
        if s.length > 1:
            spans.append(s.rows)
            contexts.append(flat)
        else:
            decodes.append(s)
    sizes = [t.shape[0] for t in contexts]
    packed = torch.cat(kv_rows + contexts).to(device)  # one upload: [T + sum X]
    tokens = len(inp.token_ids)
    parts = torch.split(packed[tokens:], sizes) if sizes else ()
    prefill = tuple(PrefillSpan(rows, ctx) for rows, ctx in zip(spans, parts, strict=True))
    if not decodes:
        return AttentionTables(packed[:tokens], prefill, None, False, None, None, 1)
    need = max(-(-s.end_position // g) for s in decodes)
    width = table_width or 1 << (need - 1).bit_length()
    if need > width:
        raise ValueError(f"a one-token row's context of {need} pages exceeds the page table's {width}")
    count = len(decodes)
    host = torch.zeros(count * (width + 1), dtype=torch.int32)  # [B*W + B]: the page table, then the lengths
    for r, s in enumerate(decodes):
        pages = s.work.page_ids[:width]
        host[r * width:r * width + len(pages)] = torch.tensor(pages, dtype=torch.int32)
        host[count * width + r] = s.end_position
    table = host.to(device)  # NOTE: the kernel reads the lengths with unit stride: they get their own tail
    rows = torch.tensor([s.offset for s in decodes], dtype=torch.int64).to(device)
    in_order = count == tokens and all(s.offset == r for r, s in enumerate(decodes))
    splits = default_num_splits(1 << (count - 1).bit_length(), kv_heads, width * g, device)
    return AttentionTables(packed[:tokens], prefill, rows, in_order, table[:count * width].view(count, width),
                           table[count * width:], splits)


@dataclass(frozen=True)
class GdnPiece:
    rows: slice  # rows of the step
    slot: int  # the sequence's state slot
    snapshot: int | None  # snapshot slot the state after this piece is copied into (a cut inside the span)


def gdn_pieces(inp: StepInputs, with_snapshots: bool) -> tuple[GdnPiece, ...]:
    """The Gated DeltaNet pieces of the step's spans of more than one token, in order: a span is cut where
    its work asks for a snapshot strictly inside it (with_snapshots), as MoeDecoder._linear_attention cuts
    it: the state after exactly that many tokens exists only between the two parts."""
    pieces = []
    for s in inp.spans:
        if s.length == 1:
            continue
        start, slot = s.offset, s.work.state_slot
        cuts = [(p - s.start_position, snap) for p, snap in s.work.snapshots if p < s.end_position]
        for cut, snap in cuts if with_snapshots else ():
            pieces.append(GdnPiece(slice(start, s.offset + cut), slot, snap))
            start = s.offset + cut
        pieces.append(GdnPiece(slice(start, s.offset + s.length), slot, None))
    return tuple(pieces)


class StepPlan:
    """Per step, what the mixers of every layer share, each built at most once (lazily: a model without
    attention layers never builds the attention tables)."""

    def __init__(self, inp: StepInputs):
        self.inp = inp
        self._memo: dict = {}

    def memo(self, key, build: Callable[[], object]):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def attention(self, page_size: int, table_width: int, kv_heads: int) -> AttentionTables:
        return self.memo(("attention", page_size, table_width, kv_heads),
                         lambda: attention_tables(self.inp, page_size, table_width, kv_heads))

    def cos_sin(self, rotary: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R] at every token's own position."""
        return self.memo(("rotary", id(rotary), dtype), lambda: rotary.cos_sin(self.inp.positions, dtype))

    def gdn_pieces(self, with_snapshots: bool) -> tuple[GdnPiece, ...]:
        return self.memo(("gdn", with_snapshots), lambda: gdn_pieces(self.inp, with_snapshots))


def attention_spans(mixer: FullAttention, x: torch.Tensor, kv: PagedKVCache, tables: AttentionTables,
                    cos_sin: tuple[torch.Tensor, torch.Tensor], *, qkv_fn: Projections,
                    linear_fn: Linear) -> torch.Tensor:
    """FullAttention.forward for a whole step: x [T, H] (the model dtype), every span's tokens at their rows.
    qkv_fn(x) -> [q, k, v] projections [T, N*D (N*2D with the output gate)], [T, M*D] x2, biases added (views
    of one stacked GEMM are fine); cos_sin [T, R] at each token's position; tables from attention_tables for
    this step and kv's page size. Writes every token's K/V into its pages (layer mixer.kv_layer) before any
    span reads its context, which is safe: a step's sequences write disjoint pages (shared prefix pages are
    only read). A span of more than one token attends causally over its whole context (SDPA, lower-right
    aligned after a prefix, as attention_prefill); the one-token rows together through
    paged_decode_attention. Then the sigmoid output gate and o_proj once. Returns [T, H] in x's dtype.
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
        for span in tables.prefill:
            k_ctx, v_ctx = kv.read(layer, span.context)  # [X, M, D]
            n, end = span.rows.stop - span.rows.start, span.context.shape[0]
            # NOTE: kv head m serves query heads m*groups .. (transformers' repeat_kv): SDPA's GQA grouping
            out[span.rows] = F.scaled_dot_product_attention(
                q[span.rows].transpose(0, 1)[None], k_ctx.to(q.dtype).transpose(0, 1)[None],
                v_ctx.to(q.dtype).transpose(0, 1)[None], attn_mask=causal_lower_right(n, end), scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)  # [n, N, D]
        if tables.decode_rows is not None:
            rows = tables.decode_rows
            out[rows] = paged_decode_attention(q[rows], k_pool, v_pool, tables.page_table, tables.seq_lens, scale,
                                               tables.num_splits)  # [B, N, D]
    if gate is not None:
        out = out * torch.sigmoid(gate)  # each rounded to the model dtype, as the reference's ops
    out = linear_fn(out.reshape(tokens, -1), mixer.w["o_proj.weight"])  # [T, H]
    return out if mixer.bias["o_proj"] is None else out + mixer.bias["o_proj"]


def gdn_spans(mixer: GatedDeltaNet, x: torch.Tensor, pieces: tuple[GdnPiece, ...], pool: LinearStatePool,
              layer: int, *, qkvz_fn: Projections, ab_fn: Projections, linear_fn: Linear,
              snapshots: LinearStatePool | None = None,
              decode: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """MoeDecoder._linear_attention for a whole step through the prefill kernels: x [T, H] (the model dtype);
    pieces (gdn_pieces) cover the rows of the spans of more than one token, decode = (rows int64 [B], state
    slots int32 [B], distinct) the one-token rows; together every row of x. qkvz_fn(x) -> [qkv [T, C],
    z [T, Nv*Dv]], ab_fn(x) -> [b, a] ([T, Nv] each): the projections, once for all rows (views of stacked
    GEMMs are fine). Each piece continues its slot's conv and recurrent state (pool layer `layer`) and leaves
    there the state after it; a piece with a snapshot slot has that state copied into `snapshots` at once
    (the next piece of its span continues from it). The one-token rows take one recurrent step together.
    Then the gated RMSNorm and out_proj once. Returns [T, H] in x's dtype.
    Raises ValueError, before any state is touched, on an empty x, a bad layer or slot, Dk > 128, or a
    snapshot cut without a snapshot pool."""
    geo, w, tokens = mixer.geo, mixer.w, x.shape[0]
    if x.dim() != 2 or tokens == 0:
        raise ValueError(f"x must be a non-empty [T, H], got {tuple(x.shape)}")
    for piece in pieces:
        check_gdn_slot(mixer, pool, layer, piece.slot)
        if piece.snapshot is not None and snapshots is None:
            raise ValueError("a piece asks for a snapshot and there is no snapshot pool")
    qkv, z = qkvz_fn(x)  # [T, C], [T, Nv*Dv]
    b, a = ab_fn(x)  # [T, Nv] each
    core = torch.empty(tokens, geo.num_v_heads, geo.v_head_dim, dtype=torch.float32, device=x.device)
    precise = x.dtype == torch.float32
    for piece in pieces:  # NOTE: only these carry a sequence's state; the rest of the layer is batched
        r = piece.rows
        gdn_core(mixer, qkv[r], a[r], b[r], pool, layer, piece.slot, precise=precise, out=core[r])
        if piece.snapshot is not None:
            pool.copy_slot(piece.slot, snapshots, piece.snapshot, layer)
    if decode is not None:
        rows, slots = decode
        conv_weight = getattr(mixer, "conv_weight_2d", None)
        if conv_weight is None:
            conv_weight = w["conv1d.weight"][:, 0, :]
        core[rows] = gdn_decode_step(qkv[rows], a[rows], b[rows], pool.conv[layer], pool.recurrent[layer], slots,
                                     conv_weight, mixer.neg_a, mixer.dt_bias, geo)  # [B, Nv, Dv]
    normed = gated_rms_norm(core, z.reshape(tokens, geo.num_v_heads, geo.v_head_dim), w["norm.weight"], mixer.eps,
                            dtype=x.dtype)  # [T, Nv, Dv]
    return linear_fn(normed.reshape(tokens, -1), w["out_proj.weight"])  # [T, H]
