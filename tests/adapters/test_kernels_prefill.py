"""Prefill kernels (Gated DeltaNet chunked prefill, attention prefill over the paged cache) against the torch
reference path, kernel by kernel, layer by layer (adapters/cuda_exec/prefill.py) and end to end through the
fast executor with its prefill routed through those entry points.

Without CUDA the kernels run in Triton's interpreter at tiny shapes. Error measure: relative Frobenius norm
|got - ref| / |ref| (rel_err). Bounds: fp32 1e-5 (only summation order differs); bf16 see each test.
"""

from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from adapters.cuda_exec import prefill
from adapters.kernels.gdn_chunk_out import gdn_chunk_out
from adapters.kernels.gdn_chunk_scan import gdn_chunk_scan
from adapters.kernels.gdn_chunk_state import SpanWalk, gdn_chunk_state
from adapters.kernels.gdn_chunk_wy import gdn_chunk_wy
from adapters.kernels.gdn_conv_prefill import gdn_conv_prefill, gdn_conv_prefill_spans
from adapters.kernels.gdn_decode import gdn_decode_step
from adapters.torch_exec.full_attention import AttentionGeometry, FullAttention
from adapters.torch_exec.gated_deltanet import (
    GatedDeltaNet,
    GdnGeometry,
    LinearStatePool,
    _l2norm,
    causal_conv,
    chunked_delta_rule,
)
from adapters.torch_exec.linear import linear
from adapters.torch_exec.paged_attention import PagedKVCache
from adapters.torch_exec.rotary import Rotary
from adapters.torch_exec.step_inputs import flatten
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams
from tests.adapters.test_kernels_attention_gdn import DEVICE, make_gdn, make_pool, rel_err

torch.set_num_threads(1)

GEOMETRIES = {
    "gqa": GdnGeometry(2, 4, 8, 8, 4),  # test_parity_layers' geometry: value head h reads key head h // 2
    "odd": GdnGeometry(2, 2, 12, 10, 3),  # non-power-of-two head dims, W = 3: masked lanes
}
# Dk = 80 > 64: the scan's state tile in two halves, the second part-masked (the kernels only)
WIDE = GdnGeometry(1, 2, 80, 24, 4)

# ---------------------------------------------------------------- conv


@pytest.mark.parametrize("tokens,kernel", [(1, 4), (2, 4), (3, 4), (37, 4), (70, 3), (5, 2)])
def test_conv_prefill_matches_causal_conv_and_hands_over_the_state(tokens, kernel):
    """T < W-1 keeps old state columns in the new state; T > block_t spans several programs (the last
    one writes the state while the first still reads the old one)."""
    gen = torch.Generator().manual_seed(tokens * 10 + kernel)
    channels = 40  # block_c 16: three channel blocks, the last part-masked
    x = torch.randn(tokens, channels, generator=gen).to(DEVICE)
    pool = torch.randn(3, channels, kernel - 1, generator=gen).to(DEVICE)  # [S, C, W-1]
    before = pool.clone()
    weight = torch.randn(channels, 1, kernel, generator=gen).to(DEVICE)
    want, want_state = causal_conv(x, before[1], weight)
    out = torch.full((tokens, channels), float("nan"), device=DEVICE)
    got = gdn_conv_prefill(x, pool[1], weight[:, 0, :], block_t=16, block_c=16, out=out)
    assert got is out
    assert rel_err(got, want) < 1e-6
    assert torch.equal(pool[1], want_state)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2])


