"""The fast path's decoder: the reference MoeDecoder's weights and prefill, plus a decode step over
static, padded buffers built only from graph-capturable kernels (fused MoE over the device expert pool,
paged decode attention, the Gated DeltaNet step, quantized GEMVs).

Shape legend: B padded decode rows, H hidden, N query heads, M kv heads, D head dim, W pages per row,
K top-k, V vocab, C conv channels, Nv value heads, Dv value head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from adapters.checkpoint.quant import QTensor, as_linear_weight, qlinear
from adapters.cuda_exec.decode_inputs import KV_ROW, POSITION, SEQ_LEN, STATE_SLOT, TOKEN, VALID, DecodeView
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.kernels import dense_gemv as gemv
from adapters.kernels.gdn_decode import gdn_decode_step
from adapters.kernels.paged_decode_attention import paged_decode_attention
from adapters.kernels.rms_norm import rms_norm as fused_norm
from adapters.torch_exec.decoder import MoeDecoder
from adapters.torch_exec.full_attention import FullAttention
from adapters.torch_exec.gated_deltanet import GatedDeltaNet, LinearStatePool
from adapters.torch_exec.moe import route
from adapters.torch_exec.norms import gated_rms_norm
from adapters.torch_exec.paged_attention import PagedKVCache
from adapters.torch_exec.rotary import apply_rotary


def fast_linear(x: torch.Tensor, w: torch.Tensor | QTensor) -> torch.Tensor:
    """x [B, I] @ w^T: float weights through cuBLAS, FP8/INT8 through the Triton GEMV (dequantized in
    the K loop), other formats through the reference qlinear (still capturable, more kernels)."""
    if not isinstance(w, QTensor):
        return F.linear(x, w)
    if gemv.supports(w):
        return gemv.dense_gemv(x, w)
    return qlinear(x, w)


class FastDecoder(MoeDecoder):
    """MoeDecoder whose experts come from a DeviceExpertPool (prefill too) and which adds decode_step."""

    def _moe(self, i: int, h: torch.Tensor, experts: DeviceExpertPool, valid: torch.Tensor | None = None):
        prefix = f"layers.{i}.mlp."
        weights, ids = route(h, self.w[prefix + "gate.weight"], self.opts.top_k, self.opts.renormalize)
        if not self.opts.shared_expert:
            return experts.routed(i, h, weights, ids, valid)  # [T, H]
        gate = torch.sigmoid(fast_linear(h, self.w[prefix + "shared_expert_gate.weight"]))  # [T, 1]
        if experts.has_shared:  # the shared expert is one more resident expert of the fused kernels
            return experts.routed(i, h, weights, ids, valid, shared_weight=gate)
        w = self.w
        out = experts.routed(i, h, weights, ids, valid)
        up = fast_linear(h, w[prefix + "shared_expert.up_proj.weight"])
        act = F.silu(fast_linear(h, w[prefix + "shared_expert.gate_proj.weight"])) * up
        return out + gate * fast_linear(act, w[prefix + "shared_expert.down_proj.weight"])

    def pack_shared_experts(self, layout) -> torch.Tensor | None:
        """uint8 [L, R]: every layer's shared expert packed like a routed expert, or None when its format
        or shape differs from the routed experts'. On success the dense copies are dropped (the packed
        rows replace them, so the device holds the same bytes)."""
        if not self.opts.shared_expert:
            return None
        names = [[f"layers.{i}.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
                 for i in range(len(self.mixers))]
        mats = [[as_linear_weight(self.w[n]).to("cpu") for n in layer] for layer in names]
        if any(layout.can_pack(*m) is not None for m in mats):
            return None
        rows = torch.stack([layout.pack(*m) for m in mats])  # [L, R]
        for layer in names:
            for n in layer:
                del self.w[n]
        return rows

    def decode_step(self, view: DecodeView, kv: PagedKVCache, state: LinearStatePool | None,
                    experts: DeviceExpertPool) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits [B, V], greedy tokens [B]) for one token per row; padded rows compute garbage that
        touches no pool (their K/V go to the scratch page, their state slot is -1, they route nowhere)."""
        st = view.staging  # int64 [6, B]; the typed views below are part of the captured graph
        buf = _Rows(st[TOKEN], st[POSITION], st[VALID] != 0, view.page_table, st[SEQ_LEN].to(torch.int32),
                    st[KV_ROW], st[STATE_SLOT].to(torch.int32))
        w, eps, unit = self.w, self.opts.eps, self.opts.unit_offset_norm
        x = self.embed[buf.token_ids]  # [B, H]
        # NOTE: the residual add is fused into the next norm: (x + delta, norm(x + delta)) in one launch
        x, h = fused_norm(x, w["layers.0.input_layernorm.weight"], eps, unit_offset=unit)  # [B, H]
        cos_sin = self._rotary.cos_sin(buf.positions, x.dtype) if self.full_layers else None  # [B, R] x2
        for i, mixer in enumerate(self.mixers):
            if isinstance(mixer, FullAttention):
                h = self._attention_decode(mixer, h, buf, kv, cos_sin)
            else:
                h = self._gdn_decode(mixer, h, buf, state, self.linear_layers.index(i))
            x, h = fused_norm(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps, unit_offset=unit, residual=h)
            delta = self._moe(i, h, experts, buf.valid)
            after = f"layers.{i + 1}.input_layernorm.weight" if i + 1 < len(self.mixers) else "norm.weight"
            x, h = fused_norm(x, w[after], eps, unit_offset=unit, residual=delta)
        logits = fast_linear(h, self.lm_head).float()  # [B, V]
        return logits, logits.argmax(dim=-1)

    def _attention_decode(self, mixer: FullAttention, x: torch.Tensor, buf: _Rows,
                          kv: PagedKVCache, cos_sin) -> torch.Tensor:
        geo, rows = mixer.geo, x.shape[0]
        proj = lambda name: _biased(fast_linear(x, mixer.w[f"{name}.weight"]), mixer.bias[name])  # noqa: E731
        q, gate = proj("q_proj"), None
        if geo.output_gate:
            q, gate = torch.chunk(q.view(rows, geo.num_heads, 2 * geo.head_dim), 2, dim=-1)  # [B, N, D] x2
            gate = gate.reshape(rows, -1)  # [B, N*D]
        q = q.reshape(rows, geo.num_heads, geo.head_dim)
        k = proj("k_proj").view(rows, geo.num_kv_heads, geo.head_dim)  # [B, M, D]
        v = proj("v_proj").view(rows, geo.num_kv_heads, geo.head_dim)  # [B, M, D]
        q = fused_norm(q, mixer.w["q_norm.weight"], geo.eps, unit_offset=geo.unit_offset_norm)[1]
        k = fused_norm(k, mixer.w["k_norm.weight"], geo.eps, unit_offset=geo.unit_offset_norm)[1]
        cos, sin = cos_sin  # [B, R]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        layer = mixer.kv_layer
        kv.k[layer].view(-1, geo.num_kv_heads, geo.head_dim)[buf.kv_rows] = k.to(kv.k.dtype)
        kv.v[layer].view(-1, geo.num_kv_heads, geo.head_dim)[buf.kv_rows] = v.to(kv.v.dtype)
        out = paged_decode_attention(q, kv.k[layer], kv.v[layer], buf.page_table, buf.seq_lens,
                                     geo.head_dim ** -0.5)  # [B, N, D]
        out = out.reshape(rows, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return _biased(fast_linear(out, mixer.w["o_proj.weight"]), mixer.bias["o_proj"])  # [B, H]

    def _gdn_decode(self, mixer: GatedDeltaNet, x: torch.Tensor, buf: _Rows, state: LinearStatePool,
                    layer: int) -> torch.Tensor:
        geo, w = mixer.geo, mixer.w
        qkv = fast_linear(x, w["in_proj_qkv.weight"])  # [B, C]
        z = fast_linear(x, w["in_proj_z.weight"]).reshape(-1, geo.num_v_heads, geo.v_head_dim)  # [B, Nv, Dv]
        b = fast_linear(x, w["in_proj_b.weight"])  # [B, Nv]
        a = fast_linear(x, w["in_proj_a.weight"])  # [B, Nv]
        core = gdn_decode_step(qkv, a, b, state.conv[layer], state.recurrent[layer], buf.state_slots,
                               mixer.conv_weight_2d, mixer.neg_a, mixer.dt_bias, geo)  # [B, Nv, Dv] fp32
        normed = gated_rms_norm(core.to(x.dtype), z, w["norm.weight"], mixer.eps)  # [B, Nv, Dv]
        return fast_linear(normed.reshape(x.shape[0], -1), w["out_proj.weight"])  # [B, H]

    def prepare_fast_path(self) -> None:
        """One-time layouts the kernels want (views, no copies of large weights)."""
        self._rotary = next((m.rotary for m in self.mixers if isinstance(m, FullAttention)), None)
        for mixer in self.mixers:
            if isinstance(mixer, GatedDeltaNet):
                mixer.conv_weight_2d = mixer.w["conv1d.weight"][:, 0, :].contiguous()  # [C, W]


class _Rows(NamedTuple):
    token_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    valid: torch.Tensor  # [B] bool
    page_table: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    kv_rows: torch.Tensor  # [B] int64
    state_slots: torch.Tensor  # [B] int32


def _biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias
