"""Gated DeltaNet prefill, step 3a of the split recurrence: only the inter-chunk state walk. Per value head
and block of value columns, walk the 64-token chunks of one window in order from the slot's fp32 state,
store the state entering every chunk and each chunk's corrected values v', and write the final state back.
Step 3b (gdn_chunk_out) then computes every chunk's output in parallel from those.

Shape legend: T tokens of the window, C conv channels (2*Nk*Dk + Nv*Dv), Nk key heads, Nv value heads
(value head h reads key head h // (Nv/Nk)), Dk key head dim (<= 128), Dv value head dim, Q tokens per
chunk, NT chunks of the window (cdiv(T, Q)), KB key rows per half (64), BV value columns per program.

Per chunk, with w, u, gc from gdn_chunk_wy and h the [Dk, Dv] state entering the chunk (fp32):
  hs[chunk] = h
  v' = u - w h                                           (written over u: only this program reads its tile)
  h  = h * exp(gc_last) + (k * exp(gc_last - gc))^T v'   (k = l2norm(k))
the same operations, in the same order, as gdn_chunk_scan's walk, so h and v' are bitwise its values.
Why split (flash-linear-attention's chunk_gated_delta_rule_fwd_h / chunk_fwd_o structure): the walk is
serial over chunks with only Nv * Dv / BV programs (128 at Qwen3.6, about one per H200 SM), so every
operation inside it is on the critical path. gdn_chunk_scan also computed the chunk's output there
(q k^T, the intra-chunk attention, q h: three of its five products and the q loads) and spilled
registers on sm_90 (1.4 KiB a thread at bf16); here the walk keeps two products and the output becomes
a fully parallel kernel (NT * Nv * Dv / BV programs). Cost: hs, Nv * Dk * Dv * 4 bytes per chunk (2 MiB
at Qwen3.6), which the caller bounds by walking long prompts in windows (prefill.GDN_WINDOW tokens).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from adapters.kernels.gdn_chunk_wy import (  # the walk's chunks are the WY form's
    CHUNK,
    dot_precision,
    load_rows,
)

# 8 warps and 32 value columns a program: 128 programs at Qwen3.6, one wave on an H100's or H200's 132 SMs, each
# reading a chunk's w and k once per 32 columns instead of per 16. Timed on an H100 (session 27, 2026-12-05,
# docs/bench/2026-12-05-s27-h100-gdn-walk.json): the walk of a 4k / 8k prompt 1.79x / 1.78x faster than 16 columns
# (411 vs 735 us, 827 vs 1,472 us), bitwise the same values there; the driver loaded it at 194 registers, no spill
# (ptxas' offline sm_90 build: 160 B under Triton 3.6, 168 B under 3.9, within bench_kernels.GDN_WALK_SPILL_BOUND).
# 16 columns (256 programs, two waves) was the default until then. One stage: the chunk loop not pipelined (2 or 3
# stages at 16 columns gained 1.40x / 1.42x, less than 32 columns; pipelined 32-column builds spill 256 B or more).
# The launcher takes other values (block_v, num_warps, num_stages) for A/B runs (docs/prefill-kernels.md, "The state
# walk's launch configuration").
LAUNCH = dict(num_warps=8, num_stages=1)
BLOCK_V = 32
WARPS = (1, 2, 4, 8, 16)  # the num_warps the launcher accepts
MAX_STAGES = 4  # the chunk loop's num_stages: 1 (not pipelined) .. MAX_STAGES
HALF = 64  # key rows per half of the state tile
MAX_DK = 2 * HALF


@triton.jit
def load_state(base, offs_kb, offs_v, stride_k, stride_v, DK: tl.constexpr, DV: tl.constexpr,
               BLOCK_KB: tl.constexpr, SPLIT: tl.constexpr):
    """A [Dk, BV] fp32 state tile as its two halves of BLOCK_KB key rows (h2 = h1, unused, when not SPLIT);
    zeros outside Dk and Dv."""
    tile = offs_kb[:, None] * stride_k + offs_v[None, :] * stride_v
    v_ok = (offs_v < DV)[None, :]
    h1 = tl.load(base + tile, mask=(offs_kb < DK)[:, None] & v_ok, other=0.0)  # [KB, BV]
    if SPLIT:
        h2 = tl.load(base + BLOCK_KB * stride_k + tile, mask=(BLOCK_KB + offs_kb < DK)[:, None] & v_ok, other=0.0)
    else:
        h2 = h1
    return h1, h2


@triton.jit
def store_state(base, h1, h2, offs_kb, offs_v, stride_k, stride_v, DK: tl.constexpr, DV: tl.constexpr,
                BLOCK_KB: tl.constexpr, SPLIT: tl.constexpr):
    """load_state's inverse: the halves' rows inside Dk and columns inside Dv."""
    tile = offs_kb[:, None] * stride_k + offs_v[None, :] * stride_v
    v_ok = (offs_v < DV)[None, :]
    tl.store(base + tile, h1, mask=(offs_kb < DK)[:, None] & v_ok)
    if SPLIT:
        tl.store(base + BLOCK_KB * stride_k + tile, h2, mask=(BLOCK_KB + offs_kb < DK)[:, None] & v_ok)


@triton.jit
def chunk_gates(gc_ptr, t0, T, stride_gt, CHUNK: tl.constexpr):
    """(gc_last, gc [Q]) of the chunk at t0 for one head's gc row: the decay through the chunk's last real
    token, and the chunk's cumulative decays with padded rows carrying gc_last (every exponent stays <= 0;
    their outputs are not stored)."""
    offs_i = tl.arange(0, CHUNK)
    t_mask = t0 + offs_i < T
    g_last = tl.load(gc_ptr + (tl.minimum(t0 + CHUNK, T) - 1) * stride_gt)
    gc = tl.load(gc_ptr + (t0 + offs_i) * stride_gt, mask=t_mask, other=0.0)
    return g_last, tl.where(t_mask, gc, g_last)


# entry0 and the table's row stride vary with the step: one binary for every step
@triton.jit(do_not_specialize=["entry0", "stride_we"])
def _gdn_chunk_state_kernel(
    mixed_ptr, w_ptr, u_ptr, gc_ptr, ks_ptr, state_ptr, hs_ptr, walk_ptr,
    T, entry0,
    stride_mt, stride_mc,
    stride_wh, stride_wt, stride_wk,
    stride_uh, stride_ut, stride_uv,
    stride_gh, stride_gt,
    stride_ss, stride_sh, stride_sk, stride_sv,
    stride_hh, stride_hc, stride_hk, stride_hv,
    stride_we,
    KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_KB: tl.constexpr, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPANS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program (h, v-block, entry): state tile [Dk, BV] of value head h (halves h1, h2) through all chunks
    of one walk entry. SPANS: the entry is row entry0 + program_id(2) of the walk table (rows begin, end,
    state slot, first hs chunk; its chunks start 64 rows apart from `begin`); else rows 0..T-1, state
    slot 0, hs from chunk 0. SPLIT: Dk > BLOCK_KB (h2 holds key rows BLOCK_KB..Dk-1). ks (gdn_chunk_wy's)
    is each key's l2norm times its decay to the chunk's end, so a [Q, KB] key tile is loaded right before
    its one product and needs no norm over both halves first: one key tile live at a time (fewer
    registers, less spill on the serial path). NUM_STAGES: the chunk loop's software pipelining (1: none; more:
    the loads that do not depend on h1/h2 are issued that many iterations ahead, at a cost in shared memory)."""
    head = tl.program_id(0)
    vblock = tl.program_id(1)
    if SPANS:
        # NOTE: rows as int32, as the one-sequence walk has them (int64 row arithmetic cost ptxas spill on
        # the serial path); the slot and first chunk only offset base pointers, in 64 bits
        entry = entry0 + tl.program_id(2)
        t_begin = tl.load(walk_ptr + entry).to(tl.int32)
        t_end = tl.load(walk_ptr + stride_we + entry).to(tl.int32)  # the entry's end (exclusive): the row masks
        slot = tl.load(walk_ptr + 2 * stride_we + entry)
        c_first = tl.load(walk_ptr + 3 * stride_we + entry)
    else:
        t_begin = 0
        t_end = T
        slot = 0
        c_first = 0
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    offs_kb = tl.arange(0, BLOCK_KB)
    offs_v = vblock * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_i = tl.arange(0, CHUNK)
    v_mask = offs_v < DV
    s_base = state_ptr + slot * stride_ss + head * stride_sh
    h1, h2 = load_state(s_base, offs_kb, offs_v, stride_sk, stride_sv, DK, DV, BLOCK_KB, SPLIT)  # [KB, BV] fp32

    w_base = w_ptr + head * stride_wh
    k_base = mixed_ptr + (KEY_HEADS * DK + key_head * DK) * stride_mc
    u_base = u_ptr + head * stride_uh
    hs_base = hs_ptr + head * stride_hh + c_first * stride_hc  # advanced one chunk per step (64-bit arithmetic)
    for chunk in tl.range(0, tl.cdiv(t_end - t_begin, CHUNK), num_stages=NUM_STAGES):
        t0 = t_begin + chunk * CHUNK
        t_mask = t0 + offs_i < t_end
        store_state(hs_base, h1, h2, offs_kb, offs_v, stride_hk, stride_hv, DK, DV, BLOCK_KB, SPLIT)
        hs_base += stride_hc
        g_last, _ = chunk_gates(gc_ptr + head * stride_gh, t0, t_end, stride_gt, CHUNK)
        u = load_rows(u_base, t0, t_end, stride_ut, stride_uv, vblock * BLOCK_V, DV, CHUNK, BLOCK_V)  # [Q, BV]
        w1 = load_rows(w_base, t0, t_end, stride_wt, stride_wk, 0, DK, CHUNK, BLOCK_KB)  # [Q, KB]
        v_new = u - tl.dot(w1, h1, input_precision=DOT_PRECISION)  # [Q, BV]
        if SPLIT:
            w2 = load_rows(w_base, t0, t_end, stride_wt, stride_wk, BLOCK_KB, DK, CHUNK, BLOCK_KB)
            v_new -= tl.dot(w2, h2, input_precision=DOT_PRECISION)
        u_ptrs = u_base + t0.to(tl.int64) * stride_ut + offs_i[:, None] * stride_ut + offs_v[None, :] * stride_uv
        tl.store(u_ptrs, v_new, mask=t_mask[:, None] & v_mask[None, :])
        # ks is gc's [Nv, T] twin (same strides, the launcher checks)
        k_row = tl.load(ks_ptr + head * stride_gh + (t0 + offs_i) * stride_gt, mask=t_mask, other=0.0)  # [Q]
        decay_last = tl.exp(g_last)
        k1 = load_rows(k_base, t0, t_end, stride_mt, stride_mc, 0, DK, CHUNK, BLOCK_KB)  # [Q, KB]
        h1 = h1 * decay_last + tl.dot(tl.trans(k1 * k_row[:, None]), v_new, input_precision=DOT_PRECISION)
        if SPLIT:
            k2 = load_rows(k_base, t0, t_end, stride_mt, stride_mc, BLOCK_KB, DK, CHUNK, BLOCK_KB)
            h2 = h2 * decay_last + tl.dot(tl.trans(k2 * k_row[:, None]), v_new, input_precision=DOT_PRECISION)

    store_state(s_base, h1, h2, offs_kb, offs_v, stride_sk, stride_sv, DK, DV, BLOCK_KB, SPLIT)


