"""The fast path's prefill fuses each residual add into the norm after it (FastDecoder._layers, as the decode step
does), and its MoE norm writes the fp32 router's input in the same launch: the same bits as MoeDecoder._layers'
add-then-norm and cast, in fp32 and in bf16 (where the sum is rounded: rms_norm rounds it as a torch add does), for
whole prompts, mixed steps and a layered chunk's groups.

On the CPU the kernels run in Triton's interpreter, whose fp32 -> bf16 casts truncate where a GPU's (and torch's)
round to nearest even (test_the_interpreter_truncates_bf16_casts): there only fp32 can show the same bits, and the
bf16 cases run on a GPU."""

import pytest
import torch

import adapters.cuda_exec.fast_decoder as fd
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.fast_decoder import FastDecoder
from adapters.torch_exec.decoder import MoeDecoder
from tests.adapters.test_fast_executor import _run, make_ckpt
from tests.adapters.test_layered_prefill import GROUPS, _plan, assert_same, scenario
from tests.adapters.torch_exec_models import make_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ON_GPU = pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
    DEVICE != "cuda", reason="the interpreter truncates fp32 -> bf16 casts; a GPU rounds them as torch does"))
DTYPES = [pytest.param(torch.float32, id="fp32"), BF16_ON_GPU]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt("hybrid_3to1", tmp_path_factory)


def _fast(ckpt, dtype) -> CudaGraphExecutor:
    ex = CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=ckpt.spec.top_k * 4), DEVICE, dtype,
                           max_decode_rows=4, prefill_kernels=True)
    # NOTE: replays off: this file counts the eager prefill steps' fused norms, and short chunks would run as decode
    # replays, equal within rounding only (ADR 0026; their own tests: test_short_prompt_replays.py)
    ex.short_prompt_tokens = 0
    return ex


def _counting_fused_norm(monkeypatch) -> list[tuple[bool, bool]]:
    """Every fused_norm call of the fast decoder as (with a residual, with an fp32 copy)."""
    calls, real = [], fd.fused_norm

    def spy(*a, residual=None, fp32_copy=False, **k):
        calls.append((residual is not None, fp32_copy))
        return real(*a, residual=residual, fp32_copy=fp32_copy, **k)

    monkeypatch.setattr(fd, "fused_norm", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_and_decode_logits_are_the_bits_of_add_then_norm(ckpt, dtype, monkeypatch):
    calls = _counting_fused_norm(monkeypatch)
    fused_logits = {}
    fused_tokens = _run(_fast(ckpt, dtype), fused_logits)
    prefill_fused = sum(1 for res, _ in calls if res)
    assert prefill_fused > 0  # the fused loop ran
    # an fp32 router beside bf16 activations reads the norm's fp32 copy (a fp32 model needs none)
    assert any(copy for _, copy in calls) == (dtype == torch.bfloat16)
    monkeypatch.setattr(FastDecoder, "_layers", MoeDecoder._layers)  # add, then norm, then the router's cast
    calls.clear()
    plain_logits = {}
    assert _run(_fast(ckpt, dtype), plain_logits) == fused_tokens
    # the decode step fuses either way; the plain loop's prefill norms take no residual
    assert sum(1 for res, _ in calls if res) < prefill_fused
    assert plain_logits.keys() == fused_logits.keys()
    for rid, rows in plain_logits.items():
        assert len(rows) == len(fused_logits[rid])
        for a, b in zip(fused_logits[rid], rows, strict=True):
            assert torch.equal(a, b), (rid, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layered_chunk_gives_the_bits_of_the_plain_loop(ckpt, dtype, monkeypatch):
    """A group ends on a plain add (no norm after its last layer) and the next one starts from that stream."""
    def layered():  # the layered tests' plan: snapshot slots and staging rows
        fast = CudaGraphExecutor(ckpt, _plan(ckpt), DEVICE, dtype, max_decode_rows=4, prefill_kernels=True)
        return scenario(fast, GROUPS["1-2-1"], chunked=("p",))

    fused = layered()
    monkeypatch.setattr(FastDecoder, "_layers", MoeDecoder._layers)
    assert_same(fused, layered())


@pytest.mark.skipif(DEVICE == "cuda", reason="what the interpreter does; a GPU rounds to nearest even")
def test_the_interpreter_truncates_bf16_casts():
    """Why the bf16 cases above need a GPU: in Triton's interpreter the fused norm's sum is x + r truncated to bf16
    (if this starts failing, the interpreter rounds as torch does, and the bf16 cases can run here too)."""
    from adapters.kernels.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(7, 64, generator=gen).bfloat16() for _ in range(2))
    total, _ = rms_norm(x, torch.zeros(64), 1e-6, unit_offset=True, residual=r)
    exact = x.float() + r.float()
    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    assert torch.equal(total, truncated) and not torch.equal(total, x + r)
