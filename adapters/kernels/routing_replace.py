"""Routing replay on the fast path: overwrite the router's top-k (weights, ids) in place with given expert
ids and the router's own probabilities at them (`ft serve --routing-replay`, benchmark-only).

Shape legend: T tokens, E experts (<= 1024), K top-k, KO = moe_router's columns (K, +1 with the shared gate).

Numerics follow adapters/torch_exec/moe.py `route(..., replace=ids)`: fp32 softmax of the router logits
(exp(l - max) / sum; the sum's order is the kernel's, within ~1e-7 relative of torch's), the probability
gathered at each replacement id, renormalised by the sum of the K gathered values in k order when the
model renormalises. A table row whose first id is negative leaves that token's (weights, ids) untouched:
the decode graph stages -1 rows for padded rows and while the replay is switched off, so one captured
graph serves both. One program per token; no host sync (graph-capturable); the shared gate's column K
is never written.
"""

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024


@triton.jit
def _routing_replace_kernel(logits_ptr, table_ptr, w_ptr, i_ptr, E, stride_l, stride_t, stride_w, stride_i,
                            K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    first = tl.load(table_ptr + row * stride_t + offs_k * 0)  # [BK] the row's first id in every lane
    write = mask_k & (first >= 0)  # NOTE: a -1 row is never dereferenced as expert ids
    ids = tl.load(table_ptr + row * stride_t + offs_k, mask=write, other=0).to(tl.int64)  # [BK]
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    logits = tl.load(logits_ptr + row * stride_l + offs_e, mask=mask_e, other=float("-inf")).to(tl.float32)
    top = tl.max(logits, axis=0)
    total = tl.sum(tl.where(mask_e, tl.exp(logits - top), 0.0), axis=0)
    picked = tl.load(logits_ptr + row * stride_l + ids, mask=write, other=float("-inf")).to(tl.float32)
    p = tl.exp(picked - top) / total  # [BK] the softmax probability of each replacement id
    p = tl.where(write, p, 0.0)
    if RENORM:
        total_k = tl.sum(p, axis=0)
        p = p / tl.where(total_k > 0, total_k, 1.0)  # a KEEP row sums to 0 and is not stored
    tl.store(w_ptr + row * stride_w + offs_k, p, mask=write)
    tl.store(i_ptr + row * stride_i + offs_k, ids, mask=write)


def routing_replace(logits: torch.Tensor, table: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    renormalize: bool) -> None:
    """In place: for every token t whose table[t, 0] >= 0, weights[t, :K] and ids[t, :K] become the
    router's probabilities at table[t, :K] (renormalised over them when `renormalize`) and those ids.

    logits: fp32 [T, E] router logits (unit column stride). table: int32/int64 [T, K] (unit column stride),
    ids in 0..E-1, or a first entry < 0 to keep the router's choice. weights: fp32 [T, KO >= K] (column K,
    the shared gate, untouched). ids: int64 [T, >= K]. Strided row views (a layer's slice of a [T, L, K]
    table, moe_router's [T, KO] ids cut to K columns) are fine. Raises ValueError on shapes or dtypes.
    NOTE: ids out of 0..E-1 are not checked on the device (no host sync); the host builds the table.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be fp32 [T, E] with unit column stride, got {logits.dtype} {tuple(logits.shape)}")
    t, e = logits.shape
    if not 0 < e <= MAX_EXPERTS:
        raise ValueError(f"E must be in 1..{MAX_EXPERTS}, got {e}")
    if table.dim() != 2 or table.shape[0] != t or table.stride(1) != 1 or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"table must be int32/int64 [{t}, K] with unit column stride, got {table.dtype} "
                         f"{tuple(table.shape)}")
    k = table.shape[1]
    if not 0 < k <= e:
        raise ValueError(f"K must be in 1..{e}, got {k}")
    if weights.dim() != 2 or weights.shape[0] != t or weights.shape[1] < k or weights.dtype != torch.float32 \
            or weights.stride(1) != 1:
        raise ValueError(f"weights must be fp32 [{t}, >= {k}], got {weights.dtype} {tuple(weights.shape)}")
    if ids.dim() != 2 or ids.shape[0] != t or ids.shape[1] < k or ids.dtype != torch.int64 or ids.stride(1) != 1:
        raise ValueError(f"ids must be int64 [{t}, >= {k}], got {ids.dtype} {tuple(ids.shape)}")
    if t == 0:
        return
    _routing_replace_kernel[(t,)](logits, table, weights, ids, e, logits.stride(0), table.stride(0),
                                  weights.stride(0), ids.stride(0), K=k, RENORM=renormalize,
                                  BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(k),
                                  num_warps=1 if e <= 256 else 4)