@dataclass(frozen=True)
class SpanWalk:
    """Which pieces of a step's prefill spans one launch of the state walk (and of gdn_chunk_out) covers.

    table: int64 [4, E] on the device, one column per piece (entry) of a span: its first row, its end
    (exclusive), its state slot, and the index of its first chunk in this launch's hs; a piece's chunks
    start 64 rows apart from its first row, as gdn_chunk_wy's chunk table has them. first, count: the
    launch's entries (columns first .. first+count-1). chunk0, chunks: the launch's chunks in the step's
    chunk table (gdn_chunk_wy's (starts, ends)), in the entries' order: hs chunk i is table chunk chunk0 + i.
    Host integers all but the table: built once per step (cuda_exec/step_plan.py), no device read.
    """

    table: torch.Tensor
    first: int
    count: int
    chunk0: int
    chunks: int

    def check(self, device) -> None:
        t = self.table
        if t.dim() != 2 or t.shape[0] != 4 or t.dtype != torch.int64 or t.device != device or t.stride(1) != 1:
            raise ValueError(f"walk table must be int64 [4, E] with unit column stride on {device}, got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()} on {t.device}")
        if not (0 <= self.first and 0 <= self.count and self.first + self.count <= t.shape[1]
                and 0 <= self.chunk0 and 0 <= self.chunks):
            raise ValueError(f"walk entries {self.first}+{self.count} / chunks {self.chunk0}+{self.chunks} outside "
                             f"a table of {t.shape[1]} entries")


