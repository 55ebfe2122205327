"""Triton MoE kernels over the slot pool (adapters/kernels/) against the torch reference (dequantize +
SwiGLU + router-weighted sum), in every weight format.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any
kernel module is imported); with CUDA the same tests run compiled, plus the `gpu`-marked tests at the real
Qwen3.6 geometry. A fresh process builds both kernels for sm_90 without a GPU (compile check).
Error bound: relative Frobenius error < 1e-5 in fp32 (the kernels reorder fp32 sums and apply scales per
group or per row instead of per element, ~1e-7 relative; anything wrong in a format is >> 1e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.quant import dequantize
from adapters.checkpoint.quantize import quantize
from adapters.kernels.fused_moe import fused_moe
from adapters.kernels.moe_down import moe_down
from adapters.kernels.moe_gate_up import moe_gate_up
from domain.model_spec import WeightFormat
from tests.adapters.sm90 import build_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

F_ = WeightFormat
FP32_BOUND = 1e-5


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def make_pool(fmt, hidden, inter, experts, num_slots, seed, float_dtype=torch.bfloat16, device=DEVICE):
    """(layout, slots [S, R], slot_of_expert [E]): E random non-zero experts packed into distinct random
    slots; every other slot holds random bytes (NaN/inf patterns included), which must never be read."""
    g = torch.Generator().manual_seed(seed)
    layout = ExpertLayout(fmt, hidden, inter, float_dtype)
    slots = torch.randint(0, 256, (num_slots, layout.row_bytes), generator=g, dtype=torch.uint8)  # [S, R]
    where = torch.randperm(num_slots, generator=g)[:experts]  # [E]
    for e in range(experts):
        gate, up, down = (quantize(torch.randn(shape, generator=g) * 0.2, fmt, float_dtype)
                          for shape in ((inter, hidden), (inter, hidden), (hidden, inter)))
        layout.pack(gate, up, down, out=slots[where[e]])
    return layout, slots.to(device), where


def make_batch(tokens, top_k, slot_of_expert, seed, skip=(0, 1), dtype=torch.float32, hidden=None):
    """x [T, H], slot_ids int32 [T, K] (distinct experts per token, `skip` set to -1), weights fp32 [T, K]."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(len(slot_of_expert), generator=g)[:top_k] for _ in range(tokens)])  # [T, K]
    slot_ids = slot_of_expert[ids].to(torch.int32)
    if skip is not None:
        slot_ids[skip] = -1
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return x.to(DEVICE), slot_ids.to(DEVICE), weights.to(DEVICE)


def reference(x, slot_ids, weights, slots, layout, round_h=None):
    """(h [T, K, I], out [T, H]) in fp32 from fully dequantized experts; round_h emulates h's storage dtype."""
    tokens, top_k = slot_ids.shape
    x32 = x.float()
    h = torch.zeros(tokens, top_k, layout.intermediate, device=x.device)
    out = torch.zeros(tokens, layout.hidden, device=x.device)
    for t in range(tokens):
        for k in range(top_k):
            s = int(slot_ids[t, k])
            if s < 0:
                continue
            w = layout.view(slots[s])
            h[t, k] = F.silu(x32[t] @ dequantize(w.gate).T) * (x32[t] @ dequantize(w.up).T)
            hk = h[t, k] if round_h is None else h[t, k].to(round_h).float()
            out[t] += weights[t, k] * (hk @ dequantize(w.down).T)
    return h, out


def run_poisoned(x, slot_ids, weights, slots, layout, block_n=64, **blocks):
    """Both kernels into NaN-filled outputs, so an element left unwritten fails the comparison.
    block_n=64 keeps the interpreter's program count low; fused_moe tests run the launcher defaults."""
    blocks["block_n"] = block_n
    tokens, top_k = slot_ids.shape
    h = torch.full((tokens, top_k, layout.intermediate), float("nan"), dtype=x.dtype, device=x.device)
    moe_gate_up(x, slot_ids, slots, layout, out=h, **blocks)
    out = torch.full((tokens, layout.hidden), float("nan"), dtype=x.dtype, device=x.device)
    moe_down(h, slot_ids, weights, slots, layout, out=out, **blocks)
    return h, out


