"""Gated DeltaNet prefill, step 1 of 3: depthwise causal conv + SiLU over a prompt chunk of one sequence,
continuing from the slot's conv state, and the hand-over of the last W-1 inputs to that state (what
gdn_conv_decode reads next); gdn_conv_prefill_spans does it for several sequences' chunks in one launch
(a span table: first row, length and state slot per span; grid over spans), so a step of many short
prompts does not launch it once per prompt.

Shape legend: T tokens of the chunk (of the step, for the span launcher), S state slots, C conv channels
(2*Nk*Dk + Nv*Dv), W conv kernel, BT x BC the tile of one program, P spans.

The window of output t is [seq(t-W+1) .. seq(t)] with seq(p) = x[p] for p >= 0 and the old state's
column W-1+p for p < 0. The launcher hands the kernel a snapshot of the old state (C*(W-1) elements per
span), so the program that writes the new state never races a program still reading the old one, whatever
the grid.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_conv_prefill_kernel(
    x_ptr, hist_ptr, state_ptr, w_ptr, out_ptr, starts_ptr, lens_ptr, slots_ptr,
    T,
    stride_xt, stride_xc,
    stride_hp, stride_hc, stride_hw,
    stride_ss, stride_sc, stride_sw,
    stride_wc, stride_ww,
    stride_ot, stride_oc,
    CHANNELS: tl.constexpr, KERNEL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, SPANS: tl.constexpr,
):
    """Program (t-block, c-block, span): out[t, c] = silu(sum_j w[c, j] * seq(t - (W-1) + j)) in fp32. The last
    t-block also writes state[c, i] = seq(n - (W-1) + i), i < W-1 (hist: the old state, read-only).
    n: the tokens (T; with SPANS the span's lens[span], its rows starting at starts[span] in x and out, its hist
    row `span`, its state slot slots[span]); t-blocks past n do nothing."""
    tblock = tl.program_id(0)
    cblock = tl.program_id(1)
    if SPANS:
        span = tl.program_id(2)
        first = tl.load(starts_ptr + span)
        n = tl.load(lens_ptr + span).to(tl.int32)
        x_ptr += first * stride_xt
        out_ptr += first * stride_ot
        hist_ptr += span.to(tl.int64) * stride_hp
        state_ptr += tl.load(slots_ptr + span) * stride_ss
    else:
        n = T
    offs_t = tblock * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = cblock * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < CHANNELS
    t2 = offs_t[:, None]
    c2 = offs_c[None, :]

    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        p = t2 - (KERNEL - 1) + j  # [BLOCK_T, 1] input position feeding tap j
        from_x = tl.load(x_ptr + p.to(tl.int64) * stride_xt + c2 * stride_xc,
                         mask=(p >= 0) & (p < n) & c_mask[None, :], other=0.0)
        from_h = tl.load(hist_ptr + c2 * stride_hc + (KERNEL - 1 + p) * stride_hw,
                         mask=(p < 0) & (p >= 1 - KERNEL) & c_mask[None, :], other=0.0)
        tap = tl.load(w_ptr + offs_c * stride_wc + j * stride_ww, mask=c_mask, other=0.0).to(tl.float32)
        acc += tl.where(p >= 0, from_x.to(tl.float32), from_h.to(tl.float32)) * tap[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t2.to(tl.int64) * stride_ot + c2 * stride_oc, out, mask=(t2 < n) & c_mask[None, :])

    # The last t-block hands the window's last W-1 inputs to the state. A mask rather than an `if`: Triton
    # 3.6 rejects the branch (it confuses the unrolled loop's `p` with names bound inside the branch).
    offs_w = tl.arange(0, BLOCK_W)
    last = (offs_w * 0 + tblock) == tl.cdiv(n, BLOCK_T) - 1  # [BLOCK_W] as a vector: see gdn_conv_decode
    ps = n - (KERNEL - 1) + offs_w[:, None]  # [BLOCK_W, 1]
    w_ok = ((offs_w < KERNEL - 1) & last)[:, None] & c_mask[None, :]
    sx = tl.load(x_ptr + ps.to(tl.int64) * stride_xt + c2 * stride_xc, mask=w_ok & (ps >= 0), other=0.0)
    sh = tl.load(hist_ptr + c2 * stride_hc + (KERNEL - 1 + ps) * stride_hw, mask=w_ok & (ps < 0), other=0.0)
    new = tl.where(ps >= 0, sx.to(sh.dtype), sh)  # [BLOCK_W, BLOCK_C], the state's dtype
    tl.store(state_ptr + c2 * stride_sc + offs_w[:, None] * stride_sw, new, mask=w_ok)


def _check(qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, block_t: int, block_c: int) -> None:
    if qkv.dim() != 2 or conv_state.dim() != 2 or conv_weight.dim() != 2:
        raise ValueError(f"need qkv [T, C], conv_state [C, W-1], conv_weight [C, W]; got "
                         f"{tuple(qkv.shape)}, {tuple(conv_state.shape)}, {tuple(conv_weight.shape)}")
    channels, kernel = qkv.shape[1], conv_weight.shape[1]
    if kernel < 2 or conv_weight.shape[0] != channels or conv_state.shape != (channels, kernel - 1):
        raise ValueError(f"conv geometry mismatch: qkv C={channels}, conv_weight {tuple(conv_weight.shape)}, "
                         f"conv_state {tuple(conv_state.shape)} (need W >= 2 and state [C, W-1])")
    if len({t.device for t in (qkv, conv_state, conv_weight)}) != 1:
        raise ValueError("qkv, conv_state and conv_weight must be on one device")
    for name, block in (("block_t", block_t), ("block_c", block_c)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {block}")


def _out(out: torch.Tensor | None, tokens: int, channels: int, device) -> torch.Tensor:
    if out is None:
        out = torch.empty(tokens, channels, dtype=torch.float32, device=device)
    if out.shape != (tokens, channels) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [T, C] = {(tokens, channels)}, got {out.dtype} {tuple(out.shape)}")
    return out


def gdn_conv_prefill(qkv: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, *,
                     block_t: int = 16, block_c: int = 128, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv + SiLU of one sequence's prefill chunk.

    qkv [T, C] in_proj_qkv output (model dtype); conv_state [C, W-1] the slot's state (pool.conv[layer, slot],
    model dtype): the W-1 inputs before qkv[0], replaced in place by the W-1 inputs ending at qkv[T-1]
    (a bitwise copy of those inputs, old state columns included when T < W-1); conv_weight [C, W].
    Returns mixed fp32 [T, C] computed in fp32 (the reference rounds the window, products and SiLU to the
    model dtype). out: optional fp32 [T, C] buffer. T = 0 returns an empty result, state untouched.
    block_t x block_c: the tile of one program (16 x 128 keeps sm_90 at 96 registers, no spill).
    Raises ValueError on mismatched shapes, dtypes, devices or bad block sizes.
    """
    _check(qkv, conv_state, conv_weight, block_t, block_c)
    tokens, channels = qkv.shape
    kernel = conv_weight.shape[1]
    out = _out(out, tokens, channels, qkv.device)
    if tokens == 0:
        return out
    hist = conv_state.clone()  # [C, W-1] the old state, read while conv_state is rewritten
    _gdn_conv_prefill_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c), 1)](
        qkv, hist, conv_state, conv_weight, out, qkv, qkv, qkv, tokens,
        *qkv.stride(), 0, *hist.stride(), 0, *conv_state.stride(), *conv_weight.stride(), *out.stride(),
        CHANNELS=channels, KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_W=max(2, triton.next_power_of_2(kernel - 1)), SPANS=False, num_warps=4,
    )
    return out


