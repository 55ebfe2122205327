"""The grouped (prefill) MoE path over the slot pool: pair alignment by slot (moe_align), the tensor-core
gate_up/down GEMMs and grouped_moe, against the torch reference (dequantize + SwiGLU + router-weighted
sum) in every weight format, and against the decode kernels (fused_moe).

Without CUDA the kernels run in Triton's interpreter with fp32 dot operands; with CUDA they run compiled.
Bounds: fp32 activations 1e-5 relative (as the decode kernels' tests), bf16 8e-3 (one rounding of h and
of the output). The GEMM checks run in both arrangements (the `w_lhs` fixture: the weight as the dots' left
operand, transposed tiles), grouped_moe's launches included.
"""

from __future__ import annotations

import functools

import pytest
import torch

from adapters.kernels.fused_moe import fused_moe
from adapters.kernels.grouped_moe import grouped_moe
from adapters.kernels.moe_align import Alignment, align_by_slot, choose_block_m, max_blocks
from adapters.kernels.moe_grouped_down import moe_grouped_down
from adapters.kernels.moe_grouped_gate_up import moe_grouped_gate_up
from domain.model_spec import WeightFormat
from tests.adapters.sm90 import build_for_sm90
from tests.adapters.test_kernels_moe import CASES, FP32_BOUND, make_batch, make_pool, reference, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F_ = WeightFormat


# ---- alignment -------------------------------------------------------------------------------------