def test_conv_prefill_bf16_state_is_a_bitwise_copy_of_the_inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 24, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    state = torch.randn(24, 3, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(24, 4, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    window = torch.cat((state.float(), x.float().t()), dim=1)  # [C, W-1+T]
    want = F.silu(F.conv1d(window[None], weight.float()[:, None, :], groups=24)[0]).t()  # fp32 math
    got = gdn_conv_prefill(x, state, weight)
    assert torch.equal(state, x[-3:].t())
    assert rel_err(got, want) < 1e-6


def test_conv_prefill_rejects_bad_input():
    good = dict(qkv=torch.zeros(4, 24), conv_state=torch.zeros(24, 3), conv_weight=torch.zeros(24, 4))
    bad = [dict(qkv=torch.zeros(4, 25)), dict(conv_state=torch.zeros(24, 4)), dict(conv_weight=torch.zeros(24, 1)),
           dict(conv_state=torch.zeros(2, 24, 3)), dict(block_t=24), dict(block_c=8),
           dict(out=torch.zeros(4, 24, dtype=torch.bfloat16))]
    for change in bad:
        with pytest.raises(ValueError):
            gdn_conv_prefill(**{**good, **change})


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def _with_gaps(lengths, gap):
    """First rows of spans of these lengths laid out with `gap` rows before each, and the total rows."""
    starts, row = [], 0
    for n in lengths:
        starts.append(row + gap)
        row += gap + n
    return starts, row + gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_prefill_spans_is_bitwise_one_launch_per_span(dtype):
    """gdn_conv_prefill_spans over 5 sequences' chunks (1, 2, 3 tokens: shorter than W-1 and not; 37 across three
    t-blocks of 16; 5) in rows with gaps, slots in shuffled order, from a strided view (a stacked projection's
    part): every span's output and new state bitwise what gdn_conv_prefill gives it alone; rows in no span and
    the slot no span names untouched."""
    gen = torch.Generator().manual_seed(7)
    channels, kernel, lengths, slots = 40, 4, [1, 2, 3, 37, 5], [4, 0, 5, 2, 1]
    starts, total = _with_gaps(lengths, 1)
    x = torch.randn(total, channels + 8, generator=gen).to(device=DEVICE, dtype=dtype)[:, :channels]
    pool = torch.randn(6, channels, kernel - 1, generator=gen).to(device=DEVICE, dtype=dtype)  # [S, C, W-1]
    weight = torch.randn(channels, kernel, generator=gen).to(device=DEVICE, dtype=dtype)
    want_pool, want = pool.clone(), torch.full((total, channels), float("nan"), device=DEVICE)
    covered = torch.zeros(total, dtype=torch.bool, device=DEVICE)
    for s0, n, slot in zip(starts, lengths, slots, strict=True):
        want[s0:s0 + n] = gdn_conv_prefill(x[s0:s0 + n], want_pool[slot], weight, block_t=16, block_c=16)
        covered[s0:s0 + n] = True
    out = torch.full((total, channels), float("nan"), device=DEVICE)
    got = gdn_conv_prefill_spans(x, pool, weight, _i64(starts), _i64(lengths), _i64(slots), max(lengths), block_t=16,
                                 block_c=16, out=out)
    assert got is out
    assert torch.equal(got[covered], want[covered]) and torch.isnan(got[~covered]).all()
    assert torch.equal(pool, want_pool)  # slot 3 as it was, the others as the one-span launches left them


def test_conv_prefill_spans_rejects_bad_input():
    one = _i64([0])
    good = dict(qkv=torch.zeros(4, 24, device=DEVICE), conv_pool=torch.zeros(2, 24, 3, device=DEVICE),
                conv_weight=torch.zeros(24, 4, device=DEVICE), starts=one, lengths=_i64([4]), slots=one, max_len=4)
    bad = [dict(conv_pool=torch.zeros(24, 3, device=DEVICE)), dict(conv_pool=torch.zeros(2, 24, 4, device=DEVICE)),
           dict(starts=one.to(torch.int32)), dict(lengths=_i64([4, 4])), dict(slots=_i64([[0]])), dict(max_len=0),
           dict(starts=_i64([]), lengths=_i64([]), slots=_i64([])), dict(block_c=8)]
    for change in bad:
        with pytest.raises(ValueError):
            gdn_conv_prefill_spans(**{**good, **change})


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_chunk_wy_with_a_chunk_table_is_bitwise_one_launch_per_sequence(name):
    """Sequences of 1, 64, 130 and 7 tokens in one launch (rows with gaps; each sequence's chunks start at its
    first row, a and b strided as parts of one [b | a] projection): w, u, gc and ks of every sequence's rows
    bitwise gdn_chunk_wy on that sequence alone (the interpreter; on a GPU the two builds may contract
    multiply-adds differently: within 1e-6)."""
    geo = GEOMETRIES[name]
    nv, lengths = geo.num_v_heads, [1, 64, 130, 7]
    starts, total = _with_gaps(lengths, 3)
    mixed, _, _, neg_a, dt_bias, _ = random_wy_inputs(geo, total, seed=21)
    ab = torch.randn(total, 2 * nv, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    b, a = ab[:, :nv], ab[:, nv:]
    chunks = [(s0 + c, s0 + n) for s0, n in zip(starts, lengths, strict=True) for c in range(0, n, 64)]
    table = (_i64([c for c, _ in chunks]), _i64([e for _, e in chunks]))
    heads = (geo.num_k_heads, geo.k_head_dim, geo.v_head_dim)
    got = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, *heads, chunks=table)
    for s0, n in zip(starts, lengths, strict=True):
        rows = slice(s0, s0 + n)
        want = gdn_chunk_wy(mixed[rows], a[rows], b[rows], neg_a, dt_bias, *heads)
        for ours, theirs in zip(got, want, strict=True):
            if DEVICE.type == "cuda":
                assert rel_err(ours[:, rows], theirs) < 1e-6, (s0, n)
            else:
                assert torch.equal(ours[:, rows], theirs), (s0, n)
    with pytest.raises(ValueError, match="chunk starts"):
        gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, *heads, chunks=(table[0].to(torch.int32), table[1]))


# ---------------------------------------------------------------- chunked delta rule


def reference_delta_rule(mixed, a, b, neg_a, dt_bias, geo, state):
    """chunked_delta_rule on the same conv output: (core [T, Nv, Dv], final state)."""
    nk, nv, dk, dv = geo.num_k_heads, geo.num_v_heads, geo.k_head_dim, geo.v_head_dim
    tokens = mixed.shape[0]
    q, k, v = torch.split(mixed, [nk * dk, nk * dk, nv * dv], -1)
    q = q.reshape(tokens, nk, dk).repeat_interleave(nv // nk, 1)
    k = k.reshape(tokens, nk, dk).repeat_interleave(nv // nk, 1)
    q, k, v = _l2norm(q) * dk ** -0.5, _l2norm(k), v.reshape(tokens, nv, dv)
    beta, g = b.float().sigmoid(), neg_a * F.softplus(a.float() + dt_bias)
    out, state = chunked_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(),
                                    state.clone())
    return out.transpose(0, 1), state


def random_wy_inputs(geo, tokens, seed):
    """(mixed, a, b, neg_a, dt_bias, state) for the chunk kernels: a random conv output and gates, a
    non-zero state."""
    gen = torch.Generator().manual_seed(seed)
    nv = geo.num_v_heads
    mixed = torch.randn(tokens, geo.conv_channels, generator=gen).to(DEVICE)
    a, b = torch.randn(tokens, nv, generator=gen).to(DEVICE), torch.randn(tokens, nv, generator=gen).to(DEVICE)
    neg_a = -(torch.rand(nv, generator=gen) * 2 - 1).exp().to(DEVICE)
    dt_bias = torch.randn(nv, generator=gen).to(DEVICE)
    state = (torch.randn(nv, geo.k_head_dim, geo.v_head_dim, generator=gen) * 0.3).to(DEVICE)
    return mixed, a, b, neg_a, dt_bias, state


@pytest.mark.parametrize("name", [*sorted(GEOMETRIES), "wide"])
@pytest.mark.parametrize("tokens", [1, 64, 130])
def test_chunk_kernels_match_chunked_delta_rule(name, tokens):
    """WY + scan against the reference on the same conv output, from a non-zero state; 130 = 2 full chunks
    and a 2-token tail, block_v 16 over Dv = 8/10 (masked columns)."""
    geo = GEOMETRIES.get(name, WIDE)
    nv = geo.num_v_heads
    mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(geo, tokens, seed=tokens)
    want, want_state = reference_delta_rule(mixed, a, b, neg_a, dt_bias, geo, state)
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, geo.num_k_heads, geo.k_head_dim, geo.v_head_dim)
    # gc restarts at each 64-token chunk
    g = neg_a[:, None] * F.softplus(a.t() + dt_bias[:, None])  # [Nv, T]
    assert rel_err(gc[:, :min(tokens, 64)], g[:, :64].cumsum(-1)) < 1e-6
    out = torch.full((tokens, nv, geo.v_head_dim), float("nan"), device=DEVICE)
    got = gdn_chunk_scan(mixed, w, u, gc, state, geo.num_k_heads, block_v=16, out=out)
    assert got is out
    assert rel_err(got, want) < 1e-5
    assert rel_err(state, want_state) < 1e-5


@pytest.mark.parametrize("name", [*sorted(GEOMETRIES), "wide"])
@pytest.mark.parametrize("tokens", [1, 64, 130])
def test_split_recurrence_is_bitwise_the_fused_scan_and_the_reference(name, tokens):
    """gdn_chunk_state + gdn_chunk_out do the fused scan's operations in its order: same core, same final
    state, bit for bit (the interpreter's dots) where gdn_chunk_wy's key tiles are the scan's halves (every
    Qwen geometry: Dk = Dv = 128); and within 1e-5 of chunked_delta_rule. The state walk
    writes v' over u and keeps the state entering each chunk: chunk 0's is the slot's state as it was."""
    geo = GEOMETRIES.get(name, WIDE)
    mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(geo, tokens, seed=100 + tokens)
    want, want_state = reference_delta_rule(mixed, a, b, neg_a, dt_bias, geo, state)
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, geo.num_k_heads, geo.k_head_dim, geo.v_head_dim)
    fused_state = state.clone()
    fused = gdn_chunk_scan(mixed, w, u.clone(), gc, fused_state, geo.num_k_heads, block_v=16)
    before = state.clone()
    hs = gdn_chunk_state(mixed, w, u, gc, ks, state, geo.num_k_heads, block_v=16)
    assert hs.shape == (geo.num_v_heads, -(-tokens // 64), geo.k_head_dim, geo.v_head_dim)
    assert torch.equal(hs[:, 0], before)
    out = torch.full((tokens, geo.num_v_heads, geo.v_head_dim), float("nan"), device=DEVICE)
    got = gdn_chunk_out(mixed, u, gc, hs, geo.num_k_heads, block_v=16, out=out)
    assert got is out
    if name == "wide" or DEVICE.type == "cuda":
        # Dk = 80: gdn_chunk_wy sums |k|^2 in 32-column tiles (its Dv sets them), the scan in its 64-row
        # halves: the key norms differ in the last bit, and so does everything after them. On sm_90 the
        # compiler contracts the two kernels' multiply-adds differently too (Dk = 12 there: state within
        # 1.7e-8, out within 6.4e-10 of the fused scan on 2026-12-01); bitwise only in the interpreter.
        assert rel_err(got, fused) < 1e-6 and rel_err(state, fused_state) < 1e-6
    else:
        assert torch.equal(got, fused) and torch.equal(state, fused_state)
    assert rel_err(got, want) < 1e-5 and rel_err(state, want_state) < 1e-5


def wy_w_float64(mixed, a, b, neg_a, dt_bias, geo):
    """gdn_chunk_wy's w for one 64-token chunk in float64, the inverse by torch.linalg.inv: [Nv, 64, Dk]."""
    nk, nv, dk = geo.num_k_heads, geo.num_v_heads, geo.k_head_dim
    tokens = mixed.shape[0]
    k = mixed.double()[:, nk * dk:2 * nk * dk].reshape(tokens, nk, dk).repeat_interleave(nv // nk, 1)
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    beta = b.double().sigmoid()
    gc = (neg_a.double() * F.softplus(a.double() + dt_bias.double())).cumsum(0)  # [T, Nv]
    eye = torch.eye(tokens, dtype=torch.float64)
    out = []
    for h in range(nv):
        kh = k[:, h]
        decay = torch.exp(gc[:, h, None] - gc[None, :, h])
        x = torch.linalg.inv(eye + torch.tril(beta[:, h, None] * (kh @ kh.T) * decay, -1))
        out.append(x @ (kh * (beta[:, h] * torch.exp(gc[:, h]))[:, None]))
    return torch.stack(out)


@pytest.mark.parametrize("blocked,bound", [(True, 2e-6), (False, 1e-5)])
def test_wy_inverse_by_doubling_or_substitution_on_correlated_keys(blocked, bound, monkeypatch):
    """The hard case for (I + A)^-1: keys nearly parallel and beta near 1, so A's entries are near 1. Against a
    float64 inverse, block doubling (the default) is within 2e-6 (measured 7.7e-7) and forward substitution
    within 1e-5 (3.2e-6); through the whole recurrence both stay within 1e-5 of chunked_delta_rule."""
    import adapters.kernels.gdn_chunk_wy as wy_mod

    geo = GEOMETRIES["gqa"]
    mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(geo, 64, seed=3)
    nk, dk = geo.num_k_heads, geo.k_head_dim
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(nk * dk, generator=gen).to(DEVICE)
    mixed[:, nk * dk:2 * nk * dk] = base + 0.1 * mixed[:, nk * dk:2 * nk * dk]  # k: one direction plus noise
    b = b.abs() + 3.0  # beta = sigmoid(b) > 0.95
    a = a - 6.0  # slow decay: exp(gc_i - gc_j) near 1 across the chunk
    monkeypatch.setattr(wy_mod, "BLOCKED_INVERSE", blocked)
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, nk, dk, geo.v_head_dim)
    assert rel_err(w.double(), wy_w_float64(mixed.cpu(), a.cpu(), b.cpu(), neg_a.cpu(), dt_bias.cpu(), geo)
                   .to(DEVICE)) < bound
    want, want_state = reference_delta_rule(mixed, a, b, neg_a, dt_bias, geo, state)
    got = prefill.delta_rule(mixed, w, u, gc, ks, state, nk, precise=True)
    assert rel_err(got, want) < 1e-5 and rel_err(state, want_state) < 1e-5


def test_split_recurrence_in_windows_is_bitwise_one_walk(monkeypatch):
    """prefill.delta_rule walks long spans in windows of GDN_WINDOW tokens (the entry states of one window
    at a time): windows of 64 and 128 over 200 tokens give the one-walk result and state, bit for bit,
    and the fused recurrence (the A/B switch) gives them too."""
    geo = GEOMETRIES["gqa"]
    mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(geo, 200, seed=7)
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, geo.num_k_heads, geo.k_head_dim, geo.v_head_dim)
    results = {}
    for mode, window in (("split", 4096), ("split", 64), ("split", 128), ("fused", 64)):
        monkeypatch.setattr(prefill, "GDN_RECURRENCE", mode)
        monkeypatch.setattr(prefill, "GDN_WINDOW", window)
        s = state.clone()
        results[mode, window] = prefill.delta_rule(mixed, w, u.clone(), gc, ks, s, geo.num_k_heads, precise=True), s
    core, final = results["split", 4096]
    for key, (c, s) in results.items():
        assert torch.equal(c, core) and torch.equal(s, final), key
    monkeypatch.setattr(prefill, "GDN_RECURRENCE", "serial")
    with pytest.raises(ValueError, match="GDN_RECURRENCE"):
        prefill.delta_rule(mixed, w, u, gc, ks, state, geo.num_k_heads, precise=True)


@pytest.mark.parametrize("window", [4096, 128])
def test_walks_over_a_steps_spans_are_bitwise_one_walk_per_span(window):
    """prefill.delta_rule_walks (step_plan.plan_walks' launches over one chunk table): spans of 2, 64, 200
    and 7 tokens with gaps between them, each in its own state slot (slot 1 untouched): every span's core
    rows and final state bitwise prefill.delta_rule on that span alone (the interpreter; on a GPU within
    1e-6). Window 128 (2 chunks a launch): the 200-token span is cut into pieces of 128 and 72 in launches
    of their own, the short spans share launches."""
    from adapters.cuda_exec.step_plan import plan_walks, upload_aligned

    geo = GEOMETRIES["gqa"]
    nv, nk, dk, dv = geo.num_v_heads, geo.num_k_heads, geo.k_head_dim, geo.v_head_dim
    lengths, slots = [2, 64, 200, 7], [0, 2, 3, 4]
    starts, total = _with_gaps(lengths, 3)
    mixed, a, b, neg_a, dt_bias, _ = random_wy_inputs(geo, total, seed=31)
    gen = torch.Generator().manual_seed(32)
    pool = (torch.randn(5, nv, dk, dv, generator=gen) * 0.3).to(DEVICE)  # [S, Nv, Dk, Dv]
    spans = [(slice(s0, s0 + n), slot) for s0, n, slot in zip(starts, lengths, slots, strict=True)]
    chunks = [(r.start + c, r.stop) for r, _ in spans for c in range(0, r.stop - r.start, 64)]
    entries, launches = plan_walks(spans, window)
    assert len(launches) == (1 if window == 4096 else 4)
    chunk_starts, chunk_ends, walk_table = upload_aligned(
        [torch.tensor(v, dtype=torch.int64) for v in ([c for c, _ in chunks], [e for _, e in chunks])]
        + [torch.tensor(entries, dtype=torch.int64).t().contiguous()], DEVICE)  # walk_table [4, E]
    table = (chunk_starts, chunk_ends)
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, nk, dk, dv, chunks=table)
    u_in = u.clone()  # the walk writes v' over u
    state = pool.clone()
    core = torch.full((total, nv, dv), float("nan"), device=DEVICE)
    prefill.delta_rule_walks(mixed, w, u, gc, ks, state, walk_table, launches, table, nk, precise=True, out=core)
    assert torch.equal(state[1], pool[1])
    for (rows_, slot), n in zip(spans, lengths, strict=True):
        one = pool[slot].clone()
        want = prefill.delta_rule(mixed[rows_], *(t[:, rows_].clone() for t in (w, u_in, gc, ks)), one, nk,
                                  precise=True)
        if DEVICE.type == "cuda":
            assert rel_err(core[rows_], want) < 1e-6 and rel_err(state[slot], one) < 1e-6, n
        else:
            assert torch.equal(core[rows_], want) and torch.equal(state[slot], one), n


