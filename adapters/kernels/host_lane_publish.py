"""Host lane, GPU side 1 of 2: hand a layer's host expert pairs to the host thread through the mailbox (ADR 0030).

Shape legend: T rows, M mailbox rows (T <= M), H hidden, K top-k, KO router weight columns (K, or K + 1 where
the last is a shared-expert gate, not a pair's).

One program, after the layer's lookup, inside the captured step:
- counts the layer's host pairs (lane t*K + k holds pair (t, k)'s key where the host computes it, else -1).
  None: state[LIVE] = 0 and nothing else; host_lane_wait reads that word and returns at once, so both sides
  decide from one device word (no host read) and the host thread sees no request: a layer without host pairs
  costs no PCIe round trip and no host wake-up, and the launch grid stays static.
- otherwise copies x (as fp32), the pairs, the K pair weights of each row and T into the mailbox, takes the
  next sequence number from the device counter state[SEQ] (so graph replays never repeat one) and stores it
  into the mailbox's request word with a system-scope release: every mailbox write before it is visible to
  the host thread that acquires the number.

One program: at bs1 x is 8 KiB; at bs16 it is 128 KiB of posted PCIe writes from one SM (tens of microseconds
at worst, unmeasured). Spreading it over programs needs a last-to-arrive program to do the release: measure first.

state (int64 [4], device): [SEQ] last sequence number published, [LIVE] 1 where this layer's request went to
the host, [ERROR] / [ERROR_SEQ] raised by host_lane_wait.
"""

import torch
import triton
import triton.language as tl

SEQ = tl.constexpr(0)
LIVE = tl.constexpr(1)
ROWS = tl.constexpr(1)  # request[ROWS]: T, beside the sequence number (host_lane.cpp's REQUEST, ROWS)


