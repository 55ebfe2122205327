"""What every token-mixer layer of one prefill or mixed step shares, built once per step on the host (a few
uploads) for prefill_spans.py: each token's flat KV row, the prefill spans' query-block table and page lists
(paged_prefill_attention; a span over a long context: its context rows), the one-token rows' page table and
lengths, the rotary tables at every token's position, and the Gated DeltaNet launch
groups (span and chunk tables of the conv and WY kernels; the pieces of spans cut by a prefix-cache
snapshot). Before, every layer recomputed its share of these on the device, span by span.

Shape legend: T tokens of the step, B one-token rows, X context tokens of a span (its cached prefix + the
span), G page size, W page-table width, R rotary dim, P spans of a launch group, NC their 64-token chunks,
NB query blocks of paged_prefill_attention, PP the page-list entries of their spans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from adapters.kernels.gdn_chunk_wy import CHUNK
from adapters.kernels.paged_decode_attention import default_num_splits
from adapters.kernels.paged_prefill_attention import BLOCK_FIELDS, span_blocks
from adapters.torch_exec.host_staging import layout, pack, staging, views
from adapters.torch_exec.rotary import Rotary
from adapters.torch_exec.step_inputs import StepInputs, upload
from domain.step_budget import GDN_WINDOW_TOKENS

# NOTE: a prefill span of n tokens over a context of X (its cached prefix + itself) attends through
# paged_prefill_attention, every such span of the step in one launch, while n * X is at most this many
# query-context pairs; a bigger one through SDPA, span by span. Why the product: the paged kernel reads the
# context's K/V once per query block of a few tokens (block_tokens: 4-8 at Qwen3.6), so its K/V traffic grows
# as n / U * X, where SDPA's flash kernel reads it once per 128-row tile after one gather; and a big span's
# own launches are few against its work. At the bound (e.g. 128 tokens after a 4k prefix, or a 724-token
# prompt) the paged kernel reads ~0.5 GB of K/V a layer at Qwen3.6 (bf16, 2 kv heads of 256). Not yet timed
# against SDPA on a GPU.
PAGED_PREFILL_MAX_PAIRS = 1 << 19


@dataclass(frozen=True)
class PrefillSpan:
    rows: slice  # the span's rows of the step
    context: torch.Tensor  # int64 [X]: flat KV row (page * G + offset) of positions 0 .. end-1


@dataclass(frozen=True)
class AttentionTables:
    """What every attention layer of one step reads, built on the host once per step (one upload). NOTE:
    every device table is a view of that upload starting at a multiple of 16 bytes: Triton specializes
    pointer arguments on 16-byte alignment, and a differently aligned view would compile another binary on
    a request's path."""

    kv_rows: torch.Tensor  # int64 [T]: flat KV row each token's K/V is written to
    prefill: tuple[PrefillSpan, ...]  # spans of more than one token past PAGED_PREFILL_MAX_PAIRS (SDPA)
    blocks: torch.Tensor | None  # int32 [NB, BLOCK_FIELDS]: the other such spans' query blocks; None when none
    block_pages: torch.Tensor | None  # int32 [PP]: those spans' page lists, one after another
    block_tokens: int  # tokens per query block of `blocks` (paged_prefill_attention.block_tokens)
    decode_rows: torch.Tensor | None  # int64 [B]: rows of the one-token spans; None when there are none
    decode_all: bool  # every row is a one-token span (rows 0..T-1 in order): q is used as it is
    page_table: torch.Tensor | None  # int32 [B, W] of the one-token rows
    seq_lens: torch.Tensor | None  # int32 [B]: each one-token row's context, itself included
    num_splits: int  # paged_decode_attention's static split count


def upload_aligned(parts: list[torch.Tensor], device) -> list[torch.Tensor]:
    """The host tensors `parts` (any integer dtypes, shapes and layouts) on `device` in one copy: views of one
    buffer, each starting at a multiple of 16 bytes (host_staging.ALIGN)."""
    device = torch.device(device)
    if device.type == "cuda":  # NOTE: asynchronous: built at the first attention layer, it would wait for the
        # layers queued before it. The parts are written straight into a reused pinned buffer: a torch.cat of
        # them cost 3.8-6.3 ms of host time for ~51 KB in a mixed step's trace on the H100
        return staging(device).upload(parts)
    offsets, total = layout(parts)
    buf = torch.zeros(total, dtype=torch.uint8)  # zeroed: the padding between parts is the same every run
    pack(parts, offsets, buf)
    return views(upload(buf, device), parts, offsets)