def test_plan_walks_cuts_long_spans_and_packs_short_ones():
    """Pure host arithmetic: entries (begin, end, slot, first hs chunk), launches (first entry, entries,
    first chunk, chunks) under a 128-token (2-chunk) window."""
    from adapters.cuda_exec.step_plan import plan_walks

    spans = [(slice(0, 20), 5), (slice(20, 40), 6), (slice(40, 300), 7), (slice(300, 301), 8)]
    entries, launches = plan_walks(spans, 128)
    assert entries == [(0, 20, 5, 0), (20, 40, 6, 1), (40, 168, 7, 0), (168, 296, 7, 0), (296, 300, 7, 0),
                       (300, 301, 8, 1)]
    assert launches == [(0, 2, 0, 2), (2, 1, 2, 2), (3, 1, 4, 2), (4, 2, 6, 2)]
    with pytest.raises(ValueError, match="multiple of 64"):
        plan_walks(spans, 100)


def test_split_recurrence_rejects_bad_input():
    geo = GEOMETRIES["gqa"]
    c, nv = geo.conv_channels, geo.num_v_heads
    z = partial(torch.zeros, device=DEVICE)  # the kernels launch below: on the GPU they need its tensors
    walk = dict(mixed=z(70, c), w=z(nv, 70, 8), u=z(nv, 70, 8),
                gc=z(nv, 70), ks=z(nv, 70), state=z(nv, 8, 8), num_k_heads=2)
    for change in [dict(state=z(nv, 8, 8, dtype=torch.bfloat16)), dict(w=z(nv, 69, 8)),
                   dict(ks=z(nv, 69)), dict(ks=z(70, nv).t()),
                   dict(u=z(nv, 70, 4)), dict(num_k_heads=3), dict(block_v=24),
                   dict(states=z(nv, 1, 8, 8)), dict(states=z(nv, 2, 8, 4))]:
        with pytest.raises(ValueError):
            gdn_chunk_state(**{**walk, **change})
    hs = gdn_chunk_state(**walk)
    out = dict(mixed=z(70, c), v_new=z(nv, 70, 8), gc=z(nv, 70), states=hs,
               num_k_heads=2)
    assert torch.equal(gdn_chunk_out(**out), z(70, nv, 8))
    for change in [dict(states=hs[:, :1]), dict(states=hs[0]), dict(v_new=z(nv, 70, 4)),
                   dict(gc=z(nv, 71)), dict(out=z(70, nv, 4)), dict(block_v=8)]:
        with pytest.raises(ValueError):
            gdn_chunk_out(**{**out, **change})
    # a walk over several spans: the pool layer's [S, Nv, Dk, Dv] state, an int64 [4, E] table, its ranges
    table = torch.tensor([[0], [70], [0], [0]], dtype=torch.int64, device=DEVICE)
    good = SpanWalk(table, 0, 1, 0, 2)
    for change in [dict(walk=good), dict(state=z(2, nv, 8, 8), walk=SpanWalk(table.int(), 0, 1, 0, 2)),
                   dict(state=z(2, nv, 8, 8), walk=SpanWalk(table.t(), 0, 1, 0, 2)),
                   dict(state=z(2, nv, 8, 8), walk=SpanWalk(table, 0, 2, 0, 2))]:
        with pytest.raises(ValueError, match="walk"):
            gdn_chunk_state(**{**walk, **change})
    starts = torch.tensor([0, 64], dtype=torch.int64, device=DEVICE)
    for chunks in [(starts.int(), starts, 0), (starts, starts, 1), (starts, starts[:1], 0)]:
        with pytest.raises(ValueError, match="chunk"):
            gdn_chunk_out(**out, chunks=chunks)


