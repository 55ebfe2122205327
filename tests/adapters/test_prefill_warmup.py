"""The start-up warm-up of the Triton prefill (adapters/cuda_exec/prefill_warmup.py) on a tiny block-FP8
Qwen3.5 MoE in Triton's interpreter: it launches every (kernel, autotune key or specialization class) a
step of up to max_step_tokens can produce, leaves the executor's pools bitwise as they were, and the
executor skips it, saying why, where nothing is tuned or compiled ahead (CPU, the reference prefill).
The plan's arithmetic is also checked at the Qwen3.6 geometry (the BLOCK_M ranges the H200 runs re-tuned).

Specialization classes: Triton compiles an int argument apart when it is 1 and when it is divisible by 16;
for an argument c*T that depends on gcd(T, 16), recorded here as 'one' for T == 1, else gcd(T, 16).
"""

import dataclasses
import logging
import math
import warnings

import pytest
import torch

from adapters.checkpoint.loader import load_checkpoint
from adapters.checkpoint.synth import synthesize
from adapters.checkpoint.synth_config import GEOMETRIES
from adapters.cuda_exec import device_residency, fast_decoder, prefill, prefill_linear, prefill_spans
from adapters.cuda_exec import expert_pool as pool_mod
from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.prefill_warmup import (
    gemm_rows,
    grouped_tokens,
    lookup_tokens,
    plan_warmup,
    warm_prefill_kernels,
)
from adapters.kernels import dense_gemm as gemm
from adapters.kernels import dense_gemm_splitk as splitk
from adapters.kernels import dense_gemv as gemv
from adapters.kernels import fused_moe as fused_mod
from adapters.kernels import grouped_moe as grouped_mod
from tests.adapters.sm90 import build_for_sm90
from tests.adapters.torch_exec_models import Sequence, make_plan, pages_for, run_requests

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # fp32 on CUDA would tune FMA-loop tiles
MAX_TOKENS, DECODE_ROWS = 40, 4
# tiny geometry (hidden 160; attention 4 heads x 32 with the output gate, 2 kv heads; GDN 2 key and 4 value
# heads of 32; shared expert 64 wide, so not packed): the quantized [N, K] projections a step reaches
SPAN_SHAPES = {(256, 160),  # q_proj (4 x 2 x 32 with the gate)
               (64, 160),  # k_proj, v_proj, shared gate/up
               (160, 128),  # o_proj, out_proj
               (160, 64)}  # shared down
# qkvz (in_proj_qkv 2*2*32 + 4*32 = 256, in_proj_z 128): every step projects all its tokens through the stack
# (prefill_spans.py), and its parts never alone. The attention's q/k/v do not stack in block FP8 (k and v have
# 64 rows, not whole 128-row scale blocks), so they keep their own GEMMs.
STACKED = (384, 160)
# K = 160 <= 2048: 1-3 rows go to the GEMV (fp8 block), 4+ to the GEMM; 40 tokens top out in bucket 64
SPAN_BUCKETS = (4, 8, 16, 32, 64)
GROUPED_THRESHOLD = 16  # GEMV_MAX_PAIRS lowered so 40-token steps reach the grouped GEMMs


def _cls(n: int):
    return "one" if n == 1 else math.gcd(n, 16)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    geometry = dataclasses.replace(GEOMETRIES["tiny"], vocab_size=256)
    directory = synthesize(tmp_path_factory.mktemp("fp8"), geometry, "fp8_block", seed=11, tokenizer=False)
    return load_checkpoint(directory, device="cpu", progress=False)


def _executor(ckpt, device=DEVICE, **kw):
    kw.setdefault("prefill_kernels", True)
    kw.setdefault("warm_prefill", True)  # as the server builds it
    return CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=ckpt.spec.top_k * 4), device,
                             DTYPE if device == DEVICE else torch.float32, max_decode_rows=DECODE_ROWS,
                             max_step_tokens=MAX_TOKENS, **kw)