def check_recurrence_inputs(mixed: torch.Tensor, w: torch.Tensor | None, u: torch.Tensor, gc: torch.Tensor,
                            state: torch.Tensor, num_k_heads: int, block_v: int) -> tuple[int, int, int, int]:
    """Shape/dtype/device checks shared by the recurrence launchers; returns (T, Nv, Dk, Dv). state: fp32
    [Nv, Dk, Dv] (a slot's state, or one chunk's entry state); w None where the kernel does not read it.
    Raises ValueError on any mismatch, Dk > 128, or a block_v that is not a power of two >= 16."""
    if state.dim() != 3 or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [Nv, Dk, Dv], got {state.dtype} {tuple(state.shape)}")
    nv, dk, dv = state.shape
    if dk > MAX_DK:
        raise ValueError(f"key head dim {dk} > {MAX_DK} is not supported (the state tile has two halves of {HALF})")
    tokens = mixed.shape[0] if mixed.dim() == 2 else -1
    if mixed.dtype != torch.float32 or tokens < 0 or mixed.shape[1] != 2 * num_k_heads * dk + nv * dv:
        raise ValueError(f"mixed must be fp32 [T, 2*{num_k_heads}*{dk} + {nv}*{dv}], got {mixed.dtype} "
                         f"{tuple(mixed.shape)}")
    if num_k_heads <= 0 or nv % num_k_heads:
        raise ValueError(f"value heads {nv} not a multiple of key heads {num_k_heads}")
    for name, t, shape in (("w", w, (nv, tokens, dk)), ("u", u, (nv, tokens, dv)), ("gc", gc, (nv, tokens))):
        if t is not None and (t.shape != shape or t.dtype != torch.float32):
            raise ValueError(f"{name} must be fp32 {shape}, got {t.dtype} {tuple(t.shape)}")
    if len({t.device for t in (mixed, w, u, gc, state) if t is not None}) != 1:
        raise ValueError("all Gated DeltaNet recurrence tensors must be on one device")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    return tokens, nv, dk, dv


