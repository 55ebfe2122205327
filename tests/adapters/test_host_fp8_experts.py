"""The host expert kernel (adapters/host_kernels/fp8_block_experts, ADR 0030) against a float64 reference
built from `dequantize`, on packed bank rows; compiled for this machine by the first test (~45 s)."""

from __future__ import annotations

import pytest
import torch

from adapters.checkpoint.expert_layout import ExpertLayout
from adapters.checkpoint.quant import QTensor, dequantize
from adapters.host_kernels import fp8_block_experts as hk
from domain.model_spec import WeightFormat


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, detail = hk.available()
    assert ok, f"the host expert kernel does not build here: {detail}"
    return detail


def _q(rows: int, cols: int, g: torch.Generator, data: torch.Tensor | None = None) -> QTensor:
    if data is None:
        data = (torch.randn(rows, cols, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) + 0.25
    return QTensor(WeightFormat.FP8_BLOCK, (rows, cols), data=data, scale=scale)


def _bank(layout: ExpertLayout, n: int, g: torch.Generator) -> torch.Tensor:
    h, i = layout.hidden, layout.intermediate
    return torch.stack([layout.pack(_q(i, h, g), _q(i, h, g), _q(h, i, g)) for _ in range(n)])  # [N, R]


def _reference(x, bank, layout, pair_token, pair_row, pair_weight) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, r, w in zip(pair_token.tolist(), pair_row.tolist(), pair_weight.tolist(), strict=True):
        e = layout.view(bank[r])
        gate, up, down = (dequantize(m).double() for m in (e.gate, e.up, e.down))
        xt = x[t].double()
        out[t] += w * (down @ (torch.nn.functional.silu(gate @ xt) * (up @ xt)))
    return out


@pytest.mark.parametrize("hidden,inter", [(256, 128), (200, 72), (201, 75), (384, 256)])
def test_matches_the_dequantized_reference(hidden, inter):
    # (200, 72): partial 128-blocks and rows that end off the 16-byte vector steps (the scalar tail); (201, 75): odd
    # row counts in a job (the GEMV's two-row step leaves one row) and odd row lengths
    g = torch.Generator().manual_seed(hidden + inter)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, hidden, inter)
    bank = _bank(layout, 6, g)
    x = torch.randn(3, hidden, generator=g)
    pair_token = torch.tensor([0, 0, 1, 2, 2, 2])
    pair_row = torch.tensor([1, 5, 0, 3, 1, 2])
    pair_weight = torch.rand(6, generator=g)
    out = hk.fp8_block_experts(x, bank, layout, pair_token, pair_row, pair_weight)
    ref = _reference(x, bank, layout, pair_token, pair_row, pair_weight)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("hidden,inter", [(256, 128), (200, 72), (201, 75)])
def test_an_expert_shared_by_many_pairs_gives_each_pair_its_own_bits(hidden, inter):
    # a batch that routes alike (one prompt sent to every request) shares experts: the kernel reads a shared
    # expert once for up to 4 vectors at a time (2 rows a step for 1 and 2, 1 row for 3 and 4); every pair must
    # still get the bits it gets alone (where no expert is shared the kernel takes its fused two-phase path: the
    # runs alone compare the two paths). Row 2 is shared by 6 pairs (a group of 4 then 2), row 0 by 3, row 4 by 1.
    # (201, 75): the scalar tail of rows off the 16-byte steps, where an FMA contraction in one template instance
    # and not another broke the bits on AMD hosts (-ffp-contract=off)
    g = torch.Generator().manual_seed(7 + hidden)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, hidden, inter)
    bank = _bank(layout, 5, g)
    x = torch.randn(6, hidden, generator=g)
    pair_token = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 5, 5])
    pair_row = torch.tensor([2, 0, 0, 2, 2, 4, 2, 2, 2, 0])
    pair_weight = torch.rand(10, generator=g)
    out = hk.fp8_block_experts(x, bank, layout, pair_token, pair_row, pair_weight)
    ref = _reference(x, bank, layout, pair_token, pair_row, pair_weight)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for t in range(6):
        mine = pair_token == t
        alone = hk.fp8_block_experts(x[t:t + 1], bank, layout, torch.zeros(int(mine.sum()), dtype=torch.int64),
                                     pair_row[mine], pair_weight[mine])
        assert torch.equal(out[t], alone[0]), f"token {t} differs from its run alone"


