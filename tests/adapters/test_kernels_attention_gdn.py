"""Triton decode kernels (paged attention, Gated DeltaNet step) against the torch reference path.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any
kernel module is imported) at tiny shapes; with CUDA the same tests run compiled, plus the `gpu` tests at
Qwen3.6 geometry and under CUDA-graph capture. Error measure: relative Frobenius norm |got - ref| / |ref|
per row (or state). Bounds: fp32 1e-5 (observed ~1e-7: only summation order differs); bf16 see each test.
"""

import math

import pytest
import torch

from adapters.kernels.gdn_conv_decode import gdn_conv_decode
from adapters.kernels.gdn_decode import gdn_decode_step
from adapters.kernels.paged_decode_attention import paged_decode_attention
from adapters.torch_exec.gated_deltanet import (
    GatedDeltaNet,
    GdnGeometry,
    LinearStatePool,
    recurrent_delta_rule,
)
from adapters.torch_exec.linear import linear
from adapters.torch_exec.paged_attention import PagedKVCache, causal_attention
from tests.adapters.cuda_graphs import capture

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- paged decode attention


def make_paged_case(lens, heads, kv_heads, head_dim, page_size, width, dtype, seed=0, device=DEVICE):
    """Random K/V in a PagedKVCache; each row gets pages from a shuffled order (non-contiguous). Slots
    that belong to no context (unused pages, the tail of a last page) hold NaN, and table entries past a
    row's pages point at a NaN page: any stray read shows up in the output."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(need) + 2
    kv = PagedKVCache(1, num_pages, page_size, kv_heads, head_dim, dtype, device)
    kv.k[0] = torch.randn(kv.k.shape[1:], generator=gen).to(dtype)
    kv.v[0] = torch.randn(kv.v.shape[1:], generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    order = torch.randperm(num_pages - 1, generator=gen)  # page num_pages - 1: the NaN page
    nan_page = num_pages - 1
    table = torch.full((len(lens), width), nan_page, dtype=torch.int32)
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    taken = 0
    for row, (n, pages) in enumerate(zip(lens, need, strict=True)):
        ids = order[taken:taken + pages]
        taken += pages
        table[row, :pages] = ids.int()
        pos = torch.arange(n)
        used[ids[pos // page_size], pos % page_size] = True
    kv.k[0][~used.to(device)] = float("nan")
    kv.v[0][~used.to(device)] = float("nan")
    return q, kv, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def reference_attention(q, kv, table, lens, scale, dtype=None):
    """Per row: the reference causal_attention of the last token over its gathered context (zeros for
    length 0). dtype: compute dtype (default q's)."""
    dtype = dtype or q.dtype
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for row, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        pages = table[row, :math.ceil(n / kv.page_size)].long()
        k_ctx, v_ctx = kv.read(0, kv.flat_slots(pages, torch.arange(n, device=q.device)))  # [C, M, D]
        out[row] = causal_attention(q[row:row + 1].to(dtype), k_ctx.to(dtype), v_ctx.to(dtype), n - 1, scale)[0]
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [(4, 2, 16, 4), (6, 2, 72, 3)])
def test_paged_attention_matches_reference(heads, kv_heads, head_dim, page_size):
    lens = [37, 0, 5, 16, 1]  # several pages, a padded row, a one-page and a one-token context
    q, kv, table, seq_lens = make_paged_case(lens, heads, kv_heads, head_dim, page_size, width=14,
                                             dtype=torch.float32)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))  # every element must be written
    got = paged_decode_attention(q, kv.k[0], kv.v[0], table, seq_lens, scale, num_splits=3, block_n=16, out=out)
    assert got is out
    ref = reference_attention(q, kv, table, seq_lens, scale)
    assert torch.isfinite(got).all()
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # padded row
    for row, n in enumerate(lens):
        if n:
            assert rel_err(got[row], ref[row]) < 1e-5, (row, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_applies_the_output_gate_in_its_combine(dtype):
    """gate= (the decode step's Qwen3.5 output gate, a strided half of the q projection): bitwise the ungated
    output times sigmoid(gate) as the reference's torch ops compute it in the model dtype (fp32: up to the
    sigmoid's last bit); a padded row stays zeros."""
    lens = [21, 0, 6]
    q, kv, table, seq_lens = make_paged_case(lens, 4, 2, 16, 4, width=8, dtype=dtype, seed=3)
    qg = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(4)).to(dtype=dtype, device=q.device)
    gate = qg[:, :, 16:]  # [B, N, D] view with stride 32 between heads, as torch.chunk leaves it
    plain = paged_decode_attention(q, kv.k[0], kv.v[0], table, seq_lens, 0.25, num_splits=2, block_n=16)
    gated = paged_decode_attention(q, kv.k[0], kv.v[0], table, seq_lens, 0.25, num_splits=2, block_n=16, gate=gate)
    want = plain * torch.sigmoid(gate)
    if dtype == torch.float32:
        assert rel_err(gated, want) < 1e-6
    else:  # NOTE: the interpreter truncates fp32 -> bf16 where torch rounds (the sigmoid and the product):
        # within 2 bf16 ulps (2^-7 relative each)
        assert ((gated.float() - want.float()).abs() <= 2 * want.float().abs() * 2.0 ** -7).all()
        if torch.cuda.is_available():
            assert torch.equal(gated, want)
    assert torch.equal(gated[1], torch.zeros_like(gated[1]))
    with pytest.raises(ValueError, match="gate"):
        paged_decode_attention(q, kv.k[0], kv.v[0], table, seq_lens, 0.25, gate=gate[:, :2])


