"""Routed experts from the slot pool in two launches: moe_gate_up then moe_down (no kernel of its own), or
(dedup) in three: moe_gate_up_dedup, moe_down_dedup's partials, moe_sum, the same bits.

Shape legend: T tokens, K top-k, H hidden, I expert intermediate, S slots, R row bytes.
"""

from __future__ import annotations

import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels.moe_down import moe_down
from adapters.kernels.moe_down_dedup import moe_down_dedup
from adapters.kernels.moe_gate_up import moe_gate_up
from adapters.kernels.moe_gate_up_dedup import moe_gate_up_dedup
from adapters.kernels.moe_sum import moe_sum


def fused_moe(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
              layout: ExpertLayout, out: torch.Tensor | None = None,
              partials: torch.Tensor | None = None, dedup: bool = False) -> torch.Tensor:
    """out [T, H] in x.dtype = sum_k weights[t, k] * expert_{slot_ids[t, k]}(x[t]) (SwiGLU experts).

    x [T, H]; slot_ids int32 [T, K] (-1 = skip); weights fp32 [T, K]; slots uint8 [S, R] packed by
    `layout`. The intermediate h [T, K, I] is rounded to x.dtype between the two kernels, as the
    torch reference does. partials (fp32 [T, K, H]): fill only the pairs whose slot is not -1 and return
    it unsummed (see moe_down). dedup: the expert-deduplicated kernels (each distinct slot's weights
    streamed once for several of its pairs; at most MAX_DEDUP_PAIRS pairs), bitwise the same result.
    Raises ValueError on mismatched inputs (see the launchers).
    """
    if dedup:
        h = moe_gate_up_dedup(x, slot_ids, slots, layout)  # [T, K, I]
        y = moe_down_dedup(h, slot_ids, weights, slots, layout, partials=partials)  # [T, K, H] fp32
        if partials is not None:
            return partials
        return moe_sum(y, torch.empty_like(x) if out is None else out)  # [T, H]
    h = moe_gate_up(x, slot_ids, slots, layout)  # [T, K, I]
    return moe_down(h, slot_ids, weights, slots, layout, out=out, partials=partials)  # [T, H] or [T, K, H]
