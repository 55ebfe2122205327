"""The simulated scheduler is configured as `ft serve` configures its own (app/containers.py `_scheduler_config`):
--max-prefill-length for a step alone, the mixed budget (--mixed-prefill-length, 512 by default) for a step that
carries decodes. predict ran one budget, the calibration's workload step (2,048 tokens for most files), until
2026-12-05 (docs/simulator.md, "Which engine a prediction is for")."""

import json

import pytest

from app.containers import _scheduler_config
from app.settings import ServeSettings
from simulator.__main__ import build_parser, deployment_from_args, main
from simulator.cost_model import CostParams
from simulator.hardware import get_profile
from simulator.predict import Deployment, Workload, plan_point, predict_point, scheduler_config
from simulator.routing import UniformRouting
from simulator.sweep import Calibration, find_calibration
from tests.simulator.conftest import tiny_spec


@pytest.mark.parametrize("flags", [
    [],
    ["--max-running-requests", "16"],
    ["--max-prefill-length", "2048"],
    ["--max-prefill-length", "256"],  # below the 512 default: the mixed budget is bounded by it
    ["--max-prefill-length", "4096", "--mixed-prefill-length", "1024"],
    ["--max-running-requests", "8", "--mixed-prefill-length", "8"],
    ["--layered-prefill", "off"],
])
def test_the_simulated_scheduler_has_the_servers_budgets_for_the_same_flags(flags):
    """Differential: `ft serve FLAGS`'s scheduler (app/containers.py) against predict's for the same flags, on a
    fluxtide calibration whose workload step (2,048) differs from ft serve's default (8,192)."""
    spec = tiny_spec()
    names = {"--max-running-requests": "max_running_requests", "--max-prefill-length": "max_prefill_length",
             "--mixed-prefill-length": "mixed_prefill_length", "--layered-prefill": "layered_prefill"}
    settings = ServeSettings(**{names[f]: v == "on" if f == "--layered-prefill" else int(v)
                                for f, v in zip(flags[::2], flags[1::2], strict=True)})
    # the calibrations were measured with layered prefill off (their deployment's default); ft serve's is on
    layered = [] if "--layered-prefill" in flags else ["--layered-prefill", "on"]
    args = build_parser().parse_args(["predict", "--hardware", "rtx3090", "--model", "m", "--kv", "4096", *flags,
                                      *layered])
    calibration = Calibration.resolve("h200_v2")
    assert Workload.from_dict(calibration.workload).max_step_tokens == 2048
    deployment = deployment_from_args(calibration.deployment_params(), args, spec)
    plan = plan_point(spec, get_profile("rtx3090"), deployment.replace(pool_bytes=1 << 30), 4096)
    served = _scheduler_config(settings, spec, plan, ())
    workload = Workload.from_dict(calibration.workload)
    max_step, mixed = deployment.step_budgets(workload.max_step_tokens, args.mixed_prefill_length)
    simulated = scheduler_config(plan, workload.replace(max_step_tokens=max_step), spec.max_context,
                                 mixed_step_tokens=mixed, layered_prefill=deployment.layered_prefill,
                                 num_layers=spec.num_layers)
    assert deployment.layered_prefill is settings.layered_prefill  # on by default in both (ADR 0024)
    for name in ("max_running", "max_step_tokens", "mixed_step_tokens", "page_size", "max_context", "layered_prefill",
                 "num_layers"):
        assert getattr(simulated, name) == getattr(served, name), name


def test_the_customers_engine_keeps_its_one_step_budget():
    """rtx3090_v2 (no --max-prefill-length in its deployment: the other engine, no ADR 0011) runs one budget, its
    fit's 2,048-token steps, so its goldens do not move; a mixed budget is refused there."""
    cal = Calibration.resolve("rtx3090_v2")
    assert cal.deployment_params().step_budgets(2048) == (2048, None)
    with pytest.raises(ValueError, match="--mixed-prefill-length"):
        cal.deployment_params().step_budgets(2048, 512)
    with pytest.raises(ValueError, match="must be >= --max-running-requests"):
        Deployment(state_slots=4).step_budgets(2048, 2)