def test_paged_attention_split_count_does_not_change_the_result():
    lens = [45, 9]
    q, kv, table, seq_lens = make_paged_case(lens, 4, 1, 16, 4, width=12, dtype=torch.float32, seed=1)
    outs = [paged_decode_attention(q, kv.k[0], kv.v[0], table, seq_lens, 0.3, num_splits=s, block_n=16)
            for s in (1, 2, 8)]  # 8 splits > 3 blocks of 16: empty splits must drop out of the combine
    ref = reference_attention(q, kv, table, seq_lens, 0.3)
    for out in outs:
        assert rel_err(out, ref) < 1e-5


def test_paged_attention_clamps_a_length_past_the_table():
    """A length beyond what the table row addresses (W*G) reads only those W*G slots: no out-of-bounds
    page-table read, same output as the full-table length."""
    q, kv, table, seq_lens = make_paged_case([12], 2, 1, 16, 4, width=3, dtype=torch.float32, seed=2)
    base = paged_decode_attention(q, kv.k[0], kv.v[0], table, seq_lens, 0.25, num_splits=2, block_n=16)
    stale = torch.tensor([999], dtype=torch.int32, device=DEVICE)
    clamped = paged_decode_attention(q, kv.k[0], kv.v[0], table, stale, 0.25, num_splits=2, block_n=16)
    assert rel_err(base, reference_attention(q, kv, table, seq_lens, 0.25)) < 1e-5
    assert torch.equal(clamped, base)


def test_paged_attention_rejects_bad_input():
    q, kv, table, lens = make_paged_case([5], 4, 2, 16, 4, width=2, dtype=torch.float32)
    k, v = kv.k[0], kv.v[0]
    bad = [
        dict(q=q[0]),  # [N, D]
        dict(k_pool=k[..., :8]),  # head dim differs
        dict(q=torch.zeros(1, 3, 16)),  # 3 query heads over 2 kv heads
        dict(q=q.to(torch.float64)),
        dict(k_pool=k.to(torch.bfloat16), v_pool=v.to(torch.bfloat16)),  # pool dtype differs from q
        dict(page_table=table.long()),
        dict(seq_lens=lens.long()),
        dict(seq_lens=torch.tensor([5, 5], dtype=torch.int32, device=DEVICE)),
        dict(num_splits=0),
        dict(block_n=8),
        dict(out=torch.empty(1, 4, 8)),
    ]
    for change in bad:
        args = dict(q=q, k_pool=k, v_pool=v, page_table=table, seq_lens=lens, scale=0.25)
        args.update(change)
        with pytest.raises(ValueError):
            paged_decode_attention(**args)