CASES = [(fmt, torch.bfloat16) for fmt in F_] + [(F_.BF16, torch.float16), (F_.BF16, torch.float32)]


@pytest.mark.parametrize(("fmt", "float_dtype"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_kernels_match_reference_in_fp32(fmt, float_dtype):
    layout, slots, where = make_pool(fmt, 256, 128, experts=4, num_slots=6, seed=1, float_dtype=float_dtype)
    x, slot_ids, weights = make_batch(3, 2, where, seed=2, hidden=256)
    h, out = run_poisoned(x, slot_ids, weights, slots, layout)
    h_ref, out_ref = reference(x, slot_ids, weights, slots, layout)
    assert torch.isfinite(h).all() and torch.isfinite(out).all()
    assert torch.equal(h[0, 1], torch.zeros_like(h[0, 1])), "a skipped (t, k) must give zeros"
    assert rel_err(h, h_ref) < FP32_BOUND
    assert rel_err(out, out_ref) < FP32_BOUND


@pytest.mark.parametrize("fmt", [F_.FP8_BLOCK, F_.NVFP4, F_.MXFP4, F_.INT8_CHANNEL, F_.BF16])
def test_ragged_shapes_and_wide_k_blocks(fmt):
    # H=320, I=96: partial K tiles, partial row tiles and (block FP8) partial 128x128 scale blocks;
    # block_k=256 covers several scale groups per tile
    layout, slots, where = make_pool(fmt, 320, 96, experts=3, num_slots=4, seed=5)
    x, slot_ids, weights = make_batch(2, 2, where, seed=6, skip=None, hidden=320)
    h, out = run_poisoned(x, slot_ids, weights, slots, layout, block_n=64, block_k=256)
    h_ref, out_ref = reference(x, slot_ids, weights, slots, layout)
    assert rel_err(h, h_ref) < FP32_BOUND
    assert rel_err(out, out_ref) < FP32_BOUND


def test_bf16_activations_round_h_once():
    layout, slots, where = make_pool(F_.FP8_BLOCK, 256, 128, experts=4, num_slots=5, seed=7)
    x, slot_ids, weights = make_batch(2, 2, where, seed=8, hidden=256, dtype=torch.bfloat16)
    h, out = run_poisoned(x, slot_ids, weights, slots, layout)
    assert h.dtype == out.dtype == torch.bfloat16
    h_ref, out_ref = reference(x, slot_ids, weights, slots, layout, round_h=torch.bfloat16)
    assert rel_err(h, h_ref) < 8e-3  # one bf16 rounding (2^-8 relative per element)
    assert rel_err(out, out_ref) < 8e-3


@pytest.mark.parametrize("fmt", [F_.FP8_BLOCK, F_.NVFP4])
def test_output_is_bitwise_identical_whichever_slot_holds_an_expert(fmt):
    layout, slots, where = make_pool(fmt, 128, 128, experts=3, num_slots=3, seed=9)
    x, slot_ids, weights = make_batch(2, 2, where, seed=10, hidden=128)
    out = fused_moe(x, slot_ids, weights, slots, layout)  # the launchers' default blocks
    assert rel_err(out, reference(x, slot_ids, weights, slots, layout)[1]) < FP32_BOUND
    # the same experts in a bigger pool, in other slots, next to other bytes
    moved = torch.randint(0, 256, (7, layout.row_bytes), dtype=torch.uint8, device=DEVICE)  # [S', R]
    new_slot = torch.tensor([6, 0, 3], dtype=torch.int32, device=DEVICE)  # old slot s -> new_slot[s]
    moved[new_slot.long()] = slots
    remapped = torch.where(slot_ids >= 0, new_slot[slot_ids.clamp(min=0).long()], slot_ids)
    assert not torch.equal(remapped, slot_ids)
    assert torch.equal(fused_moe(x, remapped, weights, moved, layout), out)


class _PoisonedTorch:
    """torch, except that empty() hands out NaN-filled float tensors: a scratch element a kernel should
    have written but did not then shows up as NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize(("fmt", "dtype"), [(F_.FP8_BLOCK, torch.bfloat16), (F_.NVFP4, torch.float32),
                                             (F_.BF16, torch.float32)])
def test_down_into_out_is_bitwise_the_callers_partials_then_moe_sum(fmt, dtype, monkeypatch):
    """The decode path (moe_down into `out`: its own partials buffer, then moe_sum) against the caller's
    partials plus moe_sum (the grouped and streamed paths): identical bits, skipped pairs and padded rows
    included, so a layer gives the same output whichever path a pool size sends it down. moe_down's own
    buffer is NaN-poisoned here: a skipped pair must be written as zeros, or out turns NaN. The caller's
    partials keep their skipped entries as the caller left them."""
    import importlib

    from adapters.kernels.moe_sum import moe_sum

    layout, slots, where = make_pool(fmt, 256, 128, experts=5, num_slots=7, seed=21)
    x, slot_ids, weights = make_batch(3, 3, where, seed=22, hidden=256, dtype=dtype)
    slot_ids[2] = -1  # a padded row: every pair skipped
    h = moe_gate_up(x, slot_ids, slots, layout)
    partials = torch.full((3, 3, layout.hidden), 7.0, dtype=torch.float32, device=DEVICE)
    assert moe_down(h, slot_ids, weights, slots, layout, partials=partials) is partials
    skipped = slot_ids < 0  # [T, K]
    assert torch.equal(partials[skipped], torch.full_like(partials[skipped], 7.0))  # left alone
    assert not torch.equal(partials[~skipped], torch.full_like(partials[~skipped], 7.0))
    partials[skipped] = 0.0
    want = moe_sum(partials, torch.empty_like(x))
    monkeypatch.setattr(importlib.import_module("adapters.kernels.moe_down"), "torch", _PoisonedTorch())
    out = torch.full_like(x, float("nan"))
    assert moe_down(h, slot_ids, weights, slots, layout, out=out) is out
    assert torch.equal(out, want)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert rel_err(out, reference(x, slot_ids, weights, slots, layout, round_h=dtype)[1]) < 8e-3


@pytest.fixture(scope="module")
def small():
    layout, slots, where = make_pool(F_.FP8_BLOCK, 256, 128, experts=2, num_slots=2, seed=11)
    x, slot_ids, weights = make_batch(2, 2, where, seed=12, hidden=256)
    h = moe_gate_up(x, slot_ids, slots, layout)
    return layout, slots, x, slot_ids, weights, h


def test_gate_up_rejects_bad_inputs(small):
    layout, slots, x, slot_ids, weights, h = small
    cases = [
        ((x[:, :128], slot_ids, slots, layout), {}, "H=128"),
        ((x[0], slot_ids, slots, layout), {}, r"\[T, H\]"),
        ((x.to(torch.int32), slot_ids, slots, layout), {}, "bf16/fp16/fp32"),
        ((x, slot_ids.long(), slots, layout), {}, "int32"),
        ((x, slot_ids[:1], slots, layout), {}, r"T=2"),
        ((x, slot_ids, slots[:, :-16], layout), {}, "uint8 \\[S, "),
        ((x, slot_ids, slots.view(torch.int8), layout), {}, "uint8"),
        ((x, slot_ids, slots, layout), {"block_k": 64}, r"scale group \(128"),
        ((x, slot_ids, slots, layout), {"block_k": 384}, "power of two"),
        ((x, slot_ids, slots, layout), {"block_n": 24}, "block_n=24"),
        ((x, slot_ids, slots, layout), {"out": torch.empty(2, 2, 64, device=DEVICE)}, "out must be"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            moe_gate_up(*args, **kwargs)
    strided = torch.empty(slots.shape[0], 2 * layout.row_bytes, dtype=torch.uint8, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        moe_gate_up(x, slot_ids, strided, layout)


def test_down_rejects_bad_inputs(small):
    layout, slots, x, slot_ids, weights, h = small
    cases = [
        ((h[:, :, :64], slot_ids, weights, slots, layout), {}, "I=64"),
        ((h[0], slot_ids, weights, slots, layout), {}, r"\[T, K, I\]"),
        ((h[:, :1], slot_ids, weights[:, :1], slots, layout), {}, "disagree on K"),
        ((h, slot_ids, weights.double(), slots, layout), {}, "weights must be fp32"),
        ((h, slot_ids, weights[:1], slots, layout), {}, "weights must be fp32"),
        ((h, slot_ids, weights, slots, layout), {"out": torch.empty(2, 256, dtype=torch.bfloat16, device=DEVICE)},
         "out must be"),
        ((h, slot_ids, weights, slots, layout), {"block_k": 32}, r"scale group \(128"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            moe_down(*args, **kwargs)


# ---- the compiled (non-interpreted) path, built for an H200 (sm_90) without a GPU --------------------

_COMPILE_CHECK = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.kernels import moe_down, moe_gate_up
from adapters.kernels.packed_gemv import default_block_k, layout_consts
from domain.model_spec import WeightFormat
from tests.adapters.sm90_usage import with_defaults

def build(kernel, ptrs, consts):
    consts = with_defaults(kernel, consts)
    sig = {**ptrs, "S": "i32", "PAIRS_BUCKET": "i32", **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}
    return triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32)).asm["ptx"]

for fmt in WeightFormat:
    layout = ExpertLayout(fmt, 2048, 512)
    c = layout_consts(layout)
    common = dict(K=8, H=2048, I=512, R=c.row_bytes, W_DTYPE=c.gate.w_dtype, FMT=c.fmt_code,
                  GROUP=max(c.group, 1), BLOCK_N=16, BLOCK_K=default_block_k(layout))
    gate_up = build(moe_gate_up._moe_gate_up_kernel,
                    {"x_ptr": "*bf16", "slot_ids_ptr": "*i32", "slots_ptr": "*u8", "h_ptr": "*bf16"},
                    dict(G_DATA=c.gate.data, G_SCALE=c.gate.scale, G_GSCALE=c.gate.global_scale,
                         U_DATA=c.up.data, U_SCALE=c.up.scale, U_GSCALE=c.up.global_scale, **common))
    down = build(moe_down._moe_down_kernel,
                 {"h_ptr": "*bf16", "slot_ids_ptr": "*i32", "weights_ptr": "*fp32", "slots_ptr": "*u8",
                  "y_ptr": "*fp32"},
                 dict(D_DATA=c.down.data, D_SCALE=c.down.scale, D_GSCALE=c.down.global_scale,
                      WRITE_SKIPPED=True, **common))
    print(fmt.value, len(re.findall(r"ld\\.global\\.v4", gate_up)), len(re.findall(r"ld\\.global\\.v4", down)))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_16_byte_weight_loads():
    """Catches what the interpreter does not check (lowering to PTX) in CI, and guards the wide loads that a
    memory-bound decode GEMV lives on: every format streams its weight tiles with 16-byte loads."""
    stdout = build_for_sm90(_COMPILE_CHECK, timeout=300)
    loads = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in stdout.splitlines()}
    assert set(loads) == {f.value for f in F_}
    for fmt, (gate_up, down) in loads.items():
        assert gate_up >= 2 and down >= 1, f"{fmt}: weight tiles not read with 16-byte loads ({loads[fmt]})"


# ---- real geometry on the GPU (Qwen3.6-35B-A3B experts: H=2048, I=512, top-8) ------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [F_.FP8_BLOCK, F_.BF16, F_.NVFP4, F_.MXFP4])
@pytest.mark.parametrize("tokens", [1, 4])
def test_real_geometry_on_gpu(fmt, tokens):
    layout, slots, where = make_pool(fmt, 2048, 512, experts=16, num_slots=24, seed=13, device="cuda")
    x, slot_ids, weights = make_batch(tokens, 8, where, seed=14, hidden=2048, skip=None)
    h, out = run_poisoned(x, slot_ids, weights, slots, layout)
    h_ref, out_ref = reference(x, slot_ids, weights, slots, layout)
    assert rel_err(h, h_ref) < 1e-4 and rel_err(out, out_ref) < 1e-4  # fp32, no TF32 (tl.sum, not tl.dot)
    xb = x.bfloat16()
    _, out_ref_b = reference(xb, slot_ids, weights, slots, layout, round_h=torch.bfloat16)
    out_b = fused_moe(xb, slot_ids, weights, slots, layout)  # autotuned tiles, down into its own partials
    assert rel_err(out_b, out_ref_b) < 8e-3
    # the partials path (grouped/streamed prefill) runs the same tuned tile: the same bits once summed
    from adapters.kernels.moe_sum import moe_sum

    hb = moe_gate_up(xb, slot_ids, slots, layout)
    partials = torch.zeros(tokens, 8, layout.hidden, device="cuda")
    moe_down(hb, slot_ids, weights, slots, layout, partials=partials)
    assert torch.equal(moe_sum(partials, torch.empty_like(xb)), out_b)


def test_pair_buckets_cover_the_decode_sizes_and_leave_prefill_chunks_on_bs1s_key(monkeypatch):
    from adapters.kernels import packed_gemv

    assert {packed_gemv.pairs_bucket(p) for p in (1, 144, 5000)} == {1}  # off by default: one key
    monkeypatch.setattr(packed_gemv, "PAIRS_BUCKET_MAX", 256)
    # bs1 (9 pairs), bs2-bs7, bs8-bs28 (bs16: 144); prefill chunks past 256 pairs: bs1's key, as before the buckets
    assert [packed_gemv.pairs_bucket(p) for p in (0, 9, 16, 17, 63, 72, 144, 256, 257, 504, 5000)] == \
        [16, 16, 16, 64, 64, 256, 256, 256, 16, 16, 16]
    monkeypatch.setattr(packed_gemv, "PAIRS_BUCKET_MAX", 64)  # a lower cap: bs8 and up share bs1's key
    assert [packed_gemv.pairs_bucket(p) for p in (9, 36, 72, 144)] == [16, 64, 16, 16]


class _FakeTuner:
    """What tuned_tile reads of a triton.autotune object: its key names, argument names and cache."""

    keys = ["K", "H", "I", "R", "FMT", "PAIRS_BUCKET"]
    arg_names = ["x_ptr", "slot_ids_ptr", "slots_ptr", "h_ptr", "S", "PAIRS_BUCKET", "K", "H", "I", "R", "FMT"]

    def __init__(self, cache):
        self.cache = cache


def test_a_capture_runs_its_buckets_tile_else_the_nearest_tuned_one():
    from adapters.kernels import packed_gemv

    values = dict(K=9, H=2048, I=512, R=3 << 20, FMT=1)
    key = lambda bucket, **kw: packed_gemv.autotune_key(  # noqa: E731
        _FakeTuner({}), torch.bfloat16, {**values, **kw, "PAIRS_BUCKET": bucket})
    tuner = _FakeTuner({key(16): "tile16", key(1024): "tile1024", key(64, H=4096): "other shape"})
    assert key(16)[-4:] == (str(torch.bfloat16), "torch.int32", "torch.uint8", str(torch.bfloat16))
    assert packed_gemv.tuned_tile(tuner, torch.bfloat16, {**values, "PAIRS_BUCKET": 1024}) == "tile1024"
    # 64 is untuned for this shape: 16 is nearer than 1024 (in powers of two); the other shape's 64 is ignored
    assert packed_gemv.tuned_tile(tuner, torch.bfloat16, {**values, "PAIRS_BUCKET": 64}) == "tile16"
    assert packed_gemv.tuned_tile(tuner, torch.bfloat16, {**values, "PAIRS_BUCKET": 256}) == "tile1024"
    with pytest.raises(RuntimeError, match="no tile tuned"):
        packed_gemv.tuned_tile(tuner, torch.bfloat16, {**values, "FMT": 5, "PAIRS_BUCKET": 16})
    # outside a capture the autotuner decides
    assert packed_gemv.captured_tile(tuner, torch.bfloat16, {**values, "PAIRS_BUCKET": 64}) is None