def _long_prompt_point(mixed_prefill_length=None):
    # two requests of a 1,000-token prompt, a 1,024-token step alone: the first step prefills the first prompt
    # and 24 tokens of the second; the rest of the second runs beside the first one's decodes, in 512-token mixed
    # steps by default (2 steps), in one step with a single budget
    spec = tiny_spec()
    deployment = Deployment(pool_bytes=1 << 30, state_slots=2, cache_type="none", max_prefill_length=1024)
    workload = Workload(prompt_tokens=1000, warmup_iterations=0, measure_iterations=1, measure_tokens=8)
    routing = UniformRouting(spec.num_layers, spec.num_experts, spec.top_k, seed=1)
    return predict_point(spec, "tiny", get_profile("rtx3090"), deployment, CostParams(step_overhead_s=1e-3),
                         routing, 4096, 2, workload, check=True, mixed_prefill_length=mixed_prefill_length)


def test_a_prompt_admitted_beside_decodes_runs_in_the_mixed_budget():
    default, single = _long_prompt_point(), _long_prompt_point(mixed_prefill_length=1024)
    assert default.extra["scheduler"] == {"max_step_tokens": 1024, "mixed_step_tokens": 512,
                                          "layered_prefill": False, "short_prompt_replays": 8}
    assert single.extra["scheduler"] == {"max_step_tokens": 1024, "mixed_step_tokens": 1024,
                                         "layered_prefill": False, "short_prompt_replays": 8}
    assert default.extra["window"]["steps"] == single.extra["window"]["steps"] + 1
    assert default.extra["window"]["output_tokens"] == single.extra["window"]["output_tokens"] == 16


def test_predict_reports_the_budgets_it_ran(tmp_path, capsys):
    argv = ["predict", "--hardware", "rtx3090", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "8k", "--workers", "1",
            "--json", "--routing", "uniform"]
    assert main(argv) == 0
    # the server's short-prompt replays (ADR 0026): 8 tokens at every plan, a 24 GB card's included
    assert json.loads(capsys.readouterr().out)[0]["scheduler"] == {"max_step_tokens": 8192, "mixed_step_tokens": 512,
                                                                  "layered_prefill": False, "short_prompt_replays": 8}
    assert main([*argv, "--calibration", "rtx3090_v2"]) == 0  # the customer's engine: no replays
    assert json.loads(capsys.readouterr().out)[0]["scheduler"] == {"max_step_tokens": 2048, "mixed_step_tokens": 2048,
                                                                  "layered_prefill": False, "short_prompt_replays": 0}
    assert main([*argv, "--mixed-prefill-length", "2"]) == 2  # below --max-running-requests (4): refused
    assert "--mixed-prefill-length (2)" in capsys.readouterr().err


def test_a_card_without_fluxtide_records_defaults_to_fluxtide_not_the_customers_engine():
    """Finding 1 of issue 10's planner: `--hardware rtx3090` used to predict the customer's engine (rtx3090_v2, the
    newest rtx3090_v*). Every consumer card now gets fluxtide's H200 profile carried over; the H200 its own."""
    for hardware in ("rtx3090", "rtx4090", "rtx5090", "rtx4060-laptop"):
        cal, measured_here = find_calibration(hardware)
        assert (cal.name, measured_here, cal.predicts, cal.customer_engine) == (
            "h200_records_v5", False, "fluxtide", False), hardware
    cal, measured_here = find_calibration("h200")
    assert (cal.name, measured_here, cal.predicts) == ("h200_records_v6", True, "fluxtide")
    for name in ("rtx3090_v1", "rtx3090_v2"):
        assert Calibration.resolve(name).predicts == "customer-engine"
    for name in ("h200_v1", "h200_v2", "h200_records_v1", "h200_records_v2", "h200_records_v3", "h200_records_v4",
                 "h200_records_v5"):
        assert Calibration.resolve(name).predicts == "fluxtide", name