def test_chunk_kernels_reject_bad_input():
    geo = GEOMETRIES["gqa"]
    c, nv = geo.conv_channels, geo.num_v_heads
    wy = dict(mixed=torch.zeros(5, c), a=torch.zeros(5, nv), b=torch.zeros(5, nv), neg_a=torch.zeros(nv),
              dt_bias=torch.zeros(nv), num_k_heads=2, k_head_dim=8, v_head_dim=8)
    for change in [dict(mixed=torch.zeros(5, c, dtype=torch.bfloat16)), dict(mixed=torch.zeros(5, c + 1)),
                   dict(a=torch.zeros(4, nv)), dict(neg_a=torch.zeros(nv, dtype=torch.float64)),
                   dict(num_k_heads=3), dict(dt_bias=torch.zeros(nv + 1))]:
        with pytest.raises(ValueError):
            gdn_chunk_wy(**{**wy, **change})
    scan = dict(mixed=torch.zeros(5, c), w=torch.zeros(nv, 5, 8), u=torch.zeros(nv, 5, 8), gc=torch.zeros(nv, 5),
                state=torch.zeros(nv, 8, 8), num_k_heads=2)
    for change in [dict(state=torch.zeros(nv, 8, 8, dtype=torch.bfloat16)), dict(w=torch.zeros(nv, 4, 8)),
                   dict(u=torch.zeros(nv, 5, 4)), dict(gc=torch.zeros(nv, 6)), dict(num_k_heads=3),
                   dict(block_v=24), dict(out=torch.zeros(5, nv, 4))]:
        with pytest.raises(ValueError):
            gdn_chunk_scan(**{**scan, **change})


