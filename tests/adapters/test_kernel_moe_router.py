"""Fused MoE router kernel against adapters/torch_exec/moe.py (`route`, the shared expert's gate), on the
CPU under Triton's interpreter; the same tests run on the GPU.

Bounds: fp32 weights within 1e-5 relative (the kernel's dot/sum order differs from torch's); ids equal
to torch.topk's, and on exact ties to a stable descending sort's (lowest id first). bf16 shared gate:
within 2 bf16 ulps (the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even).
"""

import pytest
import torch

from adapters.kernels.moe_router import moe_router
from adapters.torch_exec.linear import linear
from adapters.torch_exec.moe import route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_poisoned(x, w, top_k, renorm, g=None, **kw):
    ko = top_k + (g is not None)
    out = (torch.full((x.shape[0], ko), float("nan"), device=DEVICE),
           torch.full((x.shape[0], ko), -7, dtype=torch.int64, device=DEVICE))
    got = moe_router(x.to(DEVICE), w.to(DEVICE), top_k, renorm, None if g is None else g.to(DEVICE),
                     out=out, **kw)
    assert got[0] is out[0] and got[1] is out[1]
    return got[0].cpu(), got[1].cpu()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_route_and_the_shared_gate(renorm, dtype):
    gen = torch.Generator().manual_seed(5)
    t, h, e, k = 5, 72, 40, 4  # E and H not powers of two, H over several tiles
    x = torch.randn(t, h, generator=gen).to(dtype)
    w = torch.randn(e, h, generator=gen) * 0.2
    g = (torch.randn(1, h, generator=gen) * 0.1).to(dtype)
    want_w, want_i = route(x, w, k, renorm)
    got_w, got_i = run_poisoned(x, w, k, renorm, g, shared_id=99)
    assert torch.equal(got_i[:, :k], want_i)
    assert rel(got_w[:, :k], want_w) < 1e-5
    assert (got_i[:, k] == 99).all()
    gate = torch.sigmoid(linear(x, g))[:, 0].float()  # [T], in x's dtype as the reference computes it
    if dtype == torch.float32:
        assert rel(got_w[:, k], gate) < 1e-5
    else:
        assert ((got_w[:, k] - gate).abs() <= 2 * gate.abs() * 2.0 ** -8).all()
        assert torch.equal(got_w[:, k].to(dtype).float(), got_w[:, k])  # representable in bf16


def test_router_breaks_exact_ties_by_the_lowest_id():
    gen = torch.Generator().manual_seed(7)
    t, h, e, k = 6, 32, 24, 6
    w = torch.randn(e, h, generator=gen) * 0.3
    for dup, src in ((3, 17), (9, 17), (20, 17), (1, 5), (14, 5), (11, 2)):  # equal rows: equal logits
        w[dup] = w[src]
    x = torch.randn(t, h, generator=gen)
    x[:3] += 2.0 * w[17]  # rows 0-2 put expert 17's group of four equal logits on top
    logits = x @ w.T
    probs = torch.softmax(logits, dim=-1)
    assert (probs[:3].argsort(dim=-1, descending=True, stable=True)[:, :4].sort().values
            == torch.tensor([3, 9, 17, 20])).all()  # the tie really is in the top-k
    want_w, want_i = torch.sort(probs, dim=-1, descending=True, stable=True)
    got_w, got_i = run_poisoned(x, w, k, False)
    assert torch.equal(got_i, want_i[:, :k])
    assert rel(got_w, want_w[:, :k]) < 1e-5
    assert (got_i[:3, :4] == torch.tensor([3, 9, 17, 20])).all()  # ascending ids inside the tie


def test_router_with_precomputed_logits_and_many_tokens():
    gen = torch.Generator().manual_seed(11)
    t, h, e, k = 129, 16, 10, 2
    x = torch.randn(t, h, generator=gen)
    w = torch.randn(e, h, generator=gen)
    logits = torch.randn(t, e, generator=gen) * 3  # deliberately not x @ w^T: the kernel must use these
    got_w, got_i = run_poisoned(x, w, k, True, logits=logits.to(DEVICE))
    probs = torch.softmax(logits, dim=-1)
    want_w, want_i = torch.topk(probs, k, dim=-1)
    assert torch.equal(got_i, want_i)
    assert rel(got_w, want_w / want_w.sum(-1, keepdim=True)) < 1e-5
    assert torch.allclose(got_w.sum(-1), torch.ones(t))


def test_router_with_a_bf16_router_rounds_its_logits():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 48, generator=gen).bfloat16()
    w = (torch.randn(12, 48, generator=gen) * 0.2).bfloat16()
    want_w, want_i = route(x, w, 3, False)
    got_w, got_i = run_poisoned(x, w, 3, False)
    assert torch.equal(got_i, want_i)
    # NOTE: interpreter truncation of the bf16 logits moves probabilities by up to ~|logit| * 2^-7
    assert rel(got_w, want_w) < (1e-5 if DEVICE == "cuda" else 3e-2)


@pytest.mark.parametrize("args, kwargs, match", [
    ((torch.randn(2, 8), torch.randn(4, 6), 2, True), {}, "router_weight"),
    ((torch.randn(2, 8), torch.randn(4, 8), 5, True), {}, "top_k"),
    ((torch.randn(2, 8), torch.randn(4, 8).double(), 2, True), {}, "fp32"),
    ((torch.randn(2, 8), torch.randn(4, 8), 2, True, torch.randn(2, 8)), {}, "shared_gate_weight"),
    ((torch.randn(2, 8), torch.randn(4, 8), 2, True), {"logits": torch.randn(2, 3)}, "logits"),
])
def test_router_refuses_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        moe_router(*args, **kwargs)


def test_router_at_the_largest_expert_count():
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(2, 40, generator=gen)
    w = torch.randn(512, 40, generator=gen) * 0.5
    want_w, want_i = route(x, w, 10, True)
    got_w, got_i = run_poisoned(x, w, 10, True)
    assert torch.equal(got_i, want_i)
    assert rel(got_w, want_w) < 1e-5
