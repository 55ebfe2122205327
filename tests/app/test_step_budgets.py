"""`ft serve --max-prefill-length / --mixed-prefill-length` (docs/adr/0011-mixed-step-budget.md): checked with
clear errors, handed to the scheduler, and the largest step's activations held outside the pools, a step
size the budget cannot hold refused by name."""

import subprocess
import sys
from dataclasses import replace

import pytest

from app.containers import _budget, _pool_plan, _scheduler_config, _step_reserve
from app.settings import ServeSettings
from domain.model_spec import WeightFormat
from domain.step_budget import dense_scratch_bytes, serve_step_reserve, step_activation_bytes
from tests.app.conftest import TINY_SPEC

GIB = 2**30


def test_the_two_budgets_default_and_are_checked():
    s = ServeSettings()
    assert (s.max_prefill_length, s.mixed_step_tokens) == (8192, 512)
    assert ServeSettings(max_prefill_length=256).mixed_step_tokens == 256  # the default never exceeds the step
    assert ServeSettings(max_running_requests=600, max_prefill_length=8192).mixed_step_tokens == 600
    assert ServeSettings(mixed_prefill_length=2048).mixed_step_tokens == 2048
    with pytest.raises(ValueError, match=r"--mixed-prefill-length \(9000\) must be >= --max-running-requests \(4\) "
                                         r"and <= --max-prefill-length \(8192\)"):
        ServeSettings(mixed_prefill_length=9000)
    with pytest.raises(ValueError, match="--mixed-prefill-length"):
        ServeSettings(max_running_requests=8, mixed_prefill_length=4)
    with pytest.raises(ValueError, match=r"--max-prefill-length \(2\) must be >= --max-running-requests \(4\)"):
        ServeSettings(max_prefill_length=2)


def test_the_layer_group_budget_defaults_to_1024_and_is_checked():
    # ADR 0024, session 25: 1024, raised to the mixed budget, bounded by the step
    assert ServeSettings().layer_group_tokens == 1024
    assert ServeSettings(mixed_prefill_length=2048).layer_group_tokens == 2048
    assert ServeSettings(max_prefill_length=600).layer_group_tokens == 600
    assert ServeSettings(layer_group_length=256).layer_group_tokens == 256  # below the mixed budget: allowed
    with pytest.raises(ValueError, match=r"--layer-group-length \(9000\) must be >= --max-running-requests \(4\) "
                                         r"and <= --max-prefill-length \(8192\)"):
        ServeSettings(layer_group_length=9000)
    with pytest.raises(ValueError, match="--layer-group-length"):
        ServeSettings(max_running_requests=8, layer_group_length=4)
    with pytest.raises(ValueError, match="needs --layered-prefill on"):
        ServeSettings(layer_group_length=1024, layered_prefill=False)
    settings = ServeSettings(kv_tokens=1024, moe_slots=8, max_prefill_length=1024, mixed_prefill_length=96,
                             layer_group_length=512)
    plan = _pool_plan(settings, TINY_SPEC, _budget(settings, TINY_SPEC, "cpu"))
    assert _scheduler_config(settings, TINY_SPEC, plan, ()).layer_group_tokens == 512
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--layer-group-length", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--layer-group-length" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_refuses_a_bad_mixed_budget_on_the_command_line():
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--max-prefill-length", "1k",
                          "--mixed-prefill-length", "2k"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--mixed-prefill-length (2048) must be" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_scheduler_gets_both_budgets():
    settings = ServeSettings(kv_tokens=1024, moe_slots=8, max_prefill_length=1024, mixed_prefill_length=96)
    plan = _pool_plan(settings, TINY_SPEC, _budget(settings, TINY_SPEC, "cpu"))
    config = _scheduler_config(settings, TINY_SPEC, plan, ())
    assert (config.max_step_tokens, config.mixed_step_tokens) == (1024, 96)


def test_the_dequantized_dense_copy_is_reserved_only_where_the_prefill_makes_it(monkeypatch):
    from adapters.cuda_exec import prefill_linear

    spec = replace(TINY_SPEC, dense_format=WeightFormat.FP8_BLOCK)
    settings = ServeSettings(kv_tokens=1024, moe_slots=8, max_prefill_length=4096, layered_prefill=False)
    assert prefill_linear.DEQUANT_MIN_ROWS == 1024  # the default since session 30 (FLUXTIDE_PREFILL_DEQUANT_ROWS unset)
    on = _step_reserve(settings, spec, "cuda:0")
    monkeypatch.setattr(prefill_linear, "DEQUANT_MIN_ROWS", 0)  # FLUXTIDE_PREFILL_DEQUANT_ROWS=0: off
    off = _step_reserve(settings, spec, "cuda:0")
    assert on == off + dense_scratch_bytes(spec) > off
    monkeypatch.setattr(prefill_linear, "DEQUANT_MIN_ROWS", 1024)
    # held only where a step can make it: the Triton prefill, and steps of at least the cut's rows
    assert _step_reserve(replace(settings, prefill_kernels="reference"), spec, "cuda:0") == off
    assert _step_reserve(replace(settings, executor="reference"), spec, "cuda:0") == off
    short = replace(settings, max_prefill_length=512)
    assert _step_reserve(short, spec, "cuda:0") == serve_step_reserve(spec, 512, 4)
    assert _step_reserve(settings, spec, "cpu") == serve_step_reserve(spec, 4096, 4, 4)  # never on the CPU