def gdn_conv_prefill_spans(qkv: torch.Tensor, conv_pool: torch.Tensor, conv_weight: torch.Tensor,
                           starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, max_len: int, *,
                           block_t: int = 16, block_c: int = 128, out: torch.Tensor | None = None) -> torch.Tensor:
    """gdn_conv_prefill for P sequences' chunks in one launch.

    qkv [T, C] the step's in_proj_qkv output (model dtype; any row stride, as a view of a stacked GEMM);
    conv_pool [S, C, W-1] one layer's conv states (model dtype); span p is rows starts[p] .. starts[p] +
    lengths[p] - 1 of qkv and continues state slot slots[p] (starts, lengths, slots: int64 [P] on qkv's
    device; lengths >= 1, rows inside qkv, spans disjoint, slots distinct and inside the pool: not checked on
    the host, that would sync); max_len: the longest length (host int: sizes the grid). Each span's slot is
    left holding the W-1 inputs ending at its last row, exactly as gdn_conv_prefill leaves it.
    Returns mixed fp32 [T, C]; rows outside every span are not written. out: optional fp32 [T, C] buffer.
    Raises ValueError on mismatched shapes, dtypes, devices or bad block sizes.
    """
    if conv_pool.dim() != 3:
        raise ValueError(f"conv_pool must be [S, C, W-1], got {tuple(conv_pool.shape)}")
    _check(qkv, conv_pool[0], conv_weight, block_t, block_c)
    count = starts.shape[0] if starts.dim() == 1 else -1
    for name, t in (("starts", starts), ("lengths", lengths), ("slots", slots)):
        if t.shape != (count,) or t.dtype != torch.int64 or t.device != qkv.device or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 [P] on {qkv.device}, got {t.dtype} {tuple(t.shape)}")
    if count < 1 or max_len < 1:
        raise ValueError(f"need at least one span of at least one token, got {count} spans, longest {max_len}")
    tokens, channels = qkv.shape
    out = _out(out, tokens, channels, qkv.device)
    # NOTE: every span's old state, gathered (one launch), read while the kernel rewrites the slots
    hist = conv_pool.index_select(0, slots)  # [P, C, W-1]
    kernel = conv_weight.shape[1]
    _gdn_conv_prefill_kernel[(triton.cdiv(max_len, block_t), triton.cdiv(channels, block_c), count)](
        # NOTE: T is unread with SPANS; a constant keeps one binary whatever the step's size (Triton specializes
        # int arguments by value class)
        qkv, hist, conv_pool, conv_weight, out, starts, lengths, slots, 0,
        *qkv.stride(), *hist.stride(), *conv_pool.stride(), *conv_weight.stride(), *out.stride(),
        CHANNELS=channels, KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_W=max(2, triton.next_power_of_2(kernel - 1)), SPANS=True, num_warps=4,
    )
    return out
