"""moe_sum's `written` ids: pairs with a negative id count as +0.0 and are never read, so the callers whose
expert calls write exactly the pairs with an id >= 0 (grouped_moe's own partials, the pool's set-lookup and
grouped-decode calls on one GPU) skip the zero-fill of their partials and keep every output bit.

Each check poisons the unwritten pairs (NaN, inf, -0.0, random bits) and compares against the zero-filled
sum bitwise; a control run sums the same poisoned buffer without the ids and must see the poison."""

import pytest
import torch

import adapters.cuda_exec.expert_pool as expert_pool_mod
import adapters.kernels.grouped_moe as grouped_moe_mod
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.kernels.grouped_moe import grouped_moe
from adapters.kernels.moe_sum import moe_sum
from domain.model_spec import WeightFormat
from tests.adapters.sm90 import build_for_sm90

# NOTE: the dedup tests' bank (FP8 block, H 128, I 32, L 2, E 12, K 4, a packed shared expert per layer)
from tests.adapters.test_expert_pool_dedup import DEVICE, E, H, K, L, bank_and_shared  # noqa: F401
from tests.adapters.test_kernels_moe import make_batch, make_pool

NAN = float("nan")


def _poison(y: torch.Tensor, absent: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """y [T, K, H] with the absent pairs (bool [T, K]) overwritten by NaN, +-inf, -0.0 and random bit patterns."""
    bits = torch.randint(-2**31, 2**31 - 1, y.shape, generator=gen, dtype=torch.int32).view(torch.float32)
    specials = torch.tensor([NAN, float("inf"), -float("inf"), -0.0, 3e38])
    pick = torch.randint(0, specials.numel() + 1, y.shape, generator=gen)
    junk = torch.where(pick < specials.numel(), specials[pick.clamp(max=specials.numel() - 1)], bits)
    return torch.where(absent[:, :, None].to(y.device), junk.to(y.device), y)


def _ordered_sum(y: torch.Tensor, absent: torch.Tensor) -> torch.Tensor:
    """The zero-filled sum in torch: fp32, +0.0 start, k = 0..K-1 in order."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for k in range(y.shape[1]):
        acc = acc + torch.where(absent[:, k, None], 0.0, y[:, k])
    return acc


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the control sums the poison: inf - inf in numpy
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_skipped_pairs_are_bitwise_the_zero_filled_sum_and_never_read(seed, out_dtype):
    gen = torch.Generator().manual_seed(seed)
    tokens, top_k, hidden = 9, 5, 1100  # two column blocks of 1024, the second ragged
    y = torch.randn(tokens, top_k, hidden, generator=gen)
    # present values that meet the zero's sign rule: -0.0 and exact cancellations (x then -x)
    y[0, 1] = -0.0
    y[1, 2] = -y[1, 0]
    y[4] = -0.0  # a row of only -0.0 partials: the sum is +0.0 (0 + -0 = +0), skipped or not
    ids = torch.randint(0, 300, (tokens, top_k), generator=gen, dtype=torch.int32)  # expert ids, or slots
    absent = torch.rand(tokens, top_k, generator=gen) < 0.4
    absent[2] = True  # every pair of a row absent (a padded row): +0.0 out
    absent[3] = False  # none absent
    absent[4, ::2] = True
    ids[absent] = torch.randint(-5, 0, (int(absent.sum()),), generator=gen, dtype=torch.int32)  # any negative
    zeroed = torch.where(absent[:, :, None], 0.0, y).to(DEVICE)
    poisoned = _poison(y, absent, gen).to(DEVICE)
    assert poisoned[absent.to(DEVICE)].isnan().any()
    want = moe_sum(zeroed, torch.empty(tokens, hidden, dtype=out_dtype, device=DEVICE))
    got = moe_sum(poisoned, torch.full((tokens, hidden), NAN, dtype=out_dtype, device=DEVICE), ids.to(DEVICE))
    assert torch.equal(got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))  # bits, signs too
    assert not got.isnan().any()
    assert torch.equal(got[2], torch.zeros_like(got[2])) and not torch.signbit(got[2].float()).any()
    if out_dtype == torch.float32:  # (the interpreter's bf16 cast truncates where torch's rounds to nearest)
        ref = _ordered_sum(zeroed, absent.to(DEVICE))
        assert torch.equal(want.view(torch.int32), ref.view(torch.int32))  # the ordered fp32 sum
    # control: the same buffer summed whole reads the poison
    assert moe_sum(poisoned, torch.empty(tokens, hidden, dtype=out_dtype, device=DEVICE)).isnan().any()


def test_no_pair_written_gives_zeros_and_present_ids_read_every_pair():
    y = torch.full((3, 4, 40), NAN, device=DEVICE)
    out = moe_sum(y, torch.full((3, 40), 7.0, device=DEVICE), torch.full((3, 4), -1, dtype=torch.int32, device=DEVICE))
    assert torch.equal(out, torch.zeros_like(out)) and not torch.signbit(out).any()
    y = torch.randn(3, 4, 40, device=DEVICE)
    whole = moe_sum(y, torch.empty(3, 40, device=DEVICE))
    ids = torch.zeros((3, 4), dtype=torch.int32, device=DEVICE)  # id 0 is present
    assert torch.equal(moe_sum(y, torch.empty(3, 40, device=DEVICE), ids), whole)


_COMPILE_CHECK = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adapters.kernels import moe_sum

for skip in (False, True):
    sig = {"y_ptr": "*fp32", "written_ptr": "*i32", "out_ptr": "*bf16", "H": "i32",
           **{k: "constexpr" for k in ("K", "BLOCK", "SKIP")}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    ptx = triton.compile(ASTSource(moe_sum._moe_sum_kernel, sig, dict(K=9, BLOCK=1024, SKIP=skip), attrs),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(len(re.findall(r"\\badd\\.(?:rn\\.)?f32", ptx)), len(re.findall(r"ld\\.global", ptx)))
"""


@pytest.mark.slow
def test_skip_compiles_for_sm90_to_the_same_adds():
    """The compiled path the interpreter never runs: with the ids, the partials' loads are predicated (0.0
    where off) in front of the very same fp32 adds, plus one load of the pair's id."""
    (plain_adds, plain_loads), (skip_adds, skip_loads) = (
        tuple(map(int, line.split())) for line in build_for_sm90(_COMPILE_CHECK).splitlines())
    assert plain_adds == skip_adds > 0 and skip_loads == plain_loads + 1


def test_written_is_checked():
    y = torch.zeros(2, 3, 8, device=DEVICE)
    out = torch.empty(2, 8, device=DEVICE)
    for bad in (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int32),
                torch.zeros(3, 2, dtype=torch.int32).t(), torch.zeros(2, 3)):
        with pytest.raises(ValueError, match="written"):
            moe_sum(y, out, bad.to(DEVICE))