def core_buffer(out: torch.Tensor | None, tokens: int, nv: int, dv: int, device) -> torch.Tensor:
    """The recurrence's output core fp32 [T, Nv, Dv]: `out` checked (a view is fine), or a new one.
    Raises ValueError on a wrong shape or dtype."""
    if out is None:
        out = torch.empty(tokens, nv, dv, dtype=torch.float32, device=device)
    if out.shape != (tokens, nv, dv) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [T, Nv, Dv] = {(tokens, nv, dv)}, got {out.dtype} {tuple(out.shape)}")
    return out


def tiles(dk: int, dv: int, block_v: int) -> tuple[int, int]:
    """(BLOCK_KB, BLOCK_V) the recurrence kernels run for head dims dk, dv and a requested block_v."""
    return min(HALF, max(16, triton.next_power_of_2(dk))), min(block_v, max(16, triton.next_power_of_2(dv)))


def check_launch(num_warps, num_stages) -> tuple[int, int]:
    """(num_warps, num_stages) of a state walk launch, checked: num_warps one of WARPS, num_stages an int in
    1 .. MAX_STAGES. Raises ValueError otherwise (bools too: a flag passed by mistake)."""
    if type(num_warps) is not int or num_warps not in WARPS:
        raise ValueError(f"num_warps must be one of {WARPS}, got {num_warps!r}")
    if type(num_stages) is not int or not 1 <= num_stages <= MAX_STAGES:
        raise ValueError(f"num_stages must be an int in 1..{MAX_STAGES} (1: the chunk loop not pipelined), "
                         f"got {num_stages!r}")
    return num_warps, num_stages


