"""Split-K dense GEMM (decode rows) against the reference dequantization and against dense_gemm, every
quantized format (Triton's interpreter on the CPU, with fp32 dot operands; compiled on a GPU host).

Bounds as test_kernel_dense_gemm.py: fp32 activations 1e-5 relative (exact fp32 products, reordered sums);
bf16 activations 8e-3 (one rounding of the output to bf16). The checks run in both arrangements (w_lhs: the weight
as the dot's left operand, the transposed tile, partials and fix-up).
"""

import pytest
import torch

from adapters.checkpoint.quant import QTensor, dequantize
from adapters.checkpoint.quantize import quantize
from adapters.kernels import dense_gemm_splitk as sk
from adapters.kernels.dense_gemm import dense_gemm
from adapters.kernels.dense_gemm_splitk import MAX_ROWS, dense_gemm_splitk, supports
from domain.model_spec import WeightFormat
from tests.adapters.sm90 import build_for_sm90
from tests.adapters.test_kernel_dense_gemm import FORMATS, W_LHS, _err
from tests.adapters.test_kernel_dense_gemm import _case as _cpu_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(fmt, rows, n, k, seed):
    x, q = _cpu_case(fmt, rows, n, k, seed)  # the same draws as dense_gemm's tests
    return x.to(DEVICE), q.to(DEVICE)


def _exact(x, q):
    return x.double().cpu() @ dequantize(q.to("cpu"), torch.float64).T


@W_LHS
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_every_split_matches_the_reference_in_fp32(fmt, w_lhs):
    # K=640: five 128-column steps, so splits 2 and 4 leave ragged last splits and split 8 leaves empty
    # ones (their partials are zeros); N=48 a partial 32-column tile; M=5 a partial row tile
    x, q = _case(fmt, 5, 48, 640, seed=1)
    exact = _exact(x, q)
    for split in (1, 2, 4, 8):
        out = torch.full((5, 48), float("nan"), device=DEVICE)  # an unwritten element fails below
        dense_gemm_splitk(x, q, out=out, block_n=32, split_k=split, w_lhs=w_lhs)
        assert torch.isfinite(out).all(), split
        assert _err(out, exact) < 1e-5, split


@W_LHS
@pytest.mark.parametrize("rows", [1, 16, 17, MAX_ROWS])
def test_row_counts_up_to_the_limit(rows, w_lhs):
    # 17 and 64 rows: two and four 16-row tiles, each with its own counters
    x, q = _case(WeightFormat.FP8_BLOCK, rows, 32, 512, seed=2)
    out = dense_gemm_splitk(x, q, block_n=16, split_k=2, w_lhs=w_lhs)
    assert _err(out, _exact(x, q)) < 1e-5


@W_LHS
def test_bf16_activations_match_dense_gemm(w_lhs):
    x, q = _case(WeightFormat.FP8_BLOCK, 8, 64, 512, seed=3)
    xb = x.bfloat16()
    out = dense_gemm_splitk(xb, q, block_n=32, split_k=2, w_lhs=w_lhs)
    assert out.dtype == torch.bfloat16
    assert _err(out, _exact(xb, q)) < 8e-3
    assert _err(out, dense_gemm(xb, q)) < 8e-3


@W_LHS
def test_launches_are_deterministic_and_leave_the_counters_zeroed(w_lhs):
    """The last arrival resets its tile's counter: a second launch (a graph replay) must find them at zero,
    or it would add its partials at the wrong arrival and write y early or never."""
    x, q = _case(WeightFormat.INT8_CHANNEL, 3, 48, 512, seed=4)
    first = dense_gemm_splitk(x, q, block_n=16, split_k=4, w_lhs=w_lhs)
    assert int(sk.counters(x.device, 1).abs().sum()) == 0
    second = dense_gemm_splitk(x, q, block_n=16, split_k=4, w_lhs=w_lhs)
    assert torch.equal(first, second)
    assert _err(first, _exact(x, q)) < 1e-5


@W_LHS
def test_writes_into_a_strided_out_and_handles_zero_rows(w_lhs):
    x, q = _case(WeightFormat.FP8_CHANNEL, 4, 32, 256, seed=5)
    wide = torch.full((4, 50), float("nan"), device=DEVICE)
    dense_gemm_splitk(x, q, out=wide[:, 9:41], split_k=2, w_lhs=w_lhs)
    assert torch.isnan(wide[:, :9]).all() and torch.isnan(wide[:, 41:]).all()
    assert _err(wide[:, 9:41], _exact(x, q)) < 1e-5
    assert dense_gemm_splitk(x[:0], q).shape == (0, 32)


