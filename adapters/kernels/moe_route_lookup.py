"""A decode step's MoE routing and residency decision for one layer in one launch: softmax over the router
logits -> top-k -> optional renormalisation -> the shared expert's sigmoid gate (moe_router's numerics),
then the layer's lookup in the device LRU (residency_lookup's `lookup_keys`: hits, victims, table updates,
the miss list) and every pair's slot, the resident shared expert's slot as column K.

Shape legend: T rows (padded decode batch), E experts (<= 1024), H hidden, K top-k, KO = K (+ 1 with the
shared gate), KS = K (+ 1 with a resident shared expert), S slots, n = T*K keys, BN lanes (n rounded up).

Why one program: the lookup needs every row's experts at once (one LRU decision per layer), so the router
runs for all T rows in the same program, as a [T, E] tile (it fits up to T*E <= MAX_TILE). Without it
the step launches moe_router (grid (T,)) and then _layer_lookup_kernel (one program): here one launch per
MoE layer less, and the ids stay in the one program (out to fill_keys and back: the lookup's lanes), which
pays only for small tiles: the decode step takes this kernel up to T*E <= FUSED_MAX_TILE (`pays`, measured:
see the NOTE there) and the pair above.
Numerics are moe_router's with `logits` given (fp32 softmax, top-k by packed (probability bits, id) keys,
exact ties to the lowest id, renormalisation summed in selection order, the gate rounded to g's dtype);
decisions are residency_lookup's (padded rows route nowhere, duplicates collapse, ascending key order),
the host split (ADR 0030) included: with host_permille > 0 the layer's last misses take no slot and
host_pairs int64 [T*K] names the pairs computed on the host.
Graph-capturable: no host sync, grid (1,).
"""

import torch
import triton
import triton.language as tl

from adapters.kernels import residency_lookup
from adapters.kernels.moe_router import MAX_EXPERTS
from adapters.kernels.pdl import enabled as pdl_enabled
from adapters.kernels.pdl import let_next_start
from adapters.kernels.residency_lookup import MAX_KEYS, check_host_split, lookup_keys

# NOTE: the [T, E] logits (fp32) and their int64 top-k keys live in one program's registers, and the lookup
# then compares T*K keys pairwise: 4K elements is a 16-row bucket at E = 256 (Qwen3.6) or 8 rows at E = 512.
# Built for sm_90 (cuobjdump, with the ids flattened by tl.reshape before session 42): 91 registers at 1 x 256
# (4 warps), 178 at 8 x 256 (4 warps), 231 at 16 x 256 (8 warps), no spills; 16 x 512 spills under 8 and 16
# warps, so larger tiles take the unfused path.
MAX_TILE = 4096
# NOTE: where the decode step stops taking this kernel (`pays`): a measured crossover, not a register limit.
# The one program does the whole [T, E] tile and the shared gate's [T, H] dot serially, so its time grows
# with T, while the unfused pair (moe_router, grid (T,), then the lookup kernel) spreads the router over T
# programs. H200, Qwen3.6 (E = 256), us per step over 40 layers (docs/fast-decode.md, run 6): bs1 fused 225
# vs router 160 + lookup 109; bs16 fused 883 vs 159 + 402. bs4 (T*E = 1024) is NOT measured: interpolating
# the fused kernel linearly in T between those two puts bs4 within ~30 us/step of break-even, so 1024 is
# an interpolated crossover; scripts/bench_kernels.py --only fusions times both at 1, 2, 4, 8 and 16 rows.
# Change this constant when that measurement says so (the decisions are the same on both paths).
FUSED_MAX_TILE = 1024


