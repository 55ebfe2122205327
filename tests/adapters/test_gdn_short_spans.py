"""The opt-in short-span path of prefill_spans.gdn_spans (GDN_SHORT_SPAN_TOKENS, env FLUXTIDE_GDN_SHORT_SPANS; ADR
0025): a Gated DeltaNet group whose spans are all at most that many tokens runs its recurrence in one
gdn_recurrent_spans launch after the conv, instead of gdn_chunk_wy and the state walk. One step of short spans (one
after a cached prefix), decode rows, a long span cut by a prefix-cache snapshot (its pieces longer than the
threshold: the chunked path) and a short span cut by one (both pieces on the short path) gives, with the switch on,
gdn_spans' outputs, the state pools and the snapshot slots of the switch-off run, and the reference executor's
logits and pools (test_prefill_spans' oracle: each work a step of its own). A group holding one span past the
threshold stays chunked. The start-up warm-up launches the new kernel with a served step's JIT key. And the parsing
of the switch.

On the CPU the Triton kernels run in Triton's interpreter (fp32 tiny model). Bounds: on against off 1e-5 of each
tensor's scale (the recurrent and the chunked forms are both the exact delta rule: fp32 rounding apart); against
the reference test_prefill_spans' own (1e-4 of the logit scale; pools rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from adapters.cuda_exec import fast_decoder, prefill_spans
from adapters.cuda_exec.prefill_warmup import GdnPieceItem, WarmupPlan, warm_prefill_kernels
from adapters.torch_exec.executor import TorchExecutor
from domain.ports import StepBatch
from tests.adapters.test_prefill_first_request import LaunchKeys
from tests.adapters.test_prefill_spans import (
    DEVICE,
    TOL,
    _fast,
    _fast_step,
    _plan,
    _pools,
    _work,
    _worst,
    grouped_moe,  # noqa: F401 (autouse fixture)
)
from tests.adapters.torch_exec_models import QWEN3_5_CONFIGS, build_hf_model, save_and_load

SHORT = 4  # the switch's threshold here
ON_OFF = 1e-5  # on against off, of each tensor's scale


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """3 Gated DeltaNet layers and 1 attention layer, as Qwen3.6 mixes them (Nv = 2 Nk)."""
    return save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path_factory.mktemp("h"))


def _scenario():
    """(setup works, the step's works). In the step: `a` 3 tokens after 9 cached (a state to continue), `c` 2 and
    `f` 4 (== SHORT) from 0: the short group; `b` 13 from 0 cut by a snapshot 8 in (slot 0): pieces of 8 and 5, the
    chunked path; `g` 6 from 0 cut 3 in (snapshot slot 1): pieces of 3 and 3, the short path; d1, d2 one decode
    row each, between the spans."""
    gen = torch.Generator().manual_seed(11)
    p = {name: torch.randint(0, 96, (n,), generator=gen).tolist()
         for name, n in (("a", 12), ("d1", 6), ("b", 13), ("c", 2), ("d2", 7), ("f", 4), ("g", 6))}
    setup = [_work("a", 0, p["a"], 0, 9), _work("d1", 1, p["d1"], 0, 5), _work("d2", 4, p["d2"], 0, 6)]
    step = [_work("a", 0, p["a"], 9, 3), _work("d1", 1, p["d1"], 5, 1), _work("b", 2, p["b"], 0, 13, ((8, 0),)),
            _work("c", 3, p["c"], 0, 2), _work("d2", 4, p["d2"], 6, 1), _work("f", 5, p["f"], 0, 4),
            _work("g", 6, p["g"], 0, 6, ((3, 1),))]
    return setup, step


def _spied_step(ex, works, monkeypatch) -> tuple[dict, list, dict]:
    """One step on the fast executor with gdn_spans' outputs recorded per call (one per GDN layer, in order) and
    the GDN launches counted: (logits {rid: [n, V]}, outputs [[T, H]], calls {name: [arguments noted]})."""
    outs, calls = [], {"gdn_recurrent_spans": [], "gdn_chunk_wy": [], "gdn_conv_prefill_spans": []}

    def spy(name, fn, note):
        def wrapped(*args, **kwargs):
            calls[name].append(note(*args, **kwargs))
            return fn(*args, **kwargs)
        return wrapped

    def record(*args, **kwargs):
        out = real_gdn_spans(*args, **kwargs)
        outs.append(out.clone())
        return out

    real_gdn_spans = fast_decoder.gdn_spans
    with monkeypatch.context() as m:
        m.setattr(fast_decoder, "gdn_spans", record)
        m.setattr(prefill_spans, "gdn_recurrent_spans", spy(
            "gdn_recurrent_spans", prefill_spans.gdn_recurrent_spans,
            lambda *a, max_len, **k: (tuple(a[5].tolist()), max_len)))  # (span lengths, max_len)
        m.setattr(prefill_spans, "gdn_chunk_wy", spy(
            "gdn_chunk_wy", prefill_spans.gdn_chunk_wy,
            lambda *a, chunks, **k: tuple((chunks[1] - chunks[0]).tolist())))  # the tokens of each chunk
        m.setattr(prefill_spans, "gdn_conv_prefill_spans", spy(
            "gdn_conv_prefill_spans", prefill_spans.gdn_conv_prefill_spans, lambda *a, **k: tuple(a[4].tolist())))
        logits = _fast_step(ex, works)
    return logits, outs, calls


def _scale_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def test_short_spans_run_in_one_launch_and_match_the_chunked_path(ckpt, monkeypatch):
    """Switch on (SHORT = 4) against off on the same pools, and against the reference executor."""
    setup, step = _scenario()
    fast, ref = _fast(ckpt), TorchExecutor(ckpt, _plan(ckpt), DEVICE, torch.float32)
    _fast_step(fast, setup)
    for w in setup:
        ref.compute_logits(StepBatch((w,)))
    before = {name: t.clone() for name, t in _pools(fast).items()}
    ref_before = {name: t.clone() for name, t in _pools(ref).items()}

    monkeypatch.setattr(prefill_spans, "GDN_SHORT_SPAN_TOKENS", 0)
    off_logits, off_outs, off_calls = _spied_step(fast, step, monkeypatch)
    off_pools = {name: t.clone() for name, t in _pools(fast).items()}
    for name, t in _pools(fast).items():  # the same step again, from the same states
        t.copy_(before[name])
    monkeypatch.setattr(prefill_spans, "GDN_SHORT_SPAN_TOKENS", SHORT)
    on_logits, on_outs, on_calls = _spied_step(fast, step, monkeypatch)
    on_pools = _pools(fast)

    # the paths taken, per GDN layer: the short group, g's two pieces (one launch each, max_len the threshold);
    # b's pieces (8 and 5 tokens: one chunk each) the chunked path; off, every group chunked
    gdn = len(fast.model.linear_layers)
    assert len(on_outs) == len(off_outs) == gdn
    assert on_calls["gdn_recurrent_spans"] == [((3, 2, 4), SHORT), ((3,), SHORT), ((3,), SHORT)] * gdn
    assert on_calls["gdn_chunk_wy"] == [(8,), (5,)] * gdn
    assert off_calls["gdn_recurrent_spans"] == []
    assert off_calls["gdn_chunk_wy"] == [(3, 2, 4), (8,), (5,), (3,), (3,)] * gdn
    assert on_calls["gdn_conv_prefill_spans"] == off_calls["gdn_conv_prefill_spans"]  # the conv as before

    # on against off: gdn_spans' outputs, the logits, the state and snapshot pools (the conv states bitwise: the
    # same conv kernel on the same inputs in the first GDN layer; later layers' inputs carry the rounding)
    for on, off in zip(on_outs, off_outs, strict=True):
        assert _scale_err(on, off) <= ON_OFF
    assert _worst(on_logits, off_logits) <= ON_OFF
    for name, t in on_pools.items():
        assert torch.equal(t != before[name], off_pools[name] != before[name]), name  # the same places written
        assert _scale_err(t, off_pools[name]) <= ON_OFF, name
    assert torch.equal(on_pools["conv"][0], off_pools["conv"][0])
    assert (on_pools["snap.recurrent"][:, 1] != 0).any()  # g's cut (short path) and b's (chunked) were taken
    assert (on_pools["snap.recurrent"][:, 0] != 0).any()

    # against the reference executor, each work a step of its own
    want = {}
    for w in step:
        want |= ref.compute_logits(StepBatch((w,)), all_positions=True)
    assert _worst(on_logits, want) <= TOL
    for name, mine in on_pools.items():
        theirs = _pools(ref)[name]
        assert torch.equal(mine != before[name], theirs != ref_before[name]), name
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5), name
    fast.check_valid()


def test_a_group_with_a_long_span_stays_chunked(ckpt, monkeypatch):
    """The threshold is per group: step_plan puts every uncut span of a step in one group, so one span longer than
    the threshold keeps its short neighbours on the chunked path (one WY launch for all of them)."""
    gen = torch.Generator().manual_seed(2)
    works = [_work(f"r{i}", i, torch.randint(0, 96, (n,), generator=gen).tolist(), 0, n)
             for i, n in enumerate((2, 5, 3))]
    monkeypatch.setattr(prefill_spans, "GDN_SHORT_SPAN_TOKENS", SHORT)
    _, outs, calls = _spied_step(_fast(ckpt), works, monkeypatch)
    assert calls["gdn_recurrent_spans"] == []
    assert calls["gdn_chunk_wy"] == [(2, 5, 3)] * len(outs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the launches of Triton's interpreter")
def test_the_warm_up_compiles_the_short_path(ckpt, monkeypatch):
    """With the switch on, the warm-up's 1-token GDN piece (prefill_warmup's gdn_prefill item, which every plan of a
    GDN model holds) takes the short path, and its gdn_recurrent_spans launch has the JIT key (as an sm_90 GPU would
    file it) of a served step's: the first short step compiles nothing new (test_prefill_first_request's property).
    """
    rec, run = LaunchKeys(), InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        rec.launch(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(prefill_spans, "GDN_SHORT_SPAN_TOKENS", SHORT)
    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    ex = _fast(ckpt)
    plan = WarmupPlan((), (), (), (), (), gdn_pieces=(GdnPieceItem(1),))
    warm_prefill_kernels(ex.model, ex.experts, plan, page_size=ex.plan.page_size, dtype=torch.float32,
                         device=torch.device(DEVICE))
    warm, rec.keys = rec.keys, set()
    _, step = _scenario()
    _fast_step(ex, [w for w in step if w.request_id in ("c", "d1", "f")])  # 2 + 4 tokens and a decode row
    kernel = "_gdn_recurrent_spans_kernel"
    served = {k for k in rec.keys if k[0] == kernel}
    assert len(served) == 1 and served <= warm


@pytest.mark.parametrize(("value", "tokens"), [("0", 0), ("1", 1), ("16", 16), ("32", 32), ("064", 64)])
def test_the_switch_reads_0_to_64(value, tokens):
    assert prefill_spans._short_span_tokens(value) == tokens


@pytest.mark.parametrize("value", ["", "off", "-1", "+4", " 16", "16 ", "1.5", "65", "1000", "\u00b2"])
def test_the_switch_refuses_anything_else(value):
    with pytest.raises(ValueError, match="FLUXTIDE_GDN_SHORT_SPANS must be an integer 0..64"):
        prefill_spans._short_span_tokens(value)


def _import_with(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FLUXTIDE_GDN_SHORT_SPANS"}
    if value is not None:
        env["FLUXTIDE_GDN_SHORT_SPANS"] = value
    env.setdefault("TRITON_INTERPRET", "1")
    code = "from adapters.cuda_exec import prefill_spans; print(prefill_spans.GDN_SHORT_SPAN_TOKENS)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_switch_is_read_from_the_environment_at_import():
    """Off when unset; the variable's value when valid; a bad value fails the import, naming the variable."""
    unset, valid, bad = _import_with(None), _import_with("16"), _import_with("sixteen")
    assert (unset.returncode, unset.stdout.strip()) == (0, "0"), unset.stderr
    assert (valid.returncode, valid.stdout.strip()) == (0, "16"), valid.stderr
    assert bad.returncode != 0 and "FLUXTIDE_GDN_SHORT_SPANS must be an integer" in bad.stderr
