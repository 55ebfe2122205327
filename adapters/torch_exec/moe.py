"""Sparse MoE block: softmax router -> top-k (-> renormalise), experts computed only from the slot
cache, optional sigmoid-gated shared expert.

Shape legend: T tokens, H hidden, E experts, K top-k, I expert intermediate.
"""

import torch
import torch.nn.functional as F

from adapters.torch_exec.expert_cache import ExpertSlotCache
from adapters.torch_exec.linear import linear


def route(x: torch.Tensor, router_weight, top_k: int, renormalize: bool,
          replace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] fp32, expert ids [T, K]). replace: [T, K] ids that replace the top-k choice
    (`--routing-replay`); their weights are the router's probabilities at those ids, renormalised alike."""
    if isinstance(router_weight, torch.Tensor) and router_weight.dtype == torch.float32:
        x = x.float()  # fp32 router: activations are bf16-rounded already, the matmul need not be
    probs = torch.softmax(linear(x, router_weight), dim=-1, dtype=torch.float32)  # [T, E]
    if replace is None:
        weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    else:
        assert replace.shape == (x.shape[0], top_k), f"replacement ids {tuple(replace.shape)} for {x.shape[0]} tokens"
        ids = replace.long()
        weights = probs.gather(1, ids)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def swiglu(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for dense or quantized weights: [T, H] -> [T, H]."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)



def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: int,
                   cache: ExpertSlotCache) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), every expert read from a resident slot.

    NOTE: experts are visited in ascending id and each adds its rows in (k, token) order whatever the
    grouping, so a cache of any size yields bitwise-identical sums.
    """
    out = torch.zeros_like(x)  # [T, H]
    distinct = torch.unique(ids).tolist()  # ascending; one host sync per layer
    for group in cache.resident_groups(layer, distinct):
        for expert, w in group:
            k_pos, tokens = torch.where((ids == expert).transpose(0, 1))  # [n], [n]
            y = swiglu(x[tokens], w.gate, w.up, w.down) * weights[tokens, k_pos, None]  # [n, H] (fp32)
            out.index_add_(0, tokens, y.to(out.dtype))
    return out


def shared_expert(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    """Qwen3.5's always-on expert, scaled per token by sigmoid(shared_expert_gate(x))."""
    h = swiglu(x, *(w[f"{prefix}shared_expert.{proj}_proj.weight"] for proj in ("gate", "up", "down")))
    return torch.sigmoid(linear(x, w[f"{prefix}shared_expert_gate.weight"])) * h  # [T, H]
