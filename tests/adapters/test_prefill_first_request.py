"""The first prefill requests after the start-up warm-up (adapters/cuda_exec/prefill_warmup.py) compile nothing and
meet no attention dispatch for the first time, whatever their length: prompts of odd length, one past the paged
attention kernel's bound, and one in two chunks whose second attends over the first, on a tiny block-FP8 Qwen3.5
MoE in Triton's interpreter.

Why: on the H200 the first 1,030-token prompt after start-up took 2.13 s to its first token and the second 0.14 s;
the first 16,381-token prompt (two chunks) 2.31 s against 0.85 s (docs/prefill-kernels.md, "First requests").

What is recorded: every Triton launch's JIT cache key as Triton computes it on an sm_90 GPU (its binder over the
kernel's signature: each int argument specialized on == 1 and on divisibility by 16 unless do_not_specialize,
each pointer on 16-byte alignment, the constexprs and launch options), from the interpreter, which runs the same
launches but compiles nothing; and each long span's SDPA call (the attention of spans past
PAGED_PREFILL_MAX_PAIRS), by kind (a span from position 0 or after a cached prefix) and whether torch may pick
cuDNN for it (cuDNN builds a graph per shape: per prompt length). PAGED_PREFILL_MAX_PAIRS is lowered to 1,024 so
spans of 33+ tokens leave the paged kernel at this size, as 725+ tokens do at 2^19.
"""

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

from adapters.checkpoint.loader import load_checkpoint
from adapters.checkpoint.synth import synthesize
from adapters.checkpoint.synth_config import GEOMETRIES
from adapters.cuda_exec import expert_pool as pool_mod
from adapters.cuda_exec import prefill_spans, step_plan
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.prefill_warmup import ForwardItem, long_span, plan_warmup, warm_prefill_kernels
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams
from tests.adapters.torch_exec_models import make_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_TOKENS, DECODE_ROWS, PAIRS = 40, 4, 1024
# 37: odd, one chunk past the paged kernel (37 * 37 > 1024); 70: chunks of 40 and 30, the second after 40 cached
# tokens (30 * 70 > 1024): SDPA's lower-right dispatch
PROMPTS = (37, 70)