# ---------------------------------------------------------------- Gated DeltaNet decode step


def make_gdn(geo: GdnGeometry, hidden: int, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype=dtype, device=DEVICE)

    value_dim = geo.num_v_heads * geo.v_head_dim
    weights = {
        "in_proj_qkv.weight": rand(geo.conv_channels, hidden, std=hidden ** -0.5),
        "in_proj_z.weight": rand(value_dim, hidden, std=hidden ** -0.5),
        "in_proj_b.weight": rand(geo.num_v_heads, hidden, std=hidden ** -0.5),
        "in_proj_a.weight": rand(geo.num_v_heads, hidden, std=hidden ** -0.5),
        "conv1d.weight": rand(geo.conv_channels, 1, geo.conv_kernel, std=0.5),
        "A_log": (torch.rand(geo.num_v_heads, generator=gen) * 2 - 1).to(DEVICE),
        "dt_bias": torch.randn(geo.num_v_heads, generator=gen).to(DEVICE),
        "norm.weight": rand(geo.v_head_dim, std=0.1) + 1,
        "out_proj.weight": rand(hidden, value_dim, std=value_dim ** -0.5),
    }
    return GatedDeltaNet(weights, geo, 1e-6), gen


def make_pool(geo, num_slots, dtype, gen):
    pool = LinearStatePool(1, num_slots, geo, dtype, DEVICE)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen).to(dtype))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=gen) * 0.3)
    return pool


def kernel_step(gdn: GatedDeltaNet, x, pool, slots, **kw):
    """What the fast path will do for one layer: projections, the two kernels, the reference output norm."""
    w = gdn.w
    out = torch.full((x.shape[0], gdn.geo.num_v_heads, gdn.geo.v_head_dim), float("nan"), device=DEVICE)
    core = gdn_decode_step(linear(x, w["in_proj_qkv.weight"]), linear(x, w["in_proj_a.weight"]),
                           linear(x, w["in_proj_b.weight"]), pool.conv[0], pool.recurrent[0], slots,
                           w["conv1d.weight"][:, 0, :], gdn.neg_a, gdn.dt_bias, gdn.geo, out=out, **kw)
    assert core is out
    return core


def reference_core(gdn: GatedDeltaNet, x, conv_state, recurrent):
    """forward_decode's math up to the core, the conv in fp32 (as the kernel) over live rows only:
    (core [B, Nv, Dv] fp32, new conv state [B, C, W-1], new recurrent state)."""
    w = gdn.w
    qkv = linear(x, w["in_proj_qkv.weight"])
    beta = linear(x, w["in_proj_b.weight"]).float().sigmoid()
    g = gdn.neg_a * torch.nn.functional.softplus(linear(x, w["in_proj_a.weight"]).float() + gdn.dt_bias)
    seq = torch.cat((conv_state, qkv[:, :, None]), dim=-1)  # [B, C, W]
    mixed = torch.nn.functional.silu((seq.float() * w["conv1d.weight"][:, 0, :].float()).sum(-1))
    q, k, v = gdn._split_heads(mixed)
    core, state = recurrent_delta_rule(q, k, v, g, beta, recurrent)
    return core, seq[:, :, 1:], state