def _pools(ex) -> dict[str, torch.Tensor]:
    """Every pool tensor a warm-up must not write, as raw bytes (NaN-safe, bitwise)."""
    res = ex.experts.residency
    found = {"kv.k": ex.kv.k, "kv.v": ex.kv.v, "state.conv": ex.state.conv, "state.recurrent": ex.state.recurrent,
             "slots": ex.experts.all_slots, "slot_of_key": res.slot_of_key, "key_of_slot": res.key_of_slot,
             "stamp": res.stamp, "pinned": res.pinned, "clock": res.clock, "counters": res._counters,
             "streamed": ex.experts._streamed}
    if ex.snapshots is not None:
        found |= {"snap.conv": ex.snapshots.conv, "snap.recurrent": ex.snapshots.recurrent}
    return {k: v.detach().clone().contiguous().reshape(-1).view(torch.uint8) for k, v in found.items()}


@pytest.fixture(scope="module")
def warmed(ckpt):
    """An executor that served two requests (its pools hold data), its pools' bytes, then the warm-up run
    with every launcher recording the key it was called with."""
    ex = _executor(ckpt)
    seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + 3), state_slot=i) for i, p in enumerate([[5, 17, 3, 88, 41],
                                                                                                [2, 33]])]
    run_requests(ex, seqs, 2, chunk=4)
    before = _pools(ex)
    seen: set = set()

    def wrap(module, name, key):
        original = getattr(module, name)

        def recording(*args, **kwargs):
            found = key(*args, **kwargs)
            if found is not None:
                seen.add(found)
            return original(*args, **kwargs)

        mp.setattr(module, name, recording)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pool_mod, "GEMV_MAX_PAIRS", GROUPED_THRESHOLD)
        wrap(gemm, "dense_gemm", lambda x, q, *a, **k: ("dense_gemm", (gemm.m_bucket(x.shape[0]), *q.shape,
                                                                        q.fmt.value)))
        wrap(splitk, "dense_gemm_splitk", lambda x, q, *a, **k: ("dense_gemm_splitk", (gemm.m_bucket(x.shape[0]),
                                                                                      *q.shape, q.fmt.value)))
        wrap(gemv, "dense_gemv", lambda x, q, *a, **k: ("dense_gemv", (*q.shape, q.fmt.value)))
        wrap(grouped_mod, "moe_grouped_gate_up", lambda x, align, top_k, *a, **k: ("moe_grouped", (align.block_m, top_k)))
        wrap(fused_mod, "moe_down", lambda h, ids, *a, partials=None, **k:
             ("moe_fused", (ids.shape[1], "partials")) if partials is not None else None)
        # the one-span launchers specialize on the piece's tokens; the span-table ones take a constant
        wrap(prefill, "gdn_chunk_wy", lambda mixed, *a, **k: ("gdn_chunk_wy", _cls(mixed.shape[0])))
        wrap(prefill_spans, "gdn_chunk_wy", lambda *a, **k: ("gdn_chunk_wy", "table"))
        wrap(prefill, "gdn_chunk_state", lambda mixed, *a, **k: ("gdn_chunk_state", _cls(mixed.shape[0])))
        wrap(prefill_spans, "qk_norm_rope", lambda q, *a, **k: ("qk_norm_rope", _cls(q.shape[0])))
        wrap(prefill_spans, "paged_prefill_attention", _prefill_attention_key)
        wrap(device_residency, "layer_lookup", lambda ids, *a, **k:
             ("residency_lookup", (max(16, 1 << (ids.numel() - 1).bit_length()), _cls(ids.numel()))))
        for module in (fast_decoder, prefill_spans):  # a step of one-token rows only; a mixed step's rows
            wrap(module, "gdn_decode_step", lambda qkv, *a, **k: ("gdn_decode_step", _cls(qkv.shape[0])))
        plan = plan_warmup(ex.model, ex.experts, MAX_TOKENS, DECODE_ROWS)
        ran = []
        with warnings.catch_warnings():  # slots never filled hold garbage bytes: NaNs in the interpreter
            warnings.simplefilter("ignore", RuntimeWarning)
            report = warm_prefill_kernels(ex.model, ex.experts, plan, page_size=ex.plan.page_size,
                                          dtype=DTYPE, device=torch.device(DEVICE),
                                          on_item=lambda kernel, item: ran.append((kernel, item.key)))
    return ex, before, seen, plan, report, ran


