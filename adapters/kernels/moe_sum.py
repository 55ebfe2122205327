"""The ordered top-k sum after moe_down's partials: out[t] = ((0 + y[t, 0]) + y[t, 1]) + ... in fp32,
cast once. One fixed order whatever produced the partials (one launch, or groups of experts when the
pool is smaller than a chunk's experts), so results are bitwise the same at any expert-slot count.

With `written` (the pairs' slot or expert ids, negative where no expert call wrote the pair) the absent
pairs are not read: each adds the +0.0 a zero-filled buffer would have held, so a caller whose expert calls
write exactly the pairs with an id >= 0 can hand in torch.empty partials (no memset of 4*T*K*H bytes) and
get the bits of the zero-filled sum.

Shape legend: T tokens, K top-k (incl. a resident shared expert), H hidden.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_sum_kernel(y_ptr, written_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr, SKIP: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(K):  # NOTE: k = 0..K-1 in order, the order moe_down's partials are defined in
        live = mask
        if SKIP:
            # NOTE: an absent pair's load is masked off (no memory read, the buffer may hold anything) and
            # `other` gives +0.0, the value the zero-filled buffer held: the very same add as without SKIP.
            # tl.where, not `mask & scalar`: the interpreter turns that into an int8 mask its load rejects
            live = tl.where(tl.load(written_ptr + t * K + k) >= 0, mask, False)
        acc += tl.load(y_ptr + (t * K + k).to(tl.int64) * H + n, mask=live, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(y: torch.Tensor, out: torch.Tensor, written: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] (any float dtype) = sum over k of y [T, K, H] fp32, in order.

    written: optional contiguous int32 [T, K] on y's device: pair (t, k) counts as +0.0 where
    written[t, k] < 0, and y[t, k] is never read there (it may be uninitialized or NaN); the result is
    bitwise the sum over y with those pairs zeroed. None: every pair is read. No host sync (graph-safe).
    Raises ValueError on mismatched shapes, dtypes or devices."""
    if y.dim() != 3 or y.dtype != torch.float32 or not y.is_contiguous():
        raise ValueError(f"y must be contiguous fp32 [T, K, H], got {y.dtype} {tuple(y.shape)}")
    t, k, h = y.shape
    if out.shape != (t, h) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{t}, {h}], got {tuple(out.shape)}")
    if written is not None and (written.shape != (t, k) or written.dtype != torch.int32
                                or not written.is_contiguous() or written.device != y.device):
        raise ValueError(f"written must be contiguous int32 [{t}, {k}] on {y.device}, got {written.dtype} "
                         f"{tuple(written.shape)} on {written.device}")
    if t:
        # without `written` the pointer is never read (SKIP is a constexpr): y stands in for it
        _moe_sum_kernel[(t, triton.cdiv(h, 1024))](y, y if written is None else written, out, h, K=k, BLOCK=1024,
                                                   SKIP=written is not None)
    return out