# ---- grouped_moe's own partials ------------------------------------------------------------------------

def _fill_before_gemms(module, monkeypatch, value: float) -> None:
    """Fill the partials with `value` just before `module.grouped_gemms` writes them: NaN poisons every pair the
    GEMMs leave unwritten, 0.0 is the zero-filled buffer these paths used to allocate."""
    real = module.grouped_gemms

    def filled(x, align, weights, slots, layout, partials, *args, **kwargs):
        partials.fill_(value)
        return real(x, align, weights, slots, layout, partials, *args, **kwargs)

    monkeypatch.setattr(module, "grouped_gemms", filled)


def _sum_whole(module, monkeypatch) -> None:
    """module.moe_sum without `written`: every pair read (the sum the zero-filled paths ran)."""
    monkeypatch.setattr(module, "moe_sum", lambda y, out, written=None: moe_sum(y, out))


def test_grouped_moe_without_partials_is_the_zero_filled_sum(monkeypatch):
    layout, slots, where = make_pool(WeightFormat.BF16, 64, 32, 6, 9, seed=4, float_dtype=torch.float32)
    x, slot_ids, weights = make_batch(10, 3, where, seed=4, skip=([0, 0, 5, 7, 7, 7], [0, 2, 1, 0, 1, 2]),
                                      hidden=64)  # row 7: every pair skipped
    outs = {}
    for mode in ("zero-filled", "poisoned", "control"):
        with monkeypatch.context() as m:
            _fill_before_gemms(grouped_moe_mod, m, 0.0 if mode == "zero-filled" else NAN)
            if mode != "poisoned":
                _sum_whole(grouped_moe_mod, m)
            outs[mode] = grouped_moe(x, slot_ids, weights, slots, layout)
    assert torch.equal(outs["poisoned"], outs["zero-filled"]) and not outs["poisoned"].isnan().any()
    assert torch.equal(outs["poisoned"][7], torch.zeros_like(outs["poisoned"][7]))
    assert outs["control"].isnan().any()  # the skipped pairs hold the poison: read whole, it shows
    assert torch.equal(grouped_moe(x, slot_ids, weights, slots, layout), outs["zero-filled"])  # torch.empty as is