def test_the_budget_holds_the_largest_steps_activations_outside_the_pools():
    # layered prefill off: its kept chunk, also held there, is the next test's
    settings = ServeSettings(gpu_budget_gib=1.0, kv_tokens=1024, moe_slots=8, max_prefill_length=4096,
                             layered_prefill=False)
    budget = _budget(settings, TINY_SPEC, "cpu")
    step = min(4096, 4 * TINY_SPEC.max_context)
    assert budget.fixed_bytes == step_activation_bytes(TINY_SPEC, step, 4, dtype_bytes=4) > 0  # fp32 on the CPU
    assert _step_reserve(settings, TINY_SPEC, "cuda:0") == step_activation_bytes(TINY_SPEC, step, 4)  # bf16 there
    small = replace(settings, max_prefill_length=64)
    assert _budget(small, TINY_SPEC, "cpu").fixed_bytes < budget.fixed_bytes
    plan = _pool_plan(settings, TINY_SPEC, budget)
    assert plan.pool_bytes == int(GIB * settings.memory_ratio) - TINY_SPEC.dense_weight_bytes() - budget.fixed_bytes


def test_a_step_size_the_budget_cannot_hold_is_refused_by_name():
    fits = ServeSettings(kv_tokens=1024, moe_slots=8, max_prefill_length=16, cache_type="none")
    small = _pool_plan(fits, TINY_SPEC, _budget(fits, TINY_SPEC, "cpu"))
    big = replace(fits, max_prefill_length=4096)
    reserve = _budget(big, TINY_SPEC, "cpu").fixed_bytes
    # a card that holds these pools and a 16-token step's activations, not a 4096-token step's
    total = (small.used_bytes + TINY_SPEC.dense_weight_bytes() + reserve // 2) / 0.9
    card = replace(fits, gpu_budget_gib=total / GIB)
    assert _pool_plan(card, TINY_SPEC, _budget(card, TINY_SPEC, "cpu")).kv_tokens == 1024
    refused = replace(card, max_prefill_length=4096)
    with pytest.raises(ValueError, match=r"a prefill step of 4096 tokens \(--max-prefill-length\) needs 14\.4 MiB of "
                                         r"activations beside the pools.*lower --max-prefill-length"):
        _pool_plan(refused, TINY_SPEC, _budget(refused, TINY_SPEC, "cpu"))


def test_layered_prefill_reaches_the_scheduler_and_its_kept_chunk_is_reserved():
    """--layered-prefill (docs/adr/0024-layered-prefill.md): on by default since the H200 measured it (session 23);
    on, the scheduler gets it with the model's layer count, and the residual stream a chunk keeps between its
    groups is held beside the pools."""
    assert ServeSettings().layered_prefill is True
    on = ServeSettings(kv_tokens=1024, moe_slots=8, max_prefill_length=1024)
    off = replace(on, layered_prefill=False)
    plan = _pool_plan(on, TINY_SPEC, _budget(on, TINY_SPEC, "cpu"))
    config = _scheduler_config(on, TINY_SPEC, plan, ())
    assert (config.layered_prefill, config.num_layers) == (True, TINY_SPEC.num_layers)
    assert _scheduler_config(off, TINY_SPEC, plan, ()).layered_prefill is False
    step = min(1024, 4 * TINY_SPEC.max_context)
    kept = step * TINY_SPEC.hidden_size * 2  # bf16 on CUDA
    assert _step_reserve(on, TINY_SPEC, "cuda:0") - _step_reserve(off, TINY_SPEC, "cuda:0") == kept > 0


def test_serve_takes_layered_prefill_on_the_command_line():
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--layered-prefill", "maybe"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--layered-prefill: invalid choice: 'maybe'" in bad.stderr


def test_short_prompt_layering_follows_the_flag_and_the_plan():
    """--layer-short-prompts (ADR 0024 "A0", session 28): off by default since session 30's measurement, auto on with
    layered prefill; the scheduler is told whether the plan leaves experts out (TINY_SPEC has 16)."""
    assert ServeSettings().layer_short_prompts == "off" and ServeSettings().layers_short_prompts is False
    assert ServeSettings(layer_short_prompts="auto").layers_short_prompts is True
    assert ServeSettings(layered_prefill=False, layer_short_prompts="auto").layers_short_prompts is False  # nothing to layer with
    with pytest.raises(ValueError, match="--layer-short-prompts must be auto or off, got 'on'"):
        ServeSettings(layer_short_prompts="on")
    partial = ServeSettings(kv_tokens=1024, moe_slots=8, max_prefill_length=1024, layer_short_prompts="auto")
    plan = _pool_plan(partial, TINY_SPEC, _budget(partial, TINY_SPEC, "cpu"))
    config = _scheduler_config(partial, TINY_SPEC, plan, ())
    assert plan.partial_residency and config.layer_short_prompts and config.partial_residency
    off = replace(partial, layer_short_prompts="off")
    assert _scheduler_config(off, TINY_SPEC, plan, ()).layer_short_prompts is False
    assert _scheduler_config(replace(partial, layered_prefill=False), TINY_SPEC, plan, ()).layer_short_prompts is False
    full = replace(partial, moe_slots=TINY_SPEC.total_experts)
    plan = _pool_plan(full, TINY_SPEC, _budget(full, TINY_SPEC, "cpu"))
    config = _scheduler_config(full, TINY_SPEC, plan, ())
    assert not plan.partial_residency and config.layer_short_prompts and not config.partial_residency


def test_serve_takes_layer_short_prompts_on_the_command_line():
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--layer-short-prompts", "on"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--layer-short-prompts: invalid choice: 'on'" in bad.stderr
    helped = subprocess.run([sys.executable, "-m", "app", "serve", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert helped.returncode == 0 and "--layer-short-prompts {auto,off}" in helped.stdout
