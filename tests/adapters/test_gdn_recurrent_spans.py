"""gdn_recurrent_spans (ADR 0025 step 2: the Gated DeltaNet recurrence over short spans, token by token, one launch)
against gdn_decode_step run token by token and against GatedDeltaNet.forward_sequence (the chunked reference).

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py) at tiny shapes. Error measure: relative
Frobenius norm (rel_err). Bounds: the same per-token operations as the decode kernel: 1e-6 (bitwise in the
interpreter, and a one-token span bitwise everywhere); against the chunked form 1e-5 (fp32 rounding only).
"""

import json

import pytest
import torch

from adapters.kernels.gdn_conv_decode import gdn_conv_decode
from adapters.kernels.gdn_conv_prefill import gdn_conv_prefill_spans
from adapters.kernels.gdn_decode import gdn_decode_step
from adapters.kernels.gdn_recurrent_spans import gdn_recurrent_spans
from adapters.torch_exec.gated_deltanet import GdnGeometry, LinearStatePool
from adapters.torch_exec.linear import linear
from tests.adapters.cuda_graphs import capture
from tests.adapters.sm90 import build_for_sm90
from tests.adapters.test_kernels_attention_gdn import DEVICE, make_gdn, make_pool, rel_err

GEOMETRIES = {
    # value head h reads key head h // 2; Dv 24 in blocks of 16: the second block part-masked
    "gqa": (GdnGeometry(2, 4, 16, 24, 4), 16),
    # Dk 20 (masked key lanes), Dv 40 in blocks of 32, W = 3
    "odd": (GdnGeometry(1, 2, 20, 40, 3), 32),
}
LENGTHS = [1, 2, 5, 17, 33]
SLOTS = [4, 0, 6, 2, 5]  # slots 1 and 3 belong to no span
NUM_SLOTS = 7


