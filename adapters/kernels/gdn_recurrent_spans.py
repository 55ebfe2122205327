"""Gated DeltaNet over short spans, token by token, in one launch (ADR 0025 step 2): the gated delta rule of
gdn_decode's recurrence walked over each span's rows in order, for rows laid out as a step lays them out (each
span's tokens consecutive rows, a decode row a span of one token). The conv before it is gdn_conv_prefill_spans.

Shape legend: T rows of the step, N spans, S state slots, C conv channels (2*Nk*Dk + Nv*Dv), Nk key heads, Nv
value heads (value head h reads key head h // (Nv/Nk)), Dk key head dim, Dv value head dim, BV value columns per
program.

Why the recurrent form and not the chunked one (gdn_chunk_*): a span of <= 32 tokens is under one 64-token chunk,
and the chunked form costs three launches after the conv (WY solve, state walk, output); here a span is one
program per (value head, v-block) that keeps the [Dk, BV] state tile in registers for all its tokens. The recurrent
form is exact per token; it matches the chunked form within fp32 rounding, not bitwise, and gdn_decode's recurrence
bitwise (in the interpreter every token; compiled, a span of one token: the same operations in the same order).
ptxas, sm_90, Qwen3.6 geometry, block_v 32, 4 warps: 194 registers, no spill (the decode kernel: 167).

CUDA-graph safe: the grid (N, Nv, cdiv(Dv, BV)) and the binary depend on no lengths (max_len is an unspecialised
int), the loop bound is read on the device, no host sync.
"""

import torch
import triton
import triton.language as tl

from adapters.kernels.gdn_decode import delta_rule_row, gates, qkv_row
from adapters.torch_exec.gated_deltanet import GdnGeometry


