"""Row-concatenated projection weights for the decode step: q/k/v of an attention layer and qkv/z (and
a/b) of a Gated DeltaNet layer become one GEMV each instead of three (two), with the originals
replaced by views into the concatenation, so the device holds the same bytes and the reference
prefill path reads the same numbers.

Shape legend: O_i rows of part i, I in features, G the 128-row scale block of block FP8.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapters.checkpoint.quant import FP8_BLOCK, QTensor
from domain.model_spec import WeightFormat

ROW_SCALED = (WeightFormat.FP8_CHANNEL, WeightFormat.INT8_CHANNEL)


def _as_row_scaled(q: QTensor) -> QTensor:
    """A per-tensor FP8 weight as the same numbers with one scale per row (so parts can be stacked)."""
    if q.fmt != WeightFormat.FP8_TENSOR:
        return q
    scale = q.scale.reshape(1, 1).expand(q.shape[0], 1).contiguous()  # [O, 1]
    return QTensor(WeightFormat.FP8_CHANNEL, q.shape, q.data, scale)


def concat_rows(parts: Sequence[torch.Tensor | QTensor]) -> tuple[torch.Tensor | QTensor, list] | None:
    """(stacked [sum O_i, I], views of each part into it) or None when the parts cannot be stacked
    (mixed kinds or formats, a block-FP8 part whose rows are not whole scale blocks, fp4 formats)."""
    if all(isinstance(p, torch.Tensor) and not isinstance(p, QTensor) for p in parts):
        if len({(p.dtype, p.shape[1], p.device) for p in parts}) != 1:
            return None
        stacked = torch.cat(list(parts), 0)
        return stacked, list(torch.split(stacked, [p.shape[0] for p in parts], 0))
    if not all(isinstance(p, QTensor) for p in parts):
        return None
    qs = [_as_row_scaled(p) for p in parts]
    fmt = qs[0].fmt
    if any(q.fmt != fmt or q.shape[1] != qs[0].shape[1] or q.data.dtype != qs[0].data.dtype for q in qs):
        return None
    if fmt == WeightFormat.FP8_BLOCK:
        if any(q.shape[0] % FP8_BLOCK for q in qs):
            return None
    elif fmt not in ROW_SCALED:
        return None
    rows = [q.shape[0] for q in qs]
    data = torch.cat([q.data for q in qs], 0)
    scale = torch.cat([q.scale for q in qs], 0)
    stacked = QTensor(fmt, (sum(rows), qs[0].shape[1]), data, scale)
    views, r0 = [], 0
    for q, r in zip(qs, rows, strict=True):
        s0, s1 = (r0 // FP8_BLOCK, (r0 + r) // FP8_BLOCK) if fmt == WeightFormat.FP8_BLOCK else (r0, r0 + r)
        views.append(QTensor(fmt, q.shape, data[r0:r0 + r], scale[s0:s1]))
        r0 += r
    return stacked, views