# ---------------------------------------------------------------- gdn_prefill vs forward_sequence


def twin_pools(geo, dtype, gen, slots=3):
    ref = make_pool(geo, slots, dtype, gen)
    ours = LinearStatePool(1, slots, geo, dtype, DEVICE)
    ours.conv.copy_(ref.conv)
    ours.recurrent.copy_(ref.recurrent)
    return ref, ours


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("splits", [(130,), (64, 66), (70, 1, 59)])
def test_gdn_prefill_matches_forward_sequence_then_decode_kernels_continue(name, splits):
    """A prompt in the given chunks (consecutive steps of one slot, lengths not multiples of 64, a
    one-token span), from a non-zero state, then 3 decode steps through gdn_decode_step: every output and
    both states within fp32 tolerance of the reference, the other slots untouched."""
    geo = GEOMETRIES[name]
    gdn, gen = make_gdn(geo, hidden=32, dtype=torch.float32, seed=len(splits))
    ref_pool, pool = twin_pools(geo, torch.float32, gen)
    untouched = pool.recurrent[0, 0].clone(), pool.conv[0, 0].clone()
    x = torch.randn(sum(splits) + 3, 32, generator=gen).to(DEVICE)
    start = 0
    for n in splits:
        want = gdn.forward_sequence(x[start:start + n], ref_pool, 0, 2)
        got = prefill.gdn_prefill(gdn, x[start:start + n], pool, 0, 2)
        assert rel_err(got, want) < 1e-5, (start, n)
        assert rel_err(pool.recurrent[0, 2], ref_pool.recurrent[0, 2]) < 1e-5, (start, n)
        assert rel_err(pool.conv[0, 2], ref_pool.conv[0, 2]) < 1e-6, (start, n)
        start += n
    slots = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    w = gdn.w
    for t in range(start, start + 3):
        row = x[t:t + 1]
        want = gdn.forward_decode(row, ref_pool, 0, slots.long())
        core = gdn_decode_step(linear(row, w["in_proj_qkv.weight"]), linear(row, w["in_proj_a.weight"]),
                               linear(row, w["in_proj_b.weight"]), pool.conv[0], pool.recurrent[0], slots,
                               w["conv1d.weight"][:, 0, :], gdn.neg_a, gdn.dt_bias, geo)
        got = gdn._output(core, linear(row, w["in_proj_z.weight"]).reshape(1, geo.num_v_heads, -1), row.dtype)
        assert rel_err(got, want) < 1e-5, t
    assert rel_err(pool.recurrent[0, 2], ref_pool.recurrent[0, 2]) < 1e-5
    assert torch.equal(pool.recurrent[0, 0], untouched[0]) and torch.equal(pool.conv[0, 0], untouched[1])


def test_gdn_prefill_bf16_model_within_reference_tolerance():
    """bf16 weights, activations and conv state: the conv state is a bitwise copy of the inputs; the output
    differs from the bf16 reference (conv output rounded to bf16 there, fp32 here; tf32 allowed on a GPU)
    by a few 1e-3 relative (bound 2e-2), the fp32 state by less."""
    geo = GEOMETRIES["gqa"]
    gdn, gen = make_gdn(geo, hidden=32, dtype=torch.bfloat16, seed=9)
    ref_pool, pool = twin_pools(geo, torch.bfloat16, gen)
    x = torch.randn(100, 32, generator=gen).to(device=DEVICE, dtype=torch.bfloat16)
    for span in (slice(0, 70), slice(70, 100)):
        want = gdn.forward_sequence(x[span], ref_pool, 0, 1)
        got = prefill.gdn_prefill(gdn, x[span], pool, 0, 1)
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) < 2e-2
        assert torch.equal(pool.conv[0, 1], ref_pool.conv[0, 1])
        assert rel_err(pool.recurrent[0, 1], ref_pool.recurrent[0, 1]) < 1e-2


