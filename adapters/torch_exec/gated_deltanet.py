"""Gated DeltaNet (linear attention) of Qwen3.5: causal depthwise conv + SiLU, gated delta rule
(chunked for prefill, recurrent for decode), gated RMSNorm; fp32 recurrent state in per-sequence slots.

Shape legend: T tokens of one sequence, B sequences, S state slots, C conv channels (2*Nk*Dk + Nv*Dv),
W conv kernel, Nk key heads, Nv value heads, Dk key head dim, Dv value head dim, Q chunk size.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapters.torch_exec.linear import linear
from adapters.torch_exec.norms import gated_rms_norm

CHUNK = 64


@dataclass(frozen=True)
class GdnGeometry:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @classmethod
    def from_text_config(cls, cfg: dict) -> "GdnGeometry":
        return cls(cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                   cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"])


class LinearStatePool:
    """Per linear-attention layer: conv state [S, C, W-1] (model dtype) and recurrent state
    [S, Nv, Dk, Dv] (fp32), one slot per running sequence."""

    def __init__(self, num_layers: int, num_slots: int, geo: GdnGeometry, dtype: torch.dtype, device):
        if num_slots <= 0:
            raise ValueError(f"state pool needs at least one slot, got {num_slots}")
        self.num_layers, self.num_slots, self.geo = num_layers, num_slots, geo
        self.conv = torch.zeros(num_layers, num_slots, geo.conv_channels, geo.conv_kernel - 1,
                                dtype=dtype, device=device)  # [L, S, C, W-1]
        self.recurrent = torch.zeros(num_layers, num_slots, geo.num_v_heads, geo.k_head_dim, geo.v_head_dim,
                                     dtype=torch.float32, device=device)  # [L, S, Nv, Dk, Dv]

    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def can_use(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots

    def reset(self, slot: int) -> None:
        """A sequence starting at position 0 must not see its slot's previous tenant."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def copy_slot(self, src_slot: int, dst: "LinearStatePool", dst_slot: int, layer: int | None = None) -> None:
        """Copy slot `src_slot` (every layer, or one) into `dst_slot` of `dst`, a pool of the same geometry:
        a prefix-cache snapshot (state pool -> snapshot pool) or its restore (the other way). Exact copies,
        on the pools' device, ordered on the current stream."""
        if not (self.can_use(src_slot) and dst.can_use(dst_slot)):
            raise ValueError(f"state copy {src_slot} -> {dst_slot} outside pools of {self.num_slots} and {dst.num_slots}")
        if dst.conv.shape[2:] != self.conv.shape[2:] or dst.recurrent.shape[2:] != self.recurrent.shape[2:] \
                or dst.num_layers != self.num_layers:
            raise ValueError("state copy between pools of different geometry")
        layers = slice(None) if layer is None else layer
        dst.conv[layers, dst_slot] = self.conv[layers, src_slot]
        dst.recurrent[layers, dst_slot] = self.recurrent[layers, src_slot]

    def check_valid(self) -> None:
        assert self.recurrent.dtype == torch.float32, "recurrent state must stay fp32"
        assert self.conv.shape[:2] == self.recurrent.shape[:2] == (self.num_layers, self.num_slots)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [T, C], conv_state [C, W-1] (the W-1 previous inputs),
    weight [C, 1, W]. Returns (out [T, C], new state [C, W-1])."""
    seq = torch.cat((conv_state.to(x.dtype), x.transpose(0, 1)), dim=-1)  # [C, W-1+T]
    out = F.conv1d(seq[None], weight.to(x.dtype), groups=seq.shape[0])[0]  # [C, T]
    new_state = seq[:, seq.shape[1] - conv_state.shape[1]:]  # [C, W-1]
    return F.silu(out).transpose(0, 1), new_state  # [T, C]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunked_delta_rule(q, k, v, g, beta, state):
    """Chunked gated delta rule over one sequence. q,k [N, T, Dk], v [N, T, Dv], g, beta [N, T] (fp32,
    q/k already l2-normed and q scaled), state [N, Dk, Dv] fp32. Returns (out [N, T, Dv], state)."""
    num_heads, length, _ = k.shape
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # [N, T', D]
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))  # [N, T']
    chunks = (length + pad) // CHUNK
    q, k, v = (t.reshape(num_heads, chunks, CHUNK, t.shape[-1]) for t in (q, k, v))  # [N, n, Q, D]
    g = g.reshape(num_heads, chunks, CHUNK).cumsum(-1)  # [N, n, Q] cumulative log decay inside a chunk
    beta = beta.reshape(num_heads, chunks, CHUNK)  # [N, n, Q]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = torch.tril(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device), diagonal=-1)
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()  # [N, n, Q, Q]
    # Intra-chunk WY form: solve (I + strictly_lower(beta K K^T * decay)) X = [v_beta | k_beta * e^g].
    a = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~lower, 0)  # [N, n, Q, Q]
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    rhs = torch.cat((v_beta, k_beta * g.exp()[..., None]), dim=-1)  # [N, n, Q, Dv+Dk]
    sol = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    u, w = sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]  # [N, n, Q, Dv], [N, n, Q, Dk]
    causal = torch.triu(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device), diagonal=1)
    out = torch.empty_like(v)  # [N, n, Q, Dv]
    for i in range(chunks):
        q_i, k_i, g_i = q[:, i], k[:, i], g[:, i]
        attn = (q_i @ k_i.transpose(-1, -2) * decay[:, i]).masked_fill(causal, 0)  # [N, Q, Q]
        v_new = u[:, i] - w[:, i] @ state  # [N, Q, Dv]
        out[:, i] = (q_i * g_i.exp()[..., None]) @ state + attn @ v_new
        g_last = g_i[:, -1]  # [N]
        state = state * g_last.exp()[:, None, None] + (
            k_i * (g_last[:, None] - g_i).exp()[..., None]).transpose(-1, -2) @ v_new
    out = out.reshape(num_heads, chunks * CHUNK, -1)[:, :length]  # [N, T, Dv]
    return out, state


def recurrent_delta_rule(q, k, v, g, beta, state):
    """One token per sequence, batched. q,k [B, N, Dk], v [B, N, Dv], g, beta [B, N] (fp32, q/k normed and
    q scaled), state [B, N, Dk, Dv] fp32. Returns (out [B, N, Dv], state)."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(dim=-2)  # [B, N, Dv]
    delta = (v - kv_mem) * beta[..., None]  # [B, N, Dv]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(dim=-2)  # [B, N, Dv]
    return out, state


