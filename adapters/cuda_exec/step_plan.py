"""What every token-mixer layer of one prefill or mixed step shares, built once per step on the host (a few
uploads) for prefill_spans.py: each token's flat KV row, each prefill span's context rows, the one-token
rows' page table and lengths, the rotary tables at every token's position, and the Gated DeltaNet launch
groups (span and chunk tables of the conv and WY kernels; the pieces of spans cut by a prefix-cache
snapshot). Before, every layer recomputed its share of these on the device, span by span.

Shape legend: T tokens of the step, B one-token rows, X context tokens of a span (its cached prefix + the
span), G page size, W page-table width, R rotary dim, P spans of a launch group, NC their 64-token chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from adapters.kernels.gdn_chunk_wy import CHUNK
from adapters.kernels.paged_decode_attention import default_num_splits
from adapters.torch_exec.rotary import Rotary
from adapters.torch_exec.step_inputs import StepInputs
from domain.step_budget import GDN_WINDOW_TOKENS


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
        if s.length == 1:  # a one-token row needs only its own flat row, not its whole context's
            kv_rows.append(torch.tensor([pages[start // g] * g + start % g], dtype=torch.int64))
            decodes.append(s)
            continue
        # NOTE: on the host: every position's flat row from the page list (a few microseconds per span), so
        # no layer computes slots on the device
        flat = (torch.tensor(pages[: -(-end // g)], dtype=torch.int64)[:, None] * g + offsets).reshape(-1)[:end]
        kv_rows.append(flat[start:])
        spans.append(s.rows)
        contexts.append(flat)
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

    @property
    def walk_chunks(self) -> int:
        """The most chunks one walk launch holds: the entry states' scratch, in chunks."""
        return max(w[3] for w in self.walks)


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


def upload_aligned(parts: list[list[int]], device) -> list[torch.Tensor]:
    """int64 tensors of parts in one upload, each starting on a 16-byte boundary of one buffer (a part is
    padded to an even length: see GdnGroup)."""
    host, spans = [], []
    for part in parts:
        spans.append((len(host), len(part)))
        host += part + [0] * (len(part) % 2)
    table = torch.tensor(host, dtype=torch.int64).to(device)
    return [table[at:at + n] for at, n in spans]


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
        parts += [[r.start for r, _ in spans], [r.stop - r.start for r, _ in spans], [slot for _, slot in spans],
                  [c for c, _ in chunks], [e for _, e in chunks]]
        # NOTE: the walk table's rows padded to a multiple of 2 entries: each row 16-byte aligned too
        width = len(entries) + len(entries) % 2
        parts.append([v for col in zip(*entries, strict=True) for v in (*col, *[0] * (width - len(col)))])
    tables = upload_aligned(parts, device)
    out = []
    for i, ((spans, snap), launches) in enumerate(zip(groups, walks, strict=True)):
        starts, lengths, slots, chunk_starts, chunk_ends, walk = tables[6 * i:6 * i + 6]
        out.append(GdnGroup(tuple(spans), starts, lengths, slots, chunk_starts, chunk_ends,
                            max(r.stop - r.start for r, _ in spans), snap, walk.view(4, -1), launches))
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

    def attention(self, page_size: int, table_width: int, kv_heads: int) -> AttentionTables:
        return self.memo(("attention", page_size, table_width, kv_heads),
                         lambda: attention_tables(self.inp, page_size, table_width, kv_heads))

    def cos_sin(self, rotary: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R] at every token's own position."""
        return self.memo(("rotary", id(rotary), dtype), lambda: rotary.cos_sin(self.inp.positions, dtype))

    def gdn_groups(self, with_snapshots: bool) -> tuple[GdnGroup, ...]:
        return self.memo(("gdn", with_snapshots), lambda: gdn_groups(self.inp, with_snapshots))