def test_gdn_prefill_rejects_bad_spans():
    geo = GEOMETRIES["gqa"]
    gdn, gen = make_gdn(geo, hidden=32, dtype=torch.float32)
    pool = LinearStatePool(2, 3, geo, torch.float32, DEVICE)
    x = torch.randn(4, 32, generator=gen).to(DEVICE)
    for args in [(x[:0], pool, 0, 1), (x[0], pool, 0, 1), (x, pool, 2, 1), (x, pool, 0, 3), (x, pool, -1, 0),
                 (x, LinearStatePool(1, 3, GEOMETRIES["odd"], torch.float32, DEVICE), 0, 0)]:
        with pytest.raises(ValueError):
            prefill.gdn_prefill(gdn, *args)
    assert pool.recurrent.abs().sum() == 0 and pool.conv.abs().sum() == 0
    wide = GdnGeometry(1, 1, 136, 8, 4)  # Dk > 128: refused before the conv writes the state
    big, _ = make_gdn(wide, hidden=32, dtype=torch.float32)
    big_pool = LinearStatePool(1, 1, wide, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="136"):
        prefill.gdn_prefill(big, x, big_pool, 0, 0)
    assert big_pool.conv.abs().sum() == 0


# ---------------------------------------------------------------- attention_prefill vs FullAttention.forward


def make_attention(heads, kv_heads, head_dim, hidden, dtype, partial=0.5, gate=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std):
        return (torch.randn(*shape, generator=gen) * std).to(dtype=dtype, device=DEVICE)

    q_rows = heads * head_dim * (2 if gate else 1)
    weights = {"q_proj.weight": rand(q_rows, hidden, std=hidden ** -0.5),
               "k_proj.weight": rand(kv_heads * head_dim, hidden, std=hidden ** -0.5),
               "v_proj.weight": rand(kv_heads * head_dim, hidden, std=hidden ** -0.5),
               "o_proj.weight": rand(hidden, heads * head_dim, std=(heads * head_dim) ** -0.5),
               "q_norm.weight": rand(head_dim, std=0.2), "k_norm.weight": rand(head_dim, std=0.2)}
    geo = AttentionGeometry(heads, kv_heads, head_dim, output_gate=gate, unit_offset_norm=gate, eps=1e-6)
    return FullAttention(weights, geo, Rotary(head_dim, 10000.0, partial, DEVICE), kv_layer=1), gen


def one_span(start, length, pages):
    work = SequenceWork("r", tuple([0] * length), start, pages, 0, True, SamplingParams(temperature=0.0, max_tokens=1), 0)
    return flatten(StepBatch((work,)), DEVICE)


def twin_caches(kv_heads, head_dim, dtype, gen, pages=24, page_size=4):
    """Two identical caches whose every slot holds NaN: a read of anything not written shows up."""
    caches = [PagedKVCache(2, pages, page_size, kv_heads, head_dim, dtype, DEVICE) for _ in range(2)]
    for kv in caches:
        kv.k.fill_(float("nan"))
        kv.v.fill_(float("nan"))
    return caches


@pytest.mark.parametrize("heads,kv_heads,gate,dtype,bound", [
    (4, 2, True, torch.float32, 1e-5), (4, 1, False, torch.float32, 1e-5), (4, 2, True, torch.bfloat16, 2e-2)])
def test_attention_prefill_matches_forward_over_two_spans(heads, kv_heads, gate, dtype, bound):
    """A prompt of 57 in two spans (37 from position 0, then 20 after the cached prefix) over shuffled pages:
    outputs match FullAttention.forward, and the pools hold the same K/V in the same slots, nothing else."""
    head_dim, hidden = 16, 32
    attn, gen = make_attention(heads, kv_heads, head_dim, hidden, dtype, gate=gate)
    ref_kv, kv = twin_caches(kv_heads, head_dim, dtype, gen)
    pages = tuple(int(p) for p in torch.randperm(24, generator=gen)[:15])  # 15 pages of 4 cover 57 (+3)
    page_ids = torch.tensor(pages, dtype=torch.long, device=DEVICE)
    x = torch.randn(57, hidden, generator=gen).to(dtype=dtype, device=DEVICE)
    for start, n in ((0, 37), (37, 20)):
        want = attn.forward(x[start:start + n], one_span(start, n, pages), ref_kv)
        got = prefill.attention_prefill(attn, x[start:start + n], kv, page_ids, start)
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert rel_err(got, want) < bound, (start, n)
        written = ~torch.isnan(ref_kv.k)
        assert torch.equal(written, ~torch.isnan(kv.k))
        assert torch.equal(kv.v[written], ref_kv.v[written])  # v is a copy
        # k: qk_norm_rope reduces the norm's sum of squares in its own order (an ulp here and there)
        assert rel_err(kv.k[written], ref_kv.k[written]) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_attention_prefill_rejects_bad_spans():
    attn, gen = make_attention(4, 2, 16, 32, torch.float32)
    kv = PagedKVCache(2, 8, 4, 2, 16, torch.float32, DEVICE)
    x = torch.randn(6, 32, generator=gen).to(DEVICE)
    pages = torch.tensor([3, 5], dtype=torch.long, device=DEVICE)  # 8 positions
    for args in [(x[:0], kv, pages, 0), (x, kv, pages, 3), (x, kv, pages, -1), (x, kv, pages[None], 0)]:
        with pytest.raises(ValueError):
            prefill.attention_prefill(attn, *args)
    assert kv.k.abs().sum() == 0


# ---------------------------------------------------------------- end to end: prefill -> decode kernels