def _prefill_attention_key(q, k_pool, v_pool, blocks, pages, scale, tokens, out):
    """(spans of the launch, whether one follows a cached prefix, whether every pointer is 16-byte aligned:
    Triton's only specialization of this kernel that a step could change)."""
    rows = blocks.tolist()  # (first row, tokens, first token's last visible position, page offset) per block
    firsts = {}
    for _, _, last, offset in rows:  # a span's blocks share its page offset; its first block's position is least
        firsts[offset] = min(last, firsts.get(offset, last))
    aligned = all(t.data_ptr() % 16 == 0 for t in (q, k_pool, v_pool, blocks, pages, out))
    return "paged_prefill_attention", (len(firsts), any(p > 0 for p in firsts.values()), aligned)


def _kind(keys, kernel):
    return {key for k, key in keys if k == kernel}


def test_the_warm_up_launches_every_tuning_key_a_step_can_produce(warmed):
    ex, _, seen, plan, report, ran = warmed
    want_gemm = {(b, n, k, "fp8_block") for n, k in SPAN_SHAPES | {STACKED} for b in SPAN_BUCKETS}
    # buckets of up to SPLITK_MAX_ROWS rows tune the split-K GEMM (prefill_linear sends them there), the rest dense_gemm
    assert _kind(seen, "dense_gemm") | _kind(seen, "dense_gemm_splitk") == want_gemm
    assert {key[0] for key in _kind(seen, "dense_gemm_splitk")} == {4, 8, 16, 32}
    assert _kind(seen, "dense_gemv") == {(n, k, "fp8_block") for n, k in SPAN_SHAPES | {STACKED}}
    # 9..40 tokens x top-2 over at most 8 experts + 1: mean group size under 24, BLOCK_M 16 only
    assert _kind(seen, "moe_grouped") == {(16, 2)}
    assert _kind(seen, "moe_fused") == {(2, "partials")}
    # the plan names what ran: its tuned keys are exactly the ones launched
    assert _kind(plan.keys(), "dense_gemm") == want_gemm
    for kernel in ("dense_gemv", "moe_grouped", "moe_fused"):
        assert _kind(plan.keys(), kernel) == _kind(seen, kernel), kernel
    assert ran == [(kernel, item.key) for kernel, item in plan.items()] and report.skipped == []
    # the tuned GEMM keys run first, each at its bucket's largest row count (40 for bucket 64)
    assert [k for k, _ in ran[:len(plan.gemm)]] == ["dense_gemm"] * len(plan.gemm)
    assert {i.rows for i in plan.gemm if i.key[0] == 64} == {MAX_TOKENS}


def test_with_the_dequantized_copy_on_the_plan_compiles_it_and_stops_the_gemm_buckets_below_it(warmed, monkeypatch):
    ex = warmed[0]
    assert plan_warmup(ex.model, ex.experts, MAX_TOKENS, DECODE_ROWS).dequants == ()  # off by default
    monkeypatch.setattr(prefill_linear, "DEQUANT_MIN_ROWS", 33)  # steps of 33-40 rows take cuBLAS over the copy
    plan = plan_warmup(ex.model, ex.experts, MAX_TOKENS, DECODE_ROWS)
    # every weight a 40-token step projects (not the LM head: at most DECODE_ROWS rows) compiles the copy once
    assert {i.key for i in plan.dequants} == {(n, k, "fp8_block") for n, k in SPAN_SHAPES | {STACKED}}
    # and dense_gemm stops at the bucket of 32 rows: bucket 64 (33-40 rows) never reaches it
    assert {i.key[0] for i in plan.gemm} == set(SPAN_BUCKETS) - {64}
    assert max(i.rows for i in plan.gemm) == 32
    only = dataclasses.replace(plan, gemm=(), gemv=(), grouped=(), fused=(), forwards=(), gdn_pieces=(),
                               moe_blocks=())
    ran = []
    report = warm_prefill_kernels(ex.model, ex.experts, only, page_size=ex.plan.page_size, dtype=DTYPE,
                                  device=torch.device(DEVICE), on_item=lambda kernel, item: ran.append(kernel))
    assert ran == ["dequant_weight"] * len(plan.dequants) and report.skipped == []