@triton.jit
def _publish_kernel(x_ptr, pairs_ptr, w_ptr, mb_x_ptr, mb_pairs_ptr, mb_w_ptr, request_ptr, state_ptr, T, H,
                    stride_x, stride_w, K: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr):
    n = T * K
    count = 0
    for start in range(0, n, BLOCK_L):
        lanes = start + tl.arange(0, BLOCK_L)
        keys = tl.load(pairs_ptr + lanes, mask=lanes < n, other=-1)  # [BLOCK_L]
        count += tl.sum((keys >= 0).to(tl.int32), axis=0)
    live = count > 0
    tl.store(state_ptr + LIVE, live.to(tl.int64))
    if live:
        for start in range(0, n, BLOCK_L):
            lanes = start + tl.arange(0, BLOCK_L)
            mask = lanes < n
            tl.store(mb_pairs_ptr + lanes, tl.load(pairs_ptr + lanes, mask=mask), mask=mask)
            # lane t*K + k's weight is column k of row t: the shared gate's column (k = K) is never read
            w = tl.load(w_ptr + (lanes // K) * stride_w + lanes % K, mask=mask)
            tl.store(mb_w_ptr + lanes, w, mask=mask)
        for t in range(T):
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                mask = cols < H
                row = tl.load(x_ptr + t * stride_x + cols, mask=mask)  # [BLOCK_H]
                tl.store(mb_x_ptr + t * H + cols, row.to(tl.float32), mask=mask)
        tl.store(request_ptr + ROWS, T)
        seq = tl.load(state_ptr + SEQ) + 1
        tl.store(state_ptr + SEQ, seq)
        # NOTE: the barrier puts every thread's mailbox stores before the one thread's release (cumulativity);
        # the release itself is an exchange because Triton has no release store: the host only ever reads this
        # word, so the exchange is correct even where the link has no native atomics (not atomic for the host)
        tl.debug_barrier()
        tl.atomic_xchg(request_ptr, seq, sem="release", scope="sys")


def publish(x: torch.Tensor, host_pairs: torch.Tensor, weights: torch.Tensor, mailbox_x: torch.Tensor,
            mailbox_pairs: torch.Tensor, mailbox_weights: torch.Tensor, request: torch.Tensor,
            state: torch.Tensor) -> None:
    """Publish one layer's host request (module docstring); no host sync, graph-capturable.

    x [T, H] bf16/fp16/fp32 (rows contiguous); host_pairs int64 [T*K] contiguous (a key, or -1); weights fp32
    [T, KO >= K] (rows contiguous); on the step's device. Mailbox, in host memory (pinned where the step runs
    on CUDA): mailbox_x fp32 [M, H], mailbox_pairs int64 [M*K], mailbox_weights fp32 [M*K], request int64 [2]
    (sequence number, T); state int64 [4] on the step's device. Raises ValueError on a shape, dtype or device
    that does not fit."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or (x.numel() and x.stride(1) != 1):
        raise ValueError(f"x must be [T, H] bf16/fp16/fp32 with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    m = mailbox_x.shape[0]
    if mailbox_x.dtype != torch.float32 or mailbox_x.shape != (m, h) or not mailbox_x.is_contiguous():
        raise ValueError(f"mailbox_x must be contiguous fp32 [M, {h}], got {mailbox_x.dtype} {tuple(mailbox_x.shape)}")
    if not 0 < t <= m:
        raise ValueError(f"{t} rows do not fit the mailbox's {m}")
    if max(m * h, t * x.stride(0)) >= 2**31:
        raise ValueError("the kernel indexes rows in int32: a decode step's rows, not a prefill's")
    k = mailbox_pairs.shape[0] // m
    for name, v, dtype in (("mailbox_pairs", mailbox_pairs, torch.int64), ("mailbox_weights", mailbox_weights,
                                                                            torch.float32)):
        if v.dtype != dtype or v.shape != (m * k,) or not v.is_contiguous():
            raise ValueError(f"{name} must be contiguous {dtype} [{m} * K], got {v.dtype} {tuple(v.shape)}")
    if host_pairs.dtype != torch.int64 or host_pairs.shape != (t * k,) or not host_pairs.is_contiguous():
        raise ValueError(f"host_pairs must be contiguous int64 [{t * k}], got {host_pairs.dtype} "
                         f"{tuple(host_pairs.shape)}")
    if (weights.dtype != torch.float32 or weights.dim() != 2 or weights.shape[0] != t or weights.shape[1] < k
            or weights.stride(1) != 1):
        raise ValueError(f"weights must be fp32 [{t}, >= {k}] with contiguous rows, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if request.dtype != torch.int64 or request.shape != (2,) or not request.is_contiguous():
        raise ValueError(f"request must be contiguous int64 [2], got {request.dtype} {tuple(request.shape)}")
    if state.dtype != torch.int64 or state.shape != (4,) or not state.is_contiguous():
        raise ValueError(f"state must be contiguous int64 [4], got {state.dtype} {tuple(state.shape)}")
    _check_devices(x.device, (x, host_pairs, weights, state), (mailbox_x, mailbox_pairs, mailbox_weights, request))
    _publish_kernel[(1,)](x, host_pairs, weights, mailbox_x, mailbox_pairs, mailbox_weights, request, state, t, h,
                          x.stride(0), weights.stride(0), K=k, BLOCK_L=triton.next_power_of_2(min(t * k, 1024)),
                          BLOCK_H=min(1024, triton.next_power_of_2(h)))


def _check_devices(device: torch.device, on_device: tuple, mailbox: tuple) -> None:
    # NOTE: a CUDA kernel reaches the mailbox through UVA, which only pinned (page-locked) memory has
    if any(v.device != device for v in on_device):
        raise ValueError(f"x, host_pairs, weights and state must all be on {device}")
    if any(v.device.type != "cpu" or (device.type == "cuda" and not v.is_pinned()) for v in mailbox):
        raise ValueError("the mailbox must be in host memory, pinned where the step runs on CUDA")
