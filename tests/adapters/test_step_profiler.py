"""The step profiler (adapters/cuda_exec/step_profiler.py, FLUXTIDE_PROFILE_DIR): the step filter's grammar and its
refusals, the summary's figures from a hand-made chrome trace with a known answer (device busy time and idle gaps,
launches, host syncs, self times), and CudaGraphExecutor on the CPU (Triton's interpreter, no graphs) writing a trace
and a summary for the steps the filter picks only, up to its maximum, whole steps and layer groups alike, the
engine's launch hook timed and put back."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace

import pytest
import torch

from adapters.cuda_exec.executor import CudaGraphExecutor
from adapters.cuda_exec.step_profiler import StepProfiler, StepShape, parse_step_filter
from adapters.cuda_exec.step_summary import summarise
from domain.budget import GpuBudget, PoolRequest, plan_pools
from domain.ports import SequenceWork, StepBatch
from tests.adapters.torch_exec_models import (
    GREEDY,
    PAGE_SIZE,
    QWEN3_5_CONFIGS,
    Sequence,
    build_hf_model,
    pages_for,
    run_requests,
    save_and_load,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def shape(prefill: int, decodes: int, layers=None) -> StepShape:
    return StepShape(decodes, prefill, ((0, prefill, layers),) if prefill else ())


# ---- the filter -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "norm", "matched"), [
    ("prefill>0", "prefill>0", {"p4d3", "p4", "p40d1", "p8192", "layered"}),
    ("prefill<=32", "prefill<=32", {"p4d3", "p4", "layered"}),
    ("mixed", "mixed", {"p4d3", "p40d1", "layered"}),
    ("decode", "decode", {"d3"}),
    ("all", "all", {"p4d3", "p4", "p40d1", "p8192", "d3", "layered"}),
    (" Mixed & prefill <= 32 , decode>=3", "mixed&prefill<=32,decode>=3", {"p4d3", "layered", "d3"}),
    ("prefill-only,layered", "prefill-only,layered", {"p4", "p8192", "layered"}),
    ("decode<=2", "decode<=2", {"p40d1", "layered"}),
    ("prefill=8192", "prefill=8192", {"p8192"}),
])
def test_the_filter_picks_the_steps_it_says(text, norm, matched):
    steps = {"p4d3": shape(4, 3), "p4": shape(4, 0), "p40d1": shape(40, 1), "p8192": shape(8192, 0), "d3": shape(0, 3),
             "layered": shape(16, 2, (0, 8))}
    f = parse_step_filter(text)
    assert str(f) == norm and str(parse_step_filter(str(f))) == norm
    assert {name for name, s in steps.items() if f.matches(s)} == matched


@pytest.mark.parametrize(("text", "says"), [
    ("", "'an empty condition' is not a condition"),
    ("prefill<=32,,mixed", "'an empty condition' is not a condition"),
    ("prefill<=", "'prefill<=' is not a condition"),
    ("prefil>0", "'prefil>0' is not a condition"),
    ("prefill=>3", "'prefill=>3' is not a condition"),
    ("tokens<4", "'tokens<4' is not a condition"),
    ("prefill<=-1", "'prefill<=-1' is not a condition"),
    ("prefill<1", "prefill<1 matches no step (a comparison matches only steps with prefill tokens: for none use "
                  "decode)"),
    ("mixed&decode==0", "decode==0 matches no step (a comparison matches only steps with decode rows: for none use "
                        "prefill-only)"),
])
def test_a_malformed_filter_is_refused_naming_the_part(text, says):
    with pytest.raises(ValueError, match="step filter") as err:
        parse_step_filter(text)
    assert says in str(err.value)
    assert ("terms joined by ','" in str(err.value)) == ("is not a condition" in says)  # the grammar, where it helps


def test_a_layer_group_counts_its_tokens_in_every_group_and_decodes_are_rows():
    chunk = SequenceWork("a", tuple(range(8)), 0, (0, 1), 0, False, GREEDY, 0, layers=(2, 4))
    decode = SequenceWork("d", (5,), 3, (2,), 1, True, GREEDY, 2)
    first = SequenceWork("f", (5,), 0, (3,), 2, True, GREEDY, 0)  # a one-token prompt: no decode
    s = StepShape.of(StepBatch((chunk, first, decode)))
    assert (s.decode_rows, s.prefill_tokens, s.layers, s.label) == (1, 9, (2, 4), "p9-d1-L2-4")
    assert s.as_dict()["spans"] == [{"start": 0, "tokens": 8, "layers": [2, 4]}, {"start": 0, "tokens": 1,
                                                                                   "layers": None}]


# ---- the summary from a known trace --------------------------------------------------------------------------------
def _x(cat, name, ts, dur, corr=None, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0 if tid == 7 else 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {} if corr is None else {"correlation": corr}}


def test_the_summary_of_a_known_trace():
    """One step of 1000 µs: a GEMM launched at 20, an .item() (a DtoH copy and a stream sync), an add launched late,
    a graph of two kernels, Python between them; device work [40,140] [150,152] [615,625] [720,770] [800,900] (the
    device's thread: 7); another host thread's op of 30 µs."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {}},
        _x("user_annotation", "fluxtide.step", 0, 1000),
        _x("cpu_op", "aten::mm", 10, 50), _x("cuda_runtime", "cudaLaunchKernel", 20, 10, corr=1),
        _x("kernel", "gemm", 40, 100, corr=1, tid=7),
        _x("cpu_op", "aten::_local_scalar_dense", 100, 300), _x("cuda_runtime", "cudaMemcpyAsync", 110, 5, corr=2),
        _x("cuda_runtime", "cudaStreamSynchronize", 120, 250, corr=3),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 150, 2, corr=2, tid=7),
        _x("cpu_op", "aten::add", 600, 20), _x("cuda_runtime", "cudaLaunchKernel", 605, 5, corr=4),
        _x("kernel", "add", 615, 10, corr=4, tid=7),
        _x("cuda_runtime", "cudaGraphLaunch", 700, 30, corr=5),
        _x("kernel", "k1", 720, 50, corr=5, tid=7), _x("kernel", "k2", 800, 100, corr=5, tid=7),
        _x("cpu_op", "aten::empty", 1500, 5),  # after the step: outside its window
        _x("cpu_op", "aten::cat", 200, 30, tid=2), _x("cpu_op", "aten::empty", 205, 10, tid=2),
    ]
    s = summarise(events)
    assert s["device_time"] | {"memcpy": None, "memset": None} == {
        "kernels": 4, "kernel_sum_ms": 0.26, "busy_union_ms": 0.262, "span_ms": 0.86, "first_start_offset_ms": 0.04,
        "last_end_offset_ms": 0.9, "memcpy": None, "memset": None}
    assert s["device_time"]["memcpy"] == [{"name": "Memcpy DtoH (Device -> Pinned)", "count": 1, "total_ms": 0.002}]
    assert [k["name"] for k in s["top_kernels"]] == ["gemm", "k2", "k1", "add"]
    assert s["launches"] == {"cudaLaunchKernel": {"count": 2, "total_ms": 0.015},
                             "cudaGraphLaunch": {"count": 1, "total_ms": 0.03}}
    syncs = s["host_syncs"]
    assert (syncs["count"], syncs["total_ms"]) == (2, 0.255)
    assert syncs["calls"][0] == {"name": "cudaMemcpyAsync", "offset_ms": 0.11, "dur_ms": 0.005,
                                 "op": "aten::_local_scalar_dense", "py": None,
                                 "copy": "Memcpy DtoH (Device -> Pinned)"}
    assert syncs["calls"][1]["name"] == "cudaStreamSynchronize" and syncs["calls"][1]["dur_ms"] == 0.25
    host = s["host"]
    assert (host["step_ms"], host["outside_ops_ms"], host["in_ops_ms"], host["runtime_ms"],
            host["other_threads_ops_ms"]) == (1.0, 0.6, 0.4, 0.3, 0.03)
    ops = {o["name"]: (o["count"], o["self_ms"], o["with_children_ms"]) for o in host["top_cpu_ops"]}
    assert ops == {"aten::_local_scalar_dense": (1, 0.045, 0.3), "aten::mm": (1, 0.04, 0.05),
                   "aten::add": (1, 0.015, 0.02)}
    gaps = s["idle_gaps"]
    assert (gaps["count"], gaps["total_ms"], gaps["host_launch_bound_ms"]) == (6, 0.738, 0.598)
    assert [(g["start_offset_ms"], g["dur_ms"], g["prev_work"], g["next_work"]) for g in gaps["largest"]] == [
        (0.152, 0.463, "Memcpy DtoH (Device -> Pinned)", "add"), (0.9, 0.1, "k2", None), (0.625, 0.095, "add", "k1"),
        (0.0, 0.04, None, "gemm"), (0.77, 0.03, "k1", "k2"), (0.14, 0.01, "gemm", "Memcpy DtoH (Device -> Pinned)")]
    assert gaps["largest"][0]["next_launch_offset_ms"] == 0.605 and gaps["largest"][0]["next_launch_op"] == "aten::add"
    assert summarise(events, device_traced=False)["idle_gaps"] is None
    assert host["slow_ops"] == {"threshold_ms": 1.0, "count": 0, "total_ms": 0.0, "ops": []}
    slow = summarise(events, slow_op_us=40)["host"]["slow_ops"]  # the outermost ops of 40 µs or more, longest first
    assert (slow["count"], slow["total_ms"]) == (2, 0.35)
    assert slow["ops"] == [
        {"name": "aten::_local_scalar_dense", "offset_ms": 0.1, "dur_ms": 0.3, "self_ms": 0.045, "py": None},
        {"name": "aten::mm", "offset_ms": 0.01, "dur_ms": 0.05, "self_ms": 0.04, "py": None}]


