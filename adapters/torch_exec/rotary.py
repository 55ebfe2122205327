"""Rotary position embedding (default rope type, optional partial rotary), as transformers lays it out:
the first `rotary_dim` channels of each head are rotated in rotate-half form, the rest pass through.

Shape legend: T tokens, N heads, D head dim, R rotary dim.
"""

import torch


def rope_settings(text_config: dict) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from a HF text config, old (flat keys) or new (rope_parameters) style."""
    params = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = float(params.get("rope_theta", text_config.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", text_config.get("partial_rotary_factor", 1.0)))
    return theta, partial


class Rotary:
    """cos/sin tables for positions, computed in fp32 and cast to the activations' dtype."""

    def __init__(self, head_dim: int, theta: float, partial_factor: float, device: torch.device | str):
        self.rotary_dim = int(head_dim * partial_factor)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim {head_dim} x {partial_factor}) must be even")
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32)
        self.inv_freq = 1.0 / (theta ** (exponents / self.rotary_dim))  # [R/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D] rotated on its first R channels with cos/sin [T, R]."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R]
    x_rot, x_pass = x[..., :rot], x[..., rot:]  # [T, N, R], [T, N, D-R]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)  # [T, N, D]
