"""One matmul entry point for dense float weights and quantized QTensors.

Shape legend: T tokens, I in features, O out features.
"""

import torch
import torch.nn.functional as F

from adapters.checkpoint.quant import QTensor, qlinear
from domain.model_spec import WeightFormat


def linear(x: torch.Tensor, w: torch.Tensor | QTensor) -> torch.Tensor:
    """x [T, I] @ w[O, I]^T -> [T, O] in x's dtype; quantized weights dequantize inside the matmul."""
    if isinstance(w, QTensor):
        return qlinear(x, w)
    return F.linear(x, w)


def to_compute_dtype(w: torch.Tensor | QTensor, dtype: torch.dtype, device) -> torch.Tensor | QTensor:
    """Float weights (plain or bf16-format QTensor) move to the compute dtype; quantized ones stay packed."""
    if isinstance(w, QTensor):
        if w.fmt == WeightFormat.BF16:
            return w.data.to(device=device, dtype=dtype)
        return w.to(device)
    return w.to(device=device, dtype=dtype)
