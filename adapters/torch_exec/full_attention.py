"""Full (softmax) attention layer of the Qwen3 family over the paged KV cache: q/k RMSNorm per head,
(partial) rotary, optional sigmoid output gate carried inside q_proj (Qwen3.5).

Shape legend: T tokens of the step, N query heads, M kv heads, D head dim, H hidden.
"""

from dataclasses import dataclass

import torch

from adapters.torch_exec.linear import linear
from adapters.torch_exec.norms import rms_norm
from adapters.torch_exec.paged_attention import PagedKVCache, causal_attention
from adapters.torch_exec.rotary import Rotary, apply_rotary
from adapters.torch_exec.step_inputs import StepInputs


@dataclass(frozen=True)
class AttentionGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    output_gate: bool  # Qwen3.5: q_proj yields [query | gate] per head
    unit_offset_norm: bool  # Qwen3.5's (1 + w) q/k norms
    eps: float


class FullAttention:
    def __init__(self, weights: dict, geo: AttentionGeometry, rotary: Rotary, kv_layer: int):
        self.w, self.geo, self.rotary, self.kv_layer = weights, geo, rotary, kv_layer
        self.bias = {n: weights.get(f"{n}.bias") for n in ("q_proj", "k_proj", "v_proj", "o_proj")}

    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        out = linear(x, self.w[f"{name}.weight"])
        return out if self.bias[name] is None else out + self.bias[name]

    def forward(self, x: torch.Tensor, inp: StepInputs, kv: PagedKVCache) -> torch.Tensor:
        geo, tokens = self.geo, x.shape[0]
        q = self._proj(x, "q_proj")  # [T, N*D] or [T, N*2D]
        gate = None
        if geo.output_gate:
            q, gate = torch.chunk(q.view(tokens, geo.num_heads, 2 * geo.head_dim), 2, dim=-1)  # [T, N, D] x2
            gate = gate.reshape(tokens, -1)  # [T, N*D]
        q = q.reshape(tokens, geo.num_heads, geo.head_dim)  # [T, N, D]
        k = self._proj(x, "k_proj").view(tokens, geo.num_kv_heads, geo.head_dim)  # [T, M, D]
        v = self._proj(x, "v_proj").view(tokens, geo.num_kv_heads, geo.head_dim)  # [T, M, D]
        q = rms_norm(q, self.w["q_norm.weight"], geo.eps, unit_offset=geo.unit_offset_norm)
        k = rms_norm(k, self.w["k_norm.weight"], geo.eps, unit_offset=geo.unit_offset_norm)
        cos, sin = self.rotary.cos_sin(inp.positions, x.dtype)  # [T, R]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = torch.empty_like(q)  # [T, N, D]
        scale = geo.head_dim ** -0.5
        for span in inp.spans:
            rows = span.rows
            kv.write(self.kv_layer, kv.flat_slots(span.page_ids, inp.positions[rows]), k[rows], v[rows])
            ctx = kv.flat_slots(span.page_ids, torch.arange(span.end_position, device=x.device))  # [C]
            k_ctx, v_ctx = kv.read(self.kv_layer, ctx)  # [C, M, D]
            out[rows] = causal_attention(q[rows], k_ctx, v_ctx, span.start_position, scale)
        out = out.reshape(tokens, -1)  # [T, N*D]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self._proj(out, "o_proj")  # [T, H]
