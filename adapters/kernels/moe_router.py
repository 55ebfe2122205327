"""MoE router in one launch: router GEMV -> softmax over experts -> top-k -> optional renormalisation,
plus the optional sigmoid gate of the shared expert as an extra (weight, id) column.

Shape legend: T tokens, H hidden, E experts (<= 1024), K top-k, KO = K (+ 1 with the shared gate).

Numerics follow adapters/torch_exec/moe.py `route` and `shared_expert`:
- logits: fp32 router weight -> fp32 dot of x.float() (accumulation order is the kernel's own, so the
  fp32 result is within ~1e-6 relative, not bitwise); a router weight in x's dtype -> the logit is
  rounded to that dtype, as torch's F.linear output is;
- softmax in fp32 (exp(l - max) / sum), top-k by K rounds of max over (probability, id) keys: descending weight,
  exact ties broken by the LOWEST expert id (what a stable descending sort gives; torch.topk does not
  document its tie order). Renormalisation divides by the sum of the K weights taken in that order;
- shared gate: sigmoid(x . g) with the logit and the sigmoid rounded to g's dtype (bf16 g: the bf16
  F.linear -> bf16 sigmoid of the reference), stored in fp32 at column K with the caller's `shared_id`.
One program per token keeps all E logits in registers. NOTE: each program then streams the whole
router (E x H fp32) alone, at one SM's bandwidth; for big routers pass `logits` from a full-width
GEMV (one cuBLAS launch) and this kernel does the rest. Graph-capturable: no host sync, grid (T,).

Resident slots (`ResidentSlots`, docs/adr/0027-resident-pool-routing.md): for a pool that holds every key, the
kernel also writes each pair's slot (slot_of_key[layer * E + id], -1 on padded rows; column K the resident
shared expert's slot) and marks the layer's keys in a presence map, so the decode step needs no lookup launch:
the hits are settled once per step (residency_settle_hits.py). KS = K (+ 1 with a shared slot).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from adapters.kernels.pdl import enabled as pdl_enabled
from adapters.kernels.pdl import let_next_start

MAX_EXPERTS = 1024


class ResidentSlots(NamedTuple):
    """The slot outputs of a router launch over a pool that holds every key (DeviceResidency.route_resident).

    slot_of_key int64 [L*E + 1]: the residency's table (every key >= 0); base: the layer's first flat key
    (layer * E); valid bool [T]: rows with False route nowhere (slot -1, no mark); presence uint8 [L*E + 1]:
    each valid row's keys are set to 1 (idempotent stores, several rows may mark one key); out int32 [T, KS]
    contiguous: the slots; shared_slot: column K of out (KS = K + 1) on valid rows, or None (KS = K)."""
    slot_of_key: torch.Tensor
    base: int
    valid: torch.Tensor
    presence: torch.Tensor
    out: torch.Tensor
    shared_slot: int | None


@triton.jit
def _moe_router_kernel(x_ptr, w_ptr, logits_ptr, g_ptr, wout_ptr, iout_ptr, slot_of_ptr, valid_ptr, presence_ptr,
                       sout_ptr, E, H, stride_x, stride_l, shared_id, base, shared_slot,
                       K: tl.constexpr, HAS_LOGITS: tl.constexpr, ROUND_LOGITS: tl.constexpr,
                       KO: tl.constexpr, HAS_SHARED: tl.constexpr, ROUND_GATE: tl.constexpr, RENORM: tl.constexpr,
                       HAS_SLOTS: tl.constexpr, KS: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:  # pdl.py: a PDL-launched kernel after this one may start its pre-wait part
        let_next_start()
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)  # [BE]
    mask_e = offs_e < E
    if HAS_LOGITS:
        logits = tl.load(logits_ptr + row * stride_l + offs_e, mask=mask_e, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)  # [BH]
            mask_h = offs_h < H
            x = tl.load(x_ptr + row * stride_x + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs_e[:, None] * H + offs_h[None, :], mask=mask_e[:, None] & mask_h[None, :],
                        other=0.0).to(tl.float32)  # [BE, BH]
            acc += tl.sum(w * x[None, :], axis=1)
        logits = acc
        if ROUND_LOGITS:  # NOTE: a bf16 router's F.linear returns bf16 logits
            logits = logits.to(w_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(mask_e, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(mask_e, p, 0.0)
    p = p / tl.sum(p, axis=0)  # [BE] fp32 softmax
    # NOTE: one max-reduction per round instead of a max and a min: a probability is >= 0, so its fp32
    # bits order like the value; key = bits << 32 | (BLOCK_E - 1 - id) makes the largest key the largest
    # probability and, among exact ties, the lowest id. -1 marks padding lanes and experts already taken.
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(mask_e, (bits << 32) | (BLOCK_E - 1 - offs_e), -1)  # [BE] int64
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
    total = 0.0
    for k in tl.static_range(K):
        top = tl.max(keys, axis=0)
        idx = BLOCK_E - 1 - (top & 0xFFFFFFFF)
        best = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top_w = tl.where(offs_k == k, best, top_w)
        top_i = tl.where(offs_k == k, idx, top_i)
        keys = tl.where(keys == top, -1, keys)
        total += best  # in selection order, as a sequential sum over the K column would
    if RENORM:
        top_w = top_w / total
    if HAS_SHARED:
        gacc = tl.zeros((BLOCK_G,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_G):
            offs_h = h0 + tl.arange(0, BLOCK_G)
            mask_h = offs_h < H
            x = tl.load(x_ptr + row * stride_x + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            gacc += x * tl.load(g_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        glogit = tl.sum(gacc, axis=0)
        if ROUND_GATE:
            glogit = glogit.to(g_ptr.dtype.element_ty).to(tl.float32)
        sg = 1.0 / (1.0 + tl.exp(-glogit))
        if ROUND_GATE:
            sg = sg.to(g_ptr.dtype.element_ty).to(tl.float32)
        top_w = tl.where(offs_k == K, sg, top_w)
        top_i = tl.where(offs_k == K, shared_id, top_i)
    tl.store(wout_ptr + row * KO + offs_k, top_w, mask=offs_k < KO)
    tl.store(iout_ptr + row * KO + offs_k, top_i, mask=offs_k < KO)
    if HAS_SLOTS:  # a pool that holds every key: the slots straight from its table, the keys marked
        live = tl.load(valid_ptr + row + offs_k * 0) != 0  # [BK] the row's flag on every lane
        routed = (offs_k < K) & live
        key = base + top_i  # [BK] flat keys of the routed columns
        slot = tl.load(slot_of_ptr + key, mask=routed, other=-1)
        if KS > K:
            slot = tl.where(offs_k == K, tl.where(live, shared_slot, -1), slot)
        tl.store(sout_ptr + row * KS + offs_k, slot.to(tl.int32), mask=offs_k < KS)
        tl.store(presence_ptr + key, tl.full((BLOCK_K,), 1, tl.uint8), mask=routed)


def moe_router(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool,
               shared_gate_weight: torch.Tensor | None = None, shared_id: int | None = None, *,
               logits: torch.Tensor | None = None,
               out: tuple[torch.Tensor, torch.Tensor] | None = None,
               slots: ResidentSlots | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, KO], expert ids int64 [T, KO]) for x [T, H] (bf16/fp16/fp32).

    router_weight [E, H], fp32 or x's dtype (then logits are rounded to it). top_k K <= E.
    shared_gate_weight [1, H] (fp32 or x's dtype): appends column K = (sigmoid(x . g), shared_id;
    default E).
    logits [T, E] fp32, optional: precomputed x @ router_weight^T (the GEMV is then skipped).
    out: optional preallocated (weights, ids), contiguous [T, KO].
    slots: a pool that holds every key also gets each pair's slot and its keys marked (ResidentSlots); the
    weights and ids are the same bits as without it.
    Raises ValueError on mismatched shapes, dtypes or K.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with unit column stride, got {tuple(x.shape)}")
    t, h = x.shape
    if router_weight.dim() != 2 or router_weight.shape[1] != h or not router_weight.is_contiguous():
        raise ValueError(f"router_weight must be a contiguous [E, {h}], got {tuple(router_weight.shape)}")
    e = router_weight.shape[0]
    if router_weight.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"router_weight must be fp32 or {x.dtype}, got {router_weight.dtype}")
    if not 0 < e <= MAX_EXPERTS:
        raise ValueError(f"E must be in 1..{MAX_EXPERTS}, got {e}")
    if not 0 < top_k <= e:
        raise ValueError(f"top_k must be in 1..{e}, got {top_k}")
    has_shared = shared_gate_weight is not None
    if has_shared:
        if shared_gate_weight.shape != (1, h) or not shared_gate_weight.is_contiguous():
            raise ValueError(f"shared_gate_weight must be a contiguous [1, {h}], got "
                             f"{tuple(shared_gate_weight.shape)}")
        if shared_gate_weight.dtype not in (torch.float32, x.dtype):
            raise ValueError(f"shared_gate_weight must be fp32 or {x.dtype}, got {shared_gate_weight.dtype}")
    if logits is not None and (logits.shape != (t, e) or logits.dtype != torch.float32 or logits.stride(1) != 1):
        raise ValueError(f"logits must be fp32 [{t}, {e}] with unit column stride, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    ko = top_k + has_shared
    shared_id = e if shared_id is None else shared_id
    if out is None:
        out = (torch.empty((t, ko), dtype=torch.float32, device=x.device),
               torch.empty((t, ko), dtype=torch.int64, device=x.device))
    wout, iout = out
    assert wout.shape == (t, ko) and wout.dtype == torch.float32 and wout.is_contiguous(), "bad weights out"
    assert iout.shape == (t, ko) and iout.dtype == torch.int64 and iout.is_contiguous(), "bad ids out"
    if t == 0:
        return wout, iout
    block_e = triton.next_power_of_2(e)
    # NOTE: a ~4K-element weight tile over 8 warps compiles for sm_90 without spills up to E = 512
    # (checked with cuobjdump: 108-200 registers); 8K at E = 128 spilled under 4 warps
    block_h = max(16, min(256, triton.next_power_of_2(h), 4096 // block_e))
    # NOTE: the shared gate is one [H] dot: a wide tile (two K steps at H = 2048) instead of the router
    # tile's 16 columns, whose 128 dependent steps made the whole launch ~20 us on an H200
    block_g = min(1024, triton.next_power_of_2(h))
    g = shared_gate_weight if has_shared else router_weight
    lg = logits if logits is not None else wout
    ks = top_k
    if slots is not None:
        ks = _check_slots(slots, t, top_k, e, x.device)
    # without slots the slot pointers are never read (HAS_SLOTS False): any tensor stands in
    s = slots if slots is not None else ResidentSlots(iout, 0, iout, iout, iout, None)
    _moe_router_kernel[(t,)](x, router_weight, lg, g, wout, iout, s.slot_of_key, s.valid, s.presence, s.out,
                             e, h, x.stride(0), lg.stride(0), shared_id, s.base,
                             -1 if s.shared_slot is None else s.shared_slot,
                             K=top_k, KO=ko, HAS_LOGITS=logits is not None,
                             ROUND_LOGITS=router_weight.dtype != torch.float32, HAS_SHARED=has_shared,
                             ROUND_GATE=has_shared and shared_gate_weight.dtype != torch.float32,
                             RENORM=renormalize, HAS_SLOTS=slots is not None, KS=ks, BLOCK_E=block_e,
                             BLOCK_H=block_h, BLOCK_G=block_g, BLOCK_K=triton.next_power_of_2(max(ko, ks)),
                             num_warps=8 if logits is None else 4, USE_GDC=pdl_enabled(x))
    return wout, iout


def _check_slots(slots: ResidentSlots, t: int, top_k: int, e: int, device: torch.device) -> int:
    """KS of a ResidentSlots for T rows of top-K over E experts; ValueError if a tensor does not fit."""
    ks = top_k + (slots.shared_slot is not None)
    keys = slots.slot_of_key.numel()
    if slots.slot_of_key.dtype != torch.int64 or slots.slot_of_key.dim() != 1 or not slots.slot_of_key.is_contiguous():
        raise ValueError("slots.slot_of_key must be a contiguous int64 [L*E + 1]")
    if not 0 <= slots.base <= keys - 1 - e:
        raise ValueError(f"slots.base {slots.base} leaves no {e} keys in a table of {keys}")
    if slots.presence.dtype != torch.uint8 or slots.presence.shape != (keys,):
        raise ValueError(f"slots.presence must be uint8 [{keys}], got {slots.presence.dtype} "
                         f"{tuple(slots.presence.shape)}")
    if slots.valid.dtype != torch.bool or slots.valid.shape != (t,):
        raise ValueError(f"slots.valid must be bool [{t}], got {slots.valid.dtype} {tuple(slots.valid.shape)}")
    if slots.out.dtype != torch.int32 or slots.out.shape != (t, ks) or not slots.out.is_contiguous():
        raise ValueError(f"slots.out must be a contiguous int32 [{t}, {ks}], got {slots.out.dtype} "
                         f"{tuple(slots.out.shape)}")
    if any(v.device != device for v in (slots.slot_of_key, slots.presence, slots.valid, slots.out)):
        raise ValueError(f"slots tensors must be on {device}")
    return ks