# ---- the executor on the CPU -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_and_load(build_hf_model("qwen3_5_moe", QWEN3_5_CONFIGS["hybrid_3to1"]), tmp_path_factory.mktemp("m"))


def _fast(ckpt, profiler: StepProfiler | None) -> CudaGraphExecutor:
    plan = plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=256, expert_slots=ckpt.spec.top_k * 3, state_slots=4, page_size=PAGE_SIZE,
                                  staging_experts=8))
    return CudaGraphExecutor(ckpt, plan, DEVICE, torch.float32, max_decode_rows=4, use_graphs=False,
                             step_profiler=profiler)


def _summaries(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("step-*.json"))]


def test_the_executor_profiles_the_matching_steps_up_to_the_maximum(ckpt, tmp_path):
    """Steps: p7 (not picked), p1-d1 (picked), d1 (picked by the filter, past the maximum): one profile, a summary and
    a gzipped chrome trace, and the tokens those of an executor without a profiler."""
    out = tmp_path / "profiles"
    profiler = StepProfiler(out, parse_step_filter("prefill<=3,decode"), max_steps=1)
    outputs = []
    for ex in (_fast(ckpt, profiler), _fast(ckpt, None)):
        seqs = [Sequence("r0", [5, 17, 3], pages_for(0, 6), 0), Sequence("r1", [2, 33, 71, 4, 5], pages_for(1, 8), 1)]
        run_requests(ex, seqs, 2, chunk=4)
        outputs.append([s.output for s in seqs])
    assert outputs[0] == outputs[1]
    assert (profiler.seen, profiler.profiled) == (3, 1)
    summaries = _summaries(out)
    assert [(s["step"]["label"], s["step"]["executed_steps"], s["step"]["profile"]) for s in summaries] == [
        ("p1-d1", 2, 1)]
    first = summaries[0]
    assert first["step"] | {"spans": None} == {"profile": 1, "executed_steps": 2, "label": "p1-d1", "decode_rows": 1,
                                               "prefill_tokens": 1, "prefill_works": 1, "layers": None, "spans": None}
    assert first["step"]["spans"] == [{"start": 4, "tokens": 1, "layers": None}]
    assert first["filter"] == "prefill<=3,decode" and "summary_error" not in first
    assert first["wall_ms"] >= first["host_return_ms"] > 0 and first["host"]["step_ms"] > 0
    assert first["host"]["top_cpu_ops"] and len(first["host"]["top_cpu_ops"]) <= 25
    trace = json.loads(gzip.decompress((out / first["trace"]).read_bytes()))
    assert any(e.get("name") == "fluxtide.step" for e in trace["traceEvents"])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [s["trace"] for s in summaries] + [f"{s['trace'].removesuffix('.trace.json.gz')}.json" for s in summaries])