def gdn_chunk_state(mixed: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor, ks: torch.Tensor,
                    state: torch.Tensor, num_k_heads: int, *, block_v: int | None = None, precise: bool = True,
                    states: torch.Tensor | None = None, walk: SpanWalk | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """The chunked delta rule's state walk over one window of a sequence's prefill, or (walk) over pieces
    of several sequences' prefills in one launch.

    mixed fp32 [T, C] the conv output (k read from it and l2-normed here); w fp32 [Nv, T, Dk],
    u fp32 [Nv, T, Dv], gc and ks fp32 [Nv, T] (ks with gc's strides) from gdn_chunk_wy (views into larger
    buffers are fine);
    state fp32 [Nv, Dk, Dv] (Dk <= 128) the slot's recurrent state, read as the state before token 0 and
    overwritten with the state after token T-1. u is OVERWRITTEN with v' = u - w h, the values gdn_chunk_out
    reads. block_v: value columns per program (power of two >= 16; default BLOCK_V, read at call time).
    precise: fp32-accurate products (3xTF32 on a GPU; fp32 models); False: one TF32 pass (bf16 models).
    states: optional fp32 [Nv, >= NT, Dk, Dv] buffer. Returns hs fp32 [Nv, NT, Dk, Dv]: the state entering each 64-token chunk.
    walk: the entries walk.first .. walk.first + walk.count - 1 of walk.table at once, each from and back
    to its own slot of state, then fp32 [S, Nv, Dk, Dv] (a layer of the state pool); hs holds walk.chunks
    chunks, entry e's from its table column 3 on (see SpanWalk). The entries must use distinct slots and
    disjoint rows; neither is checked on the host (that would sync).
    num_warps, num_stages: the launch (default LAUNCH's, read at call time): warps a program (one of WARPS) and the
    software-pipelining stages of the chunk loop (1 .. MAX_STAGES; 1: not pipelined). Any block_v / num_warps /
    num_stages gives the same values (the same operations per chunk, tiled otherwise across programs).
    T = 0: nothing is touched. Raises ValueError on mismatched shapes, dtypes or devices, or a launch outside
    those ranges.
    """
    num_warps, num_stages = check_launch(LAUNCH["num_warps"] if num_warps is None else num_warps,
                                         LAUNCH["num_stages"] if num_stages is None else num_stages)
    block_v = BLOCK_V if block_v is None else block_v
    if walk is not None:
        if state.dim() != 4:
            raise ValueError(f"with a walk, state must be fp32 [S, Nv, Dk, Dv], got {tuple(state.shape)}")
        walk.check(mixed.device)
    tokens, nv, dk, dv = check_recurrence_inputs(mixed, w, u, gc, state if walk is None else state[0], num_k_heads,
                                                 block_v)
    if ks.shape != gc.shape or ks.dtype != torch.float32 or ks.stride() != gc.stride() or ks.device != gc.device:
        raise ValueError(f"ks must be fp32 {tuple(gc.shape)} with gc's strides {gc.stride()}, got {ks.dtype} "
                         f"{tuple(ks.shape)} strides {ks.stride()}")
    chunks = triton.cdiv(tokens, CHUNK) if walk is None else walk.chunks
    if states is None:
        states = torch.empty(nv, chunks, dk, dv, dtype=torch.float32, device=mixed.device)
    if (states.dim() != 4 or states.shape[0] != nv or states.shape[1] < chunks or states.shape[2:] != (dk, dv)
            or states.dtype != torch.float32 or states.device != mixed.device):
        raise ValueError(f"states must be fp32 [{nv}, >= {chunks}, {dk}, {dv}] on {mixed.device}, "
                         f"got {states.dtype} {tuple(states.shape)}")
    states = states[:, :chunks]
    if tokens == 0 or (walk is not None and walk.count == 0):
        return states
    block_kb, block_v = tiles(dk, dv, block_v)
    if walk is None:  # NOTE: the table is unread without SPANS; slot 0 of a one-slot view
        grid, state_arg, table, t_arg, entry0 = (nv, triton.cdiv(dv, block_v), 1), state[None], state, tokens, 0
    else:  # a constant T keeps one binary for every step size
        grid, state_arg, table, t_arg, entry0 = (nv, triton.cdiv(dv, block_v), walk.count), state, walk.table, 0, walk.first
    _gdn_chunk_state_kernel[grid](
        mixed, w, u, gc, ks, state_arg, states, table, t_arg, entry0,
        *mixed.stride(), *w.stride(), *u.stride(), *gc.stride(), *state_arg.stride(), *states.stride(),
        table.stride(0),
        KEY_HEADS=num_k_heads, VALUE_HEADS=nv, DK=dk, DV=dv, CHUNK=CHUNK, BLOCK_KB=block_kb,
        SPLIT=dk > block_kb, BLOCK_V=block_v, DOT_PRECISION=dot_precision(precise), SPANS=walk is not None,
        NUM_STAGES=num_stages, num_warps=num_warps, num_stages=num_stages,
    )
    return states
