"""Paged KV cache and causal attention over it.

Shape legend: L full-attention layers, P pages, G page size, N query heads, M kv heads, D head dim,
T query tokens of one sequence, C context tokens (cached + new).
"""

import torch
import torch.nn.functional as F


class PagedKVCache:
    """K and V pools [L, P, G, M, D]; a sequence's position p lives at page_ids[p // G], offset p % G."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if min(num_pages, page_size, kv_heads, head_dim) <= 0 or num_layers < 0:
            raise ValueError(f"bad KV cache geometry: layers={num_layers} pages={num_pages} page_size={page_size}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, P, G, M, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, P, G, M, D]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def can_address(self, page_ids: tuple[int, ...], end_position: int) -> bool:
        """Read-only probe: do these pages exist and cover positions [0, end_position)?"""
        return len(page_ids) * self.page_size >= end_position and all(0 <= p < self.num_pages for p in page_ids)

    def flat_slots(self, page_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row index into the [P*G] view for each position."""
        return page_ids[positions // self.page_size] * self.page_size + positions % self.page_size  # [T]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        flat_k = self.k[layer].view(-1, *self.k.shape[-2:])  # [P*G, M, D]
        flat_v = self.v[layer].view(-1, *self.v.shape[-2:])  # [P*G, M, D]
        flat_k[slots] = k.to(flat_k.dtype)
        flat_v[slots] = v.to(flat_v.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat_k = self.k[layer].view(-1, *self.k.shape[-2:])
        flat_v = self.v[layer].view(-1, *self.v.shape[-2:])
        return flat_k[slots], flat_v[slots]  # [C, M, D] each

    def check_valid(self) -> None:
        assert self.k.shape == self.v.shape, "K and V pools differ in shape"
        assert self.k.shape[:3] == (self.num_layers, self.num_pages, self.page_size), "pool shape drifted"


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_position: int,
                     scale: float) -> torch.Tensor:
    """q [T, N, D] at positions start..start+T-1 over k/v [C, M, D] holding positions 0..C-1."""
    num_q, ctx = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    # NOTE: kv head m serves query heads m*groups .. m*groups+groups-1 (transformers' repeat_kv).
    k = k.repeat_interleave(groups, dim=1)  # [C, N, D]
    v = v.repeat_interleave(groups, dim=1)  # [C, N, D]
    q_pos = torch.arange(start_position, start_position + num_q, device=q.device)  # [T]
    k_pos = torch.arange(ctx, device=q.device)  # [C]
    mask = k_pos[None, :] <= q_pos[:, None]  # [T, C]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )  # [N, T, D]
    return out.transpose(0, 1)  # [T, N, D]
