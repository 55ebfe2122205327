"""The Triton pair alignment (moe_align_count -> moe_align_scan -> moe_align_place) against the torch
reference align_by_slot_torch: bitwise-equal `pairs` and `block_slots` and the same block_m over random
and edge cases, and align_by_slot's dispatch between the two.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py) at small shapes; a small `chunk`
there gives many chunks (the cross-chunk prefix) at interpreter sizes. With CUDA the same tests run the
compiled kernels, and the gpu-marked test adds the real prefill shapes.
"""

from __future__ import annotations

import re

import pytest
import torch

import adapters.kernels.moe_align as moe_align
from adapters.kernels.moe_align import (
    MAX_TRITON_SLOTS,
    align_by_slot,
    align_by_slot_torch,
    align_by_slot_triton,
    max_blocks,
    uses_triton,
)
from adapters.kernels.moe_align_count import count_chunks
from adapters.kernels.moe_align_place import place_pairs
from adapters.kernels.moe_align_scan import scan_chunks
from tests.adapters.sm90 import build_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _assert_same(slot_ids: torch.Tensor, num_slots: int, block_m: int, max_groups: int | None = None,
                 chunk: int = 32) -> moe_align.Alignment:
    """Both paths on slot_ids; returns the reference after asserting bitwise equality."""
    ids = slot_ids.to(DEVICE)
    ref = align_by_slot_torch(ids, num_slots, block_m, max_groups)
    got = align_by_slot_triton(ids, num_slots, block_m, max_groups, chunk=chunk)
    assert got.block_m == ref.block_m == block_m
    assert got.pairs.dtype == got.block_slots.dtype == torch.int32
    assert got.pairs.shape == ref.pairs.shape and got.block_slots.shape == ref.block_slots.shape
    assert torch.equal(got.pairs, ref.pairs), (
        f"pairs differ at rows {torch.nonzero(got.pairs != ref.pairs).flatten()[:10].tolist()}")
    assert torch.equal(got.block_slots, ref.block_slots), (
        f"block_slots differ at {torch.nonzero(got.block_slots != ref.block_slots).flatten()[:10].tolist()}")
    return ref