def test_fast_executor_with_kernel_prefill_gives_the_reference_tokens(tmp_path, monkeypatch):
    """The fast executor (decode through its Triton kernels) with every prefill span's mixers routed
    through gdn_prefill / attention_prefill, as fast_decoder's prefill would call them: prompts of 130
    (spans 80 + 50: chunks of 64 inside a span and across spans) and 7 tokens, in one continuous batch,
    give the reference executor's greedy tokens, and logits within 1e-4 of the logit scale."""
    from adapters.cuda_exec.executor import CudaGraphExecutor
    from adapters.torch_exec.executor import TorchExecutor
    from tests.adapters.torch_exec_models import (
        QWEN3_5_CONFIGS,
        Sequence,
        build_hf_model,
        make_plan,
        pages_for,
        run_requests,
        save_and_load,
    )

    ckpt = save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (130,), generator=gen).tolist(), torch.randint(0, 96, (7,), generator=gen).tolist()]

    def run(executor):
        seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + 4), state_slot=i) for i, p in enumerate(prompts)]
        record: dict = {}
        run_requests(executor, seqs, 3, chunk=80, record=record)
        return [s.output for s in seqs], record

    slots = ckpt.spec.top_k * 8
    want_tokens, want_logits = run(TorchExecutor(ckpt, make_plan(ckpt, expert_slots=slots), DEVICE, torch.float32))
    calls = {"gdn": 0, "attn": 0}

    def gdn_sequence(self, x, pool, layer, slot):
        calls["gdn"] += 1
        return prefill.gdn_prefill(self, x, pool, layer, slot)

    def attention_forward(self, x, inp, kv):
        out = torch.empty_like(x)
        for span in inp.spans:  # a decode row of a mixed step is a one-token span: also valid here
            calls["attn"] += 1
            out[span.rows] = prefill.attention_prefill(self, x[span.rows], kv, span.page_ids, span.start_position)
        return out

    monkeypatch.setattr(GatedDeltaNet, "forward_sequence", gdn_sequence)
    monkeypatch.setattr(FullAttention, "forward", attention_forward)
    fast = CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=slots), DEVICE, torch.float32, max_decode_rows=4)
    got_tokens, got_logits = run(fast)
    assert calls["gdn"] >= 3 * 2 and calls["attn"] >= 2  # both prompts' spans went through the kernels
    assert got_tokens == want_tokens
    for rid, rows in want_logits.items():
        for step, (ours, want) in enumerate(zip(got_logits[rid], rows, strict=True)):
            assert (ours - want).abs().max().item() <= 1e-4 * want.abs().max().item(), (rid, step)
    fast.check_valid()


# ---------------------------------------------------------------- GPU: Qwen3.6 geometry, compiled kernels


@pytest.mark.gpu
@pytest.mark.parametrize("precise", [True, False])
def test_gpu_split_recurrence_matches_the_fused_scan_across_windows(precise, monkeypatch):
    """Qwen3.6 geometry, 2,500 tokens (two 2,048-token windows of the state walk, a 4-token chunk tail): the
    split recurrence against the fused scan (same operations: within 1e-6, expected bitwise) and against
    chunked_delta_rule (3xTF32: 1e-4; one TF32 pass: 2e-2)."""
    geo = GdnGeometry(16, 32, 128, 128, 4)
    mixed, a, b, neg_a, dt_bias, state = random_wy_inputs(geo, 2500, seed=5)
    want, want_state = reference_delta_rule(mixed, a, b, neg_a, dt_bias, geo, state)
    w, u, gc, ks = gdn_chunk_wy(mixed, a, b, neg_a, dt_bias, 16, 128, 128, precise=precise)
    results = {}
    for mode in ("split", "fused"):
        monkeypatch.setattr(prefill, "GDN_RECURRENCE", mode)
        s = state.clone()
        results[mode] = prefill.delta_rule(mixed, w, u.clone(), gc, ks, s, 16, precise=precise), s
    (core, final), (fused, fused_state) = results["split"], results["fused"]
    assert rel_err(core, fused) < 1e-6 and rel_err(final, fused_state) < 1e-6
    bound = 1e-4 if precise else 2e-2
    assert rel_err(core, want) < bound and rel_err(final, want_state) < bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_gpu_gdn_prefill_qwen36_geometry(dtype, bound):
    """Nk=16, Nv=32, Dk=Dv=128, W=4 (C = 8192): a 700-token prompt in spans of 300 and 400 (tails of 44 and
    16 past the 64-token chunks), then two decode steps through gdn_decode_step, against the reference."""
    geo = GdnGeometry(16, 32, 128, 128, 4)
    gdn, gen = make_gdn(geo, hidden=256, dtype=dtype, seed=11)
    ref_pool, pool = twin_pools(geo, dtype, gen, slots=2)
    x = torch.randn(702, 256, generator=gen).to(dtype=dtype, device=DEVICE)
    for span in (slice(0, 300), slice(300, 700)):
        want = gdn.forward_sequence(x[span], ref_pool, 0, 1)
        got = prefill.gdn_prefill(gdn, x[span], pool, 0, 1)
        assert rel_err(got, want) < bound, span
        assert rel_err(pool.recurrent[0, 1], ref_pool.recurrent[0, 1]) < bound, span
        assert torch.equal(pool.conv[0, 1], ref_pool.conv[0, 1])
    slots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    w = gdn.w
    for t in (700, 701):
        row = x[t:t + 1]
        want = gdn.forward_decode(row, ref_pool, 0, slots.long())
        core = gdn_decode_step(linear(row, w["in_proj_qkv.weight"]), linear(row, w["in_proj_a.weight"]),
                               linear(row, w["in_proj_b.weight"]), pool.conv[0], pool.recurrent[0], slots,
                               w["conv1d.weight"][:, 0, :], gdn.neg_a, gdn.dt_bias, geo)
        got = gdn._output(core, linear(row, w["in_proj_z.weight"]).reshape(1, 32, 128), dtype)
        assert rel_err(got, want) < bound, t


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_gpu_attention_prefill_qwen36_geometry(dtype, bound):
    """N=16, M=2, D=256, page size 16, gate on: spans of 300 from 0 and 200 after the prefix. bf16 runs
    with SDPA restricted to the flash backend: it must take GQA and the lower-right causal mask there."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attn, gen = make_attention(16, 2, 256, 256, dtype, partial=0.25, seed=12)
    ref_kv, kv = twin_caches(2, 256, dtype, gen, pages=48, page_size=16)
    pages = tuple(int(p) for p in torch.randperm(48, generator=gen)[:32])  # 512 positions
    page_ids = torch.tensor(pages, dtype=torch.long, device=DEVICE)
    x = torch.randn(500, 256, generator=gen).to(dtype=dtype, device=DEVICE)
    for start, n in ((0, 300), (300, 200)):
        want = attn.forward(x[start:start + n], one_span(start, n, pages), ref_kv)
        only_flash = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if dtype == torch.bfloat16 else nullcontext()
        with only_flash:
            got = prefill.attention_prefill(attn, x[start:start + n], kv, page_ids, start)
        assert rel_err(got.float(), want.float()) < bound, (start, n)


# ---------------------------------------------------------------- CPU: compiled for sm_90 by ptxas

_SM90_COMPILE = r"""
import json