def test_layer_groups_and_whole_steps_are_profiled_alike_and_the_launch_hook_is_timed_and_put_back(ckpt, tmp_path):
    """A chunk in two layer groups beside two decodes (the decode step, then the group: _execute_decodes) and the same
    decodes with a whole prompt (one forward: compute_logits): `mixed` picks all three, each profile says its group."""
    out = tmp_path / "profiles"
    ex = _fast(ckpt, StepProfiler(out, parse_step_filter("mixed"), max_steps=8))
    calls = []
    hook = ex.on_launched = lambda: calls.append(1)
    d = {rid: [tok] for rid, tok in (("d0", 2), ("d1", 8))}
    pages = {"d0": tuple(range(20, 25)), "d1": tuple(range(30, 35))}

    def decode(rid, i):  # the i-th decode of rid (its first step fed its one-token prompt)
        return SequenceWork(rid, (d[rid][-1],), i, pages[rid], {"d0": 2, "d1": 3}[rid], True, GREEDY, i)

    def step(works):
        for rid, tok in ex.execute(StepBatch(tuple(works))).items():
            if rid in d:
                d[rid].append(tok.token_id)

    step([SequenceWork(rid, tuple(d[rid]), 0, pages[rid], slot, True, GREEDY, 0) for rid, slot in (("d0", 2),
                                                                                                    ("d1", 3))])
    chunk = SequenceWork("a", (5, 17, 3, 88, 41, 9, 60, 2), 0, (0, 1, 2), 0, True, GREEDY, 0)
    for i, layers in enumerate(((0, 2), (2, 4))):
        step([replace(chunk, layers=layers, sample=layers[1] == 4), decode("d0", i + 1), decode("d1", i + 1)])
    step([SequenceWork("b", (7, 7, 1), 0, (3,), 1, True, GREEDY, 0), decode("d0", 3), decode("d1", 3)])
    assert ex.on_launched is hook and len(calls) == 4
    summaries = _summaries(out)
    assert [(s["step"]["label"], s["step"]["layers"]) for s in summaries] == [
        ("p8-d2-L0-2", [0, 2]), ("p8-d2-L2-4", [2, 4]), ("p3-d2", None)]
    assert all(s["on_launched_ms"] is not None and s["on_launched_ms"] >= 0 for s in summaries)
    ex.check_valid()