class LaunchKeys:
    """The JIT cache key of each Triton launch as an sm_90 GPU would file it, recorded from the interpreter."""

    def __init__(self):
        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binders: dict[int, object] = {}
        self.keys: set[tuple] = set()

    def launch(self, fn: InterpretedFunction, args, kwargs) -> None:
        binder = self.binders.get(id(fn))
        if binder is None:
            jit = JITFunction(fn.fn, do_not_specialize=fn.kwargs.get("do_not_specialize"),
                              do_not_specialize_on_alignment=fn.kwargs.get("do_not_specialize_on_alignment"))
            binder = self.binders[id(fn)] = create_function_from_signature(jit.signature, jit.params, self.backend)
        _, specialization, options = binder(*args, **kwargs)
        self.keys.add((fn.fn.__qualname__, repr(specialization), repr(sorted(options.items()))))

    def sdpa(self, q: torch.Tensor, k: torch.Tensor) -> None:
        kind = "from position 0" if q.shape[-2] == k.shape[-2] else "after a cached prefix"
        self.keys.add(("sdpa", kind, "cudnn" if torch.backends.cuda.cudnn_sdp_enabled() else "no cudnn"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    geometry = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)
    directory = synthesize(tmp_path_factory.mktemp("fp8"), geometry, "fp8_block", seed=11, tokenizer=False)
    return load_checkpoint(directory, device="cpu", progress=False)


@pytest.fixture(scope="module")
def first_requests(ckpt):
    """(keys the warm-up launched, keys the prompts launched after it, the warm-up plan)."""
    rec = LaunchKeys()
    run, sdpa = InterpretedFunction.run, F.scaled_dot_product_attention

    def recording_run(self, *args, grid, warmup, **kwargs):
        rec.launch(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def recording_sdpa(q, k, v, *args, **kwargs):
        rec.sdpa(q, k)
        return sdpa(q, k, v, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # never-filled slots hold garbage bytes: NaNs
        mp.setattr(step_plan, "PAGED_PREFILL_MAX_PAIRS", PAIRS)
        mp.setattr(pool_mod, "GEMV_MAX_PAIRS", 16)  # 40-token steps reach the grouped GEMMs, as prompts do at 8k
        mp.setattr(InterpretedFunction, "run", recording_run)
        # NOTE: prefill_spans' own F only: torch's CausalBias dispatch recognises SDPA by identity
        mp.setattr(prefill_spans, "F", SimpleNamespace(scaled_dot_product_attention=recording_sdpa))
        ex = CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=ckpt.spec.top_k * 4), "cpu", torch.float32,
                               max_decode_rows=DECODE_ROWS, max_step_tokens=MAX_TOKENS, prefill_kernels=True)
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        # on a GPU the decode graphs' capture runs an eager decode step first (its miss gather among the kernels it
        # compiles); the CPU executor captures nothing: one such step here
        ex.execute(StepBatch((SequenceWork("start-up", (1,), 0, (99,), 3, True, greedy, 0),)))
        plan = plan_warmup(ex.model, ex.experts, MAX_TOKENS, DECODE_ROWS)
        # what the executor runs at start-up on CUDA (on the CPU it skips it: nothing to compile ahead)
        warm_prefill_kernels(ex.model, ex.experts, plan, page_size=ex.plan.page_size, dtype=torch.float32,
                             device=torch.device("cpu"))
        warm, rec.keys = rec.keys, set()
        for i, n in enumerate(PROMPTS):
            prompt = tuple((31 * j + 7 * i) % 256 for j in range(n))
            pages = tuple(range(i * 20, i * 20 + -(-n // ex.plan.page_size)))
            for s in range(0, n, MAX_TOKENS):
                part = prompt[s:s + MAX_TOKENS]
                ex.execute(StepBatch((SequenceWork(f"p{i}", part, s, pages, i, s + len(part) == n, greedy, 0),)))
    return warm, rec.keys, plan


def test_the_warm_up_runs_both_sdpa_dispatches_of_a_long_span(ckpt, monkeypatch):
    # at the server's step of 8,192 tokens: a 725-token span from position 0 and one after a 1-token prefix
    ex = CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=ckpt.spec.top_k * 4), "cpu", torch.float32,
                           max_decode_rows=DECODE_ROWS, max_step_tokens=64, prefill_kernels=True)
    assert long_span() == 725 and long_span() ** 2 > step_plan.PAGED_PREFILL_MAX_PAIRS >= 724 ** 2
    forwards = plan_warmup(ex.model, ex.experts, 8192, DECODE_ROWS).forwards
    assert {ForwardItem(((725, 0),), 0), ForwardItem(((725, 1),), 0)} <= set(forwards)
    # a step too small for a 725-token span plans none (the scratch steps stay short)
    assert max(n for f in plan_warmup(ex.model, ex.experts, 724, DECODE_ROWS).forwards for n, _ in f.spans) <= 32
    monkeypatch.setattr(step_plan, "PAGED_PREFILL_MAX_PAIRS", PAIRS)
    assert long_span() == 33


def test_after_the_warm_up_prompts_of_any_length_compile_nothing(first_requests):
    warm, seen, plan = first_requests
    new = sorted(seen - warm)
    assert new == [], (f"first met on a request's path: {new}; the warm-up's keys of those kernels: "
                       f"{sorted(k for k in warm if k[0] in {n[0] for n in new})}")
    # the prompts did run the kernels and both long-span dispatches, neither where torch could pick cuDNN
    assert {k[0] for k in seen} >= {"_dense_gemm_kernel", "_gdn_chunk_state_kernel", "_qk_norm_rope_kernel", "sdpa"}
    assert {k for k in seen if k[0] == "sdpa"} == {("sdpa", "from position 0", "no cudnn"),
                                                   ("sdpa", "after a cached prefix", "no cudnn")}
    assert {ForwardItem(((33, 0),), 0), ForwardItem(((33, 1),), 0)} <= set(plan.forwards)