from adapters.kernels import gdn_chunk_out as chunk_out, gdn_chunk_scan as scan, gdn_chunk_state as walk
from adapters.kernels import gdn_chunk_wy as wy, gdn_conv_prefill as conv
from tests.adapters.sm90_usage import resource_usage


def usage(fn, pointers, constexprs, options):
    return resource_usage(fn, pointers, constexprs, options, lambda n: "fp32" if n == "q_scale" else "i32")


heads = dict(KEY_HEADS=16, VALUE_HEADS=32, DK=128, DV=128, CHUNK=64)
f32 = "*fp32"
# the span-table variants: what the fast path's prefill launches (prefill_spans.py)
out = {"conv": usage(conv._gdn_conv_prefill_kernel, dict(
    x_ptr="*bf16", hist_ptr="*bf16", state_ptr="*bf16", w_ptr="*bf16", out_ptr=f32, starts_ptr="*i64",
    lens_ptr="*i64", slots_ptr="*i64"), dict(CHANNELS=8192, KERNEL=4, BLOCK_T=16, BLOCK_C=128, BLOCK_W=4, SPANS=True),
    {"num_warps": 4})}
for precise in (False, True):
    tag = "fp32" if precise else "bf16"
    out[f"wy_{tag}"] = usage(wy._gdn_chunk_wy_kernel, dict(
        mixed_ptr=f32, a_ptr="*bf16", b_ptr="*bf16", neg_a_ptr=f32, dt_bias_ptr=f32, w_ptr=f32, u_ptr=f32,
        gc_ptr=f32, ks_ptr=f32, starts_ptr="*i64", ends_ptr="*i64"), dict(
            **heads, BLOCK_K=128, BLOCK_V=128, TILE=wy.TILE, DOT_PRECISION=wy.dot_precision(precise),
            BLOCKED_INVERSE=wy.BLOCKED_INVERSE, LOG2_CHUNK=6, SPANS=True), wy.LAUNCH)
    out[f"scan_{tag}"] = usage(scan._gdn_chunk_scan_kernel, dict(
        mixed_ptr=f32, w_ptr=f32, u_ptr=f32, gc_ptr=f32, state_ptr=f32, out_ptr=f32),
        dict(**heads, BLOCK_KB=64, SPLIT=True, BLOCK_V=32, DOT_PRECISION=wy.dot_precision(precise)), scan.LAUNCH)
    out[f"state_{tag}"] = usage(walk._gdn_chunk_state_kernel, dict(
        mixed_ptr=f32, w_ptr=f32, u_ptr=f32, gc_ptr=f32, ks_ptr=f32, state_ptr=f32, hs_ptr=f32, walk_ptr="*i64"),
        dict(**heads, BLOCK_KB=64, SPLIT=True, BLOCK_V=walk.BLOCK_V, DOT_PRECISION=wy.dot_precision(precise),
             SPANS=True, NUM_STAGES=walk.LAUNCH["num_stages"]), walk.LAUNCH)
    out[f"out_{tag}"] = usage(chunk_out._gdn_chunk_out_kernel, dict(
        mixed_ptr=f32, v_ptr=f32, gc_ptr=f32, hs_ptr=f32, out_ptr=f32, starts_ptr="*i64", ends_ptr="*i64"),
        dict(**heads, BLOCK_KB=64, SPLIT=True, BLOCK_V=chunk_out.BLOCK_V, DOT_PRECISION=wy.dot_precision(precise),
             SPANS=True), chunk_out.LAUNCH)
print(json.dumps(out))
"""

# ptxas' spill stack per thread (bytes) at Qwen3.6 geometry, measured 2026-12-01 (Triton 3.9): conv 0,
# wy 104 / 1320 (bf16 / fp32 model; the substitution inverse: 120 / 784), scan 1416 / 2944, the split recurrence's state walk 168 / 632 and
# output 0 / 144. The walk and output over a span table (2026-12-02): state 24 / 368 and output 0 / 128 (Triton
# 3.9), 0 / 688 and 0 / 0 (3.6, the device's: FT_SM90_TRITON). The output at its session-30 launch (64 value
# columns, 4 warps; 2.34x the 32 x 8 warps on an H100 under Triton 3.6, which reported 239 registers and no spill):
# 464 / 1176 under Triton 3.9. The bounds catch a regression; the fused scan's spill is why the split is the default
# (see docs/prefill-kernels.md).
_STACK_BOUND = {"conv": 0, "wy_bf16": 256, "wy_fp32": 2048, "scan_bf16": 2048, "scan_fp32": 4096,
                "state_bf16": 384, "state_fp32": 1024, "out_bf16": 512, "out_fp32": 1280}


@pytest.mark.slow
def test_prefill_kernels_compile_for_sm90_within_shared_memory():
    """The interpreter proves the math, not that the kernels build: ptxas builds each for sm_90 at
    Qwen3.6 geometry with the launchers' settings, in a fresh process (no TRITON_INTERPRET); every kernel
    fits an H200 SM's 227 KiB of shared memory and stays within its spill bound."""
    import json

    from tests.adapters.sm90 import build_for_sm90

    usage = json.loads(build_for_sm90(_SM90_COMPILE).strip().splitlines()[-1])
    assert set(usage) == set(_STACK_BOUND)
    for name, found in usage.items():
        assert found["SMEM"] <= 227 * 1024, (name, found)
        assert found["STACK"] <= _STACK_BOUND[name], (name, found)
