"""The static inputs of a captured decode step and how a step's works get into them with as little
host work as possible: one pinned int64 staging block copied in one transfer, and page-table rows
copied only where they changed (a sequence gains a page every page-size tokens).

Shape legend: B rows (the largest decode bucket), W pages per row (max context / page size).
Staging rows: 0 token id, 1 position, 2 valid (0/1), 3 context length incl. this token, 4 flat KV row
(page * page size + offset; the scratch page for padded rows), 5 state slot (-1 for padded rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from domain.ports import SequenceWork

TOKEN, POSITION, VALID, SEQ_LEN, KV_ROW, STATE_SLOT = range(6)


@dataclass(frozen=True)
class DecodeView:
    """What decode_step reads for its first n rows (views of the static buffers)."""

    staging: torch.Tensor  # int64 [6, n]
    page_table: torch.Tensor  # int32 [n, W]

    @property
    def rows(self) -> int:
        return int(self.staging.shape[1])


class DecodeInputs:
    def __init__(self, rows: int, pages_per_row: int, page_size: int, scratch_row: int, device):
        self.rows, self.page_size, self.scratch_row = rows, page_size, scratch_row
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.host = torch.zeros((6, rows), dtype=torch.int64, pin_memory=pin)  # [6, B]
        self._np = self.host.numpy()
        self.staging = torch.zeros((6, rows), dtype=torch.int64, device=self.device)  # [6, B]
        self.page_table = torch.zeros((rows, pages_per_row), dtype=torch.int32, device=self.device)  # [B, W]
        self._row_pages: list[tuple[int, ...]] = [()] * rows  # what each device row holds (host mirror)
        # NOTE: the host block is rewritten each step; wait for the previous step's copy to have left it
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.pad_from(0)
        self.staging.copy_(self.host)

    def view(self, n: int) -> DecodeView:
        return DecodeView(self.staging[:, :n], self.page_table[:n])

    def pad_from(self, n: int) -> None:
        """Rows n.. route nowhere: no expert, no state slot, K/V into the scratch page, context 0."""
        a = self._np
        a[:, n:] = 0
        a[KV_ROW, n:] = self.scratch_row
        a[STATE_SLOT, n:] = -1

    def stage(self, works: Sequence[SequenceWork], has_state: bool) -> None:
        """Write n single-token works into rows 0..n-1 (and pad the rest) on the current stream."""
        n, g, a = len(works), self.page_size, self._np
        if n > self.rows:
            raise ValueError(f"{n} decode rows exceed the {self.rows} the buffers hold")
        if self._copied is not None:
            self._copied.synchronize()
        width = self.page_table.shape[1]
        for r, w in enumerate(works):
            p = w.start_position
            if p // g >= width:
                raise ValueError(f"{w.request_id}: position {p} is past the {width * g} tokens a row addresses")
            a[TOKEN, r], a[POSITION, r], a[VALID, r], a[SEQ_LEN, r] = w.token_ids[0], p, 1, p + 1
            a[KV_ROW, r] = w.page_ids[p // g] * g + p % g
            a[STATE_SLOT, r] = w.state_slot if has_state else -1
            self._sync_pages(r, w.page_ids[: min(len(w.page_ids), width)])
        self.pad_from(n)
        self.staging.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _sync_pages(self, row: int, pages: tuple[int, ...]) -> None:
        held = self._row_pages[row]
        start = len(held) if pages[: len(held)] == held else 0
        if start < len(pages):
            new = torch.tensor(pages[start:], dtype=torch.int32)
            self.page_table[row, start:len(pages)].copy_(new.to(self.device, non_blocking=False))
            self._row_pages[row] = tuple(pages)