def _check_alignment(slot_ids: torch.Tensor, num_slots: int, align: Alignment) -> None:
    """Every live pair exactly once, in a block of its own slot, ascending within the slot; each slot's
    group starts a fresh block and uses ceil(n / BM) consecutive blocks; unused blocks only at the end."""
    flat = slot_ids.reshape(-1).cpu()
    pairs, block_slots, bm = (t.cpu() if isinstance(t, torch.Tensor) else t for t in align)
    assert pairs.numel() == block_slots.numel() * bm
    live = pairs[pairs >= 0]
    assert sorted(live.tolist()) == torch.nonzero(flat >= 0).flatten().tolist()
    rows_slot = block_slots.repeat_interleave(bm)  # [P]
    assert torch.equal(rows_slot[pairs >= 0], flat[live.long()])
    used = int((block_slots >= 0).sum())
    assert (block_slots[used:] == -1).all() and (pairs[used * bm:] == -1).all()
    counts = torch.bincount(flat[flat >= 0].long(), minlength=num_slots)
    assert used == int(((counts + bm - 1) // bm).sum())
    order = block_slots[:used]
    assert torch.equal(order, torch.sort(order).values), "slots in ascending order, each slot's blocks together"
    for s in torch.unique(order).tolist():
        rows = torch.nonzero(rows_slot == s).flatten()
        group = pairs[rows]
        n = int(counts[s])
        assert (group[:n] >= 0).all() and (group[n:] == -1).all(), "a slot's pairs come first in its blocks"
        assert torch.equal(group[:n], torch.sort(group[:n]).values), "ascending pair order within a slot"


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alignment_places_every_pair_once_in_its_slot_block(block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, top_k, num_slots = 23, 3, 9
    slot_ids = torch.randint(-1, num_slots, (tokens, top_k), generator=gen, dtype=torch.int32)
    slot_ids[5] = -1  # a whole token routed nowhere
    align = align_by_slot(slot_ids.to(DEVICE), num_slots, block_m)
    _check_alignment(slot_ids, num_slots, align)
    assert align.block_slots.numel() == max_blocks(tokens * top_k, num_slots, block_m)
    # the tightest bound the caller can guarantee (the distinct slots) still places every pair
    distinct = int(torch.unique(slot_ids[slot_ids >= 0]).numel())
    _check_alignment(slot_ids, num_slots, align_by_slot(slot_ids.to(DEVICE), num_slots, block_m, distinct))


def test_alignment_edge_cases_and_refusals():
    empty = align_by_slot(torch.full((4, 2), -1, dtype=torch.int32, device=DEVICE), 3, 16)
    assert (empty.block_slots == -1).all() and (empty.pairs == -1).all()
    none = align_by_slot(torch.empty((0, 2), dtype=torch.int32, device=DEVICE), 3, 16)
    assert none.pairs.numel() == 0 and none.block_slots.numel() == 0
    with pytest.raises(ValueError, match="int32"):
        align_by_slot(torch.zeros(4, 2, dtype=torch.int64), 3, 16)
    with pytest.raises(ValueError, match="power of two"):
        align_by_slot(torch.zeros(4, 2, dtype=torch.int32), 3, 24)
    with pytest.raises(ValueError, match="num_slots"):
        align_by_slot(torch.zeros(4, 2, dtype=torch.int32), 0, 16)


def test_block_m_follows_the_mean_group_size():
    assert choose_block_m(16, 8) == 16  # decode-like: 2 rows per expert
    assert choose_block_m(8192 * 9, 257) == 64  # an 8k chunk, top-8 + shared over 256 experts
    assert choose_block_m(32768 * 9, 257) == 128
    assert choose_block_m(1000, 0) == 128  # no experts: any block size (nothing runs)


# ---- the GEMMs against the reference ---------------------------------------------------------------

@pytest.fixture(params=[False, True], ids=["w_rhs", "w_lhs"])
def w_lhs(request, monkeypatch):
    """Both arrangements of the grouped GEMMs: under True, grouped_moe's launches take w_lhs=True as well."""
    if request.param:
        import adapters.kernels.grouped_moe as gm
        monkeypatch.setattr(gm, "moe_grouped_gate_up", functools.partial(moe_grouped_gate_up, w_lhs=True))
        monkeypatch.setattr(gm, "moe_grouped_down", functools.partial(moe_grouped_down, w_lhs=True))
    return request.param


def _bf16_bound(fmt, w_lhs: bool) -> float:
    """The bf16-activation bound, 8e-3. W_LHS with block FP8 rounds the weights to bf16 too (the scale folded into
    the tile: the reference qlinear's rounding, about 4e-3 more at these shapes), which Triton's interpreter
    truncates instead of rounding (biased: about 9e-3 more): 1.6e-2 there. Compiled, 8e-3 holds."""
    return 1.6e-2 if w_lhs and fmt == F_.FP8_BLOCK and DEVICE != "cuda" else 8e-3


def _batch(layout, where, tokens, top_k, seed, dtype=torch.float32):
    x, slot_ids, weights = make_batch(tokens, top_k, where, seed, skip=None, dtype=dtype, hidden=layout.hidden)
    slot_ids[1, 0] = -1  # skipped pairs: zeros in h's place, nothing in the output
    slot_ids[3] = -1
    return x, slot_ids, weights


@pytest.mark.parametrize(("fmt", "float_dtype"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_grouped_kernels_match_reference_in_fp32(fmt, float_dtype, w_lhs):
    layout, slots, where = make_pool(fmt, 256, 128, experts=4, num_slots=6, seed=1, float_dtype=float_dtype)
    x, slot_ids, weights = _batch(layout, where, tokens=21, top_k=2, seed=2)  # ~10 rows per expert
    h_ref, out_ref = reference(x, slot_ids, weights, slots, layout)
    align = align_by_slot(slot_ids, slots.shape[0], 16)
    h = torch.full((align.pairs.numel(), layout.intermediate), float("nan"), device=DEVICE)
    moe_grouped_gate_up(x, align, 2, slots, layout, out=h, block_n=64, w_lhs=w_lhs)
    used = (align.block_slots >= 0).repeat_interleave(16)
    live = align.pairs >= 0
    assert rel_err(h[live], h_ref.reshape(-1, layout.intermediate)[align.pairs[live].long()]) < FP32_BOUND
    assert torch.equal(h[used & ~live], torch.zeros_like(h[used & ~live])), "padding rows are zeros"
    partials = torch.full((21, 2, layout.hidden), float("nan"), device=DEVICE)
    moe_grouped_down(h, align, weights, slots, layout, partials, block_n=32, w_lhs=w_lhs)
    assert torch.isnan(partials[1, 0]).all() and torch.isnan(partials[3]).all(), "skipped pairs are not written"
    out = grouped_moe(x, slot_ids, weights, slots, layout)  # launcher defaults
    assert torch.isfinite(out).all()
    assert rel_err(out, out_ref) < FP32_BOUND
    assert torch.equal(out[3], torch.zeros_like(out[3]))


@pytest.mark.parametrize("fmt", [F_.FP8_BLOCK, F_.NVFP4, F_.MXFP4, F_.INT8_CHANNEL, F_.BF16], ids=lambda f: f.value)
def test_grouped_ragged_shapes(fmt, w_lhs):
    # H=320, I=96: partial K steps, partial row tiles, partial 128x128 scale blocks (block FP8); top-3
    # over 3 experts: every expert in every token, several 16-row blocks per slot
    layout, slots, where = make_pool(fmt, 320, 96, experts=3, num_slots=5, seed=5)
    x, slot_ids, weights = _batch(layout, where, tokens=13, top_k=3, seed=6)
    out = grouped_moe(x, slot_ids, weights, slots, layout, block_m=16)
    assert rel_err(out, reference(x, slot_ids, weights, slots, layout)[1]) < FP32_BOUND


@pytest.mark.parametrize("fmt", [F_.FP8_BLOCK, F_.MXFP4], ids=lambda f: f.value)
def test_grouped_bf16_activations_round_h_once(fmt, w_lhs):
    layout, slots, where = make_pool(fmt, 256, 128, experts=4, num_slots=5, seed=7)
    x, slot_ids, weights = _batch(layout, where, tokens=10, top_k=2, seed=8, dtype=torch.bfloat16)
    out = grouped_moe(x, slot_ids, weights, slots, layout)
    assert out.dtype == torch.bfloat16
    _, out_ref = reference(x, slot_ids, weights, slots, layout, round_h=torch.bfloat16)
    assert rel_err(out, out_ref) < _bf16_bound(fmt, w_lhs)
    assert rel_err(out, fused_moe(x, slot_ids, weights, slots, layout)) < _bf16_bound(fmt, w_lhs)


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", [F_.FP8_BLOCK, F_.NVFP4, F_.MXFP4], ids=lambda f: f.value)
def test_every_tuned_grouped_tile_is_exact_on_ragged_shapes(fmt, act):
    """Any tile the autotuner may pick for the activation dtype (GROUPED_FMA_TILES for fp32, GROUPED_TILES for
    bf16) must be right: H=320 and I=96 give partial K steps and partial column tiles (and partial 128x128
    scale blocks for block FP8). The interpreter ignores warps and stages; on a GPU each tile is launched as
    tuned, so a tile the compiler gets wrong is named. bf16 also takes the W_LHS tiles (GROUPED_W_LHS_TILES)."""
    from adapters.kernels.dequant_tile import GROUPED_FMA_TILES, GROUPED_TILES, GROUPED_W_LHS_TILES
    layout, slots, where = make_pool(fmt, 320, 96, experts=3, num_slots=5, seed=15)
    x, slot_ids, weights = _batch(layout, where, tokens=13, top_k=3, seed=16, dtype=act)
    fp32 = act == torch.float32
    h_ref, out_ref = reference(x, slot_ids, weights, slots, layout, **({} if fp32 else {"round_h": act}))
    bound = FP32_BOUND if fp32 else 8e-3
    align = align_by_slot(slot_ids, slots.shape[0], 16)
    live = align.pairs >= 0
    tiles = ([(*t, False) for t in GROUPED_FMA_TILES] if fp32
             else [(*t, False) for t in GROUPED_TILES] + [(*t, True) for t in GROUPED_W_LHS_TILES])
    if DEVICE != "cuda":
        tiles = sorted({(bn, 4, None, lhs) for bn, _, _, lhs in tiles})
    bad = {}
    for bn, warps, stages, lhs in tiles:
        launch = dict(block_n=bn, num_warps=warps, num_stages=stages, w_lhs=lhs)
        h = moe_grouped_gate_up(x, align, 3, slots, layout, **launch)
        err_h = rel_err(h[live], h_ref.reshape(-1, layout.intermediate)[align.pairs[live].long()])
        partials = torch.zeros((13, 3, layout.hidden), device=DEVICE)
        moe_grouped_down(h, align, weights, slots, layout, partials, **launch)
        err_out = rel_err(partials.sum(1), out_ref)
        tile_bound = bound if fp32 else _bf16_bound(fmt, lhs)
        if not (err_h < tile_bound and err_out < tile_bound):
            bad[(bn, warps, stages, lhs)] = (err_h, err_out)
    assert not bad, f"tiles off the reference: {bad}"


def _pruned(tuner, prec, fmt, block_m, a8=False, w_lhs=False):
    """The admitted (BLOCK_N, warps, stages) of one arrangement (w_lhs: the W_LHS tiles)."""
    from adapters.kernels.dequant_tile import grouped_configs
    kept = tuner.early_config_prune(grouped_configs(w_lhs=True), {}, PRECISION=prec, FMT=fmt, BLOCK_M=block_m, H=2048,
                                    I=512, A8=a8)
    return [(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept if c.kwargs["W_LHS"] == w_lhs]


def test_grouped_autotune_tries_only_tiles_that_fit_the_registers():
    from adapters.kernels import moe_grouped_down as gd
    from adapters.kernels import moe_grouped_gate_up as gu
    from adapters.kernels.dequant_tile import GROUPED_FMA_TILES, GROUPED_TILES, GROUPED_W_LHS_TILES
    # fp32 activations: only FMA tiles, at most 8 accumulators per thread (two for gate_up); no W_LHS tile
    assert _pruned(gu._TUNED, "ieee", 5, 16) == list(GROUPED_FMA_TILES)
    assert _pruned(gu._TUNED, "ieee", 5, 16, w_lhs=True) == []
    assert _pruned(gu._TUNED, "ieee", 5, 128) == [(16, 8, 3)]  # none fits: the fewest accumulators per thread
    # bf16, 8-bit: the accumulator rule only; 4-bit: no 128-column tile on 4 warps
    assert set(_pruned(gd._TUNED, "tf32", 1, 64)) == set(GROUPED_TILES)
    assert set(_pruned(gd._TUNED, "tf32", 1, 64, w_lhs=True)) == set(GROUPED_W_LHS_TILES)
    assert all(bn >= 64 for bn, _, _ in GROUPED_W_LHS_TILES)  # the weight tile is the wgmma's M side
    assert (128, 4, 3) not in _pruned(gd._TUNED, "tf32", 6, 64) + _pruned(gd._TUNED, "tf32", 6, 64, w_lhs=True)
    assert _pruned(gu._TUNED, "tf32", 6, 128) == [(64, 8, 3), (32, 4, 4)]
    # W_LHS: gate_up's two 128-row weight tiles on 4 warps would hold 256 elements per thread (they spill)
    assert (128, 4, 3) in _pruned(gd._TUNED, "tf32", 1, 16, w_lhs=True)
    assert (128, 4, 3) not in _pruned(gu._TUNED, "tf32", 1, 16, w_lhs=True)
    assert _pruned(gu._TUNED, "tf32", 6, 128, w_lhs=True) == [(64, 8, 3)]
    # e4m3 activations (W8A8): the activations stay the left operand, no W_LHS tile
    assert _pruned(gd._TUNED, "tf32", 1, 64, a8=True) == _pruned(gd._TUNED, "tf32", 1, 64)
    assert _pruned(gd._TUNED, "tf32", 1, 64, a8=True, w_lhs=True) == []
    # a K loop of two steps (H = 256) takes at most two stages, and tiles no wider than I
    small = gu._TUNED.early_config_prune(gu._TUNED.configs, {}, PRECISION="tf32", FMT=1, BLOCK_M=16, H=256, I=48)
    assert small and all(c.num_stages <= 2 and c.kwargs["BLOCK_N"] <= 64 for c in small)


# ---- bitwise invariances (the expert pool's contract) ----------------------------------------------

@pytest.mark.parametrize("fmt", [F_.FP8_BLOCK, F_.NVFP4], ids=lambda f: f.value)
def test_grouped_output_is_bitwise_independent_of_slots_and_grouping(fmt, w_lhs):
    layout, slots, where = make_pool(fmt, 128, 128, experts=4, num_slots=4, seed=9)
    x, slot_ids, weights = _batch(layout, where, tokens=12, top_k=2, seed=10)
    bound = 5  # experts + 1, as the expert pool passes it
    out = grouped_moe(x, slot_ids, weights, slots, layout, max_groups=bound)
    assert rel_err(out, reference(x, slot_ids, weights, slots, layout)[1]) < FP32_BOUND
    assert rel_err(out, fused_moe(x, slot_ids, weights, slots, layout)) < FP32_BOUND
    # the same experts in a bigger pool, in other slots, next to other bytes
    moved = torch.randint(0, 256, (9, layout.row_bytes), dtype=torch.uint8, device=DEVICE)
    new_slot = torch.tensor([7, 0, 3, 5], dtype=torch.int32, device=DEVICE)
    moved[new_slot.long()] = slots
    remapped = torch.where(slot_ids >= 0, new_slot[slot_ids.clamp(min=0).long()], slot_ids)
    assert torch.equal(grouped_moe(x, remapped, weights, moved, layout, max_groups=bound), out)
    # a layer's experts in two calls (the pool's grouped path when it is smaller than the chunk's
    # experts), partials filled per call, one ordered sum: the same bits
    partials = torch.zeros((12, 2, layout.hidden), device=DEVICE)
    for group in (slot_ids % 2 == 0, slot_ids % 2 == 1):
        part_ids = torch.where(group & (slot_ids >= 0), slot_ids, -1).to(torch.int32)
        grouped_moe(x, part_ids, weights, slots, layout, partials=partials, max_groups=bound)
    from adapters.kernels.moe_sum import moe_sum
    assert torch.equal(moe_sum(partials, torch.empty_like(x)), out)


# ---- refusals --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    layout, slots, where = make_pool(F_.FP8_BLOCK, 256, 128, experts=2, num_slots=2, seed=11)
    x, slot_ids, weights = make_batch(4, 2, where, seed=12, hidden=256)
    align = align_by_slot(slot_ids, 2, 16)
    h = moe_grouped_gate_up(x, align, 2, slots, layout)
    return layout, slots, x, slot_ids, weights, align, h


def test_grouped_launchers_reject_bad_inputs(small):
    layout, slots, x, slot_ids, weights, align, h = small
    partials = torch.zeros(4, 2, 256, device=DEVICE)
    bad_align = Alignment(align.pairs[:-1], align.block_slots, 16)
    gate_up_cases = [
        ((x[:, :128], align, 2, slots, layout), {}, "H=128"),
        ((x.to(torch.int32), align, 2, slots, layout), {}, "bf16/fp16/fp32"),
        ((x, bad_align, 2, slots, layout), {}, "blocks of 16"),
        ((x, Alignment(align.pairs, align.block_slots, 8), 2, slots, layout), {}, "blocks of 8"),
        ((x, Alignment(align.pairs.long(), align.block_slots, 16), 2, slots, layout), {}, "int32"),
        ((x, align, 0, slots, layout), {}, "top_k"),
        ((x, align, 2, slots[:, :-16], layout), {}, "uint8 \\[S, "),
        ((x, align, 2, slots, layout), {"block_n": 256}, "block_n=256"),
        ((x, align, 2, slots, layout), {"out": torch.empty(3, 128, device=DEVICE)}, "out must be"),
    ]
    for args, kwargs, message in gate_up_cases:
        with pytest.raises(ValueError, match=message):
            moe_grouped_gate_up(*args, **kwargs)
    down_cases = [
        ((h[:, :64].contiguous(), align, weights, slots, layout, partials), "must be \\["),
        ((h, align, weights.double(), slots, layout, partials), "weights must be"),
        ((h, align, weights, slots, layout, partials[:, :1]), "partials must be"),
        ((h, align, weights, slots, layout, partials.bfloat16()), "partials must be"),
        ((h, bad_align, weights, slots, layout, partials), "blocks of 16"),
    ]
    for args, message in down_cases:
        with pytest.raises(ValueError, match=message):
            moe_grouped_down(*args)
    from adapters.kernels.act_quant_fp8 import act_quant_fp8_reference
    with pytest.raises(ValueError, match="w_lhs does not apply to FP8 activations"):
        moe_grouped_gate_up(act_quant_fp8_reference(x), align, 2, slots, layout, w_lhs=True)
    with pytest.raises(ValueError, match="w_lhs does not apply to FP8 activations"):
        moe_grouped_down(act_quant_fp8_reference(h), align, weights, slots, layout, partials, w_lhs=True)
    with pytest.raises(ValueError, match="w_lhs must be a bool"):
        moe_grouped_down(h, align, weights, slots, layout, partials, w_lhs="yes")
    with pytest.raises(ValueError, match="weights must be fp32"):
        grouped_moe(x, slot_ids, weights[:, :1], slots, layout)
    with pytest.raises(ValueError, match=r"x must be \[T=4"):
        grouped_moe(x[:2], slot_ids, weights, slots, layout)


# ---- the compiled path, built for an H200 (sm_90) without a GPU --------------------------------------

_COMPILE_CHECK = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels import dense_gemm, moe_grouped_down, moe_grouped_gate_up
from adapters.kernels.dequant_tile import A8_FORMATS, scale_dtype
from adapters.kernels.packed_gemv import FORMAT_CODES, SCALE_GROUP, layout_consts
from domain.model_spec import WeightFormat

def build(kernel, ptrs, ints, consts, warps):
    sig = {**ptrs, **{k: "i32" for k in ints}, **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}
    src = ASTSource(kernel, sig, consts, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3)).asm["ptx"]
    ops = re.findall(r"wgmma.mma_async[.a-z0-9]*", ptx)
    return f"{len(ops)}:{'+'.join(sorted({o.rsplit('.', 2)[-2] for o in ops})) or '-'}"  # count:operand types

W = {"fp8": "fp8e4nv", "int8": "i8"}
for fmt in WeightFormat:
    c = layout_consts(ExpertLayout(fmt, 2048, 512))
    a8s = (False, True) if c.fmt_code in A8_FORMATS else (False,)
    for a8 in a8s:
        act = "fp8e4nv" if a8 else "bf16"
        common = dict(H=2048, I=512, R=c.row_bytes, W_DTYPE=c.gate.w_dtype, S_DTYPE=scale_dtype(c.fmt_code),
                      FMT=c.fmt_code, GROUP=max(c.group, 1), F32_DOT=False, PRECISION="tf32", A8=a8,
                      BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, W_LHS=False)
        gu = build(moe_grouped_gate_up._moe_grouped_gate_up_kernel,
                   {"x_ptr": "*" + act, "xs_ptr": "*fp32", "pairs_ptr": "*i32", "block_slots_ptr": "*i32",
                    "slots_ptr": "*u8", "h_ptr": "*bf16"},
                   ["S"], dict(K=9, G_DATA=c.gate.data, G_SCALE=c.gate.scale, G_GSCALE=c.gate.global_scale,
                               U_DATA=c.up.data, U_SCALE=c.up.scale, U_GSCALE=c.up.global_scale, **common), 8)
        dn = build(moe_grouped_down._moe_grouped_down_kernel,
                   {"h_ptr": "*" + act, "hs_ptr": "*fp32", "pairs_ptr": "*i32", "block_slots_ptr": "*i32",
                    "weights_ptr": "*fp32", "slots_ptr": "*u8", "y_ptr": "*fp32"},
                   ["S"], dict(D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale, **common), 4)
        dg = "0:-"
        if fmt in dense_gemm.SUPPORTED:
            w = W.get(fmt.value.split("_")[0], "u8")
            s = {WeightFormat.NVFP4: "fp8e4nv", WeightFormat.MXFP4: "u8"}.get(fmt, "fp32")
            dg = build(dense_gemm._dense_gemm_kernel,
                       {"x_ptr": "*" + act, "xs_ptr": "*fp32", "w_ptr": "*" + w, "s_ptr": "*" + s, "g_ptr": "*fp32",
                        "y_ptr": "*bf16"},
                       ["M", "M_BUCKET", "stride_xm", "stride_ym"],
                       dict(N=4096, K=2048, FMT=FORMAT_CODES[fmt], GROUP=SCALE_GROUP.get(fmt, 1), F32_DOT=False,
                            PRECISION="tf32", A8=a8, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8,
                            W_LHS=False), 8)
        print(fmt.value + ("/a8" if a8 else ""), gu, dn, dg)
"""


@pytest.mark.slow
def test_prefill_kernels_compile_for_sm90_on_tensor_cores():
    """Lowering to PTX is what the interpreter does not check: every format's grouped GEMMs and dense GEMM
    build for an H200 and their dots become Hopper wgmma instructions (bf16 operands, not FMA loops); with
    e4m3 activations (the FP8 formats' W8A8 path, ADR 0018) they become e4m3 x e4m3 wgmma with half the
    instructions (k32 steps instead of k16)."""
    stdout = build_for_sm90(_COMPILE_CHECK)
    counts = {line.split()[0]: line.split()[1:] for line in stdout.splitlines()}
    a8 = {F_.FP8_BLOCK.value, F_.FP8_TENSOR.value, F_.FP8_CHANNEL.value}
    assert set(counts) == {f.value for f in F_} | {f + "/a8" for f in a8}
    for name, ops in counts.items():
        (gu, gu_types), (dn, dn_types), (dg, dg_types) = (op.split(":") for op in ops)
        want = "e4m3" if name.endswith("/a8") else "bf16"
        assert int(gu) > 0 and int(dn) > 0 and gu_types == dn_types == want, f"{name}: grouped GEMMs {ops}"
        if name != F_.BF16.value:
            assert int(dg) > 0 and dg_types == want, f"{name}: dense GEMM {ops}"
    for fmt in a8:  # one k32 e4m3 instruction per two k16 bf16 ones
        assert [int(o.split(":")[0]) * 2 for o in counts[fmt + "/a8"]] == [int(o.split(":")[0]) for o in counts[fmt]]


_SPILL_CHECK = r"""
import os, re, subprocess, sys, tempfile
import triton
import triton.backends.nvidia as nv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels import dense_gemm, moe_grouped_down, moe_grouped_gate_up
from adapters.kernels.dequant_tile import grouped_configs, scale_dtype
from adapters.kernels.packed_gemv import FORMAT_CODES, SCALE_GROUP, layout_consts
from domain.model_spec import WeightFormat

TOOL = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")

def stack(src, cfg):
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        out = subprocess.run([TOOL, "-res-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"STACK:(\d+)", out).group(1))

def src_of(kernel, ptrs, ints, consts, divisible_ints=()):
    # the pointers and the ints the JIT specializes as multiples of 16 (dense: the row strides)
    sig = {**ptrs, **{k: "i32" for k in ints}, **{k: "constexpr" for k in consts}}
    div = list(range(len(ptrs))) + [len(ptrs) + ints.index(k) for k in divisible_ints]
    return ASTSource(kernel, sig, consts, {(i,): [["tt.divisibility", 16]] for i in div})

W = {WeightFormat.FP8_BLOCK: "fp8e4nv"}
for fmt in (WeightFormat.FP8_BLOCK, WeightFormat.NVFP4, WeightFormat.MXFP4):
    code, group = FORMAT_CODES[fmt], SCALE_GROUP[fmt]
    modes = (("bf16", "tf32", False), ("fp32", "ieee", False)) + ((("fp8e4nv", "tf32", True),) if code == 1 else ())
    for act, prec, a8 in modes:  # a8: e4m3 activations (ADR 0018), outputs bf16
        out = "bf16" if a8 else act
        consts = dict(N=4096, K=2048, FMT=code, GROUP=group, F32_DOT=False, PRECISION=prec, A8=a8)
        for cfg in dense_gemm._prune(dense_gemm.tune_configs(w_lhs=True), {"M_BUCKET": 4096}, **consts):
            src = src_of(dense_gemm._dense_gemm_kernel,
                         {"x_ptr": "*" + act, "xs_ptr": "*fp32", "w_ptr": "*" + W.get(fmt, "u8"), "s_ptr": "*" + {WeightFormat.NVFP4: "fp8e4nv", WeightFormat.MXFP4: "u8"}.get(fmt, "fp32"),
                          "g_ptr": "*fp32", "y_ptr": "*" + out}, ["M", "M_BUCKET", "stride_xm", "stride_ym"], {**consts, **cfg.kwargs},
                         ("stride_xm", "stride_ym"))
            print("dense", fmt.value, act, cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages,
                  "w_lhs" if cfg.kwargs["W_LHS"] else "w_rhs", stack(src, cfg), flush=True)
        c = layout_consts(ExpertLayout(fmt, 2048, 512))
        for block_m in (16, 64):
            common = dict(H=2048, I=512, R=c.row_bytes, W_DTYPE=c.gate.w_dtype, S_DTYPE=scale_dtype(code), FMT=code,
                          GROUP=group, F32_DOT=False, PRECISION=prec, A8=a8, BLOCK_M=block_m)
            for name, mod, extra, ptrs in (
                ("gate_up", moe_grouped_gate_up, dict(K=9, G_DATA=c.gate.data, G_SCALE=c.gate.scale, G_GSCALE=c.gate.global_scale,
                                                     U_DATA=c.up.data, U_SCALE=c.up.scale, U_GSCALE=c.up.global_scale),
                 {"x_ptr": "*" + act, "xs_ptr": "*fp32", "pairs_ptr": "*i32", "block_slots_ptr": "*i32", "slots_ptr": "*u8", "h_ptr": "*" + out}),
                ("down", moe_grouped_down, dict(D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale),
                 {"h_ptr": "*" + act, "hs_ptr": "*fp32", "pairs_ptr": "*i32", "block_slots_ptr": "*i32", "weights_ptr": "*fp32", "slots_ptr": "*u8", "y_ptr": "*fp32"})):
                kernel = mod._TUNED.fn
                for cfg in mod._TUNED.early_config_prune(grouped_configs(w_lhs=True), {}, **common, **extra):
                    src = src_of(kernel, ptrs, ["S"], {**common, **extra, **cfg.kwargs})
                    print(name, fmt.value, act, block_m, cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages,
                          "w_lhs" if cfg.kwargs["W_LHS"] else "w_rhs", stack(src, cfg), flush=True)
"""


@pytest.mark.slow
def test_admitted_tiles_do_not_spill_at_sm90():
    """Every tile the pruners admit (dense GEMM at M_BUCKET 4096, grouped GEMMs at BLOCK_M 16 and 64; fp32 and
    bf16 activations, and e4m3 ones for block FP8; block FP8, NVFP4, MXFP4 at the Qwen3.6 shapes; the W_LHS tiles
    with bf16) builds for an H200 with at most 1 KB of stack per thread. The tensor-core tiles with fp32 activations ("ieee" dots, FMA loops) spilled 3-24 KB,
    which is what the FMA tile lists and the register bounds of dequant_tile.prune_tiles keep out."""
    lines = [line.split() for line in build_for_sm90(_SPILL_CHECK, timeout=900).splitlines() if line.strip()]
    assert len(lines) > 40
    spills = [" ".join(line) for line in lines if int(line[-1]) > 1024]
    assert not spills, f"tiles with more than 1 KB of stack: {spills}"


_W_LHS_CHECK = r"""
import os, re, sys
import triton
from triton.backends.compiler import GPUTarget
import adapters
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(adapters.__file__)), "scripts"))
import compile_probe as cp
from adapters.kernels import dense_gemm, moe_grouped_down, moe_grouped_gate_up
from adapters.kernels.dequant_tile import grouped_configs
from adapters.kernels.packed_gemv import FORMAT_CODES
from domain.model_spec import WeightFormat

def report(name, src, cfg):
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ir = k.asm["ttgir"]
    pend = max((int(p) for p in re.findall(r"pendings = (\d+)", ir)), default=-1)
    print(name, cfg.kwargs["BLOCK_N"], cfg.num_warps, len(re.findall("wgmma.mma_async", k.asm["ptx"])), pend,
          int("#ttg.dot_op<{opIdx = 0, parent = #mma" in ir), flush=True)

for fmt in (WeightFormat.FP8_BLOCK, WeightFormat.NVFP4):
    code = FORMAT_CODES[fmt]
    for cfg in dense_gemm._prune(dense_gemm.tune_configs(w_lhs=True), {"M_BUCKET": 4096}, PRECISION="tf32", FMT=code, N=4096,
                                 K=2048, A8=False):
        if cfg.kwargs["W_LHS"]:
            report("dense_" + fmt.value, cp.dense_source(fmt, "bf16", (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]), True), cfg)
    for name, mod, source in (("gate_up", moe_grouped_gate_up, cp.grouped_source), ("down", moe_grouped_down, cp.down_source)):
        for cfg in mod._TUNED.early_config_prune(grouped_configs(w_lhs=True), {}, PRECISION="tf32", FMT=code, BLOCK_M=64, H=2048,
                                                 I=512, A8=False):
            if cfg.kwargs["W_LHS"]:
                report(name + "_" + fmt.value, source(fmt, "bf16", 64, cfg.kwargs["BLOCK_N"], True), cfg)
"""


@pytest.mark.slow
def test_w_lhs_tiles_keep_the_weight_in_registers_and_wait_async_at_sm90():
    """The point of W_LHS (dequant_tile.py): built for an H200, every admitted W_LHS tile of the three GEMMs (block
    FP8 and NVFP4, bf16 activations, dense at M_BUCKET 4096, grouped at BLOCK_M 64) runs wgmma with the converted
    weight as a register operand (the TTGIR's dot_op opIdx 0 of an #mma parent, no write back to shared memory)
    and waits for its wgmma a step later (`pendings` > 0), where the other arrangement waits at once."""
    lines = [line.split() for line in build_for_sm90(_W_LHS_CHECK, timeout=600).splitlines() if line.strip()]
    assert {line[0] for line in lines} == {f"{k}_{f}" for k in ("dense", "gate_up", "down") for f in ("fp8_block", "nvfp4")}
    bad = [" ".join(line) for line in lines if not (int(line[3]) > 0 and int(line[4]) > 0 and line[5] == "1")]
    assert not bad, f"W_LHS tiles without wgmma, async waits or a register weight operand: {bad}"


# ---- real geometry on the GPU (Qwen3.6-35B-A3B experts: H=2048, I=512, top-8), autotuned tiles --------

def _reference_by_expert(x, slot_ids, weights, slots, layout, round_h=None):
    """out [T, H] fp32, one dense pass per distinct slot (the per-pair reference is too slow at this size)."""
    from adapters.checkpoint.quant import dequantize
    out = torch.zeros(x.shape[0], layout.hidden, device=x.device)
    for s in torch.unique(slot_ids[slot_ids >= 0]).tolist():
        t, k = torch.nonzero(slot_ids == s, as_tuple=True)
        w = layout.view(slots[s])
        xs = x[t].float()
        h = torch.nn.functional.silu(xs @ dequantize(w.gate).T) * (xs @ dequantize(w.up).T)
        h = h if round_h is None else h.to(round_h).float()
        out.index_add_(0, t, weights[t, k, None] * (h @ dequantize(w.down).T))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [F_.FP8_BLOCK, F_.BF16, F_.NVFP4], ids=lambda f: f.value)
@pytest.mark.parametrize("tokens", [64, 1024])
def test_grouped_real_geometry_on_gpu(fmt, tokens):
    layout, slots, where = make_pool(fmt, 2048, 512, experts=64, num_slots=80, seed=13, device="cuda")
    x, slot_ids, weights = make_batch(tokens, 8, where, seed=14, hidden=2048, skip=None)
    out = grouped_moe(x, slot_ids, weights, slots, layout, max_groups=65)
    assert rel_err(out, _reference_by_expert(x, slot_ids, weights, slots, layout)) < 1e-4  # fp32: "ieee" dots
    xb = x.bfloat16()
    got = grouped_moe(xb, slot_ids, weights, slots, layout, max_groups=65)
    assert rel_err(got, _reference_by_expert(xb, slot_ids, weights, slots, layout, round_h=torch.bfloat16)) < 8e-3
    assert rel_err(got, fused_moe(xb, slot_ids, weights, slots, layout)) < 8e-3