def test_supports_and_refusals():
    q = quantize(torch.randn(32, 128) * 0.05, WeightFormat.FP8_BLOCK).to(DEVICE)
    bf16 = QTensor(WeightFormat.BF16, (32, 128), torch.randn(32, 128, dtype=torch.bfloat16))
    assert supports(q, 1) and supports(q, MAX_ROWS)
    assert not supports(q, MAX_ROWS + 1) and not supports(q, 0) and not supports(bf16, 4)
    x = torch.randn(4, 128, device=DEVICE)
    cases = [
        ((x, bf16), {}, "does not read bf16"),
        ((x[:, :64], q), {}, r"\[M, 128\]"),
        ((x.to(torch.int32), q), {}, "bf16/fp16/fp32"),
        ((torch.randn(MAX_ROWS + 1, 128, device=DEVICE), q), {}, "rows >"),
        ((x, q), {"block_n": 8}, "block_n=8"),
        ((x, q), {"block_n": 256}, "block_n=256"),
        ((x, q), {"split_k": 0}, "split_k=0"),
        ((x, q), {"split_k": 17}, "split_k=17"),
        ((x, q), {"w_lhs": 1}, "w_lhs must be a bool"),
        ((x, q), {"out": torch.empty(4, 16, device=DEVICE)}, "out must be"),
        ((torch.randn(128, 4, device=DEVICE).T, q), {}, "contiguous"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            dense_gemm_splitk(*args, **kwargs)


def _pruned(prec, fmt, n, k, w_lhs=False):
    """The admitted (BLOCK_N, SPLIT_K, warps, stages) of one arrangement (w_lhs: the W_LHS tiles)."""
    kept = sk._prune(sk.tune_configs(w_lhs=True), {}, PRECISION=prec, FMT=fmt, N=n, K=k)
    return [(c.kwargs["BLOCK_N"], c.kwargs["SPLIT_K"], c.num_warps, c.num_stages) for c in kept
            if c.kwargs["W_LHS"] == w_lhs]


def test_autotune_tries_only_splits_and_tiles_that_fit():
    # K = 4096 (32 steps): every split up to 16, each split >= 2 steps
    wide = _pruned("tf32", 1, 2048, 4096)
    assert {s for _, s, _, _ in wide} == {1, 2, 4, 8, 16}
    # K = 2048 (16 steps): no split of 16; stages never above a split's steps
    mid = _pruned("tf32", 1, 12288, 2048)
    assert max(s for _, s, _, _ in mid) == 8
    assert all(st <= -(-16 // s) for _, s, _, st in mid)
    # fp32 activations: FMA loops, no tile wider than 32 columns
    assert max(bn for bn, _, _, _ in _pruned("ieee", 1, 2048, 4096)) == 32
    # one K step: only the unsplit kernel
    assert {s for _, s, _, _ in _pruned("tf32", 1, 64, 128)} == {1}
    assert len(set(wide)) == len(wide)


def test_w_lhs_tiles_are_tried_only_where_they_run():
    # bf16 at the qkvz shape: the weight rows 64 and 128 on one warpgroup, every split that fits
    lhs = _pruned("tf32", 1, 12288, 2048, w_lhs=True)
    assert {(bn, w) for bn, _, w, _ in lhs} == {(64, 4), (128, 4)} and max(s for _, s, _, _ in lhs) == 8
    assert not _pruned("ieee", 1, 12288, 2048, w_lhs=True)  # fp32 activations: FMA loops, no wgmma operand
    # 4-bit weights: a 128-row tile dequantizes 128 elements per thread on 4 warps (they spill): 64 rows only
    assert {bn for bn, _, _, _ in _pruned("tf32", 5, 12288, 2048, w_lhs=True)} == {64}
    # only with FLUXTIDE_PREFILL_W_LHS=1 do they join the autotuned configs (the environment of this run says)
    from adapters.kernels.dequant_tile import W_LHS_TUNING
    assert any(c.kwargs["W_LHS"] for c in sk._TUNED.configs) == W_LHS_TUNING


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [WeightFormat.FP8_BLOCK, WeightFormat.NVFP4, WeightFormat.MXFP4],
                         ids=lambda f: f.value)
@pytest.mark.parametrize("shape", [(12288, 2048), (2048, 4096)], ids=["qkvz", "out"])
@pytest.mark.parametrize("rows", [2, 16])
def test_real_shapes_on_gpu(fmt, shape, rows):
    """Autotuned split and tile at the Qwen3.6 projection shapes, fp32 (exact products) and bf16; then every
    split at the out projection's shape, so a split the compiler or the fix-up gets wrong is named."""
    x, q = _case(fmt, rows, *shape, seed=6)
    assert _err(dense_gemm_splitk(x, q), _exact(x, q)) < 1e-5
    xb = x.bfloat16()
    assert _err(dense_gemm_splitk(xb, q), _exact(xb, q)) < 8e-3
    bad = {}
    for block_n, w_lhs in ((32, False), (64, True), (128, True)):
        for split in sk.SPLITS:
            for _ in range(3):  # the fix-up is a race between programs: run it more than once
                err = _err(dense_gemm_splitk(xb, q, block_n=block_n, split_k=split, w_lhs=w_lhs), _exact(xb, q))
                if not err < 8e-3:
                    bad[(block_n, w_lhs, split)] = err
    assert not bad, f"splits off the reference: {bad}"


_SM90_CHECK = r"""
from adapters.kernels import dense_gemm_splitk as sk
from adapters.kernels.packed_gemv import FORMAT_CODES, SCALE_GROUP
from domain.model_spec import WeightFormat
from tests.adapters.sm90_usage import resource_usage

W = {WeightFormat.FP8_BLOCK: "fp8e4nv", WeightFormat.NVFP4: "u8", WeightFormat.MXFP4: "u8"}
S = {WeightFormat.FP8_BLOCK: "fp32", WeightFormat.NVFP4: "fp8e4nv", WeightFormat.MXFP4: "u8"}
for fmt in W:
    for act, prec in (("bf16", "tf32"), ("fp32", "ieee")):
        for n, k in ((12288, 2048), (2048, 4096)):  # the Qwen3.6 qkvz and out projections
            consts = dict(N=n, K=k, FMT=FORMAT_CODES[fmt], GROUP=SCALE_GROUP[fmt], F32_DOT=act == "fp32",
                          PRECISION=prec, BLOCK_M=sk.BLOCK_M, BLOCK_K=sk.BLOCK_K)
            for cfg in sk._prune(sk.tune_configs(w_lhs=True), {}, **consts):
                block_n, w_lhs = cfg.kwargs["BLOCK_N"], cfg.kwargs["W_LHS"]
                use = resource_usage(sk._dense_gemm_splitk_kernel,
                                     {"x_ptr": "*" + act, "w_ptr": "*" + W[fmt], "s_ptr": "*" + S[fmt], "g_ptr": "*fp32",
                                      "y_ptr": "*" + act, "ws_ptr": "*fp32", "cnt_ptr": "*i32"},
                                     {**consts, "BLOCK_N": block_n, "W_LHS": w_lhs},
                                     {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
                print(fmt.value, act, n, k, block_n, cfg.kwargs["SPLIT_K"], cfg.num_warps, cfg.num_stages,
                      "w_lhs" if w_lhs else "w_rhs", use["REG"], use["STACK"], flush=True)
"""


@pytest.mark.slow
def test_every_admitted_config_builds_for_sm90_without_spills():
    """Every (tile, split, warps, stages) the pruner admits at the Qwen3.6 projection shapes, block FP8 and both
    4-bit formats, builds for an H200: with bf16 activations (every served decode step) with no spill stack;
    with fp32 ones ("ieee" dots: FMA loops at 255 registers; only fp32 parity runs take them) with at most 1 KB
    per thread, dense_gemm's bound for the same loops (test_kernels_moe_grouped.py). Measured when written:
    168-392 bytes."""
    lines = [line.split() for line in build_for_sm90(_SM90_CHECK, timeout=900).splitlines() if line.strip()]
    assert len(lines) >= 3 * 2 * 2 * 4  # every format, activation and shape admits several configs
    spills = [" ".join(line) for line in lines if int(line[-1]) > (0 if line[1] == "bf16" else 1024)]
    assert not spills, f"configs past their stack bound: {spills}"