def test_every_e4m3_byte_decodes_as_torch_casts_it():
    # all 254 finite encodings (zero, both signs, the subnormals) in one gate row, a one-hot x picks each out
    g = torch.Generator().manual_seed(1)
    hidden, inter = 256, 128
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # [254]
    gate_data = torch.zeros(inter, hidden, dtype=torch.uint8)
    gate_data[0, : codes.numel()] = codes
    gate = _q(inter, hidden, g, gate_data.view(torch.float8_e4m3fn))
    gate.scale.fill_(1.0)
    # down/up chosen so the output exposes the gate row's pre-activation: up = 1 on row 0, down = e_0
    up_data = torch.zeros(inter, hidden, dtype=torch.float8_e4m3fn)
    up = _q(inter, hidden, g, up_data)
    down = _q(hidden, inter, g, torch.zeros(hidden, inter, dtype=torch.float8_e4m3fn))
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, hidden, inter)
    values = codes.view(torch.float8_e4m3fn).double()  # [254] torch's decoding
    for j in (0, 1, 37, 127, 128, 200, 253):  # a sample of columns, each its own one-hot x
        up.data.zero_()
        up.data[0, j] = 1.0
        up.scale.fill_(1.0)
        down.data.zero_()
        down.data[0, 0] = 1.0
        down.scale.fill_(1.0)
        bank = layout.pack(gate, up, down).unsqueeze(0)
        x = torch.zeros(1, hidden)
        x[0, j] = 1.0
        out = hk.fp8_block_experts(x, bank, layout, torch.tensor([0]), torch.tensor([0]), torch.tensor([1.0]))
        v = values[j]
        assert out[0, 0].item() == pytest.approx((torch.nn.functional.silu(v) * 1.0).item(), rel=1e-6, abs=1e-30)


def test_thread_count_does_not_change_the_bits():
    g = torch.Generator().manual_seed(2)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, 256, 128)
    bank = _bank(layout, 4, g)
    x = torch.randn(2, 256, generator=g)
    args = (torch.tensor([0, 1, 1, 0]), torch.tensor([3, 0, 2, 1]), torch.rand(4, generator=g))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = hk.fp8_block_experts(x, bank, layout, *args)
        torch.set_num_threads(max(2, before))
        many = hk.fp8_block_experts(x, bank, layout, *args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_no_pairs_gives_zeros_and_tokens_without_pairs_stay_zero():
    g = torch.Generator().manual_seed(3)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, 256, 128)
    bank = _bank(layout, 2, g)
    x = torch.randn(3, 256, generator=g)
    empty = torch.empty(0, dtype=torch.int64)
    assert torch.equal(hk.fp8_block_experts(x, bank, layout, empty, empty, torch.empty(0)), torch.zeros(3, 256))
    out = hk.fp8_block_experts(x, bank, layout, torch.tensor([1]), torch.tensor([0]), torch.tensor([0.5]))
    assert torch.equal(out[0], torch.zeros(256)) and torch.equal(out[2], torch.zeros(256))
    assert out[1].abs().max() > 0
    # an expert shared by tokens 1 and 2 (the grouped phases), tokens 0 and 3 without a pair: the unrouted rows come
    # out zero whatever the output memory held before (the kernel skips their jobs). Each checked call follows one
    # that routes every token, whose freed output the allocator tends to hand the next call of the same size
    x4 = torch.randn(4, 256, generator=g)
    every = torch.arange(4)
    for _ in range(20):
        dirty = hk.fp8_block_experts(x4, bank, layout, every, every % 2, torch.ones(4))
        assert (dirty.abs().amax(dim=1) > 0).all()
        del dirty
        out = hk.fp8_block_experts(x4, bank, layout, torch.tensor([1, 2]), torch.tensor([0, 0]),
                                   torch.tensor([0.5, 0.25]))
        assert torch.equal(out[0], torch.zeros(256)) and torch.equal(out[3], torch.zeros(256))
        assert out[1].abs().max() > 0 and out[2].abs().max() > 0


def test_bad_inputs_are_refused_before_the_kernel_runs():
    g = torch.Generator().manual_seed(4)
    layout = ExpertLayout(WeightFormat.FP8_BLOCK, 256, 128)
    bank = _bank(layout, 2, g)
    x = torch.randn(1, 256)
    one, w = torch.tensor([0]), torch.tensor([1.0])
    with pytest.raises(ValueError, match="pair_row out of"):
        hk.fp8_block_experts(x, bank, layout, one, torch.tensor([2]), w)
    with pytest.raises(ValueError, match="pair_token out of"):
        hk.fp8_block_experts(x, bank, layout, torch.tensor([1]), one, w)
    with pytest.raises(ValueError, match="fp32"):
        hk.fp8_block_experts(x.bfloat16(), bank, layout, one, one, w)
    with pytest.raises(ValueError, match="bank must be"):
        hk.fp8_block_experts(x, bank[:, :-16], layout, one, one, w)
    with pytest.raises(ValueError, match="pair_weight"):
        hk.fp8_block_experts(x, bank, layout, one, one, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="reads block FP8 rows"):
        hk.row_offsets(ExpertLayout(WeightFormat.BF16, 256, 128))