def attention_tables(inp: StepInputs, page_size: int, table_width: int, kv_heads: int,
                     block_tokens: int) -> AttentionTables:
    """The step's AttentionTables. table_width: the page-table width W of the one-token rows (0: the smallest
    power of two that holds their pages); block_tokens: tokens per query block of paged_prefill_attention
    (its block_tokens for the model's heads and dtype). NOTE: W and the split count are compile-time
    constants of paged_decode_attention: a fixed W (the decode graphs') and a split count from the row count
    rounded up to a power of two keep mixed steps on the binaries the graph capture and the prefill warm-up
    built. Raises ValueError when a span's pages do not cover its positions or a row's context exceeds W
    pages."""
    device = inp.token_ids.device
    g = page_size
    offsets = torch.arange(g, dtype=torch.int64)  # [G]
    kv_rows, contexts, spans, decodes, blocks, block_pages = [], [], [], [], [], []
    for s in inp.spans:
        start, end = s.start_position, s.end_position
        pages = s.work.page_ids
        if len(pages) * g < end:
            raise ValueError(f"{s.work.request_id}: {len(pages)} pages of {g} do not cover positions 0..{end - 1}")
        if s.length == 1:  # a one-token row needs only its own flat row, not its whole context's
            kv_rows.append(torch.tensor([pages[start // g] * g + start % g], dtype=torch.int64))
            decodes.append(s)
            continue
        used = pages[: -(-end // g)]
        if s.length * end <= PAGED_PREFILL_MAX_PAIRS:  # its query blocks and page list; its own positions' rows
            pos = torch.arange(start, end)
            kv_rows.append(torch.tensor(used, dtype=torch.int64)[pos // g] * g + pos % g)
            blocks += span_blocks(s.offset, s.length, end, len(block_pages), block_tokens)
            block_pages += used
            continue
        # NOTE: on the host: every position's flat row from the page list (a few microseconds per span), so
        # no layer computes slots on the device
        flat = (torch.tensor(used, dtype=torch.int64)[:, None] * g + offsets).reshape(-1)[:end]
        kv_rows.append(flat[start:])
        spans.append(s.rows)
        contexts.append(flat)
    parts = [torch.cat(kv_rows), *contexts]
    if blocks:
        parts += [torch.tensor(blocks, dtype=torch.int32).view(-1, BLOCK_FIELDS),
                  torch.tensor(block_pages, dtype=torch.int32)]
    if decodes:
        need = max(-(-s.end_position // g) for s in decodes)
        width = table_width or 1 << (need - 1).bit_length()
        if need > width:
            raise ValueError(f"a one-token row's context of {need} pages exceeds the page table's {width}")
        count = len(decodes)
        table = torch.zeros(count, width, dtype=torch.int32)  # [B, W]
        for r, s in enumerate(decodes):
            pages = s.work.page_ids[:width]
            table[r, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        parts += [table, torch.tensor([s.end_position for s in decodes], dtype=torch.int32),
                  torch.tensor([s.offset for s in decodes], dtype=torch.int64)]
    dev = upload_aligned(parts, device)  # NOTE: one upload for every layer of the step
    n_ctx = len(contexts)
    rows_all, prefill = dev[0], tuple(PrefillSpan(r, c) for r, c in zip(spans, dev[1:1 + n_ctx], strict=True))
    at = 1 + n_ctx
    blocks_dev = pages_dev = None
    if blocks:
        blocks_dev, pages_dev = dev[at:at + 2]
        at += 2
    if not decodes:
        return AttentionTables(rows_all, prefill, blocks_dev, pages_dev, block_tokens, None, False, None, None, 1)
    table_dev, lens_dev, rows_dev = dev[at:at + 3]
    tokens = len(inp.token_ids)
    in_order = count == tokens and all(s.offset == r for r, s in enumerate(decodes))
    splits = default_num_splits(1 << (count - 1).bit_length(), kv_heads, width * g, device)
    return AttentionTables(rows_all, prefill, blocks_dev, pages_dev, block_tokens, rows_dev, in_order, table_dev,
                           lens_dev, splits)


@dataclass(frozen=True)
class GdnGroup:
    """Gated DeltaNet spans whose conv and WY run in one launch each (the span and chunk tables of
    gdn_conv_prefill_spans and gdn_chunk_wy), then their state walks and outputs in as few launches as the
    walk's scratch allows (`walks`: gdn_chunk_state's SpanWalk over `walk_table`, gdn_chunk_out over the
    chunk table). Every table is a view starting on a 16-byte boundary: Triton specializes a pointer
    argument on that alignment, and a view that has it in one step and not in the next would compile
    another binary on a request's path."""

    spans: tuple[tuple[slice, int], ...]  # (rows of the step, state slot) per span
    starts: torch.Tensor  # int64 [P]: first row of each span
    lengths: torch.Tensor  # int64 [P]
    slots: torch.Tensor  # int64 [P]
    chunk_starts: torch.Tensor  # int64 [NC]: first row of every 64-token chunk of the spans
    chunk_ends: torch.Tensor  # int64 [NC]: the end (exclusive) of each chunk's span
    max_len: int
    snapshot: int | None  # a piece of a cut span: the snapshot slot its state is copied into after it
    walk_table: torch.Tensor  # int64 [4, E]: SpanWalk's table (begin, end, slot, first hs chunk per piece)
    walks: tuple[tuple[int, int, int, int], ...]  # SpanWalk's (first, count, chunk0, chunks) per launch


def plan_walks(spans, window: int) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int, int]]]:
    """The state walk of spans [(rows, slot)] as launches of at most window // 64 chunks (the entry states
    one launch keeps: prefill.GDN_WINDOW): (entries [(begin, end, slot, first hs chunk)], launches
    [(first entry, entries, first chunk in the chunk table, chunks)]). A span longer than the window is cut
    into window-long pieces, each in a later launch than the one before (it starts from that one's state);
    short spans share a launch. window: a positive multiple of 64, so pieces start where the chunk table's
    chunks do. Pure host arithmetic."""
    if window <= 0 or window % CHUNK:
        raise ValueError(f"window must be a positive multiple of {CHUNK}, got {window}")
    limit = window // CHUNK
    entries, launches, chunk_at, cur = [], [], 0, None
    for rows, slot in spans:
        for begin in range(rows.start, rows.stop, window):
            end = min(rows.stop, begin + window)
            n = -(-(end - begin) // CHUNK)
            if cur is None or cur[3] + n > limit or begin != rows.start:
                if cur is not None:
                    launches.append(tuple(cur))
                cur = [len(entries), 0, chunk_at, 0]
            entries.append((begin, end, slot, cur[3]))
            cur[1] += 1
            cur[3] += n
            chunk_at += n
    if cur is not None:
        launches.append(tuple(cur))
    return entries, launches


def gdn_groups(inp: StepInputs, with_snapshots: bool) -> tuple[GdnGroup, ...]:
    """The step's spans of more than one token as launch groups, built on the host and uploaded in one copy:
    first every span without a prefix-cache snapshot strictly inside it (with_snapshots), all in one group;
    then each piece of each span that has one, a group of its own, in order. NOTE: a snapshot inside a span
    cuts it there, as MoeDecoder._linear_attention does: the state after exactly that many tokens exists only
    between the two pieces, so they run one after the other (their conv state and recurrent state hand over
    through the slot)."""
    whole, pieces = [], []
    for s in inp.spans:
        if s.length == 1:
            continue
        slot = s.work.state_slot
        cuts = [(p - s.start_position, snap) for p, snap in s.work.snapshots if p < s.end_position]
        if not (cuts and with_snapshots):
            whole.append((slice(s.offset, s.offset + s.length), slot))
            continue
        start = s.offset
        for cut, snap in cuts:
            pieces.append(([(slice(start, s.offset + cut), slot)], snap))
            start = s.offset + cut
        pieces.append(([(slice(start, s.offset + s.length), slot)], None))
    return upload_groups(([(whole, None)] if whole else []) + pieces, inp.token_ids.device)


def upload_groups(groups: list, device) -> tuple[GdnGroup, ...]:
    """GdnGroups from [(spans: [(rows, slot)], snapshot slot or None)], every table in one upload."""
    if not groups:
        return ()
    parts, walks = [], []
    for spans, _ in groups:
        chunks = [(r.start + c, r.stop) for r, _ in spans for c in range(0, r.stop - r.start, CHUNK)]
        entries, launches = plan_walks(spans, GDN_WINDOW_TOKENS)
        walks.append(tuple(launches))
        parts += [torch.tensor(v, dtype=torch.int64) for v in (
            [r.start for r, _ in spans], [r.stop - r.start for r, _ in spans], [slot for _, slot in spans],
            [c for c, _ in chunks], [e for _, e in chunks])]
        parts.append(torch.tensor(entries, dtype=torch.int64).t().contiguous())  # [4, E]
    tables = upload_aligned(parts, device)
    out = []
    for i, ((spans, snap), launches) in enumerate(zip(groups, walks, strict=True)):
        starts, lengths, slots, chunk_starts, chunk_ends, walk = tables[6 * i:6 * i + 6]
        out.append(GdnGroup(tuple(spans), starts, lengths, slots, chunk_starts, chunk_ends,
                            max(r.stop - r.start for r, _ in spans), snap, walk, launches))
    return tuple(out)


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

    def attention(self, page_size: int, table_width: int, kv_heads: int, block_tokens: int) -> AttentionTables:
        return self.memo(("attention", page_size, table_width, kv_heads, block_tokens),
                         lambda: attention_tables(self.inp, page_size, table_width, kv_heads, block_tokens))

    def cos_sin(self, rotary: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R] at every token's own position."""
        return self.memo(("rotary", id(rotary), dtype), lambda: rotary.cos_sin(self.inp.positions, dtype))

    def gdn_groups(self, with_snapshots: bool) -> tuple[GdnGroup, ...]:
        return self.memo(("gdn", with_snapshots), lambda: gdn_groups(self.inp, with_snapshots))
