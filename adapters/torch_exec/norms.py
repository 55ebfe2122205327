"""RMS norms of the Qwen3 family, computed in fp32 like transformers.

Shape legend: T tokens, H hidden (or head dim), D value head dim.
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool) -> torch.Tensor:
    """RMSNorm over the last dim. unit_offset=True is Qwen3.5's (1 + w) form, whose weights are stored
    zero-centred; False is the classic w * x of Qwen3."""
    xf = x.float()  # [T, H]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [T, H]
    if unit_offset:
        # NOTE: (x * (1 + w)) in fp32, then cast — the order transformers uses for Qwen3.5.
        return (xf * (1.0 + weight.float())).to(x.dtype)
    # Qwen3 casts before scaling: w * x.to(dtype).
    return weight * xf.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet output norm: w * rmsnorm(x) * silu(gate), per value head (last dim D)."""
    dtype = x.dtype
    xf = x.float()  # [T, D]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [T, D]
    out = weight * xf.to(dtype)  # [T, D]
    out = out * F.silu(gate.float())  # [T, D] (fp32)
    return out.to(dtype)
