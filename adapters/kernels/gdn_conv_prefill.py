"""Gated DeltaNet prefill, step 1 of 3: depthwise causal conv + SiLU over a prompt chunk of one sequence,
continuing from the slot's conv state, and the hand-over of the last W-1 inputs to that state (what
gdn_conv_decode reads next).

Shape legend: T tokens of the chunk, S state slots, C conv channels (2*Nk*Dk + Nv*Dv), W conv kernel,
BT x BC the tile of one program.

The window of output t is [seq(t-W+1) .. seq(t)] with seq(p) = x[p] for p >= 0 and the old state's
column W-1+p for p < 0. The launcher hands the kernel a snapshot of the old state (C*(W-1) elements), so
the program that writes the new state never races a program still reading the old one, whatever the grid.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_conv_prefill_kernel(
    x_ptr, hist_ptr, state_ptr, w_ptr, out_ptr,
    T,
    stride_xt, stride_xc,
    stride_hc, stride_hw,
    stride_sc, stride_sw,
    stride_wc, stride_ww,
    stride_ot, stride_oc,
    CHANNELS: tl.constexpr, KERNEL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program (t-block, c-block): out[t, c] = silu(sum_j w[c, j] * seq(t - (W-1) + j)) in fp32. The last
    t-block also writes state[c, i] = seq(T - (W-1) + i), i < W-1 (hist: the old state, read-only)."""
    tblock = tl.program_id(0)
    cblock = tl.program_id(1)
    offs_t = tblock * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = cblock * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < CHANNELS
    t2 = offs_t[:, None]
    c2 = offs_c[None, :]

    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        p = t2 - (KERNEL - 1) + j  # [BLOCK_T, 1] input position feeding tap j
        from_x = tl.load(x_ptr + p.to(tl.int64) * stride_xt + c2 * stride_xc,
                         mask=(p >= 0) & (p < T) & c_mask[None, :], other=0.0)
        from_h = tl.load(hist_ptr + c2 * stride_hc + (KERNEL - 1 + p) * stride_hw,
                         mask=(p < 0) & (p >= 1 - KERNEL) & c_mask[None, :], other=0.0)
        tap = tl.load(w_ptr + offs_c * stride_wc + j * stride_ww, mask=c_mask, other=0.0).to(tl.float32)
        acc += tl.where(p >= 0, from_x.to(tl.float32), from_h.to(tl.float32)) * tap[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t2.to(tl.int64) * stride_ot + c2 * stride_oc, out, mask=(t2 < T) & c_mask[None, :])

    if tblock == tl.cdiv(T, BLOCK_T) - 1:
        offs_w = tl.arange(0, BLOCK_W)
        p = T - (KERNEL - 1) + offs_w[:, None]  # [BLOCK_W, 1]
        w_ok = (offs_w[:, None] < KERNEL - 1) & c_mask[None, :]
        from_x = tl.load(x_ptr + p.to(tl.int64) * stride_xt + c2 * stride_xc, mask=w_ok & (p >= 0), other=0.0)
        from_h = tl.load(hist_ptr + c2 * stride_hc + (KERNEL - 1 + p) * stride_hw, mask=w_ok & (p < 0), other=0.0)
        new = tl.where(p >= 0, from_x.to(from_h.dtype), from_h)  # [BLOCK_W, BLOCK_C], the state's dtype
        tl.store(state_ptr + c2 * stride_sc + offs_w[:, None] * stride_sw, new, mask=w_ok)


def gdn_conv_prefill(qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, *,
                     block_t: int = 64, block_c: int = 128, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv + SiLU of one sequence's prefill chunk.

    qkv [T, C] in_proj_qkv output (model dtype); conv_state [C, W-1] the slot's state (pool.conv[layer, slot],
    model dtype): the W-1 inputs before qkv[0], replaced in place by the W-1 inputs ending at qkv[T-1]
    (a bitwise copy of those inputs, old state columns included when T < W-1); conv_weight [C, W].
    Returns mixed fp32 [T, C] computed in fp32 (the reference rounds the window, products and SiLU to the
    model dtype). out: optional fp32 [T, C] buffer. T = 0 returns an empty result, state untouched.
    Raises ValueError on mismatched shapes, dtypes, devices or bad block sizes.
    """
    if qkv.dim() != 2 or conv_state.dim() != 2 or conv_weight.dim() != 2:
        raise ValueError(f"need qkv [T, C], conv_state [C, W-1], conv_weight [C, W]; got "
                         f"{tuple(qkv.shape)}, {tuple(conv_state.shape)}, {tuple(conv_weight.shape)}")
    tokens, channels = qkv.shape
    kernel = conv_weight.shape[1]
    if kernel < 2 or conv_weight.shape[0] != channels or conv_state.shape != (channels, kernel - 1):
        raise ValueError(f"conv geometry mismatch: qkv C={channels}, conv_weight {tuple(conv_weight.shape)}, "
                         f"conv_state {tuple(conv_state.shape)} (need W >= 2 and state [C, W-1])")
    if len({t.device for t in (qkv, conv_state, conv_weight)}) != 1:
        raise ValueError("qkv, conv_state and conv_weight must be on one device")
    for name, block in (("block_t", block_t), ("block_c", block_c)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {block}")
    if out is None:
        out = torch.empty(tokens, channels, dtype=torch.float32, device=qkv.device)
    if out.shape != (tokens, channels) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [T, C] = {(tokens, channels)}, got {out.dtype} {tuple(out.shape)}")
    if tokens == 0:
        return out
    hist = conv_state.clone()  # [C, W-1] the old state, read while conv_state is rewritten
    _gdn_conv_prefill_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
        qkv, hist, conv_state, conv_weight, out, tokens,
        *qkv.stride(), *hist.stride(), *conv_state.stride(), *conv_weight.stride(), *out.stride(),
        CHANNELS=channels, KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_W=max(2, triton.next_power_of_2(kernel - 1)), num_warps=4,
    )
    return out
