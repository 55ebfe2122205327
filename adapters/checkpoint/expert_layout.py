"""Byte layout of one expert (gate, up, down with their scales) inside a packed uint8 row.

Shape legend: H hidden, I expert intermediate, R row bytes.
A row is what the slot pool copies in one transfer: every part sits at a 16-byte aligned
offset so `view` can reinterpret the bytes as typed tensors without copying.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.checkpoint.quant import QTensor, expected_parts
from domain.model_spec import WeightFormat

ALIGN = 16
MATRICES = ("gate", "up", "down")
PARTS = ("data", "scale", "global_scale")


@dataclass
class ExpertWeights:
    gate: QTensor  # [I, H]
    up: QTensor  # [I, H]
    down: QTensor  # [H, I]

    def check_valid(self) -> None:
        for q in (self.gate, self.up, self.down):
            q.check_valid()


@dataclass(frozen=True)
class Segment:
    matrix: str  # gate | up | down
    part: str  # data | scale | global_scale
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ExpertLayout:
    """Offsets of gate/up/down (data + scales) of one expert of format `fmt`."""

    def __init__(
        self, fmt: WeightFormat, hidden: int, intermediate: int, float_dtype: torch.dtype = torch.bfloat16
    ):
        self.fmt = fmt
        self.hidden = hidden
        self.intermediate = intermediate
        self.float_dtype = float_dtype
        shapes = {"gate": (intermediate, hidden), "up": (intermediate, hidden), "down": (hidden, intermediate)}
        segments: list[Segment] = []
        offset = 0
        for matrix in MATRICES:
            parts = expected_parts(fmt, *shapes[matrix], float_dtype=float_dtype)
            for part in PARTS:
                if part not in parts:
                    continue
                dtype, shape = parts[part]
                seg = Segment(matrix, part, offset, dtype, shape)
                segments.append(seg)
                offset = _align(offset + seg.nbytes)
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.shapes = shapes
        self.row_bytes: int = offset

    def __repr__(self) -> str:
        return (
            f"ExpertLayout({self.fmt.value}, H={self.hidden}, I={self.intermediate}, "
            f"{self.float_dtype}, row_bytes={self.row_bytes})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpertLayout) and self.segments == other.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    def check_valid(self) -> None:
        end = 0
        for seg in self.segments:
            if seg.offset % ALIGN or seg.offset < end:
                raise AssertionError(f"segment {seg} misaligned or overlapping")
            end = seg.offset + seg.nbytes
        if end > self.row_bytes:
            raise AssertionError("segments run past row_bytes")

    def can_pack(self, gate: QTensor, up: QTensor, down: QTensor) -> str | None:
        """None when the three matrices fit this layout, else the reason."""
        for matrix, q in zip(MATRICES, (gate, up, down), strict=True):
            if q.fmt != self.fmt:
                return f"{matrix} is {q.fmt.value}, layout is {self.fmt.value}"
            if tuple(q.shape) != self.shapes[matrix]:
                return f"{matrix} has shape {tuple(q.shape)}, layout expects {self.shapes[matrix]}"
            for seg in self.segments:
                if seg.matrix != matrix:
                    continue
                t = getattr(q, seg.part)
                if t is None or t.dtype != seg.dtype or t.numel() * t.element_size() != seg.nbytes:
                    got = None if t is None else (t.dtype, tuple(t.shape))
                    return f"{matrix}.{seg.part} is {got}, layout expects {seg.dtype} {seg.shape}"
        return None

    def pack(
        self, gate: QTensor, up: QTensor, down: QTensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """uint8 [R] holding the three matrices; writes into `out` (a bank row) when given."""
        reason = self.can_pack(gate, up, down)
        if reason is not None:
            raise ValueError(f"cannot pack expert: {reason}")
        row = torch.zeros(self.row_bytes, dtype=torch.uint8) if out is None else out  # [R]
        if row.dtype != torch.uint8 or row.numel() != self.row_bytes:
            raise ValueError(f"pack target must be uint8 [{self.row_bytes}], got {row.dtype} {tuple(row.shape)}")
        by_name = dict(zip(MATRICES, (gate, up, down), strict=True))
        end = 0
        for seg in self.segments:  # NOTE: segments are in offset order
            # zero the alignment padding too: a bank row from an uninitialised buffer must still be
            # the same bytes for the same weights
            row[end : seg.offset].zero_()
            src = getattr(by_name[seg.matrix], seg.part).contiguous().reshape(-1).view(torch.uint8)
            row[seg.offset : seg.offset + seg.nbytes].copy_(src)
            end = seg.offset + seg.nbytes
        row[end:].zero_()
        return row

    def view(self, row: torch.Tensor) -> ExpertWeights:
        """Zero-copy typed views of one packed row (on any device)."""
        if row.dtype != torch.uint8 or row.shape[-1] != self.row_bytes or row.dim() != 1:
            raise ValueError(f"expected a uint8 [{self.row_bytes}] row, got {row.dtype} {tuple(row.shape)}")
        parts: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MATRICES}
        for seg in self.segments:
            raw = row[seg.offset : seg.offset + seg.nbytes]
            parts[seg.matrix][seg.part] = raw.view(seg.dtype).view(seg.shape)
        qs = [QTensor(self.fmt, self.shapes[m], **parts[m]) for m in MATRICES]
        return ExpertWeights(*qs)