def _routing(gen: torch.Generator, tokens: int, top_k: int, experts: int, skip: float, shared: bool) -> torch.Tensor:
    """slot_ids int32 [T, K(+1)]: K distinct experts per token (top-k), a fraction `skip` of pairs -1, and
    with `shared` a last column of slot `experts` (the shared expert, as align_by_expert's E) on every token."""
    top = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)  # [T, K]
    top[torch.rand(tokens, top_k, generator=gen) < skip] = -1
    if shared:
        top = torch.cat([top, torch.full((tokens, 1), experts, dtype=torch.int32)], dim=1)
    return top


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
@pytest.mark.parametrize("seed", range(6))
def test_random_routings_match_the_reference(block_m, seed):
    gen = torch.Generator().manual_seed(100 * block_m + seed)
    tokens = int(torch.randint(1, 90, (1,), generator=gen))
    top_k = int(torch.randint(1, 5, (1,), generator=gen))
    experts = int(torch.randint(top_k, 40, (1,), generator=gen))
    shared = bool(seed % 2)
    ids = _routing(gen, tokens, top_k, experts, skip=(0.0, 0.1, 0.5)[seed % 3], shared=shared)
    groups = experts + shared
    chunk = (32, 64, 256)[seed % 3]  # P is rarely a multiple of it: the last chunk is partial
    _assert_same(ids, groups, block_m, chunk=chunk)
    _assert_same(ids, groups, block_m, groups, chunk=chunk)  # align_by_expert's bound: E + 1 groups


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_uniform_ids_with_tight_and_too_small_bounds(block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    num_slots = 9
    ids = torch.randint(-1, num_slots, (23, 3), generator=gen, dtype=torch.int32)
    ids[5] = -1  # a whole token routed nowhere
    distinct = int(torch.unique(ids[ids >= 0]).numel())
    for bound in (None, distinct, num_slots, 1, 0):
        _assert_same(ids, num_slots, block_m, bound)


def test_a_too_small_bound_drops_the_same_pairs():
    # 40 pairs over 4 slots at BM 16 need 4 blocks; a bound of 1 group gives (40 + 15) // 16 = 3 blocks
    ids = torch.arange(40, dtype=torch.int32).remainder(4).reshape(20, 2)
    ref = _assert_same(ids, 4, 16, 1)
    assert ref.block_slots.numel() == 3 and int((ref.pairs >= 0).sum()) == 30, "the case must drop pairs"
    assert ref.block_slots.tolist() == [0, 1, 2]


def test_all_pairs_in_one_group_and_empty_groups():
    ids = torch.full((70, 3), 5, dtype=torch.int32)  # every pair to slot 5 of 300: 299 empty groups
    ref = _assert_same(ids, 300, 32, chunk=64)
    assert ref.block_slots[:7].tolist() == [5] * 7 and (ref.block_slots[7:] == -1).all()
    assert torch.equal(ref.pairs[:210].cpu(), torch.arange(210, dtype=torch.int32)) and (ref.pairs[210:] == -1).all()
    sparse = torch.tensor([[0, 299], [299, -1], [150, 0]], dtype=torch.int32)  # the first and last slots
    _assert_same(sparse, 300, 16)
    _assert_same(sparse, 300, 16, 3)


def test_edge_sizes():
    none = align_by_slot_triton(torch.empty((0, 9), dtype=torch.int32, device=DEVICE), 257, 64)
    assert none.pairs.numel() == 0 and none.block_slots.numel() == 0 and none.block_m == 64
    _assert_same(torch.empty((0, 9), dtype=torch.int32), 257, 64)
    _assert_same(torch.full((5, 3), -1, dtype=torch.int32), 3, 16)  # nothing live: every row padding
    _assert_same(torch.tensor([[0]], dtype=torch.int32), 1, 16)  # one pair, one slot
    _assert_same(torch.tensor([[2]], dtype=torch.int32), 1024, 128)  # the largest S the kernels take
    for pairs in (31, 32, 33, 95, 96, 97):  # around chunk boundaries
        ids = (torch.arange(pairs, dtype=torch.int32) * 7).remainder(5).reshape(pairs, 1)
        _assert_same(ids, 5, 16, chunk=32)


def test_prefill_geometry_in_few_chunks():
    """Qwen3.6's layout (E = 256 experts + the shared one, top-8 + shared column) at 256 tokens, launcher
    defaults (CHUNK 256: 9 chunks)."""
    gen = torch.Generator().manual_seed(7)
    ids = _routing(gen, 256, 8, 256, skip=0.02, shared=True)  # [256, 9]
    _assert_same(ids, 257, 16, 257, chunk=moe_align.CHUNK)
    _assert_same(ids, 257, 64, 257, chunk=moe_align.CHUNK)


def test_launchers_write_every_output_and_scratch_element():
    """No memset is needed: the three launchers on poisoned buffers overwrite every count, prefix, total,
    row and block (a poison value left anywhere would differ from the reference)."""
    gen = torch.Generator().manual_seed(11)
    ids = _routing(gen, 50, 3, 20, skip=0.2, shared=True)  # [50, 4], 200 pairs over 21 groups
    flat, groups, bm, chunk = ids.reshape(-1).to(DEVICE), 21, 16, 32
    blocks = max_blocks(flat.numel(), groups, bm)
    chunks = -(-flat.numel() // chunk)
    poison = dict(dtype=torch.int32, device=DEVICE)
    counts = torch.full((chunks, groups), 7777, **poison)
    totals = torch.full((groups,), 7777, **poison)
    pairs = torch.full((blocks * bm,), 7777, **poison)
    block_slots = torch.full((blocks,), 7777, **poison)
    count_chunks(flat, groups, chunk, counts)
    want = torch.stack([torch.bincount(c[c >= 0].long().cpu(), minlength=groups) for c in flat.split(chunk)])
    assert torch.equal(counts.cpu(), want.to(torch.int32))
    scan_chunks(counts, totals)
    assert torch.equal(totals.cpu(), want.sum(0).to(torch.int32))
    assert torch.equal(counts.cpu(), (want.cumsum(0) - want).to(torch.int32))
    place_pairs(flat, counts, totals, bm, chunk, pairs, block_slots)
    ref = align_by_slot_torch(ids.to(DEVICE), groups, bm, groups)
    assert torch.equal(pairs, ref.pairs) and torch.equal(block_slots, ref.block_slots)


def test_ids_out_of_range_are_dropped_by_the_kernels():
    """The reference's contract leaves ids >= S undefined; the kernels count and place them nowhere (no
    out-of-bounds gather), which equals the reference with those ids skipped."""
    ids = torch.tensor([[0, 3], [7, 1], [2, 2], [100, 0]], dtype=torch.int32)
    got = align_by_slot_triton(ids.to(DEVICE), 3, 4)
    ref = align_by_slot_torch(torch.where(ids < 3, ids, -1).to(DEVICE), 3, 4)
    assert torch.equal(got.pairs, ref.pairs) and torch.equal(got.block_slots, ref.block_slots)


def test_dispatch_takes_the_kernels_up_to_the_bound_and_the_reference_above(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 257, (12, 9), generator=gen, dtype=torch.int32).to(DEVICE)
    assert uses_triton(ids, 257) and uses_triton(ids, MAX_TRITON_SLOTS) and not uses_triton(ids, MAX_TRITON_SLOTS + 1)
    ref = align_by_slot_torch(ids, 257, 16)

    def refuse(*args, **kwargs):
        raise AssertionError("the other path ran")

    with monkeypatch.context() as m:
        m.setattr(moe_align, "align_by_slot_torch", refuse)
        got = align_by_slot(ids, 257, 16)
    assert torch.equal(got.pairs, ref.pairs) and torch.equal(got.block_slots, ref.block_slots)
    big = MAX_TRITON_SLOTS + 1
    ref_big = align_by_slot_torch(ids, big, 16)
    with monkeypatch.context() as m:
        m.setattr(moe_align, "align_by_slot_triton", refuse)
        got_big = align_by_slot(ids, big, 16)
    assert torch.equal(got_big.pairs, ref_big.pairs) and torch.equal(got_big.block_slots, ref_big.block_slots)
    with pytest.raises(ValueError, match="num_slots"):
        align_by_slot_triton(ids, big, 16)


def test_refusals_match_the_reference():
    bad = [((torch.zeros(4, 2, dtype=torch.int64), 3, 16), "int32"),
           ((torch.zeros(4, 2, dtype=torch.int32), 3, 24), "power of two"),
           ((torch.zeros(4, 2, dtype=torch.int32), 0, 16), "num_slots"),
           ((torch.zeros(8, dtype=torch.int32), 3, 16), "int32 \\[T, K\\]")]
    for args, message in bad:
        for fn in (align_by_slot_torch, align_by_slot_triton, align_by_slot):
            with pytest.raises(ValueError, match=message):
                fn(*args)
    with pytest.raises(ValueError, match="max_groups"):
        align_by_slot_triton(torch.zeros(4, 2, dtype=torch.int32), 3, 16, -1)
    with pytest.raises(ValueError, match="chunk"):
        align_by_slot_triton(torch.zeros(4, 2, dtype=torch.int32), 3, 16, chunk=48)
    flat, i32 = torch.zeros(40, dtype=torch.int32), dict(dtype=torch.int32)
    with pytest.raises(ValueError, match="num_slots"):
        count_chunks(flat, MAX_TRITON_SLOTS + 1, 32, torch.empty(2, MAX_TRITON_SLOTS + 1, **i32))
    with pytest.raises(ValueError, match="counts"):
        count_chunks(flat, 3, 32, torch.empty(1, 3, **i32))  # 40 pairs are 2 chunks of 32
    with pytest.raises(ValueError, match="totals"):
        scan_chunks(torch.empty(2, 3, **i32), torch.empty(4, **i32))
    with pytest.raises(ValueError, match="base"):
        place_pairs(flat, torch.empty(2, 4, **i32), torch.empty(3, **i32), 16, 32, torch.empty(32, **i32),
                    torch.empty(2, **i32))
    with pytest.raises(ValueError, match="pairs"):
        place_pairs(flat, torch.empty(2, 3, **i32), torch.empty(3, **i32), 16, 32, torch.empty(30, **i32),
                    torch.empty(2, **i32))


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "experts", "block_m"),
                         [(4096, 256, 64), (8192, 256, 64), (32768, 256, 128), (4096, 512, 32), (1000, 256, 16)])