@triton.jit
def _moe_route_lookup_kernel(logits_ptr, x_ptr, g_ptr, valid_ptr, wout_ptr, slot_ids_ptr,
                             slot_of_ptr, key_of_ptr, stamp_ptr, clock_ptr, counters_ptr, fill_keys_ptr,
                             fill_slots_ptr, owner_ptr, T, E, H, stride_l, stride_x, base, S, shared_slot, rank,
                             K: tl.constexpr, KO: tl.constexpr, KS: tl.constexpr, HAS_GATE: tl.constexpr,
                             HAS_OWNER: tl.constexpr,
                             ROUND_GATE: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                             host_permille=None, host_count_ptr=None,
                             host_pairs_ptr=None, HOST: tl.constexpr = False, USE_GDC: tl.constexpr = False):
    # NOTE: the host split's arguments default to None, which Triton binds as constexprs: the plain lookup's
    # launches and sm_90 builds need not name them and compile to exactly the kernel without them
    if USE_GDC:  # pdl.py: a PDL-launched kernel after this one may start its pre-wait part
        let_next_start()
    offs_t = tl.arange(0, BLOCK_T)  # [BT]
    offs_e = tl.arange(0, BLOCK_E)  # [BE]
    offs_k = tl.arange(0, BLOCK_K)  # [BK] weight columns (KO)
    offs_r = tl.arange(0, BLOCK_R)  # [BR] routed columns (K)
    t_ok = offs_t < T
    mask_e = offs_e[None, :] < E
    tile_ok = t_ok[:, None] & mask_e  # [BT, BE]
    logits = tl.load(logits_ptr + offs_t[:, None].to(tl.int64) * stride_l + offs_e[None, :], mask=tile_ok,
                     other=0.0).to(tl.float32)
    logits = tl.where(mask_e, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = tl.where(mask_e, p, 0.0)
    p = p / tl.sum(p, axis=1)[:, None]  # [BT, BE] fp32 softmax per row
    # NOTE: moe_router's packed keys: probability bits << 32 | (BLOCK_E - 1 - id), one max per round
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    keys = tl.where(mask_e, (bits << 32) | (BLOCK_E - 1 - offs_e[None, :]), -1)  # [BT, BE] int64
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.int64)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k in tl.static_range(K):
        top = tl.max(keys, axis=1)  # [BT]
        idx = BLOCK_E - 1 - (top & 0xFFFFFFFF)
        best = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top_w = tl.where(offs_k[None, :] == k, best[:, None], top_w)
        top_i = tl.where(offs_r[None, :] == k, idx[:, None], top_i)
        keys = tl.where(keys == top[:, None], -1, keys)
        total += best  # in selection order, as a sequential sum over the K column would
    if RENORM:
        top_w = top_w / total[:, None]
    if HAS_GATE:
        gacc = tl.zeros((BLOCK_T, BLOCK_G), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_G):
            offs_h = h0 + tl.arange(0, BLOCK_G)
            mask_h = offs_h < H
            x = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_x + offs_h[None, :],
                        mask=t_ok[:, None] & mask_h[None, :], other=0.0).to(tl.float32)  # [BT, BG]
            gacc += x * tl.load(g_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, :]
        glogit = tl.sum(gacc, axis=1)  # [BT]
        if ROUND_GATE:
            glogit = glogit.to(g_ptr.dtype.element_ty).to(tl.float32)
        sg = 1.0 / (1.0 + tl.exp(-glogit))
        if ROUND_GATE:
            sg = sg.to(g_ptr.dtype.element_ty).to(tl.float32)
        top_w = tl.where(offs_k[None, :] == K, sg[:, None], top_w)
    tl.store(wout_ptr + offs_t[:, None] * KO + offs_k[None, :], top_w, mask=t_ok[:, None] & (offs_k[None, :] < KO))
    # the lookup over the n = T*K routed pairs in request order (lane t*K + k), as layer_lookup's lanes: loaded
    # one-dimensional from memory, fill_keys serving as the scratch (lookup_keys overwrites it only after every
    # thread has read its lanes: the barriers).
    # NOTE: not tl.reshape of the [BT, BR] ids: with BT = 8 (5-8 rows) the compiled reshape's layout made the
    # lookup's lane reductions count each lane twice (fills of key 2f instead of f, on an H100 with Triton 3.6,
    # at every top-k; 1-4 and 16 rows were right, and so is the interpreter): scripts/diag/route_lookup_probe.py
    live = tl.load(valid_ptr + offs_t, mask=t_ok, other=0) != 0  # [BT]
    tl.store(fill_keys_ptr + offs_t[:, None] * K + offs_r[None, :], top_i + base,
             mask=t_ok[:, None] & (offs_r[None, :] < K))
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK_N)  # [BN] lanes
    in_range = offs < T * K
    valid = in_range & (tl.load(valid_ptr + offs // K, mask=in_range, other=0) != 0)
    key = tl.load(fill_keys_ptr + offs, mask=in_range, other=-1)
    if HAS_OWNER:  # expert parallelism: a pair another rank owns routes nowhere here (no key, slot -1)
        valid = valid & (tl.load(owner_ptr + key, mask=valid, other=-1) == rank)
    key = tl.where(valid, key, -1)
    tl.debug_barrier()
    slot_after = lookup_keys(key, valid, offs, T * K, slot_of_ptr, key_of_ptr, stamp_ptr, clock_ptr,
                             counters_ptr, fill_keys_ptr, fill_slots_ptr, S, host_permille, host_count_ptr,
                             BLOCK_N, BLOCK_S, HOST)
    tl.store(slot_ids_ptr + (offs // K) * KS + offs % K, slot_after.to(tl.int32), mask=in_range)
    if HOST:  # a valid pair left without a slot is computed on the host; lane t*K + k (padded, foreign: -1)
        tl.store(host_pairs_ptr + offs, tl.where(valid & (slot_after < 0), key, -1), mask=in_range)
    if KS > K:  # the layer's resident shared expert as column K, on valid rows only
        tl.store(slot_ids_ptr + offs_t * KS + K, tl.where(live, shared_slot, -1).to(tl.int32), mask=t_ok)


def fits(rows: int, experts: int, top_k: int, num_slots: int) -> bool:
    """Whether one launch can route and look up `rows` rows: the lookup's bound (T*K <= min(S, MAX_KEYS))
    and the register tile's (T*E <= MAX_TILE, padded to powers of two)."""
    return (0 < rows * top_k <= min(num_slots, MAX_KEYS) and 0 < experts <= MAX_EXPERTS
            and triton.next_power_of_2(rows) * triton.next_power_of_2(experts) <= MAX_TILE)


def pays(rows: int, experts: int) -> bool:
    """Whether the decode step takes this kernel (where it `fits`) for `rows` rows over `experts` experts
    rather than moe_router then the lookup kernel: T*E <= FUSED_MAX_TILE, padded to powers of two."""
    return triton.next_power_of_2(rows) * triton.next_power_of_2(experts) <= FUSED_MAX_TILE


def moe_route_lookup(logits: torch.Tensor, x: torch.Tensor, top_k: int, renormalize: bool,
                     gate_weight: torch.Tensor | None, valid: torch.Tensor, base: int, slot_of_key: torch.Tensor,
                     key_of_slot: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor, counters: torch.Tensor,
                     num_slots: int, shared_slot: int | None = None, owner: torch.Tensor | None = None,
                     rank: int = 0, host_permille: int = 0, host_count: torch.Tensor | None = None,
                     host_pairs: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, KO], slot_ids int32 [T, KS], fill_keys int64 [T*K], fill_slots int64 [T*K]).

    logits fp32 [T, E] (unit column stride): the router GEMV's output. x [T, H]: the router's input, read
    only for the shared gate; gate_weight [1, H] (fp32 or x's dtype) or None: column K of weights is
    sigmoid(x . g) (KO = K + 1). valid bool [T]: rows with False route nowhere (no key, slot -1).
    base = layer * E, the layer's first flat key; the residency tables are DeviceResidency's (updated in
    place, decisions as residency_lookup's). shared_slot: slot_ids gets column K = that slot on valid
    rows, -1 on the others (KS = K + 1; -1 everywhere: no shared expert on this rank). fill_keys/fill_slots:
    the misses to gather, then -1. owner: int32 [L*E(+1)], the rank owning each flat key (expert
    parallelism): pairs another rank owns keep their weight but are not looked up (slot -1, zero output).
    host_permille (ADR 0030, 0 = off, the default), host_count, host_pairs: residency_lookup.layer_lookup's
    host split, the same rule and arguments: host_pairs int64 [T*K] is filled in place (lane t*K + k: the
    pair's flat key where that valid pair is computed on the host, its slot_ids entry -1; else -1), an
    output the caller owns so it can live where the host reads it (mapped pinned memory), and the return
    stays these four tensors with the split on or off. The weights of host pairs are those in `weights`.
    Needs fits(T, E, K, num_slots) and no pinned slots (the decode step's buckets guarantee both).
    Raises ValueError on mismatched shapes or dtypes or a bad host split, before anything is written.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be fp32 [T, E] with unit column stride, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    t, e = logits.shape
    if x.dim() != 2 or x.shape[0] != t or x.stride(1) != 1:
        raise ValueError(f"x must be [{t}, H] with unit column stride, got {tuple(x.shape)}")
    h = x.shape[1]
    host = check_host_split(host_permille, host_count, host_pairs, t * top_k)
    if not fits(t, e, top_k, num_slots):
        raise ValueError(f"{t} rows x top-{top_k} of {e} experts do not fit one launch over {num_slots} slots "
                         f"(T*K <= min(S, {MAX_KEYS}), T*E <= {MAX_TILE})")
    if valid.shape != (t,) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool [{t}], got {valid.dtype} {tuple(valid.shape)}")
    has_gate = gate_weight is not None
    if has_gate and (gate_weight.shape != (1, h) or not gate_weight.is_contiguous()
                     or gate_weight.dtype not in (torch.float32, x.dtype)):
        raise ValueError(f"gate_weight must be a contiguous fp32 or {x.dtype} [1, {h}], got "
                         f"{gate_weight.dtype} {tuple(gate_weight.shape)}")
    assert stamp.dtype == key_of_slot.dtype == slot_of_key.dtype == torch.int64
    assert slot_of_key.numel() <= 2**31, "flat keys are compared as int32 (lookup_keys)"
    if owner is not None and (owner.dtype != torch.int32 or owner.numel() < slot_of_key.numel() - 1):
        raise ValueError(f"owner must be int32 [L*E(+1)], got {owner.dtype} {tuple(owner.shape)}")
    ko, ks = top_k + has_gate, top_k + (shared_slot is not None)
    dev = logits.device
    weights = torch.empty((t, ko), dtype=torch.float32, device=dev)
    slot_ids = torch.empty((t, ks), dtype=torch.int32, device=dev)
    fill_keys = torch.empty(t * top_k, dtype=torch.int64, device=dev)
    fill_slots = torch.empty(t * top_k, dtype=torch.int64, device=dev)
    block_t, block_e = triton.next_power_of_2(t), triton.next_power_of_2(e)
    block_g = min(triton.next_power_of_2(h), max(64, 8192 // block_t))
    # off: the host arguments stay at the kernel's defaults, so the launch is the plain lookup's
    extra = dict(host_permille=host_permille, host_count_ptr=host_count, host_pairs_ptr=host_pairs,
                 HOST=True) if host else {}
    _moe_route_lookup_kernel[(1,)](
        logits, x, gate_weight if has_gate else x, valid, weights, slot_ids, slot_of_key, key_of_slot, stamp,
        clock, counters, fill_keys, fill_slots, owner if owner is not None else slot_of_key, t, e, h,
        logits.stride(0), x.stride(0), base, num_slots, -1 if shared_slot is None else shared_slot, rank,
        K=top_k, KO=ko, KS=ks, HAS_GATE=has_gate, HAS_OWNER=owner is not None, ROUND_GATE=has_gate and gate_weight.dtype != torch.float32,
        RENORM=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_G=block_g,
        BLOCK_K=triton.next_power_of_2(ko), BLOCK_R=triton.next_power_of_2(top_k),
        BLOCK_N=max(16, triton.next_power_of_2(t * top_k)), BLOCK_S=residency_lookup.VICTIM_BLOCK,
        num_warps=4 if block_t * block_e <= 2048 else 8, USE_GDC=pdl_enabled(logits), **extra)
    return weights, slot_ids, fill_keys, fill_slots