def test_the_warm_up_compiles_every_specialization_class_of_the_mixers(warmed):
    _, _, seen, _, _, _ = warmed
    every = {"one", 1, 2, 4, 8, 16}
    # each span's state walk: spans of 17, 18, 20, 24, 32 (and 16) tokens, a 1-token piece; the conv and WY of a
    # step's spans (or of one piece) in one launch: one binary
    assert _kind(seen, "gdn_chunk_state") == every
    assert _kind(seen, "gdn_chunk_wy") == {"table"}
    assert _kind(seen, "qk_norm_rope") == every
    # the attention of a step's spans: one launch over both spans of the two-span step (one after a cached
    # prefix) and the single spans, every pointer aligned alike: the one binary a request's steps reuse
    assert _kind(seen, "paged_prefill_attention") == {(1, False, True), (2, True, True)}
    assert _kind(seen, "gdn_decode_step") == {"one", 2, 4}  # mixed steps' decode rows, up to 4 running
    # chunks of 1-4 tokens x top-2 fit the one-launch lookup on 8 slots: 2, 4, 6, 8 keys in one 16-wide block
    assert _kind(seen, "residency_lookup") == {(16, 2), (16, 4), (16, 8)}
    assert _kind(warmed[3].keys(), "moe_block") == _kind(seen, "residency_lookup")


def test_the_warm_up_leaves_every_pool_bitwise_unchanged(warmed):
    ex, before, _, _, _, _ = warmed
    after = _pools(ex)
    assert before.keys() == after.keys()
    for name, data in before.items():
        assert torch.equal(data, after[name]), f"{name} changed"
    ex.check_valid()


def test_the_executor_skips_the_warm_up_where_nothing_is_tuned_ahead(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="adapters.cuda_exec.executor"):
        ex = _executor(ckpt, "cpu")
        ref = _executor(ckpt, "cpu", prefill_kernels=False)
    assert ex.warmup is None and ref.warmup is None
    text = caplog.text
    assert "prefill kernel warm-up skipped: cpu runs the kernels without autotuning" in text
    assert "prefill kernel warm-up skipped: the reference prefill runs" in text


