"""Fast prefill of the token mixers for one sequence's span (a prompt chunk): Gated DeltaNet through the
Triton chunk kernels, full attention through qk_norm_rope and the flash backend of
scaled_dot_product_attention over the K/V gathered from the span's pages. Each entry point keeps the
contract of its reference (GatedDeltaNet.forward_sequence, FullAttention.forward for one span). The fast
path's prefill runs a whole step at once (prefill_spans.py), from gdn_core (the state-carrying part of
gdn_prefill) and the same attention math.

Shape legend: T tokens of the span, H hidden, C conv channels, Nv value heads, Dv value head dim,
N query heads, M kv heads, D head dim, X context tokens (cached prefix + span).

Why attention goes through SDPA and not a paged Triton kernel: for 8k-32k prompts the cost is the
O(T*X*N*D) score/value products (~8.8 TFLOP per layer at 32k, D = 256), where torch's flash kernels
(FlashAttention-2, tuned for D = 256 on sm_90, native GQA, lower-right causal for a span after a prefix)
are the strongest we can get; gathering the context out of the pages costs O(X*M*D) bytes (~64 MiB per
layer at 32k: tens of microseconds), and no [T, X] mask is ever built (the reference's boolean mask is
1 GiB at 32k and sends SDPA to the math backend, which would need 64 GiB of scores).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from adapters.kernels.gated_rms_norm import gated_rms_norm
from adapters.kernels.gdn_chunk_out import gdn_chunk_out
from adapters.kernels.gdn_chunk_scan import gdn_chunk_scan
from adapters.kernels.gdn_chunk_state import CHUNK, MAX_DK, SpanWalk, gdn_chunk_state
from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy
from adapters.kernels.gdn_conv_prefill import gdn_conv_prefill
from adapters.kernels.qk_norm_rope import qk_norm_rope
from adapters.torch_exec.full_attention import FullAttention
from adapters.torch_exec.gated_deltanet import GatedDeltaNet, LinearStatePool
from adapters.torch_exec.linear import linear
from adapters.torch_exec.paged_attention import PagedKVCache
from domain.step_budget import GDN_CHUNK_TOKENS, GDN_WINDOW_TOKENS

Linear = Callable[[torch.Tensor, object], torch.Tensor]  # (x [T, I], weight [O, I] or QTensor) -> [T, O]

# The Gated DeltaNet recurrence: "split" walks the state (gdn_chunk_state, serial over chunks) and then
# computes every chunk's output in parallel (gdn_chunk_out); "fused" is the one-kernel walk that does both
# (gdn_chunk_scan), kept for A/B runs (scripts/bench_prefill.py --gdn-recurrence). Same bits either way.
GDN_RECURRENCE = "split"
# Tokens per state walk of the split recurrence: the per-chunk entry states it keeps (Nv*Dk*Dv fp32 per 64
# tokens, 2 MiB at Qwen3.6) stay at GDN_WINDOW / 64 chunks (64 MiB) whatever the span length.
# The domain's activation reserve counts this window (domain/step_budget.py gdn_window_bytes).
GDN_WINDOW = GDN_WINDOW_TOKENS
assert GDN_WINDOW % CHUNK == 0 and CHUNK == GDN_CHUNK_TOKENS  # windows start where gdn_chunk_wy's gc restarts


def gdn_prefill(mixer: GatedDeltaNet, x: torch.Tensor, pool: LinearStatePool, layer: int, slot: int, *,
                linear_fn: Linear = linear) -> torch.Tensor:
    """GatedDeltaNet.forward_sequence through the Triton prefill kernels: x [T, H] (T >= 1, the model
    dtype) is a prompt chunk of the sequence in state slot `slot`; continues from pool.conv[layer, slot]
    and pool.recurrent[layer, slot] and leaves there the states after x[T-1] (what gdn_decode_step and the
    next chunk read). Returns [T, H] in x's dtype.

    Numerics: the conv, the delta rule and the norm statistics in fp32 (the reference rounds the conv
    output to the model dtype first); fp32 models take fp32-accurate products (3xTF32 on a GPU), bf16/fp16
    models one TF32 pass.
    Scratch: ~4*T*(C + Nv*(Dk + 2*Dv + 1)) bytes of fp32 besides the projections (80 KiB per token for
    Qwen3.6: 640 MiB at 8k tokens), and with the split recurrence the entry states of one window,
    4*Nv*Dk*Dv*min(T, GDN_WINDOW)/64 bytes (64 MiB for Qwen3.6).
    linear_fn: the projection matmul (default the reference linear; the fast path may pass its own).
    Raises ValueError on a bad span, layer or slot, or Dk > 128, before any state is touched.
    """
    geo, w = mixer.geo, mixer.w
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty [T, H], got {tuple(x.shape)}")
    check_gdn_slot(mixer, pool, layer, slot)
    tokens = x.shape[0]
    qkv = linear_fn(x, w["in_proj_qkv.weight"])  # [T, C]
    z = linear_fn(x, w["in_proj_z.weight"]).reshape(tokens, geo.num_v_heads, geo.v_head_dim)  # [T, Nv, Dv]
    b = linear_fn(x, w["in_proj_b.weight"])  # [T, Nv]
    a = linear_fn(x, w["in_proj_a.weight"])  # [T, Nv]
    core = gdn_core(mixer, qkv, a, b, pool, layer, slot, precise=x.dtype == torch.float32)  # [T, Nv, Dv]
    normed = gated_rms_norm(core, z, w["norm.weight"], mixer.eps, dtype=x.dtype)  # [T, Nv, Dv]
    return linear_fn(normed.reshape(tokens, -1), w["out_proj.weight"])  # [T, H]


def check_gdn_slot(mixer: GatedDeltaNet, pool: LinearStatePool, layer: int, slot: int) -> None:
    """Raises ValueError unless the kernels can run `mixer` on state slot `slot` of pool layer `layer`."""
    geo = mixer.geo
    if geo.k_head_dim > MAX_DK:
        raise ValueError(f"key head dim {geo.k_head_dim} > {MAX_DK} is not supported by gdn_chunk_scan")
    if not 0 <= layer < pool.num_layers or not pool.can_use(slot):
        raise ValueError(f"layer {layer} / slot {slot} outside the state pool "
                         f"({pool.num_layers} layers, {pool.num_slots} slots)")
    if pool.geo != geo:
        raise ValueError(f"state pool geometry {pool.geo} differs from the layer's {geo}")


def gdn_core(mixer: GatedDeltaNet, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pool: LinearStatePool,
             layer: int, slot: int, *, precise: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The part of gdn_prefill that carries one sequence's state: conv, WY form and delta rule of a piece of
    T >= 1 tokens from its projections qkv [T, C] (model dtype), a, b [T, Nv] (views with any row stride
    are fine), continuing from pool.conv/recurrent[layer, slot] and leaving there the states after the
    piece. precise: fp32-accurate products (fp32 models). out: optional fp32 [T, Nv, Dv] (a view is fine).
    Returns core fp32 [T, Nv, Dv], before the gated RMSNorm. Raises ValueError as gdn_prefill does, before
    any state is touched."""
    geo = mixer.geo
    if qkv.dim() != 2 or qkv.shape[0] == 0:
        raise ValueError(f"qkv must be a non-empty [T, C], got {tuple(qkv.shape)}")
    check_gdn_slot(mixer, pool, layer, slot)
    conv_weight = getattr(mixer, "conv_weight_2d", None)  # [C, W] once fast_decoder prepared it
    if conv_weight is None:
        conv_weight = mixer.w["conv1d.weight"][:, 0, :]
    mixed = gdn_conv_prefill(qkv, pool.conv[layer, slot], conv_weight)  # [T, C] fp32
    wy = gdn_chunk_wy(mixed, a, b, mixer.neg_a, mixer.dt_bias, geo.num_k_heads, geo.k_head_dim, geo.v_head_dim,
                      precise=precise)
    return delta_rule(mixed, *wy, pool.recurrent[layer, slot], geo.num_k_heads, precise=precise, out=out)


