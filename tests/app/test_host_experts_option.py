"""`ft serve --host-experts PERMILLE|auto` (docs/adr/0030-host-expert-compute.md): parsed as a share in per mille or
auto, checked by the settings, refused where the CUDA fast path cannot serve one GPU (before loading where the flags
tell, by the container where only the device or the bank does), and handed to the fast executor's constructor as
`host_experts` (0 = off, "auto" as it is)."""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from dependency_injector import providers

import app.containers as containers
from app.cli import _add_serve, main
from app.settings import ServeSettings
from domain.model_spec import WeightFormat as F
from tests.app.conftest import TINY_SPEC


def parse_serve(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ft")
    _add_serve(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *flags])


# --- the flag -------------------------------------------------------------------------------------------------------

def test_the_flag_is_off_by_default_and_takes_a_share_or_auto():
    assert parse_serve().host_experts is None
    for text, value in (("0", 0), ("1", 1), ("423", 423), ("1000", 1000), ("auto", "auto")):
        assert parse_serve("--host-experts", text).host_experts == value, text
    assert type(parse_serve("--host-experts", "423").host_experts) is int


@pytest.mark.parametrize(("text", "why"), [
    ("1001", "a share in per mille must be 0 to 1000 (or auto), got 1001"),
    ("-1", "a share in per mille must be 0 to 1000 (or auto), got -1"),
    ("0.5", "not a share in per mille: '0.5' (use 0 to 1000, or auto)"),
    ("42%", "not a share in per mille: '42%' (use 0 to 1000, or auto)"),
    ("1k", "not a share in per mille: '1k' (use 0 to 1000, or auto)"),  # no size suffixes: it is not a count
    ("Auto", "not a share in per mille: 'Auto' (use 0 to 1000, or auto)"),
    ("", "not a share in per mille: '' (use 0 to 1000, or auto)"),
])
def test_a_bad_value_is_an_argument_error_naming_the_flag(text, why, capsys):
    with pytest.raises(SystemExit) as info:
        parse_serve("--host-experts", text)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --host-experts: {why}" in err and "Traceback" not in err, err


def test_the_help_says_what_it_does():
    parser = argparse.ArgumentParser(prog="ft")
    serve = _add_serve(parser.add_subparsers(dest="command"))
    text = " ".join(serve.format_help().split())
    assert "--host-experts PERMILLE|auto" in text
    for words in ("on the host CPU", "needs the CUDA fast path and a block-FP8 checkpoint", "no longer bitwise",
                  "within fp32 1e-4", "auto: measure", "at start-up", "0, or unset (the default): off",
                  "docs/adr/0030-host-expert-compute.md"):
        assert words in text, words


def test_the_adr_the_help_points_to_exists():
    from pathlib import Path

    assert (Path(__file__).resolve().parents[2] / "docs" / "adr" / "0030-host-expert-compute.md").is_file()


@pytest.mark.parametrize(("flags", "forwarded"), [((), None), (("--host-experts", "0"), "0"),
                                                  (("--host-experts", "300"), "300"),
                                                  (("--host-experts", "auto"), "auto")])
def test_the_value_travels_to_spawned_servers_as_given(flags, forwarded):
    # data-parallel workers and expert-parallel ranks get every flag that differs from its default
    from app.data_parallel.serve import worker_argv

    parser = argparse.ArgumentParser(prog="ft")
    serve = _add_serve(parser.add_subparsers(dest="command"))
    argv = worker_argv(serve, parser.parse_args(["serve", *flags]))
    assert (argv[argv.index("--host-experts") + 1] if "--host-experts" in argv else None) == forwarded
    if forwarded is not None:
        assert parse_serve(*argv).host_experts == parse_serve(*flags).host_experts  # read back the same


# --- the settings ---------------------------------------------------------------------------------------------------

def test_the_settings_take_a_share_or_auto_and_say_what_the_executor_gets():
    assert ServeSettings().host_experts is None and ServeSettings().host_experts_share == 0
    for value, share in ((None, 0), (0, 0), (1, 1), (500, 500), (1000, 1000), ("auto", "auto")):
        settings = ServeSettings(host_experts=value)
        assert settings.host_experts == value and settings.host_experts_share == share, value