GEOMETRIES = {
    "gqa": (GdnGeometry(2, 4, 16, 16, 4), 4),  # value head h reads key head h // 2; 2 value blocks of 8
    "odd": (GdnGeometry(2, 2, 12, 10, 3), 4),  # non-power-of-two head dims, W = 3: masked lanes
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_gdn_step_matches_forward_decode_fp32(name):
    geo, block_v = GEOMETRIES[name]
    gdn, gen = make_gdn(geo, hidden=32, dtype=torch.float32)
    ref_pool = make_pool(geo, 5, torch.float32, gen)
    pool = LinearStatePool(1, 5, geo, torch.float32, DEVICE)
    pool.conv.copy_(ref_pool.conv)
    pool.recurrent.copy_(ref_pool.recurrent)
    slots = torch.tensor([3, -1, 0, 1], dtype=torch.int32, device=DEVICE)  # row 1 padded; slots 2, 4 idle
    live = slots >= 0
    for step in range(2):  # the second step reads the state the first one wrote
        x = torch.randn(4, 32, generator=gen).to(DEVICE)
        x[1] = float("nan")  # a padded row's activations are garbage; nothing may read them
        core = kernel_step(gdn, x, pool, slots, block_v=block_v)
        ref = gdn.forward_decode(x[live], ref_pool, 0, slots[live].long())
        got = gdn._output(core, linear(x, gdn.w["in_proj_z.weight"]).reshape(4, geo.num_v_heads, -1), x.dtype)
        assert torch.equal(core[1], torch.zeros_like(core[1])), step
        assert torch.isfinite(core[live]).all()
        for i, row in enumerate(live.nonzero()[:, 0].tolist()):
            assert rel_err(got[row], ref[i]) < 1e-5, (step, row)
        # a copy of the inputs (bitwise in the bf16 test; here the two sides' in_proj matmuls differ in M)
        assert rel_err(pool.conv, ref_pool.conv) < 1e-6, step
        for s in range(5):
            assert rel_err(pool.recurrent[0, s], ref_pool.recurrent[0, s]) < 1e-5, (step, s)
        for idle in (2, 4):
            assert torch.equal(pool.recurrent[0, idle], ref_pool.recurrent[0, idle])


def test_gdn_step_bf16_model_dtype():
    """bf16 activations/conv state: the conv state is still a bitwise copy; the core equals the same math
    with the conv in fp32 to 1e-5, and differs from the bf16 reference (window, products, SiLU rounded
    to bf16 before the split) by 2-3e-3 relative over 5 seeds (bound 1e-2)."""
    geo, block_v = GEOMETRIES["gqa"]
    gdn, gen = make_gdn(geo, hidden=32, dtype=torch.bfloat16, seed=3)
    pool = make_pool(geo, 3, torch.bfloat16, gen)
    conv0, rec0 = pool.conv[0].clone(), pool.recurrent[0].clone()
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    x = torch.randn(2, 32, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
    core = kernel_step(gdn, x, pool, slots, block_v=block_v)
    want, new_conv, new_rec = reference_core(gdn, x, conv0[slots.long()], rec0[slots.long()])
    assert torch.equal(pool.conv[0, slots.long()], new_conv)
    assert torch.equal(pool.conv[0, 1], conv0[1])
    assert rel_err(core, want) < 1e-5
    assert rel_err(pool.recurrent[0, slots.long()], new_rec) < 1e-5
    ref_pool = LinearStatePool(1, 3, geo, torch.bfloat16, DEVICE)
    ref_pool.conv[0], ref_pool.recurrent[0] = conv0, rec0
    captured = {}
    gdn._output = lambda c, z, dtype: captured.setdefault("core", c)  # the reference core, before the norm
    gdn.forward_decode(x, ref_pool, 0, slots.long())
    assert rel_err(core, captured["core"]) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_step_projects_a_and_b_itself(dtype):
    """project_ab (the decode step's path for float a/b weights): the recurrence computes a and b from x and
    the two [Nv, H] weights; the same core and states as with the GEMV outputs handed in (fp32: dot order
    only; bf16: both round a and b to bf16, the interpreter by truncation), padded rows untouched."""
    geo, block_v = GEOMETRIES["gqa"]
    gdn, gen = make_gdn(geo, hidden=40, dtype=dtype, seed=5)
    w = gdn.w
    pools = [make_pool(geo, 4, dtype, torch.Generator().manual_seed(9)) for _ in range(2)]
    slots = torch.tensor([3, -1, 1], dtype=torch.int32, device=DEVICE)
    for _step in range(2):
        x = torch.randn(3, 40, generator=gen).to(dtype=dtype, device=DEVICE)
        x[1] = float("nan")  # a padded row
        want = kernel_step(gdn, x, pools[0], slots, block_v=block_v)
        got = gdn_decode_step(linear(x, w["in_proj_qkv.weight"]), None, None, pools[1].conv[0], pools[1].recurrent[0],
                              slots, w["conv1d.weight"][:, 0, :], gdn.neg_a, gdn.dt_bias, geo, block_v=block_v,
                              project_ab=(x, w["in_proj_a.weight"], w["in_proj_b.weight"]))
        bound = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        assert rel_err(got, want) < bound
        assert torch.equal(pools[1].conv, pools[0].conv)
        assert rel_err(pools[1].recurrent, pools[0].recurrent) < bound
        assert torch.equal(pools[1].recurrent[0, 0], pools[0].recurrent[0, 0])  # no row's slot: untouched
    with pytest.raises(ValueError, match="not both"):
        gdn_decode_step(linear(x, w["in_proj_qkv.weight"]), want, None, pools[1].conv[0], pools[1].recurrent[0],
                        slots, w["conv1d.weight"][:, 0, :], gdn.neg_a, gdn.dt_bias, geo,
                        project_ab=(x, w["in_proj_a.weight"], w["in_proj_b.weight"]))
    with pytest.raises(ValueError, match="in_proj_a"):
        gdn_decode_step(linear(x, w["in_proj_qkv.weight"]), None, None, pools[1].conv[0], pools[1].recurrent[0],
                        slots, w["conv1d.weight"][:, 0, :], gdn.neg_a, gdn.dt_bias, geo,
                        project_ab=(x, w["in_proj_a.weight"][:, :8], w["in_proj_b.weight"]))


def test_gdn_conv_decode_writes_each_channel_once_and_skips_padded_rows():
    geo = GdnGeometry(1, 1, 8, 8, 4)  # C = 24, block_c 16: two channel blocks, the second part-masked
    gen = torch.Generator().manual_seed(4)
    state = torch.randn(3, geo.conv_channels, 3, generator=gen).to(DEVICE)
    before = state.clone()
    x = torch.randn(2, geo.conv_channels, generator=gen).to(DEVICE)
    weight = torch.randn(geo.conv_channels, 4, generator=gen).to(DEVICE)
    out = torch.full((2, geo.conv_channels), float("nan"), device=DEVICE)
    mixed = gdn_conv_decode(x, state, torch.tensor([-1, 1], dtype=torch.int32, device=DEVICE), weight,
                            block_c=16, out=out)
    window = torch.cat((before[1], x[1, :, None]), dim=-1)  # [C, W]
    assert torch.equal(mixed[0], torch.zeros_like(mixed[0]))
    assert rel_err(mixed[1], torch.nn.functional.silu((window * weight).sum(-1))) < 1e-6
    assert torch.equal(state[1], window[:, 1:])
    assert torch.equal(state[0], before[0]) and torch.equal(state[2], before[2])


def test_gdn_step_rejects_bad_input():
    geo = GdnGeometry(2, 4, 8, 8, 4)
    c, nv = geo.conv_channels, geo.num_v_heads
    good = dict(qkv=torch.zeros(2, c), a=torch.zeros(2, nv), b=torch.zeros(2, nv),
                conv_state=torch.zeros(3, c, 3), recurrent=torch.zeros(3, nv, 8, 8),
                slots=torch.zeros(2, dtype=torch.int32), conv_weight=torch.zeros(c, 4),
                neg_a=torch.zeros(nv), dt_bias=torch.zeros(nv), geo=geo)
    bad = [
        dict(qkv=torch.zeros(2, c + 1)),
        dict(a=torch.zeros(2, nv + 1)),
        dict(conv_state=torch.zeros(3, c, 4)),
        dict(conv_state=torch.zeros(4, c, 3)),  # S differs from recurrent's
        dict(recurrent=torch.zeros(3, nv, 8, 8, dtype=torch.bfloat16)),
        dict(recurrent=torch.zeros(3, nv, 8, 4)),
        dict(slots=torch.zeros(2, dtype=torch.int64)),
        dict(slots=torch.zeros(3, dtype=torch.int32)),
        dict(conv_weight=torch.zeros(c, 3)),
        dict(neg_a=torch.zeros(nv, dtype=torch.float64)),
        dict(dt_bias=torch.zeros(nv + 1)),
        dict(geo=GdnGeometry(3, 4, 8, 8, 4)),
        dict(block_v=3),
        dict(out=torch.zeros(2, nv, 8, dtype=torch.bfloat16)),
    ]
    for change in bad:
        args = dict(good)
        args.update(change)
        with pytest.raises(ValueError):
            gdn_decode_step(**args)


# ---------------------------------------------------------------- GPU: real geometry, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_gpu_paged_attention_qwen36_geometry(dtype, bound):
    """N=16, M=2, D=256, G=16, contexts 1..70k and a padded row, default split count. bf16 is compared with
    the fp32 reference on the same bf16 inputs (P is rounded to bf16 before P@V: bound 2e-2)."""
    lens = [1, 17, 4099, 70_000, 0, 263]
    q, kv, table, seq_lens = make_paged_case(lens, 16, 2, 256, 16, width=70_000 // 16 + 8, dtype=dtype)
    got = paged_decode_attention(q, kv.k[0], kv.v[0], table, seq_lens, 256 ** -0.5)
    ref = reference_attention(q, kv, table, seq_lens, 256 ** -0.5, dtype=torch.float32)
    assert torch.equal(got[4], torch.zeros_like(got[4]))
    for row, n in enumerate(lens):
        if n:
            assert rel_err(got[row].float(), ref[row]) < bound, (row, n)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gdn_step_qwen36_geometry(batch, dtype):
    geo = GdnGeometry(16, 32, 128, 128, 4)  # C = 8192
    gdn, gen = make_gdn(geo, hidden=256, dtype=dtype, seed=5)
    pool = make_pool(geo, 6, dtype, gen)
    conv0, rec0 = pool.conv[0].clone(), pool.recurrent[0].clone()
    slots = torch.tensor([5, -1, 0, 2][:batch], dtype=torch.int32, device=DEVICE)
    live = slots >= 0
    x = torch.randn(batch, 256, generator=gen).to(dtype=dtype, device=DEVICE)
    core = kernel_step(gdn, x, pool, slots)
    idx = slots[live].long()
    want, new_conv, new_rec = reference_core(gdn, x[live], conv0[idx], rec0[idx])
    assert rel_err(core[live], want) < 1e-5
    assert rel_err(pool.recurrent[0, idx], new_rec) < 1e-5
    assert torch.equal(pool.conv[0, idx], new_conv)
    if batch > 1:
        assert torch.equal(core[1], torch.zeros_like(core[1]))
    for idle in (1, 3, 4):
        assert torch.equal(pool.recurrent[0, idle], rec0[idle]) and torch.equal(pool.conv[0, idle], conv0[idle])


@pytest.mark.gpu
def test_gpu_kernels_replay_inside_a_cuda_graph():
    """Both launchers captured once, replayed with new lengths/slots/inputs written into the same buffers:
    the replay equals an eager call on the new inputs."""
    lens = [40, 300, 0]
    q, kv, table, seq_lens = make_paged_case(lens, 16, 2, 256, 16, width=32, dtype=torch.bfloat16, seed=6)
    geo = GdnGeometry(16, 32, 128, 128, 4)
    gdn, gen = make_gdn(geo, hidden=256, dtype=torch.bfloat16, seed=7)
    pool = make_pool(geo, 4, torch.bfloat16, gen)
    w = gdn.w
    x = torch.randn(3, 256, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
    qkv, a, b = (linear(x, w[n]) for n in ("in_proj_qkv.weight", "in_proj_a.weight", "in_proj_b.weight"))
    slots = torch.tensor([0, 3, -1], dtype=torch.int32, device=DEVICE)
    attn_out = torch.empty_like(q)
    core = torch.empty(3, 32, 128, device=DEVICE)

    def step():
        paged_decode_attention(q, kv.k[0], kv.v[0], table, seq_lens, 256 ** -0.5, out=attn_out)
        gdn_decode_step(qkv, a, b, pool.conv[0], pool.recurrent[0], slots, w["conv1d.weight"][:, 0, :],
                        gdn.neg_a, gdn.dt_bias, geo, out=core)

    graph = capture(step)
    seq_lens.copy_(torch.tensor([41, 17, 0], dtype=torch.int32))
    slots.copy_(torch.tensor([2, -1, 1], dtype=torch.int32))
    qkv.normal_()
    conv0, rec0 = pool.conv[0].clone(), pool.recurrent[0].clone()
    graph.replay()
    torch.cuda.synchronize()
    replay_attn, replay_core = attn_out.clone(), core.clone()
    replay_conv, replay_rec = pool.conv[0].clone(), pool.recurrent[0].clone()
    pool.conv[0], pool.recurrent[0] = conv0, rec0
    step()
    assert torch.equal(replay_attn, attn_out) and torch.equal(replay_core, core)
    assert torch.equal(replay_conv, pool.conv[0]) and torch.equal(replay_rec, pool.recurrent[0])


# ---------------------------------------------------------------- CPU: compiled for sm_90 by ptxas

_SM90_COMPILE = r"""
import json

import torch

from adapters.kernels import gdn_conv_decode as conv, gdn_decode as gdn
from adapters.kernels import paged_decode_attention as attn, paged_decode_combine as comb
from tests.adapters.sm90_usage import resource_usage


def usage(fn, pointers, constexprs, num_warps):
    return resource_usage(fn, pointers, constexprs, {"num_warps": num_warps},
                          lambda n: "i64" if n.startswith("stride") else "fp32")


out = {}
for dt, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    block_n, warps = attn.launch_config(tdt, 256)
    out[f"split_{dt}"] = usage(attn._paged_decode_split_kernel, dict(
        q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", table_ptr="*i32", lens_ptr="*i32",
        part_o_ptr="*fp32", part_lse_ptr="*fp32"), dict(
        GROUP=8, HEAD_DIM=256, PAGE_SIZE=16, MAX_PAGES=16384, NUM_SPLITS=64, BLOCK_H=16, BLOCK_D=256,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if dt == "fp32" else "tf32"), warps)
for gated in (False, True):
    out["combine" + ("_gated" if gated else "")] = usage(comb._paged_decode_combine_kernel, dict(
        part_o_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", gate_ptr="*bf16"),
        dict(NUM_SPLITS=64, HEAD_DIM=256, BLOCK_S=64, BLOCK_D=64, HAS_GATE=gated), 4)
out["gdn_conv"] = usage(conv._gdn_conv_decode_kernel, dict(
    x_ptr="*bf16", state_ptr="*bf16", slots_ptr="*i32", w_ptr="*bf16", mixed_ptr="*fp32"),
    dict(CHANNELS=8192, KERNEL=4, BLOCK_C=256, BLOCK_W=4), 4)
for project in (False, True):  # a/b handed in, or projected from x by the kernel (project_ab)
    out["gdn_recurrent" + ("_project_ab" if project else "")] = usage(gdn._gdn_recurrent_decode_kernel, dict(
        mixed_ptr="*fp32", a_ptr="*bf16", b_ptr="*bf16", state_ptr="*fp32", slots_ptr="*i32", neg_a_ptr="*fp32",
        dt_bias_ptr="*fp32", core_ptr="*fp32", x_ptr="*bf16", H="i32"),
        dict(KEY_HEADS=16, VALUE_HEADS=32, DK=128, DV=128, BLOCK_K=128, BLOCK_V=32, PROJECT_AB=project,
             ROUND_AB=project, BLOCK_H=1024), 4)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_register_spills():
    """Without a GPU the interpreter proves the math, not that the kernels compile: ptxas (shipped with
    triton) builds each one for sm_90 at Qwen3.6 geometry, in a fresh process (no TRITON_INTERPRET), and
    reports no spill stack. The launch parameters mirror the launchers' (launch_config, block_c, block_v)."""
    import json

    from tests.adapters.sm90 import build_for_sm90

    usage = json.loads(build_for_sm90(_SM90_COMPILE, timeout=300).strip().splitlines()[-1])
    assert set(usage) == {"split_bf16", "split_fp32", "combine", "combine_gated", "gdn_conv", "gdn_recurrent",
                          "gdn_recurrent_project_ab"}
    for name, regs in usage.items():
        assert regs["STACK"] == 0, (name, regs)