def test_the_plan_at_the_qwen36_geometry_covers_the_block_sizes_the_h200_re_tuned(monkeypatch):
    # 8 routed + the packed shared expert (9 columns) over 256 experts (+1): BLOCK_M 16 below a mean group of
    # 24 pairs (685 tokens), 32 below 48 (1,370), 64 below 384 (10,965), then 128; grouped above 512 pairs
    assert grouped_tokens(16_500, 8, 9, 257, 512) == {16: 685, 32: 1370, 64: 10965, 128: 16_500}
    assert min(t for t in range(1, 2000) if t * 8 > 512) == 65
    assert grouped_tokens(2048, 8, 9, 257, 512) == {16: 685, 32: 1370, 64: 2048}
    # block FP8 with the split-K GEMM (the default): GEMV up to 2 rows; then one key per power-of-two bucket, the
    # top one at 4096 rows (up to 32 rows the split-K GEMM's keys)
    assert gemm_rows(16_500, 2048, True) == (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert gemm_rows(16_500, 4096, True) == (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert gemm_rows(100, 2048, False) == (1, 2, 4, 8, 16, 32, 64, 100)  # no GEMV: every bucket
    monkeypatch.setattr(prefill_linear, "SPLITK_MAX_ROWS", 0)  # without it: K = 2048, GEMV up to 3 rows
    assert gemm_rows(16_500, 2048, True) == (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert gemm_rows(16_500, 4096, True) == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # GEMV up to 8 rows
    assert gemm_rows(100, 2048, False) == (1, 2, 4, 8, 16, 32, 64, 100)  # 4-bit: no GEMV; bucket 128 at 100
    # the one-launch lookup (up to 256 keys, 8 per token): one compile per BLOCK_N and class of 8T
    assert lookup_tokens(16_500, 8, 256) == (1, 2, 3, 4, 7, 8, 15, 16, 31, 32)
    with pytest.raises(ValueError, match="max_tokens"):
        plan_warmup(None, None, 0, 4)


def test_every_autotuned_kernel_keeps_its_tunings_on_disk():
    """Read in a Python without the interpreter (whose autotuner turns disk caching off, and whose kernels
    carry no specialization flags)."""
    script = """
from adapters.kernels import dense_gemm, dense_gemv, moe_down, moe_gate_up, moe_grouped_down, moe_grouped_gate_up
for m in (dense_gemm, dense_gemv, moe_gate_up, moe_down, moe_grouped_gate_up, moe_grouped_down):
    print(m.__name__.split(".")[-1], m._TUNED.cache_results)
f = dense_gemm._dense_gemm_kernel  # names or indices, by Triton version
print("dense_gemm_do_not_specialize", *(k if isinstance(k, str) else f.arg_names[k] for k in f.do_not_specialize))
"""
    lines = dict(line.split(" ", 1) for line in build_for_sm90(script, timeout=120).splitlines())
    assert lines == {"dense_gemm": "True", "dense_gemv": "True", "moe_gate_up": "True", "moe_down": "True",
                     "moe_grouped_gate_up": "True", "moe_grouped_down": "True",
                     # M and M_BUCKET only bound the row mask: one dense_gemm binary for every row count
                     "dense_gemm_do_not_specialize": "M M_BUCKET"}


@pytest.mark.gpu
@pytest.mark.timeout(400)  # the warm-up itself: ~30 keys x 9 tiles benchmarked, plus their compiles
def test_after_the_warm_up_no_step_on_the_gpu_tunes_or_compiles(ckpt, monkeypatch):
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    phases = []
    ex = CudaGraphExecutor(ckpt, make_plan(ckpt, expert_slots=ckpt.spec.top_k * 4), "cuda", torch.bfloat16,
                           max_decode_rows=DECODE_ROWS, max_step_tokens=160, prefill_kernels=True,
                           warm_prefill=True, on_phase=phases.append)
    assert [p.split(" ")[0] for p in phases] == ["capturing", "decode", "tuning", "prefill"]
    assert phases[-1] == f"prefill kernels tuned in {ex.warmup.seconds:.1f} s" and ex.warmup.skipped == []
    events = []

    def spy(name, original):
        def recording(self, *args, **kwargs):
            events.append((name, getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?")))
            return original(self, *args, **kwargs)
        return recording

    monkeypatch.setattr(Autotuner, "_bench", spy("tune", Autotuner._bench))
    if hasattr(JITFunction, "_do_compile"):  # Triton >= 3.4; before, only the tuning is checked
        monkeypatch.setattr(JITFunction, "_do_compile", spy("compile", JITFunction._do_compile))
    # three prompts in one continuous batch, chunks of up to 48 tokens (steps of up to 144), then decodes
    # mixed with the last chunks: lengths whose buckets, BLOCK_M and specializations the warm-up covered
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate((5, 70, 131))]
    seqs = [Sequence(f"r{i}", p, pages_for(i, len(p) + 4), state_slot=i) for i, p in enumerate(prompts)]
    run_requests(ex, seqs, 3, chunk=48)
    assert events == [], f"tuned or compiled on a request's path: {sorted(set(events))}"