@pytest.mark.parametrize("bad", [-1, 1001, True, False, 0.5, 300.0, "300", "AUTO", "off", ""])
def test_the_settings_refuse_anything_else_naming_the_flag_and_the_values(bad):
    with pytest.raises(ValueError) as refused:
        ServeSettings(host_experts=bad)
    assert str(refused.value) == f"--host-experts must be a share in per mille, 0 to 1000, or auto, got {bad!r}"


@pytest.mark.parametrize(("overrides", "flag"), [({"device": "cpu"}, "--device cpu"),
                                                 ({"executor": "reference"}, "--executor reference"),
                                                 ({"mmap_experts": True}, "--mmap-experts")])
@pytest.mark.parametrize("value", [1, "auto"])
def test_the_settings_refuse_it_before_loading_where_the_fast_path_cannot_serve(overrides, flag, value):
    with pytest.raises(ValueError) as refused:
        ServeSettings(host_experts=value, **overrides)
    assert str(refused.value) == (f"--host-experts needs the CUDA fast path (--executor cuda-graph on a CUDA device), "
                                  f"which cannot run with {flag}")
    for off in (None, 0):  # off is never refused
        assert ServeSettings(host_experts=off, **overrides).host_experts_share == 0


def test_the_settings_refuse_it_with_expert_parallelism():
    with pytest.raises(ValueError, match="--host-experts cannot run with --expert-parallel yet"):
        ServeSettings(host_experts="auto", expert_parallel=2)
    with pytest.raises(ValueError, match="--host-experts cannot run with --expert-parallel yet"):
        ServeSettings(host_experts=250, expert_parallel=2, ep_rank=1)
    assert ServeSettings(host_experts=0, expert_parallel=2).expert_parallel == 2


# --- ft serve refuses before listening ------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "message"), [
    (("--host-experts", "300", "--device", "cpu"),
     "ft serve: --host-experts needs the CUDA fast path (--executor cuda-graph on a CUDA device), which cannot run "
     "with --device cpu"),
    (("--host-experts", "auto", "--expert-parallel", "2"),
     "ft serve: --host-experts cannot run with --expert-parallel yet"),
    (("--host-experts", "auto", "--data-parallel", "2"),
     "ft serve: --host-experts cannot run with --data-parallel yet"),
    (("--host-experts", "1", "--data-parallel", "2", "--device", "cpu"),
     "ft serve: --host-experts needs the CUDA fast path"),
])
def test_serve_refuses_it_before_anything_starts(flags, message, capsys, monkeypatch):
    import app.data_parallel.serve
    import app.expert_parallel

    started = []
    monkeypatch.setattr(app.data_parallel.serve, "serve_data_parallel", lambda *a: started.append("dp") or 0)
    monkeypatch.setattr(app.expert_parallel, "serve_expert_parallel", lambda *a: started.append("ep") or 0)
    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "listening on" not in err, err
    assert started == []


def test_serve_lets_zero_through_to_data_parallel_workers(capsys, monkeypatch):
    import app.data_parallel.serve

    started = []
    monkeypatch.setattr(app.data_parallel.serve, "serve_data_parallel",
                        lambda args, parser, settings: started.append(settings.host_experts) or 0)
    assert main(["serve", "--port", "0", "--host-experts", "0", "--data-parallel", "2"]) == 0
    assert started == [0]


# --- the container: refused on the reference executor, passed to the fast one --------------------------------------

def _checkpoint(experts: F = F.FP8_BLOCK):
    """A checkpoint as far as the executor choice reads it: its spec, the bank (rows None: not pinned), the expert
    format and the dense weights."""
    return SimpleNamespace(spec=TINY_SPEC, experts=SimpleNamespace(rows=None, layout=SimpleNamespace(fmt=experts)),
                           dense={"model.norm.weight": torch.ones(2)})


@pytest.fixture
def reference_executor(monkeypatch):
    """TorchExecutor replaced by a recorder of its arguments (nothing is built)."""
    import adapters.torch_exec.executor as torch_executor

    built: list[dict] = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            built.append(kwargs)

    monkeypatch.setattr(torch_executor, "TorchExecutor", Recorder)
    return built