class GatedDeltaNet:
    """One linear-attention layer; weights are the HF tensors (in_proj_qkv fused, in_proj_z/b/a, conv1d,
    A_log, dt_bias, norm, out_proj)."""

    def __init__(self, weights: dict, geo: GdnGeometry, eps: float):
        self.w, self.geo, self.eps = weights, geo, eps
        self.neg_a = -weights["A_log"].float().exp()  # [Nv]
        self.dt_bias = weights["dt_bias"].float()  # [Nv]

    def _project(self, x: torch.Tensor):
        geo = self.geo
        qkv = linear(x, self.w["in_proj_qkv.weight"])  # [T, C]
        z = linear(x, self.w["in_proj_z.weight"])  # [T, Nv*Dv]
        beta = linear(x, self.w["in_proj_b.weight"]).float().sigmoid()  # [T, Nv]
        # NOTE: the decay gate in fp32, as transformers does (fp16/bf16 A can underflow to -inf).
        g = self.neg_a * F.softplus(linear(x, self.w["in_proj_a.weight"]).float() + self.dt_bias)  # [T, Nv]
        return qkv, z.reshape(-1, geo.num_v_heads, geo.v_head_dim), beta, g

    def _split_heads(self, mixed: torch.Tensor):
        """mixed [T, C] after the conv -> l2-normed fp32 q (scaled), k [T, Nv, Dk] and v [T, Nv, Dv]."""
        geo = self.geo
        key_dim = geo.num_k_heads * geo.k_head_dim
        q, k, v = torch.split(mixed, [key_dim, key_dim, geo.num_v_heads * geo.v_head_dim], dim=-1)
        q = q.reshape(-1, geo.num_k_heads, geo.k_head_dim)  # [T, Nk, Dk]
        k = k.reshape(-1, geo.num_k_heads, geo.k_head_dim)  # [T, Nk, Dk]
        v = v.reshape(-1, geo.num_v_heads, geo.v_head_dim).float()  # [T, Nv, Dv]
        rep = geo.num_v_heads // geo.num_k_heads
        if rep > 1:  # value head h reads key head h // rep
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)  # [T, Nv, Dk]
        q = _l2norm(q.float()) * geo.k_head_dim ** -0.5  # fp32 from here on
        k = _l2norm(k.float())
        return q, k, v

    def _output(self, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        normed = gated_rms_norm(core.to(dtype), z, self.w["norm.weight"], self.eps)  # [T, Nv, Dv]
        return linear(normed.reshape(core.shape[0], -1), self.w["out_proj.weight"])  # [T, H]

    def forward_sequence(self, x: torch.Tensor, pool: LinearStatePool, layer: int, slot: int) -> torch.Tensor:
        """A prefill chunk of one sequence, x [T, H], continuing from the state in `slot`."""
        qkv, z, beta, g = self._project(x)
        mixed, new_conv = causal_conv(qkv, pool.conv[layer, slot], self.w["conv1d.weight"])
        pool.conv[layer, slot] = new_conv
        q, k, v = self._split_heads(mixed)
        out, state = chunked_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                        g.transpose(0, 1), beta.transpose(0, 1), pool.recurrent[layer, slot])
        pool.recurrent[layer, slot] = state
        return self._output(out.transpose(0, 1), z, x.dtype)

    def forward_decode(self, x: torch.Tensor, pool: LinearStatePool, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """One token for each of B sequences, x [B, H], slots [B] (distinct)."""
        qkv, z, beta, g = self._project(x)
        conv_state = pool.conv[layer, slots]  # [B, C, W-1]
        seq = torch.cat((conv_state.to(x.dtype), qkv[:, :, None]), dim=-1)  # [B, C, W]
        weight = self.w["conv1d.weight"][:, 0, :].to(x.dtype)  # [C, W]
        mixed = F.silu((seq * weight[None]).sum(-1))  # [B, C]
        pool.conv[layer, slots] = seq[:, :, 1:].to(pool.conv.dtype)
        q, k, v = self._split_heads(mixed)
        out, state = recurrent_delta_rule(q, k, v, g, beta, pool.recurrent[layer, slots])
        pool.recurrent[layer, slots] = state
        return self._output(out, z, x.dtype)
