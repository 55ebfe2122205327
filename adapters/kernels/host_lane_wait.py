"""Host lane, GPU side 2 of 2: wait for the host thread's answer to this layer's request, then add its partial
into the MoE output (ADR 0030).

Shape legend: T rows, M mailbox rows (T <= M), H hidden.

Grid (T,): one program of one warp a row, every program on its own. One poller a row: session 44's A/B on an H100
(docs/bench/2026-12-07-s44-h100-wait-pollers-ab.json) showed that the launch before it, T x H/512 programs of 4 warps
each polling the done word over PCIe while the host computed, slowed the host's answer (8 rows with one routed 248.8 ->
110.6 µs a layer, 8 rows routed alike 434.4 -> 333.8). Every program:
- returns at once where this layer sent nothing to the host (state[LIVE] = 0, host_lane_publish's decision) or
  an earlier wait of the step already failed (state[ERROR] != 0: the step is lost, later layers must not wait
  out the bound again);
- polls the mailbox's done word with system-scope acquire loads until it holds this layer's sequence number
  (state[SEQ]): + seq served, - seq refused by the host (a bad key; its reason in the mailbox's error words).
  When the host finished first, that is one load. After max_spins polls it gives up;
- served: out[t, cols] = round(fp32(out) + partial[t, cols]), one rounding; refused or given up: adds nothing
  and raises the sticky device error word (TIMEOUT or HOST_FAILED), keeping the first, with its sequence number.

A stalled host thread therefore fails the step (the executor reads state[ERROR] with its tokens) instead of
hanging the device. On CUDA the poll is an `ld.acquire.sys` (a plain load: the host writes this word, so no
read-modify-write may touch it) with a nanosleep between polls; Triton's interpreter loads and loops.

state (int64 [4], device): [SEQ] last sequence number published, [LIVE] this layer's request went to the host,
[ERROR] first error code (0 none), [ERROR_SEQ] the sequence number it was raised at.
"""

import torch
import triton
import triton.language as tl

SEQ = tl.constexpr(0)
LIVE = tl.constexpr(1)
ERROR = tl.constexpr(2)
ERROR_SEQ = tl.constexpr(3)
TIMEOUT = 1  # the host did not answer within max_spins polls
HOST_FAILED = 2  # the host answered - seq: it refused the request


@triton.jit
def _load_acquire(ptr, ON_GPU: tl.constexpr):
    if ON_GPU:
        v = tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        v = tl.load(ptr, volatile=True)
    return v


@triton.jit
def _pause(spins, ON_GPU: tl.constexpr):
    # NOTE: 100 ns between polls: a poll is a PCIe read (~1 us), so this only spaces out the programs' reads
    if ON_GPU:
        tl.inline_asm_elementwise("nanosleep.u32 100;\n\tmov.u32 $0, $1;", "=r,r", [spins],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_add_kernel(partial_ptr, out_ptr, done_ptr, state_ptr, H, stride_out, max_spins,
                     TIMEOUT_CODE: tl.constexpr, HOST_CODE: tl.constexpr, BLOCK_H: tl.constexpr,
                     ON_GPU: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if (tl.load(state_ptr + LIVE) != 0) & (tl.load(state_ptr + ERROR) == 0):
        seq = tl.load(state_ptr + SEQ)
        done = _load_acquire(done_ptr, ON_GPU)
        spins = 0
        while (done != seq) & (done != -seq) & (spins < max_spins):
            _pause(spins, ON_GPU)
            done = _load_acquire(done_ptr, ON_GPU)
            spins += 1
        if done == seq:
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                mask = cols < H
                # NOTE: every thread ran its own acquire above (an asm with side effects: no load moves over it), so
                # this plain load sees the host's partial; volatile would split it into scalar PCIe reads
                part = tl.load(partial_ptr + t * H + cols, mask=mask)  # [BLOCK_H]
                o = tl.load(out_ptr + t * stride_out + cols, mask=mask)
                tl.store(out_ptr + t * stride_out + cols, (o.to(tl.float32) + part).to(out_ptr.dtype.element_ty),
                         mask=mask)
        else:
            code = tl.where(done == -seq, HOST_CODE, TIMEOUT_CODE).to(tl.int64)
            if tl.atomic_cas(state_ptr + ERROR, tl.full([], 0, tl.int64), code) == 0:  # the first error stays
                tl.store(state_ptr + ERROR_SEQ, seq)


def wait_add(out: torch.Tensor, partial: torch.Tensor, done: torch.Tensor, state: torch.Tensor,
             max_spins: int) -> torch.Tensor:
    """out[:T] += the host's partial[:T] once it answers this layer's request (module docstring); returns out.
    No host sync, graph-capturable.

    out [T, H] any float dtype (rows contiguous) and state int64 [4] on the step's device; partial fp32 [M, H]
    and done int64 [1] in the mailbox (host memory, pinned where the step runs on CUDA). max_spins >= 1 bounds
    the polls. Raises ValueError on a shape, dtype or device that does not fit."""
    if out.dim() != 2 or not out.dtype.is_floating_point or (out.numel() and out.stride(1) != 1):
        raise ValueError(f"out must be a float [T, H] with contiguous rows, got {out.dtype} {tuple(out.shape)}")
    t, h = out.shape
    if partial.dtype != torch.float32 or partial.dim() != 2 or partial.shape[1] != h or not partial.is_contiguous():
        raise ValueError(f"partial must be contiguous fp32 [M, {h}], got {partial.dtype} {tuple(partial.shape)}")
    if not 0 < t <= partial.shape[0]:
        raise ValueError(f"{t} rows do not fit the mailbox's {partial.shape[0]}")
    if done.dtype != torch.int64 or done.shape != (1,):
        raise ValueError(f"done must be int64 [1], got {done.dtype} {tuple(done.shape)}")
    if state.dtype != torch.int64 or state.shape != (4,) or not state.is_contiguous():
        raise ValueError(f"state must be contiguous int64 [4], got {state.dtype} {tuple(state.shape)}")
    if max_spins < 1:
        raise ValueError(f"max_spins must be at least 1, got {max_spins}")
    if state.device != out.device:
        raise ValueError(f"out and state must be on one device, got {out.device} and {state.device}")
    if any(v.device.type != "cpu" or (out.is_cuda and not v.is_pinned()) for v in (partial, done)):
        raise ValueError("the mailbox must be in host memory, pinned where the step runs on CUDA")
    block = min(2048, triton.next_power_of_2(h))  # 64 fp32 a thread at most: Qwen3.6's 2,048 in one pass
    _wait_add_kernel[(t,)](partial, out, done, state, h, out.stride(0), max_spins, TIMEOUT_CODE=TIMEOUT,
                           HOST_CODE=HOST_FAILED, BLOCK_H=block, ON_GPU=out.is_cuda, num_warps=1)
    return out
