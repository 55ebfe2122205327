"""Gated DeltaNet decode, step 1 of 2: depthwise causal conv over [conv_state | x] + SiLU for one token per
sequence, and the conv-state shift, in place, over state slots.

Shape legend: B batch rows (padded included), S state slots, C conv channels, W conv kernel.

Why a kernel of its own: q/k channels are read by every value-head program of the recurrent kernel; were
the state shift done there, a program could read a state its neighbour had already shifted (no grid-wide
barrier exists). Here each channel of each row belongs to exactly one program, which reads the old state,
then (after a CTA barrier) writes the new one.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_conv_decode_kernel(
    x_ptr, state_ptr, slots_ptr, w_ptr, mixed_ptr,
    stride_xb, stride_xc,
    stride_ss, stride_sc, stride_sw,
    stride_wc, stride_ww,
    stride_mb, stride_mc,
    CHANNELS: tl.constexpr, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program (b, c-block): mixed[b, c] = silu(sum_j window[c, j] * w[c, j]) in fp32 with
    window = [state[slot, c, 0..W-2] | x[b, c]]; then state[slot, c] = window[c, 1..W-1]. A padded row
    (slot < 0) reads and writes no state; its mixed row is zeros."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    offs_c = block * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_w = tl.arange(0, BLOCK_W)
    # NOTE: liveness as a vector: the interpreter rejects a block mask combined with a scalar one.
    live_c = (offs_c * 0 + slot) >= 0  # [BLOCK_C]
    c_mask = offs_c < CHANNELS
    c2 = offs_c[:, None]
    live2 = (c_mask & live_c)[:, None]  # [BLOCK_C, 1]: channels whose state this program reads and writes
    w2 = offs_w[None, :]
    state_row = state_ptr + slot64 * stride_ss + c2 * stride_sc

    x = tl.load(x_ptr + row * stride_xb + offs_c * stride_xc, mask=c_mask & live_c, other=0.0)  # [BLOCK_C]
    old = tl.load(state_row + w2 * stride_sw, mask=live2 & (w2 < KERNEL - 1), other=0.0)
    # the new state, column j = window column j + 1: old column j + 1, or x for the last column
    shifted = tl.load(state_row + (w2 + 1) * stride_sw,
                      mask=live2 & (w2 + 1 < KERNEL - 1), other=0.0)
    new_state = tl.where(w2 == KERNEL - 2, x[:, None].to(shifted.dtype), shifted)  # [BLOCK_C, BLOCK_W]

    window = tl.where(w2 == KERNEL - 1, x[:, None].to(tl.float32), old.to(tl.float32))  # [BLOCK_C, BLOCK_W]
    weight = tl.load(w_ptr + c2 * stride_wc + w2 * stride_ww, mask=c_mask[:, None] & (w2 < KERNEL), other=0.0)
    acc = tl.sum(window * weight.to(tl.float32), 1)  # [BLOCK_C] fp32
    mixed = acc * tl.sigmoid(acc)
    tl.store(mixed_ptr + row * stride_mb + offs_c * stride_mc, tl.where(live_c, mixed, 0.0), mask=c_mask)

    # NOTE: threads of this program read state columns other threads are about to overwrite; the
    # barrier makes every read land before any write (no other program touches these channels).
    tl.debug_barrier()
    tl.store(state_row + w2 * stride_sw, new_state, mask=live2 & (w2 < KERNEL - 1))


def gdn_conv_decode(qkv: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                    *, block_c: int = 256, out: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [B, C] (in_proj_qkv output, model dtype), conv_state [S, C, W-1] (updated in place: the last W-1
    inputs), slots int32 [B] (distinct, -1 = padded row: state untouched, output row zeros),
    conv_weight [C, W]. Returns mixed fp32 [B, C] = silu(depthwise causal conv) computed in fp32 (the
    reference rounds the window, products and SiLU to the model dtype). out: optional fp32 [B, C] buffer.
    Raises ValueError on mismatched shapes, dtypes or devices."""
    if qkv.dim() != 2 or conv_state.dim() != 3 or conv_weight.dim() != 2:
        raise ValueError(f"need qkv [B, C], conv_state [S, C, W-1], conv_weight [C, W]; got "
                         f"{tuple(qkv.shape)}, {tuple(conv_state.shape)}, {tuple(conv_weight.shape)}")
    batch, channels = qkv.shape
    kernel = conv_weight.shape[1]
    if kernel < 2 or conv_weight.shape[0] != channels or conv_state.shape[1:] != (channels, kernel - 1):
        raise ValueError(f"conv geometry mismatch: qkv C={channels}, conv_weight {tuple(conv_weight.shape)}, "
                         f"conv_state {tuple(conv_state.shape)} (need W >= 2 and state [S, C, W-1])")
    if slots.shape != (batch,) or slots.dtype != torch.int32:
        raise ValueError(f"slots must be int32 [B={batch}], got {slots.dtype} {tuple(slots.shape)}")
    if len({t.device for t in (qkv, conv_state, slots, conv_weight)}) != 1:
        raise ValueError("qkv, conv_state, slots and conv_weight must be on one device")
    if block_c < 16 or block_c & (block_c - 1):
        raise ValueError(f"block_c must be a power of two >= 16, got {block_c}")
    if out is None:
        out = torch.empty(batch, channels, dtype=torch.float32, device=qkv.device)
    if out.shape != (batch, channels) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [B, C] = {(batch, channels)}, got {out.dtype} {tuple(out.shape)}")
    if batch == 0:
        return out
    _gdn_conv_decode_kernel[(batch, triton.cdiv(channels, block_c))](
        qkv, conv_state, slots, conv_weight, out,
        *qkv.stride(), *conv_state.stride(), *conv_weight.stride(), *out.stride(),
        CHANNELS=channels, KERNEL=kernel, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(kernel),
        num_warps=4,
    )
    return out