@pytest.mark.parametrize("value", [1, 300, 1000, "auto"])
def test_the_container_refuses_it_where_auto_found_no_cuda_device(reference_executor, value):
    # --device auto on a host without CUDA: the settings cannot see it; the real container wiring decides
    container = containers.Container()
    container.settings.override(providers.Object(ServeSettings(host_experts=value)))
    container.device.override(providers.Object("cpu"))
    container.checkpoint.override(providers.Object(_checkpoint()))
    container.pool_plan.override(providers.Object(None))
    with pytest.raises(ValueError) as refused:
        container.executor()
    assert str(refused.value) == ("--host-experts needs the CUDA fast path (--executor cuda-graph on a CUDA device), "
                                  "and the reference executor serves here (--device auto resolved to cpu, no CUDA "
                                  "device); leave --host-experts unset or 0")
    assert reference_executor == []  # refused, not built and silently ignored


def test_the_container_refuses_it_on_cuda_without_a_pinned_bank(reference_executor):
    with pytest.raises(ValueError, match=r"the reference executor serves here \(the expert bank is not in pinned "
                                         r"host memory\)"):
        containers._torch_executor(ServeSettings(host_experts="auto"), _checkpoint(), None, "cuda")
    assert reference_executor == []


@pytest.mark.parametrize("value", [None, 0])
def test_off_builds_the_reference_executor_as_before(reference_executor, value):
    containers._torch_executor(ServeSettings(host_experts=value), _checkpoint(), None, "cpu")
    assert len(reference_executor) == 1 and "host_experts" not in reference_executor[0]


@pytest.mark.parametrize(("value", "passed"), [(None, 0), (0, 0), (1, 1), (423, 423), (1000, 1000),
                                               ("auto", "auto")])
def test_the_fast_executor_is_built_with_the_share(fast_path, value, passed):
    containers._torch_executor(ServeSettings(host_experts=value), _checkpoint(), None, "cuda")
    assert len(fast_path) == 1
    got = fast_path[0]["host_experts"]
    assert got == passed and type(got) is type(passed)  # 0, never None or False; "auto" as it is


def test_the_fast_executor_takes_the_arguments_the_container_passes(monkeypatch):
    """The recorder above takes any keyword; this binds what the container passes to the real constructor's
    signature (ADR 0030: `host_experts: int | str = 0`, 0 = off), so a keyword it does not take fails here, not on
    the first GPU start."""
    import adapters.cuda_exec.executor as cuda_executor

    real = inspect.signature(cuda_executor.CudaGraphExecutor.__init__)
    parameter = real.parameters.get("host_experts")
    assert parameter is not None, "CudaGraphExecutor has no host_experts keyword"
    assert parameter.default == 0
    calls = []
    monkeypatch.setattr(containers, "_use_fast_path", lambda *a: True)
    monkeypatch.setattr(cuda_executor, "CudaGraphExecutor", lambda *a, **kw: calls.append((a, kw)) or SimpleNamespace())
    containers._torch_executor(ServeSettings(host_experts="auto"), _checkpoint(), None, "cuda")
    (args, kwargs), = calls
    bound = real.bind(None, *args, **kwargs)  # None: self
    assert bound.arguments["host_experts"] == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the fast path would serve")
def test_ft_serve_on_a_host_without_cuda_fails_the_load_naming_the_flag():
    """End to end with the demo model: --device auto finds no CUDA device, the load fails (exit 1) with the reason,
    instead of serving with the option silently ignored."""
    out = subprocess.run([sys.executable, "-m", "app", "serve", "--port", "0", "--host-experts", "300"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "load failed: --host-experts needs the CUDA fast path" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_stats_report_the_host_lanes_share_and_nothing_where_the_executor_has_no_lane():
    """Engine.executor_info (in /v1/stats and every `ft bench` record): the share in effect, 0 once turned off."""
    from types import SimpleNamespace

    from app.engine import Engine

    class Fast:
        host_share = 423

    class Reference:
        pass

    assert Engine.executor_info(SimpleNamespace(executor=Fast()))["host_experts"] == 423
    Fast.host_share = 0
    assert Engine.executor_info(SimpleNamespace(executor=Fast()))["host_experts"] == 0
    assert "host_experts" not in Engine.executor_info(SimpleNamespace(executor=Reference()))