def test_a_summary_that_fails_keeps_the_step_and_the_trace(ckpt, tmp_path, monkeypatch):
    import adapters.cuda_exec.step_profiler as sp

    def broken(*a, **k):
        raise KeyError("ts")

    monkeypatch.setattr(sp, "summarise", broken)
    out = tmp_path / "profiles"
    ex = _fast(ckpt, StepProfiler(out, parse_step_filter("all"), max_steps=1))
    sampled = ex.execute(StepBatch((SequenceWork("r", (5, 17, 3), 0, (0,), 0, True, GREEDY, 0),)))
    assert set(sampled) == {"r"}
    (summary,) = _summaries(out)
    assert summary["summary_error"] == "KeyError: 'ts'" and (out / summary["trace"]).stat().st_size > 0


@pytest.mark.gpu
def test_on_cuda_graph_replays_and_eager_steps_are_profiled_kernel_by_kernel(ckpt, tmp_path):
    """The fast path as served (decode graphs, the MoE segments of short prefill steps from graphs, the Triton
    prefill): every step profiled with the device's timeline, the kernels a replayed graph runs traced one by one
    (the profiler was first used before the executor captured its graphs)."""
    out = tmp_path / "profiles"
    plan = plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=256, expert_slots=ckpt.spec.num_layers * ckpt.spec.num_experts,
                                  state_slots=4, page_size=PAGE_SIZE))
    profiler = StepProfiler(out, parse_step_filter("all"), max_steps=16)
    ex = CudaGraphExecutor(ckpt, plan, "cuda", torch.float32, max_decode_rows=4, prefill_kernels=True,
                           prefill_graphs=True, step_profiler=profiler)
    assert ex.graphs and ex.model.segments is not None
    seqs = [Sequence("r0", [5, 17, 3, 88, 41, 9, 60], pages_for(0, 12), 0),
            Sequence("r1", [2, 33, 71], pages_for(1, 8), 1)]
    run_requests(ex, seqs, 3, chunk=4)
    summaries = _summaries(out)
    assert len(summaries) == profiler.profiled == profiler.seen
    for s in summaries:
        assert "summary_error" not in s and s["activities"] == ["cpu", "cuda"], s.get("summary_error")
        assert s["device_time"]["kernels"] > 0 and s["idle_gaps"]["count"] >= 1
    decode = next(s for s in summaries if s["step"]["prefill_tokens"] == 0)
    assert decode["launches"]["cudaGraphLaunch"]["count"] == 1
    assert decode["device_time"]["kernels"] > ckpt.spec.num_layers  # the graph's kernels, not one launch
    assert any("cudaGraphLaunch" in s["launches"] for s in summaries if s["step"]["prefill_tokens"] > 0)