@triton.jit(do_not_specialize=["max_len"])  # NOTE: one binary whatever the step's longest span
def _gdn_recurrent_spans_kernel(
    mixed_ptr, a_ptr, b_ptr, state_ptr, starts_ptr, lens_ptr, slots_ptr, neg_a_ptr, dt_bias_ptr, core_ptr,
    max_len,
    stride_mt, stride_mc,
    stride_at, stride_ah,
    stride_bt, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_sv,
    stride_ot, stride_oh, stride_ov,
    q_scale,
    KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (span, h, v-block): the [Dk, BV] tile of value head h's state of slot slots[span] in registers,
    for rows starts[span] + i, i < n = min(lens[span], max_len), in order:
    state = state*exp(g); delta = (v - k^T state)*beta; state += k delta^T; core[row] = q^T state;
    then the state back once. Each row's operations are _gdn_recurrent_decode_kernel's (not PROJECT_AB), in the
    same order, so one row gives its bits. A padded span (slot < 0) reads and writes no state and its rows' core
    is zeros, as a padded decode row's; a span with n <= 0 does nothing."""
    span = tl.program_id(0)
    head = tl.program_id(1)
    vblock = tl.program_id(2)
    first = tl.load(starts_ptr + span).to(tl.int64)
    n = tl.minimum(tl.load(lens_ptr + span), max_len).to(tl.int32)  # NOTE: max_len bounds the work of a bad length
    slot = tl.load(slots_ptr + span)
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < DK
    v_mask = offs_v < DV
    # NOTE: liveness as a vector: the interpreter rejects a block mask combined with a scalar one.
    live_v = (offs_v * 0 + slot) >= 0  # [BLOCK_V]
    touch_v = live_v & ((offs_v * 0 + n) > 0)  # [BLOCK_V] a live slot and at least one row: the state is walked

    tile = slot64 * stride_ss + head * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    tile_mask = k_mask[:, None] & (v_mask & touch_v)[None, :]
    state = tl.load(state_ptr + tile, mask=tile_mask, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    neg_a = tl.load(neg_a_ptr + head)
    dt_bias = tl.load(dt_bias_ptr + head)
    for i in range(0, n):  # per row, gdn_decode's helpers: the decode kernel's operations in its order
        row = first + i
        q, k, v = qkv_row(mixed_ptr + row * stride_mt, stride_mc, key_head, head, offs_k, offs_v, k_mask, v_mask,
                          q_scale, KEY_HEADS, DK, DV)
        a_val = tl.load(a_ptr + row * stride_at + head * stride_ah).to(tl.float32)
        b_val = tl.load(b_ptr + row * stride_bt + head * stride_bh).to(tl.float32)
        beta, decay = gates(a_val, b_val, dt_bias, neg_a)
        state, core = delta_rule_row(state * decay, q, k, v, beta)
        tl.store(core_ptr + row * stride_ot + head * stride_oh + offs_v * stride_ov, tl.where(live_v, core, 0.0),
                 mask=v_mask)
    tl.store(state_ptr + tile, state, mask=tile_mask)


def _check_table(name: str, t: torch.Tensor, count: int, device: torch.device) -> None:
    if t.shape != (count,) or t.dtype not in (torch.int32, torch.int64) or t.device != device \
            or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int32 or int64 [N] on {device}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")


def gdn_recurrent_spans(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, recurrent: torch.Tensor,
                        starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, neg_a: torch.Tensor,
                        dt_bias: torch.Tensor, geo: GdnGeometry, *, max_len: int, block_v: int = 32,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule of one layer over N spans, token by token (GatedDeltaNet.forward_sequence's recurrence
    after the conv, up to, not including, the gated RMSNorm and out_proj; per token the math of gdn_decode_step's
    recurrence, bitwise for a span of one token).

    mixed fp32 [T, C] the conv output of the step's rows (gdn_conv_prefill_spans'; any strides); a, b [T, Nv]
    in_proj_a / in_proj_b outputs (float: model dtype or fp32; any strides); recurrent fp32 [S, Nv, Dk, Dv] this
    layer's state slots, updated in place; neg_a = -exp(A_log) and dt_bias fp32 [Nv]. The span table, as
    gdn_conv_prefill_spans takes it: span p is rows starts[p] .. starts[p] + lengths[p] - 1 and continues state slot
    slots[p] (starts, lengths, slots: contiguous int32 or int64 [N] on mixed's device; rows inside [0, T), spans
    disjoint, the slots of spans that walk a state (slot >= 0, length >= 1) distinct and < S: not checked on the
    host, that would sync). max_len: a host int >= 1
    bounding the lengths (a step's span cap, e.g. 32: it is not specialised on, so a captured graph's binary
    serves every step); a span runs min(lengths[p], max_len) rows. Each live span's slot is left holding the
    state after its last row.
    Padding: a span with slots[p] < 0 reads and writes no state and writes zeros to its rows' core (a padded
    decode row is such a span of length 1); a span of length <= 0 reads and writes nothing, so an unused entry of a
    fixed-size table may name any slot, a live span's included, without racing it.
    Returns core fp32 [T, Nv, Dv]; rows outside every span are not written. block_v: value columns per program
    (power of two >= 2). out: optional fp32 [T, Nv, Dv] buffer.
    Raises ValueError on mismatched shapes, dtypes, devices, an empty span table, max_len < 1 or a bad block_v.
    """
    nk, nv, dk, dv = geo.num_k_heads, geo.num_v_heads, geo.k_head_dim, geo.v_head_dim
    if nv % nk:
        raise ValueError(f"value heads {nv} not a multiple of key heads {nk}")
    if mixed.dim() != 2 or mixed.shape[1] != geo.conv_channels or mixed.dtype != torch.float32:
        raise ValueError(f"mixed must be fp32 [T, C={geo.conv_channels}], got {mixed.dtype} {tuple(mixed.shape)}")
    tokens = mixed.shape[0]
    for name, t in (("a", a), ("b", b)):
        if t.shape != (tokens, nv) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float [T, Nv] = {(tokens, nv)}, got {t.dtype} {tuple(t.shape)}")
    if recurrent.dim() != 4 or recurrent.shape[1:] != (nv, dk, dv) or recurrent.dtype != torch.float32:
        raise ValueError(f"recurrent must be fp32 [S, Nv, Dk, Dv] with (Nv, Dk, Dv) = {(nv, dk, dv)}, "
                         f"got {recurrent.dtype} {tuple(recurrent.shape)}")
    for name, t in (("neg_a", neg_a), ("dt_bias", dt_bias)):
        if t.shape != (nv,) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [Nv={nv}], got {t.dtype} {tuple(t.shape)}")
    if len({t.device for t in (mixed, a, b, recurrent, neg_a, dt_bias)}) != 1:
        raise ValueError("all gdn_recurrent_spans tensors must be on one device")
    count = starts.shape[0] if starts.dim() == 1 else -1
    for name, t in (("starts", starts), ("lengths", lengths), ("slots", slots)):
        _check_table(name, t, count, mixed.device)
    if count < 1 or max_len < 1:
        raise ValueError(f"need at least one span and max_len >= 1, got {count} spans, max_len {max_len}")
    if block_v < 2 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 2, got {block_v}")
    if out is None:
        out = torch.empty(tokens, nv, dv, dtype=torch.float32, device=mixed.device)
    if out.shape != (tokens, nv, dv) or out.dtype != torch.float32 or out.device != mixed.device:
        raise ValueError(f"out must be fp32 [T, Nv, Dv] = {(tokens, nv, dv)} on {mixed.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if tokens == 0:  # no rows: every span is empty (or out of contract)
        return out
    block_v = min(block_v, triton.next_power_of_2(dv))
    _gdn_recurrent_spans_kernel[(count, nv, triton.cdiv(dv, block_v))](
        mixed, a, b, recurrent, starts, lengths, slots, neg_a, dt_bias, out,
        max_len,
        *mixed.stride(), *a.stride(), *b.stride(), *recurrent.stride(), *out.stride(),
        dk ** -0.5,
        KEY_HEADS=nk, VALUE_HEADS=nv, DK=dk, DV=dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=4,
    )
    return out
