"""`ft serve --prefill-kernels auto`, the default (docs/adr/0020-prefill-kernels-auto.md): the flag and the
settings take it, the container hands the resolved choice to the executor it builds (logged, reported in
/v1/stats, refusing --prefill-fp8-activations where auto chose the reference prefill), and on the CPU the demo
model serves with the reference prefill under the default."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import httpx
import pytest
import torch

import app.containers as containers
from app.cli import _add_serve
from app.settings import ServeSettings
from domain.model_spec import WeightFormat as F


def parse_serve(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ft")
    _add_serve(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *flags])


def test_the_flag_defaults_to_auto_and_takes_every_setting(capsys):
    assert parse_serve().prefill_kernels == "auto"
    for value in ("auto", "reference", "triton"):
        assert parse_serve("--prefill-kernels", value).prefill_kernels == value
    with pytest.raises(SystemExit):
        parse_serve("--prefill-kernels", "fast")
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_the_settings_default_to_auto_and_check_the_value():
    assert ServeSettings().prefill_kernels == "auto"
    for value in ("auto", "reference", "triton"):
        assert ServeSettings(prefill_kernels=value).prefill_kernels == value
    with pytest.raises(ValueError, match="--prefill-kernels must be auto, reference or triton, got 'fast'"):
        ServeSettings(prefill_kernels="fast")


def test_fp8_activations_are_refused_before_loading_only_where_no_triton_prefill_can_run():
    # auto may resolve to triton once the checkpoint is read: accepted here, decided by the executor (below)
    assert ServeSettings(prefill_fp8_activations=True).prefill_kernels == "auto"
    with pytest.raises(ValueError, match="use --prefill-kernels triton \\(or auto\\), not reference"):
        ServeSettings(prefill_fp8_activations=True, prefill_kernels="reference")
    with pytest.raises(ValueError, match="needs the CUDA fast path, which cannot run with --device cpu"):
        ServeSettings(prefill_fp8_activations=True, device="cpu")


@pytest.mark.parametrize(("overrides", "flag"), [({"device": "cpu"}, "--device cpu"),
                                                 ({"prefill_kernels": "reference"}, "--prefill-kernels reference"),
                                                 ({"executor": "reference"}, "--executor reference"),
                                                 ({"routing_replay": "uniform"}, "--routing-replay")])
def test_prefill_graphs_on_is_refused_before_loading_where_they_cannot_run(overrides, flag):
    assert ServeSettings(prefill_graphs="on").prefill_graphs == "on"  # the prefill: decided once the weights are read
    with pytest.raises(ValueError, match=f"--prefill-graphs is a mode of the CUDA fast path's Triton prefill, which "
                                         f"cannot run with {flag}"):
        ServeSettings(prefill_graphs="on", **overrides)
    for value in ("auto", "off"):  # auto turns itself off there (below), never an error
        assert ServeSettings(prefill_graphs=value, **overrides).prefill_graphs == value


def test_prefill_graphs_default_to_auto_and_the_value_is_checked(capsys):
    assert ServeSettings().prefill_graphs == "auto" and parse_serve().prefill_graphs == "auto"
    assert parse_serve("--prefill-graphs").prefill_graphs == "on"  # the bare flag of old scripts
    for value in ("auto", "on", "off"):
        assert parse_serve("--prefill-graphs", value).prefill_graphs == value
        assert ServeSettings(prefill_graphs=value).prefill_graphs == value
    assert parse_serve("--prefill-graphs", "--device", "cpu").prefill_graphs == "on"
    with pytest.raises(SystemExit):
        parse_serve("--prefill-graphs", "yes")
    assert "argument --prefill-graphs: invalid choice: 'yes'" in capsys.readouterr().err
    for bad in ("yes", True, False):  # the bool it was before auto is refused, not read as a truth value
        with pytest.raises(ValueError, match=f"--prefill-graphs must be auto, on or off, got {bad!r}"):
            ServeSettings(prefill_graphs=bad)


def test_prefill_graphs_travel_to_data_parallel_workers_as_given():
    from app.data_parallel.serve import worker_argv

    parser = argparse.ArgumentParser(prog="ft")
    serve = _add_serve(parser.add_subparsers(dest="command"))
    for flags, forwarded in (((), None), (("--prefill-graphs",), "on"), (("--prefill-graphs", "off"), "off")):
        argv = worker_argv(serve, parser.parse_args(["serve", *flags]))
        assert (argv[argv.index("--prefill-graphs") + 1] if "--prefill-graphs" in argv else None) == forwarded


def qtensor(fmt: F):
    from adapters.checkpoint.quant import QTensor

    return QTensor(fmt, (2, 2), torch.empty(0))


def checkpoint(experts: F, *dense: F):
    """A checkpoint as far as the executor choice reads it: the expert bank's format and the dense weights
    (a float tensor for the norms and embeddings, QTensors for quantized projections)."""
    weights = {"model.norm.weight": torch.ones(2), **{f"layers.{i}.proj.weight": qtensor(f) for i, f in enumerate(dense)}}
    return SimpleNamespace(experts=SimpleNamespace(layout=SimpleNamespace(fmt=experts)), dense=weights)


@pytest.mark.parametrize("requested, ckpt, triton, reason", [
    ("auto", checkpoint(F.BF16), True, "auto: CUDA fast path, experts bf16, dense bf16"),
    ("auto", checkpoint(F.FP8_BLOCK, F.FP8_BLOCK), True, "experts fp8_block, dense bf16+fp8_block"),
    ("auto", checkpoint(F.NVFP4, F.NVFP4), True, "experts nvfp4, dense bf16+nvfp4"),  # validated in session 30
    ("auto", checkpoint(F.MXFP4, F.MXFP4), False, "not GPU-validated with experts mxfp4, dense mxfp4"),
    ("auto", checkpoint(F.FP8_BLOCK, F.INT8_CHANNEL), False, "not GPU-validated with dense int8_channel"),
    ("triton", checkpoint(F.NVFP4), True, "--prefill-kernels triton"),  # as asked, as before auto
    ("reference", checkpoint(F.BF16), False, "--prefill-kernels reference"),
])
def test_the_fast_path_is_built_with_the_resolved_prefill(fast_path, caplog, requested, ckpt, triton, reason):
    settings = ServeSettings(prefill_kernels=requested)
    with caplog.at_level(logging.INFO, logger="fluxtide.serve"):
        executor = containers._torch_executor(settings, ckpt, None, "cuda")
    assert [kw["prefill_kernels"] for kw in fast_path] == [triton]
    choice = executor.prefill_choice  # what Engine.executor_info reports
    assert (choice.requested, choice.triton) == (requested, triton) and reason in choice.reason
    assert f"prefill: {choice.kernels} ({choice.reason})" in caplog.text


@pytest.mark.parametrize("setting, ckpt, overrides, graphs, why", [
    ("auto", checkpoint(F.FP8_BLOCK, F.FP8_BLOCK), {}, True, "on (auto"),  # the default on the Triton prefill
    ("on", checkpoint(F.BF16), {}, True, "on (on"),
    ("off", checkpoint(F.BF16), {}, False, "off (off: --prefill-graphs off)"),
    ("auto", checkpoint(F.MXFP4, F.MXFP4), {}, False, "off (auto: the reference prefill runs)"),
    ("auto", checkpoint(F.BF16), {"prefill_kernels": "reference"}, False, "off (auto: the reference prefill runs)"),
    ("auto", checkpoint(F.BF16), {"routing_replay": "uniform"}, False, "off (auto: --routing-replay)"),
])
def test_the_fast_path_is_built_with_the_resolved_prefill_graphs(fast_path, caplog, setting, ckpt, overrides,
                                                                 graphs, why):
    settings = ServeSettings(prefill_graphs=setting, **overrides)
    with caplog.at_level(logging.INFO, logger="fluxtide.serve"):
        containers._torch_executor(settings, ckpt, None, "cuda")
    assert [kw["prefill_graphs"] for kw in fast_path] == [graphs]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefill graphs: ")]
    assert len(lines) == 1 and lines[0].startswith(f"prefill graphs: {why}"), lines


def test_prefill_graphs_on_names_why_where_auto_chose_the_reference_prefill(fast_path):
    with pytest.raises(ValueError) as refused:
        containers._torch_executor(ServeSettings(prefill_graphs="on"), checkpoint(F.MXFP4, F.MXFP4), None, "cuda")
    assert "--prefill-graphs is a mode of the Triton prefill, and --prefill-kernels auto chose the reference " \
           "prefill (auto: the Triton prefill is not GPU-validated with experts mxfp4" in str(refused.value)
    assert "add --prefill-kernels triton" in str(refused.value) and not fast_path  # refused before building


@pytest.fixture
def reference_executor(monkeypatch):
    """The reference executor's branch taken on the CPU (_use_fast_path as there: no fast path) with TorchExecutor
    replaced by a recorder of its arguments."""
    import adapters.torch_exec.executor as torch_executor

    built: list[dict] = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            built.append(kwargs)

    monkeypatch.setattr(containers, "_use_fast_path", lambda *a: False)
    monkeypatch.setattr(torch_executor, "TorchExecutor", Recorder)
    return built


def test_prefill_graphs_auto_is_off_on_the_reference_executor_without_complaint(reference_executor, caplog):
    with caplog.at_level(logging.INFO, logger="fluxtide.serve"):
        for value in ("auto", "off"):
            executor = containers._torch_executor(ServeSettings(prefill_graphs=value), None, None, "cpu")
            assert not getattr(executor, "prefill_graphs", False)  # what /v1/stats reports
    assert "prefill graphs: off (auto: the reference executor serves)" in caplog.text
    assert len(reference_executor) == 2


def test_prefill_graphs_on_is_refused_on_the_reference_executor(reference_executor):
    # --device auto with no CUDA: the settings cannot see it before loading; the container refuses it, clearly
    with pytest.raises(ValueError, match="--prefill-graphs applies to the fast path's Triton prefill, which cannot "
                                         "run here \\(the reference executor serves"):
        containers._torch_executor(ServeSettings(prefill_graphs="on"), None, None, "cpu")
    assert not reference_executor


def test_fp8_activations_follow_auto_to_the_triton_prefill_or_name_why_not(fast_path):
    settings = ServeSettings(prefill_fp8_activations=True)  # --prefill-kernels auto
    containers._torch_executor(settings, checkpoint(F.FP8_BLOCK, F.FP8_BLOCK), None, "cuda")
    assert fast_path[-1]["prefill_kernels"] and fast_path[-1]["fp8_activations"]
    with pytest.raises(ValueError) as refused:  # per-tensor FP8 could take e4m3 activations, but is not validated
        containers._torch_executor(settings, checkpoint(F.FP8_TENSOR, F.FP8_TENSOR), None, "cuda")
    assert "--prefill-fp8-activations is a mode of the Triton prefill, and --prefill-kernels auto chose the " \
           "reference prefill (auto: the Triton prefill is not GPU-validated with experts fp8_tensor" in str(refused.value)
    assert "add --prefill-kernels triton" in str(refused.value)
    assert len(fast_path) == 1  # refused before the executor was built


def test_the_pool_plan_stages_prefill_rows_only_where_auto_picks_the_triton_prefill():
    from dataclasses import replace

    from domain.budget import GpuBudget
    from tests.app.conftest import TINY_SPEC

    settings = ServeSettings(kv_tokens=1024, moe_slots=8, max_running_requests=4, cache_type="none")
    roomy = GpuBudget(total_bytes=1 << 30, memory_ratio=1.0)
    assert containers._pool_plan(settings, TINY_SPEC, roomy, "cuda").staging_experts > 0  # bf16 on CUDA: triton
    for fmt in (F.MXFP4, F.FP8_TENSOR):
        spec = replace(TINY_SPEC, expert_format=fmt, dense_format=fmt)
        assert containers._pool_plan(settings, spec, roomy, "cuda").staging_experts == 0, fmt
    for fmt in (F.FP8_BLOCK, F.NVFP4):
        spec = replace(TINY_SPEC, expert_format=fmt, dense_format=fmt)
        assert containers._pool_plan(settings, spec, roomy, "cuda").staging_experts > 0, fmt
    assert containers._pool_plan(settings, TINY_SPEC, roomy, "cpu").staging_experts == 0
    assert containers._pool_plan(replace(settings, prefill_kernels="reference"), TINY_SPEC, roomy,
                                 "cuda").staging_experts == 0


def test_the_demo_model_serves_on_the_cpu_with_the_reference_prefill_under_the_default(demo_server):
    pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")
    assert demo_server.settings.prefill_kernels == "auto"
    executor = httpx.get(demo_server.base_url + "/v1/stats").json()["executor"]
    assert executor == {"kind": "TorchExecutor", "prefill_kernels": False, "prefill_fp8_activations": False,
                        "prefill_graphs": False, "prefill_kernels_setting": "auto",
                        "prefill_kernels_reason": "auto: cpu has no Triton prefill (CUDA only)"}
    r = httpx.post(demo_server.base_url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "What is 19 + 23?"}], "max_tokens": 8,
                         "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].strip() == "42"