def _table(values, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _layout(lengths, gap=1):
    """First rows of consecutive spans of these lengths with `gap` rows before each, the total rows, and the
    mask of rows inside a span."""
    starts, row = [], 0
    for n in lengths:
        starts.append(row + gap)
        row += gap + n
    total = row + gap
    covered = torch.zeros(total, dtype=torch.bool, device=DEVICE)
    for s0, n in zip(starts, lengths, strict=True):
        covered[s0:s0 + n] = True
    return starts, total, covered


def _gates(geo, gen):
    nv = geo.num_v_heads
    neg_a = -(torch.rand(nv, generator=gen) * 2 - 1).exp().to(DEVICE)
    dt_bias = torch.randn(nv, generator=gen).to(DEVICE)
    return neg_a, dt_bias


def _random_rows(geo, total, covered, gen, ab_dtype=torch.float32):
    """mixed [T, C] fp32 and a, b [T, Nv] (strided views of one [T, 2*Nv] tensor, as a stacked projection leaves
    them), NaN in the rows outside every span: a stray read shows in the output."""
    nv = geo.num_v_heads
    mixed = torch.randn(total, geo.conv_channels, generator=gen).to(DEVICE)
    ba = torch.randn(total, 2 * nv, generator=gen).to(device=DEVICE, dtype=ab_dtype)
    mixed[~covered] = float("nan")
    ba[~covered] = float("nan")
    return mixed, ba[:, nv:], ba[:, :nv]


# ---------------------------------------------------------------- against the decode kernel, token by token


def decode_token_by_token(geo, qkv, a, b, weight, neg_a, dt_bias, conv, rec, starts, lengths, slots, block_v=32):
    """gdn_decode_step run token by token over spans (one decode step per token position, over the spans still
    running then), updating conv [S, C, W-1] and rec [S, Nv, Dk, Dv] in place: (core [T, Nv, Dv], NaN in rows of
    no span; mixed [T, C], the conv output of every span row as gdn_conv_decode gives it from a copy of conv's
    initial states, NaN elsewhere), the rows to hand the span kernel so that both see the same mixed bits."""
    total = qkv.shape[0]
    core = torch.full((total, geo.num_v_heads, geo.v_head_dim), float("nan"), device=DEVICE)
    mixed = torch.full((total, geo.conv_channels), float("nan"), device=DEVICE)
    conv_copy = conv.clone()
    for t in range(max(lengths)):
        live = [i for i, n in enumerate(lengths) if n > t]
        rows = _table([starts[i] + t for i in live])
        step_slots = _table([slots[i] for i in live], torch.int32)
        core[rows] = gdn_decode_step(qkv[rows], a[rows], b[rows], conv, rec, step_slots, weight, neg_a, dt_bias,
                                     geo, block_v=block_v)
        mixed[rows] = gdn_conv_decode(qkv[rows], conv_copy, step_slots, weight)
    return core, mixed


@pytest.mark.parametrize("name,ab_dtype", [("gqa", torch.float32), ("odd", torch.float32),
                                           ("gqa", torch.bfloat16)], ids=["gqa", "odd", "gqa-bf16-ab"])
def test_spans_are_the_decode_recurrence_token_by_token(name, ab_dtype):
    """Spans of 1, 2, 5, 17 and 33 tokens in shuffled slots from a non-zero state: every row's core and every slot's
    final state equal gdn_decode_step's, run token by token over the same inputs (the same mixed rows: its conv,
    gdn_conv_decode, is fed the same qkv and conv states and gives the rows handed to the span kernel). Bitwise in
    the interpreter (the same operations in the same order; the state only stays in registers between tokens),
    within 1e-6 compiled, the one-token span bitwise everywhere; rows in no span and slots no span names untouched."""
    geo, block_v = GEOMETRIES[name]
    gen = torch.Generator().manual_seed(11)
    starts, total, covered = _layout(LENGTHS)
    qkv = torch.randn(total, geo.conv_channels, generator=gen).to(DEVICE)
    _, a, b = _random_rows(geo, total, covered, gen, ab_dtype)
    neg_a, dt_bias = _gates(geo, gen)
    weight = torch.randn(geo.conv_channels, geo.conv_kernel, generator=gen).to(DEVICE)
    pool = make_pool(geo, NUM_SLOTS, torch.float32, gen)
    rec = pool.recurrent[0]
    before, ref_rec = rec.clone(), rec.clone()
    want, mixed = decode_token_by_token(geo, qkv, a, b, weight, neg_a, dt_bias, pool.conv[0], ref_rec, starts,
                                        LENGTHS, SLOTS, block_v)

    out = torch.full((total, geo.num_v_heads, geo.v_head_dim), float("nan"), device=DEVICE)
    got = gdn_recurrent_spans(mixed, a, b, rec, _table(starts), _table(LENGTHS), _table(SLOTS), neg_a, dt_bias, geo,
                              max_len=32 + 1, block_v=block_v, out=out)
    assert got is out
    assert torch.isfinite(got[covered]).all() and torch.isnan(got[~covered]).all()
    assert rel_err(got[covered], want[covered]) < 1e-6
    assert rel_err(rec, ref_rec) < 1e-6
    assert torch.equal(got[starts[0]], want[starts[0]])  # the one-token span: the decode kernel's bits
    assert torch.equal(rec[SLOTS[0]], ref_rec[SLOTS[0]])
    if not torch.cuda.is_available():
        assert torch.equal(got[covered], want[covered]) and torch.equal(rec, ref_rec)
    for idle in (1, 3):
        assert torch.equal(rec[idle], before[idle])
    assert not torch.equal(rec[SLOTS[4]], before[SLOTS[4]])  # (the comparisons above are not vacuous)


# ---------------------------------------------------------------- the mixer path against forward_sequence


def _twin_pools(geo, gen):
    ref = make_pool(geo, NUM_SLOTS, torch.float32, gen)
    ours = LinearStatePool(1, NUM_SLOTS, geo, torch.float32, DEVICE)
    ours.conv.copy_(ref.conv)
    ours.recurrent.copy_(ref.recurrent)
    return ref, ours


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_conv_and_recurrent_spans_match_forward_sequence(name):
    """What a step of spans as rows will run for one layer: projections over all rows, gdn_conv_prefill_spans, then
    gdn_recurrent_spans, the reference output norm, over two steps (the second continues the states the first left,
    with other lengths). Each span's output and its slot's conv and recurrent states within fp32 tolerance of
    forward_sequence on the span alone (the chunked form: rounding only); slots no span names untouched."""
    geo, block_v = GEOMETRIES[name]
    gdn, gen = make_gdn(geo, hidden=32, dtype=torch.float32, seed=13)
    ref_pool, pool = _twin_pools(geo, gen)
    w = gdn.w
    untouched = pool.conv[0, [1, 3]].clone(), pool.recurrent[0, [1, 3]].clone()
    for lengths in (LENGTHS, [3, 1, 2, 9, 4]):
        starts, total, covered = _layout(lengths)
        x = torch.randn(total, 32, generator=gen).to(DEVICE)
        x[~covered] = float("nan")  # rows of no span: garbage nothing may read
        qkv, z = linear(x, w["in_proj_qkv.weight"]), linear(x, w["in_proj_z.weight"])
        a, b = linear(x, w["in_proj_a.weight"]), linear(x, w["in_proj_b.weight"])
        tables = _table(starts), _table(lengths), _table(SLOTS)
        mixed = gdn_conv_prefill_spans(qkv, pool.conv[0], w["conv1d.weight"][:, 0, :], *tables, max(lengths))
        core = gdn_recurrent_spans(mixed, a, b, pool.recurrent[0], *tables, gdn.neg_a, gdn.dt_bias, geo,
                                   max_len=max(lengths), block_v=block_v)
        got = gdn._output(core, z.reshape(total, geo.num_v_heads, geo.v_head_dim), x.dtype)  # [T, H]
        for s0, n, slot in zip(starts, lengths, SLOTS, strict=True):
            want = gdn.forward_sequence(x[s0:s0 + n], ref_pool, 0, slot)
            assert rel_err(got[s0:s0 + n], want) < 1e-5, (lengths, n)
            # a copy of the inputs (the two sides' in_proj matmuls differ in M)
            assert rel_err(pool.conv[0, slot], ref_pool.conv[0, slot]) < 1e-6, (lengths, n)
            assert rel_err(pool.recurrent[0, slot], ref_pool.recurrent[0, slot]) < 1e-5, (lengths, n)
    assert torch.equal(pool.conv[0, [1, 3]], untouched[0]) and torch.equal(pool.recurrent[0, [1, 3]], untouched[1])


# ---------------------------------------------------------------- padding, independence, max_len


def test_padded_spans_touch_nothing_and_spans_do_not_interfere():
    """One launch over live spans beside a padded span (slot -1, 3 rows of NaN input: core zeros, no state read
    or written), an empty span naming a live span's slot (length 0: its row untouched, the slot as the live span
    leaves it) and a span longer than max_len (only its first max_len rows run): each live span's rows and slot
    bitwise what a launch of that span alone gives, and a span's state in one launch bitwise two launches over its
    halves."""
    geo, block_v = GEOMETRIES["gqa"]
    gen = torch.Generator().manual_seed(17)
    # span 2: empty, naming span 3's slot (as an unused entry of a fixed table may); span 4: 9 rows, max_len 6
    lengths, slots = [5, 3, 0, 4, 9], [2, -1, 0, 0, 5]
    max_len = 6
    starts, total, covered = _layout([5, 3, 1, 4, 9])  # the empty span still has a row (which it must not write)
    mixed, a, b = _random_rows(geo, total, covered, gen)
    mixed[starts[1]:starts[1] + 3] = float("nan")  # the padded span's inputs: garbage
    neg_a, dt_bias = _gates(geo, gen)
    rec = make_pool(geo, 6, torch.float32, gen).recurrent[0]
    before = rec.clone()
    nan = float("nan")
    out = torch.full((total, geo.num_v_heads, geo.v_head_dim), nan, device=DEVICE)
    gdn_recurrent_spans(mixed, a, b, rec, _table(starts, torch.int32), _table(lengths, torch.int32),
                        _table(slots, torch.int32), neg_a, dt_bias, geo, max_len=max_len, block_v=block_v, out=out)

    padded = out[starts[1]:starts[1] + 3]
    assert torch.equal(padded, torch.zeros_like(padded))
    assert torch.isnan(out[starts[2]]).all()  # the empty span's row
    assert torch.isnan(out[starts[4] + max_len:starts[4] + 9]).all()  # past max_len
    assert torch.equal(rec[3], before[3]) and torch.equal(rec[1], before[1]) and torch.equal(rec[4], before[4])
    for i in (0, 3, 4):  # each live span alone
        n, alone_rec = min(lengths[i], max_len), before.clone()
        alone = torch.full_like(out, nan)
        gdn_recurrent_spans(mixed, a, b, alone_rec, _table([starts[i]]), _table([n]), _table([slots[i]]), neg_a,
                            dt_bias, geo, max_len=32, block_v=block_v, out=alone)
        rows = slice(starts[i], starts[i] + n)
        assert torch.equal(out[rows], alone[rows]), i
        assert torch.isfinite(out[rows]).all(), i
        assert torch.equal(rec[slots[i]], alone_rec[slots[i]]), i
        assert not torch.equal(rec[slots[i]], before[slots[i]]), i
    halves = before.clone()
    for s0, n in ((starts[3], 2), (starts[3] + 2, 2)):  # span 3 (slot 0) as two consecutive launches
        part = gdn_recurrent_spans(mixed, a, b, halves, _table([s0]), _table([n]), _table([0]), neg_a, dt_bias, geo,
                                   max_len=2, block_v=block_v)
        assert torch.equal(part[s0:s0 + n], out[s0:s0 + n])
    assert torch.equal(halves[0], rec[0])


def test_rejects_bad_input():
    geo = GdnGeometry(2, 4, 8, 8, 4)
    c, nv = geo.conv_channels, geo.num_v_heads
    one = _table([0])
    good = dict(mixed=torch.zeros(4, c, device=DEVICE), a=torch.zeros(4, nv, device=DEVICE),
                b=torch.zeros(4, nv, device=DEVICE), recurrent=torch.zeros(3, nv, 8, 8, device=DEVICE),
                starts=one, lengths=_table([4]), slots=one, neg_a=torch.zeros(nv, device=DEVICE),
                dt_bias=torch.zeros(nv, device=DEVICE), geo=geo, max_len=4)
    bad = [
        dict(mixed=torch.zeros(4, c + 1, device=DEVICE)),
        dict(mixed=torch.zeros(4, c, dtype=torch.bfloat16, device=DEVICE)),
        dict(a=torch.zeros(4, nv + 1, device=DEVICE)),
        dict(b=torch.zeros(3, nv, device=DEVICE)),
        dict(a=torch.zeros(4, nv, dtype=torch.int32, device=DEVICE)),
        dict(recurrent=torch.zeros(3, nv, 8, 8, dtype=torch.bfloat16, device=DEVICE)),
        dict(recurrent=torch.zeros(3, nv, 8, 4, device=DEVICE)),
        dict(neg_a=torch.zeros(nv, dtype=torch.float64, device=DEVICE)),
        dict(dt_bias=torch.zeros(nv + 1, device=DEVICE)),
        dict(geo=GdnGeometry(3, 4, 8, 8, 4)),  # Nv not a multiple of Nk (and C differs)
        dict(starts=one.to(torch.int16)),
        dict(lengths=_table([4, 4])),
        dict(slots=_table([[0]])),
        dict(starts=_table([0, 9, 2, 9])[::2], lengths=_table([2, 2]), slots=_table([0, 1])),  # not contiguous
        dict(starts=_table([]), lengths=_table([]), slots=_table([])),
        dict(max_len=0),
        dict(block_v=3),
        dict(out=torch.zeros(4, nv, 8, dtype=torch.bfloat16, device=DEVICE)),
        dict(out=torch.zeros(4, nv, 4, device=DEVICE)),
    ]
    bad += [dict(slots=one.to("meta")), dict(neg_a=torch.zeros(nv, device="meta"))]  # another device
    for change in bad:
        with pytest.raises(ValueError):
            gdn_recurrent_spans(**{**good, **change})
    recurrent = good["recurrent"]
    gdn_recurrent_spans(**good)  # the good arguments pass
    assert torch.equal(recurrent, torch.zeros_like(recurrent))


# ---------------------------------------------------------------- CPU: compiled for sm_90 by ptxas

_SM90_COMPILE = r"""
import json

from adapters.kernels import gdn_recurrent_spans as spans
from tests.adapters.sm90_usage import resource_usage

out = {}
for table in ("i32", "i64"):
    out[table] = resource_usage(spans._gdn_recurrent_spans_kernel, dict(
        mixed_ptr="*fp32", a_ptr="*bf16", b_ptr="*bf16", state_ptr="*fp32", starts_ptr=f"*{table}",
        lens_ptr=f"*{table}", slots_ptr=f"*{table}", neg_a_ptr="*fp32", dt_bias_ptr="*fp32", core_ptr="*fp32",
        max_len="i32", q_scale="fp32"),
        dict(KEY_HEADS=16, VALUE_HEADS=32, DK=128, DV=128, BLOCK_K=128, BLOCK_V=32), {"num_warps": 4},
        lambda n: "i64" if n.startswith("stride") else "i32")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_register_spills():
    """The interpreter proves the math, not that the loop compiles: ptxas builds the kernel for sm_90 at Qwen3.6
    geometry (the launcher's block_v 32, 4 warps; int32 and int64 span tables) with no spill stack."""
    usage = json.loads(build_for_sm90(_SM90_COMPILE, timeout=300).strip().splitlines()[-1])
    assert set(usage) == {"i32", "i64"}
    for table, regs in usage.items():
        assert regs["STACK"] == 0, (table, regs)


# ---------------------------------------------------------------- GPU: real geometry, CUDA graphs


@pytest.mark.gpu
def test_gpu_spans_qwen36_geometry_and_graph_replay():
    """Qwen3.6's GDN geometry, spans of up to 32 tokens beside decode rows (spans of one) and a padded row (slot -1):
    within 1e-6 of gdn_decode_step token by token, the padded row zeros. Then captured once with max_len 32 and
    replayed with other lengths, slots and inputs written into the same buffers: the replay equals an eager call."""
    geo = GdnGeometry(16, 32, 128, 128, 4)
    gen = torch.Generator().manual_seed(19)
    lengths, slots = [1, 32, 1, 7, 1], [5, 0, -1, 2, 3]
    starts, total, covered = _layout(lengths, gap=0)
    qkv = torch.randn(total, geo.conv_channels, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    _, a, b = _random_rows(geo, total, covered, gen, torch.bfloat16)
    neg_a, dt_bias = _gates(geo, gen)
    weight = (torch.randn(geo.conv_channels, geo.conv_kernel, generator=gen) * 0.5).to(DEVICE, torch.bfloat16)
    pool = make_pool(geo, 6, torch.bfloat16, gen)
    rec = pool.recurrent[0]
    ref_rec = rec.clone()
    want, mixed = decode_token_by_token(geo, qkv, a, b, weight, neg_a, dt_bias, pool.conv[0], ref_rec, starts,
                                        lengths, slots)
    tables = _table(starts), _table(lengths), _table(slots)
    out = torch.empty(total, geo.num_v_heads, geo.v_head_dim, device=DEVICE)
    gdn_recurrent_spans(mixed, a, b, rec, *tables, neg_a, dt_bias, geo, max_len=32, out=out)
    assert rel_err(out, want) < 1e-6 and rel_err(rec, ref_rec) < 1e-6
    assert torch.equal(out[starts[2]], torch.zeros_like(out[starts[2]]))

    def step():
        gdn_recurrent_spans(mixed, a, b, rec, *tables, neg_a, dt_bias, geo, max_len=32, out=out)

    graph = capture(step)
    new_lengths = [4, 20, 1, 1, 16]
    new_starts, _, _ = _layout(new_lengths, gap=0)
    for table, values in zip(tables, (new_starts, new_lengths, [1, -1, 4, 0, 2]), strict=True):
        table.copy_(_table(values))
    mixed.normal_()
    rec0 = rec.clone()
    graph.replay()
    torch.cuda.synchronize()
    replay_out, replay_rec = out.clone(), rec.clone()
    rec.copy_(rec0)
    step()
    assert torch.equal(replay_out, out) and torch.equal(replay_rec, rec)