def test_real_prefill_shapes_on_gpu(tokens, experts, block_m):
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = _routing(gen, tokens, 8, experts, skip=0.01, shared=True)
    groups = experts + 1
    assert max_blocks(ids.numel(), groups, block_m) > 0
    _assert_same(ids, groups, block_m, groups, chunk=moe_align.CHUNK)
    _assert_same(ids, groups, block_m, 3, chunk=moe_align.CHUNK)  # a too-small bound: drops pairs
    skewed = torch.where(ids >= 0, ids.remainder(5), ids)  # 5 hot experts: long groups, many empty ones
    _assert_same(skewed, groups, block_m, groups, chunk=moe_align.CHUNK)


_BUILD = r"""
import os, re, subprocess, tempfile
import triton
import triton.backends.nvidia as nv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adapters.kernels import moe_align_count, moe_align_place, moe_align_scan

TOOL = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")

def usage(kernel, ptrs, ints, consts, warps):
    sig = {**{p: "*i32" for p in ptrs}, **{k: "i32" for k in ints}, **{k: "constexpr" for k in consts}}
    src = ASTSource(kernel, sig, consts, {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        out = subprocess.run([TOOL, "-res-usage", f.name], capture_output=True, text=True).stdout
    return re.search(r"REG:(\d+) STACK:(\d+)", out).groups()

for nb in (moe_align_count.MAX_SLOTS,):
    print("count", nb, *usage(moe_align_count._moe_align_count_kernel, ["slot_ids_ptr", "counts_ptr"], ["P", "S"],
                              dict(CHUNK=moe_align_place.CHUNK, BLOCK_S=nb), 4))
    for bm in (16, 64, 128):
        print("place", nb, bm, *usage(moe_align_place._moe_align_place_kernel,
              ["slot_ids_ptr", "base_ptr", "totals_ptr", "pairs_ptr", "block_slots_ptr"], ["P", "S", "C", "B", "R"],
              dict(BM=bm, CHUNK=moe_align_place.CHUNK, SUB=moe_align_place.SUB, BLOCK_S=nb,
                   BT=moe_align_place.blocks_per_program(bm)), moe_align_place.NUM_WARPS))
print("scan", 32, *usage(moe_align_scan._moe_align_scan_kernel, ["counts_ptr", "totals_ptr"], ["C", "S"],
                         dict(BLOCK_C=moe_align_scan.BLOCK_C, BLOCK_G=moe_align_scan.BLOCK_G), 4))
"""


@pytest.mark.slow
def test_kernels_build_for_sm90_without_spills():
    """The interpreter proves the math, not the lowering (tl.histogram, tl.gather) nor the register budget:
    each kernel builds for an H200 at the launchers' settings with no stack (spills)."""
    lines = build_for_sm90(_BUILD, timeout=300).splitlines()
    assert len(lines) == 5
    for line in lines:
        regs, stack = map(int, re.findall(r"\d+", line)[-2:])
        assert stack == 0 and regs <= 128, f"spills or a register-bound occupancy: {line}"
