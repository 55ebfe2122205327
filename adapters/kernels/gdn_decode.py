"""Gated DeltaNet decode, step 2 of 2: the gated delta rule for one token per sequence over fp32 state slots,
and gdn_decode_step, the launcher of both steps (conv in gdn_conv_decode, then this kernel).

Shape legend: B batch rows (padded included), S state slots, C conv channels (2*Nk*Dk + Nv*Dv), W conv
kernel, Nk key heads, Nv value heads (value head h reads key head h // (Nv/Nk)), Dk key head dim, Dv value
head dim, BV value columns per program, H hidden (the layer's input width, with projected a/b).

The a/b projections ([Nv, H] each, bf16 in the FP8 checkpoints: no stacking with the FP8 qkv/z GEMV) can
be computed here, by the programs that use them (PROJECT_AB): each (b, h, v-block) program dots x[b] with
row h of in_proj_a and in_proj_b (the Dv/BV programs of a head repeat it, from L2), rounded to x's dtype as
the reference's F.linear output is. That replaces one cuBLAS GEMV launch per GDN layer (~4.9 us each on
the H200 for the [64, 2048] bf16 pair) with ~8 KB more L2 reads per program.

CUDA-graph safe: grids (B, C/BLOCK_C) and (B, Nv, Dv/BV) are static; padded rows are masked on the device.
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.gdn_conv_decode import gdn_conv_decode
from adapters.torch_exec.gated_deltanet import GdnGeometry


@triton.jit
def qkv_row(mixed_row, stride_mc, key_head, head, offs_k, offs_v, k_mask, v_mask, q_scale,
            KEY_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """One row's q [BLOCK_K] (l2-normed, times q_scale), k [BLOCK_K] (l2-normed) and v [BLOCK_V] in fp32, read from
    its conv output row (mixed_row: q, k of every key head, then v of every value head). Shared with
    gdn_recurrent_spans: the same operations, so the same bits per row."""
    q = tl.load(mixed_row + (key_head * DK + offs_k) * stride_mc, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(mixed_row + (KEY_HEADS * DK + key_head * DK + offs_k) * stride_mc, mask=k_mask,
                other=0.0).to(tl.float32)
    v = tl.load(mixed_row + (2 * KEY_HEADS * DK + head * DV + offs_v) * stride_mc, mask=v_mask,
                other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale)  # l2norm, then Dk**-0.5
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    return q, k, v


@triton.jit
def gates(a_val, b_val, dt_bias, neg_a):
    """(beta, decay) of one row and head: sigmoid(b), exp(-exp(A_log) * softplus(a + dt_bias))."""
    beta = tl.sigmoid(b_val)
    x = a_val + dt_bias
    # softplus with torch's threshold 20 (linear above it); log(1+e^x), not log1p: <= 6e-8 absolute.
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return beta, tl.exp(neg_a * softplus)


@triton.jit
def delta_rule_row(state, q, k, v, beta):
    """The gated delta rule's update of the decayed state tile [BLOCK_K, BLOCK_V] by one row, and its output:
    delta = (v - k^T state) * beta; state += k delta^T; core = q^T state. Returns (state, core [BLOCK_V])."""
    kv_mem = tl.sum(state * k[:, None], 0)  # [BLOCK_V]
    delta = (v - kv_mem) * beta
    state = state + k[:, None] * delta[None, :]
    return state, tl.sum(state * q[:, None], 0)


@triton.jit
def _gdn_recurrent_decode_kernel(
    mixed_ptr, a_ptr, b_ptr, state_ptr, slots_ptr, neg_a_ptr, dt_bias_ptr, core_ptr, x_ptr,
    stride_mb, stride_mc,
    stride_ab, stride_ah,
    stride_bb, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_sv,
    stride_ob, stride_oh, stride_ov,
    stride_xb, H,
    q_scale,
    KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PROJECT_AB: tl.constexpr, ROUND_AB: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program (b, h, v-block): the [Dk, BV] tile of value head h's state in registers.
    state = state*exp(g); delta = (v - k^T state)*beta; state += k delta^T; core = q^T state.
    A padded row (slot < 0) reads and writes no state; its core is zeros.
    PROJECT_AB: a_ptr/b_ptr are in_proj_a/in_proj_b [Nv, H] (rows strided by stride_ab/stride_bb) and the
    head's a and b are x[row] . w[head], rounded to x's dtype (ROUND_AB)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    vblock = tl.program_id(2)
    slot = tl.load(slots_ptr + row)
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    # NOTE: liveness as a vector: the interpreter rejects a block mask combined with a scalar one.
    live_v = (offs_v * 0 + slot) >= 0  # [BLOCK_V]

    q, k, v = qkv_row(mixed_ptr + row * stride_mb, stride_mc, key_head, head, offs_k, offs_v, k_mask, v_mask,
                      q_scale, KEY_HEADS, DK, DV)

    if PROJECT_AB:
        acc_a = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            xh = tl.load(x_ptr + row * stride_xb + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            acc_a += xh * tl.load(a_ptr + head * stride_ab + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            acc_b += xh * tl.load(b_ptr + head * stride_bb + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        a_val = tl.sum(acc_a, 0)
        b_val = tl.sum(acc_b, 0)
        if ROUND_AB:  # NOTE: the reference's bf16 F.linear returns bf16 a and b
            a_val = a_val.to(x_ptr.dtype.element_ty).to(tl.float32)
            b_val = b_val.to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        a_val = tl.load(a_ptr + row * stride_ab + head * stride_ah).to(tl.float32)
        b_val = tl.load(b_ptr + row * stride_bb + head * stride_bh).to(tl.float32)
    beta, decay = gates(a_val, b_val, tl.load(dt_bias_ptr + head), tl.load(neg_a_ptr + head))

    tile = slot64 * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    tile_mask = k_mask[:, None] & (v_mask & live_v)[None, :]
    state = tl.load(state_ptr + tile, mask=tile_mask, other=0.0) * decay  # [BLOCK_K, BLOCK_V] fp32
    state, core = delta_rule_row(state, q, k, v, beta)
    tl.store(state_ptr + tile, state, mask=tile_mask)
    tl.store(core_ptr + row * stride_ob + head * stride_oh + offs_v * stride_ov, tl.where(live_v, core, 0.0),
             mask=v_mask)


def gdn_decode_step(qkv: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None, conv_state: torch.Tensor,
                    recurrent: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                    neg_a: torch.Tensor, dt_bias: torch.Tensor, geo: GdnGeometry, *, block_v: int = 32,
                    out: torch.Tensor | None = None,
                    project_ab: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One Gated DeltaNet recurrent step of one layer for B sequences (the math of
    GatedDeltaNet.forward_decode up to, not including, the gated RMSNorm and out_proj).

    qkv [B, C] in_proj_qkv output before the conv (model dtype); a, b [B, Nv] in_proj_a / in_proj_b
    outputs; conv_state [S, C, W-1] (model dtype) and recurrent [S, Nv, Dk, Dv] fp32, this layer's views,
    both updated in place; slots int32 [B] (distinct; -1 = padded row: no state read or written, core
    zeros); conv_weight [C, W]; neg_a = -exp(A_log) fp32 [Nv]; dt_bias fp32 [Nv]. block_v: value columns
    per program (power of two). out: optional fp32 [B, Nv, Dv] buffer. Returns core fp32 [B, Nv, Dv].
    project_ab: (x [B, H], in_proj_a [Nv, H], in_proj_b [Nv, H]) with a = b = None: the kernel computes
    a and b itself (float weights of x's dtype or fp32, rows with unit column stride), no GEMV launch.
    The conv runs in fp32 (see gdn_conv_decode). Raises ValueError on mismatched shapes, dtypes or devices.
    """
    nk, nv, dk, dv = geo.num_k_heads, geo.num_v_heads, geo.k_head_dim, geo.v_head_dim
    batch = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != geo.conv_channels:
        raise ValueError(f"qkv must be [B, C={geo.conv_channels}], got {tuple(qkv.shape)}")
    if conv_weight.shape != (geo.conv_channels, geo.conv_kernel):
        raise ValueError(f"conv_weight must be [C, W] = {(geo.conv_channels, geo.conv_kernel)}, "
                         f"got {tuple(conv_weight.shape)}")
    if nv % nk:
        raise ValueError(f"value heads {nv} not a multiple of key heads {nk}")
    if project_ab is not None:
        if a is not None or b is not None:
            raise ValueError("give a and b, or project_ab, not both")
        x, a, b = project_ab  # a, b: the projection weights from here on
        if x.dim() != 2 or x.shape[0] != batch or x.stride(1) != 1:
            raise ValueError(f"project_ab's x must be [B={batch}, H] with unit column stride, got {tuple(x.shape)}")
        for name, w in (("in_proj_a", a), ("in_proj_b", b)):
            if (w.shape != (nv, x.shape[1]) or w.stride(1) != 1 or w.dtype not in (x.dtype, torch.float32)
                    or not w.dtype.is_floating_point):
                raise ValueError(f"{name} must be a float [Nv={nv}, H={x.shape[1]}] ({x.dtype} or fp32) with "
                                 f"unit column stride, got {w.dtype} {tuple(w.shape)}")
    elif a is None or b is None or a.shape != (batch, nv) or b.shape != (batch, nv):
        raise ValueError(f"a and b must be [B, Nv] = {(batch, nv)}, got {None if a is None else tuple(a.shape)} "
                         f"and {None if b is None else tuple(b.shape)}")
    if recurrent.dim() != 4 or recurrent.shape[1:] != (nv, dk, dv) or recurrent.dtype != torch.float32:
        raise ValueError(f"recurrent must be fp32 [S, Nv, Dk, Dv] with (Nv, Dk, Dv) = {(nv, dk, dv)}, "
                         f"got {recurrent.dtype} {tuple(recurrent.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[0] != recurrent.shape[0]:
        raise ValueError(f"conv_state [S, C, W-1] and recurrent [S, ...] disagree on S: "
                         f"{tuple(conv_state.shape)} vs {tuple(recurrent.shape)}")
    for name, t in (("neg_a", neg_a), ("dt_bias", dt_bias)):
        if t.shape != (nv,) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [Nv={nv}], got {t.dtype} {tuple(t.shape)}")
    tensors = (qkv, a, b, conv_state, recurrent, slots, conv_weight, neg_a, dt_bias)
    if len({t.device for t in tensors + ((project_ab[0],) if project_ab is not None else ())}) != 1:
        raise ValueError("all gdn_decode_step tensors must be on one device")
    if block_v < 2 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 2, got {block_v}")
    if out is None:
        out = torch.empty(batch, nv, dv, dtype=torch.float32, device=qkv.device)
    if out.shape != (batch, nv, dv) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [B, Nv, Dv] = {(batch, nv, dv)}, got {out.dtype} {tuple(out.shape)}")

    mixed = gdn_conv_decode(qkv, conv_state, slots, conv_weight)  # [B, C] fp32; checks conv shapes, slots
    if batch == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(dv))
    x = project_ab[0] if project_ab is not None else qkv  # (x unread without PROJECT_AB)
    hidden = x.shape[1]
    _gdn_recurrent_decode_kernel[(batch, nv, triton.cdiv(dv, block_v))](
        mixed, a, b, recurrent, slots, neg_a, dt_bias, out, x,
        *mixed.stride(), *a.stride(), *b.stride(), *recurrent.stride(), *out.stride(), x.stride(0), hidden,
        dk ** -0.5,
        KEY_HEADS=nk, VALUE_HEADS=nv, DK=dk, DV=dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, PROJECT_AB=project_ab is not None,
        ROUND_AB=project_ab is not None and x.dtype != torch.float32,
        BLOCK_H=min(1024, triton.next_power_of_2(hidden)), num_warps=4,
    )
    return out