def delta_rule(mixed: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor, ks: torch.Tensor,
               state: torch.Tensor, num_k_heads: int, *, precise: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """core fp32 [T, Nv, Dv] of the chunked delta rule from gdn_chunk_wy's (w, u, gc, ks) and the slot's state
    (updated in place to the state after token T-1), by GDN_RECURRENCE. u is consumed (the split walk
    writes v' over it). out: optional fp32 [T, Nv, Dv] to write core into (a view is fine).
    Raises ValueError as the kernels' launchers do."""
    if GDN_RECURRENCE == "fused":
        return gdn_chunk_scan(mixed, w, u, gc, state, num_k_heads, precise=precise, out=out)
    if GDN_RECURRENCE != "split":
        raise ValueError(f"GDN_RECURRENCE must be 'split' or 'fused', got {GDN_RECURRENCE!r}")
    tokens, (nv, _, dv) = mixed.shape[0], state.shape
    core = torch.empty(tokens, nv, dv, dtype=torch.float32, device=mixed.device) if out is None else out
    if core.shape != (tokens, nv, dv) or core.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [T, Nv, Dv] = {(tokens, nv, dv)}, got {core.dtype} {tuple(core.shape)}")
    states = None  # the first window's buffer, reused by the later (never longer) windows
    for t0 in range(0, tokens, GDN_WINDOW):
        t1 = min(tokens, t0 + GDN_WINDOW)
        hs = gdn_chunk_state(mixed[t0:t1], w[:, t0:t1], u[:, t0:t1], gc[:, t0:t1], ks[:, t0:t1], state, num_k_heads,
                             precise=precise, states=states)
        states = hs if states is None else states
        gdn_chunk_out(mixed[t0:t1], u[:, t0:t1], gc[:, t0:t1], hs, num_k_heads, precise=precise, out=core[t0:t1])
    return core


def delta_rule_walks(mixed: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor, ks: torch.Tensor,
                     state: torch.Tensor, walk_table: torch.Tensor, walks, chunk_table: tuple[torch.Tensor, torch.Tensor],
                     num_k_heads: int, *, precise: bool, out: torch.Tensor) -> None:
    """delta_rule for several spans of a step at once (the split recurrence): per launch of `walks`
    (step_plan.plan_walks' (first, count, chunk0, chunks)) one gdn_chunk_state over its entries of walk_table
    (each from and back to its own slot of state, fp32 [S, Nv, Dk, Dv]: a layer of the state pool) and one
    gdn_chunk_out over its chunks of chunk_table (gdn_chunk_wy's (starts, ends)). mixed, w, u, gc, ks: the
    step's rows (gdn_chunk_wy over the same chunk table); out fp32 [T, Nv, Dv] gets the spans' rows.
    Each row gets the bits delta_rule on its span alone gives it. Raises ValueError as the kernels'
    launchers do."""
    if not walks:
        return
    nv, dk, dv = state.shape[1:]
    states = torch.empty(nv, max(c for *_, c in walks), dk, dv, dtype=torch.float32, device=mixed.device)
    for first, count, chunk0, chunks in walks:
        hs = gdn_chunk_state(mixed, w, u, gc, ks, state, num_k_heads, precise=precise, states=states,
                             walk=SpanWalk(walk_table, first, count, chunk0, chunks))
        gdn_chunk_out(mixed, u, gc, hs, num_k_heads, precise=precise, out=out, chunks=(*chunk_table, chunk0))


def attention_prefill(mixer: FullAttention, x: torch.Tensor, kv: PagedKVCache, page_ids: torch.Tensor,
                      start_position: int, *, linear_fn: Linear = linear) -> torch.Tensor:
    """FullAttention.forward for one span: x [T, H] (T >= 1) holds positions start_position ..
    start_position+T-1 of a sequence whose positions 0 .. start_position-1 are already in its pages;
    page_ids long [pages] (on x's device) must cover start_position+T positions. Writes the span's K/V
    into those pages (layer mixer.kv_layer), attends causally over the whole context, applies the
    sigmoid output gate when the model has one. Returns [T, H] in x's dtype.

    On CUDA with bf16/fp16 this runs SDPA's flash kernel (causal, lower-right aligned when there is a
    prefix; GQA without repeating K/V). linear_fn: as in gdn_prefill.
    Raises ValueError on an empty span, a negative start or pages that do not cover the context.
    """
    geo, tokens = mixer.geo, x.shape[0]
    if x.dim() != 2 or tokens == 0:
        raise ValueError(f"x must be a non-empty [T, H], got {tuple(x.shape)}")
    end = start_position + tokens
    if start_position < 0 or page_ids.dim() != 1 or page_ids.shape[0] * kv.page_size < end:
        raise ValueError(f"{tuple(page_ids.shape)} pages of {kv.page_size} do not cover positions "
                         f"{start_position}..{end - 1}")

    def proj(inp: torch.Tensor, name: str) -> torch.Tensor:
        out = linear_fn(inp, mixer.w[f"{name}.weight"])
        return out if mixer.bias[name] is None else out + mixer.bias[name]

    q, gate = proj(x, "q_proj"), None  # [T, N*D] or [T, N*2D]
    if geo.output_gate:
        q, gate = torch.chunk(q.view(tokens, geo.num_heads, 2 * geo.head_dim), 2, dim=-1)  # [T, N, D] x2
        gate = gate.reshape(tokens, -1)  # [T, N*D]
    q = q.reshape(tokens, geo.num_heads, geo.head_dim)  # [T, N, D]
    k = proj(x, "k_proj").view(tokens, geo.num_kv_heads, geo.head_dim)  # [T, M, D]
    v = proj(x, "v_proj").view(tokens, geo.num_kv_heads, geo.head_dim)  # [T, M, D]
    positions = torch.arange(start_position, end, device=x.device)  # [T]
    cos, sin = mixer.rotary.cos_sin(positions, x.dtype)  # [T, R]
    layer = mixer.kv_layer
    # q/k norms and rotary in one launch; the span's rotated k and raw v land in its pages
    q = qk_norm_rope(q, k, v, mixer.w["q_norm.weight"], mixer.w["k_norm.weight"], geo.eps, geo.unit_offset_norm,
                     cos, sin, kv.k[layer], kv.v[layer], kv.flat_slots(page_ids, positions))  # [T, N, D]
    k_ctx, v_ctx = kv.read(layer, kv.flat_slots(page_ids, torch.arange(end, device=x.device)))  # [X, M, D]
    # NOTE: kv head m serves query heads m*groups .. (transformers' repeat_kv), which is SDPA's GQA grouping.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_ctx.to(q.dtype).transpose(0, 1)[None], v_ctx.to(q.dtype).transpose(0, 1)[None],
        attn_mask=causal_lower_right(tokens, end), scale=geo.head_dim ** -0.5, enable_gqa=True,
    )[0]  # [N, T, D]
    out = out.transpose(0, 1).reshape(tokens, -1)  # [T, N*D]
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return proj(out, "o_proj")  # [T, H]