# ---- the pool's calls ----------------------------------------------------------------------------------

def _pool_outputs(bank, shared, slots: int, calls, mode: str, monkeypatch, **pool_kwargs) -> list[torch.Tensor]:
    """A fresh pool's outputs for `calls` (routed's arguments) with its partials zero-filled and summed whole
    (the code before the skip), poisoned and summed with the ids (as it runs), or poisoned and summed whole."""
    seen = []
    with monkeypatch.context() as m:
        for module in (expert_pool_mod, grouped_moe_mod):
            _fill_before_gemms(module, m, 0.0 if mode == "zero-filled" else NAN)
            if mode != "poisoned":
                _sum_whole(module, m)
            else:
                real = module.moe_sum
                m.setattr(module, "moe_sum", lambda y, out, written=None, real=real:
                          seen.append(written) or real(y, out, written))
        pool = DeviceExpertPool(bank, slots, DEVICE, shared_rows=shared, **pool_kwargs)
        outs = [pool.routed(layer, x, weights, ids, valid, shared=has_shared)
                for layer, x, weights, ids, valid, has_shared in calls]
        pool.check_valid()
    if mode == "poisoned":  # every sum took ids, and some pairs were skipped
        assert len(seen) == len(calls) and all(w is not None for w in seen)
        assert any(bool((w < 0).any()) for w in seen)
    return outs


def _calls(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).to(DEVICE)  # [T, K]
    weights = torch.rand(tokens, K + 1, generator=gen).to(DEVICE)  # column K: the shared expert's gate
    valid = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    valid[[1, tokens - 1]] = False  # padded rows: no routed pair written (the shared column per path)
    calls = [(layer, x, weights, ids, valid, True) for layer in range(L)]
    calls.append((0, x, weights[:, :K].contiguous(), ids, valid, False))  # no shared column
    calls.append((1, x, weights, (ids + 5) % E, None, True))  # every row valid
    return calls


@pytest.mark.parametrize("path", ["set lookup", "grouped decode", "grouped_moe"])
def test_pool_paths_without_zero_fill_are_bitwise_the_zero_filled_ones(bank_and_shared, monkeypatch, path):  # noqa: F811
    """The resident-prefill path (`_routed_set` on the grouped GEMMs: the layer's experts fit the pool), the decode
    lookup on the grouped GEMMs (`_grouped_by_expert`) and the decode lookup's one-call grouped_moe (`_moe_out`),
    padded rows included: poisoned partials summed with the ids give the zero-filled outputs bit for bit."""
    bank, shared = bank_and_shared
    monkeypatch.setattr(expert_pool_mod, "GEMV_MAX_PAIRS", 8)  # the grouped GEMMs at interpreter sizes
    if path == "set lookup":
        slots, tokens, kwargs = L * E, 8, {}  # T*K = 32 keys > S = 24: past the one-launch lookup
    elif path == "grouped decode":
        slots, tokens, kwargs = L * E, 4, {"grouped_decode_min_pairs": 1}
    else:
        slots, tokens, kwargs = L * E, 4, {}  # 16 keys: the one-launch lookup, 16 > 8 pairs: grouped_moe
    taken = []
    for name in ("_routed_set", "_grouped_by_expert", "_moe_out"):
        real = getattr(DeviceExpertPool, name)
        monkeypatch.setattr(DeviceExpertPool, name, lambda self, *a, real=real, name=name, **k:
                            taken.append(name) or real(self, *a, **k))
    calls = _calls(tokens, seed=11)
    outs = {mode: _pool_outputs(bank, shared, slots, calls, mode, monkeypatch, **kwargs)
            for mode in ("zero-filled", "poisoned", "control")}
    expect = {"set lookup": "_routed_set", "grouped decode": "_grouped_by_expert", "grouped_moe": "_moe_out"}[path]
    assert set(taken) == {expect}
    for got, want in zip(outs["poisoned"], outs["zero-filled"], strict=True):
        assert torch.equal(got, want) and not got.isnan().any()
    assert any(o.isnan().any() for o in outs["control"])  # unwritten pairs exist, and would be read whole
    plain = DeviceExpertPool(bank, slots, DEVICE, shared_rows=shared, **kwargs)  # torch.empty as it comes
    for (layer, x, weights, ids, valid, has_shared), want in zip(calls, outs["zero-filled"], strict=True):
        assert torch.equal(plain.routed(layer, x, weights, ids, valid, shared=has_shared), want)
