"""The step profiler's environment (FLUXTIDE_PROFILE_DIR, _STEPS, _MAX, _STACKS; docs/serving.md "Step profiles"):
read where the executor is built (app/containers.py), malformed values refused by `ft serve` before anything loads
(exit 2, naming the variable), one INFO line when it is on, and a warning, not a failure, where the reference
executor serves (only the CUDA fast path profiles)."""

from __future__ import annotations

import logging

import pytest

from app import containers
from app.cli import main
from tests.log_records import logger_records


def test_off_unless_the_directory_is_set():
    assert containers._profile_env({}) is None
    assert containers._profile_env({"FLUXTIDE_PROFILE_STEPS": "all", "FLUXTIDE_PROFILE_MAX": "x"}) is None
    containers.check_step_profiler({})  # nothing to check, nothing imported


def test_the_defaults_and_the_values(tmp_path):
    env = {"FLUXTIDE_PROFILE_DIR": str(tmp_path / "p")}
    assert containers._profile_env(env) == (str(tmp_path / "p"), "prefill>0", 8, False)
    env |= {"FLUXTIDE_PROFILE_STEPS": "mixed&prefill<=32", "FLUXTIDE_PROFILE_MAX": "3", "FLUXTIDE_PROFILE_STACKS": "1"}
    assert containers._profile_env(env) == (str(tmp_path / "p"), "mixed&prefill<=32", 3, True)
    with logger_records("fluxtide.serve", logging.INFO) as records:
        profiler = containers._step_profiler(env)
    assert (str(profiler.steps), profiler.max_steps, profiler.with_stack) == ("mixed&prefill<=32", 3, True)
    assert (tmp_path / "p").is_dir()
    (line,) = [r.getMessage() for r in records if r.getMessage().startswith("step profiler")]
    assert line == (f"step profiler: on: up to 3 steps matching 'mixed&prefill<=32' (FLUXTIDE_PROFILE_STEPS), Python "
                    f"stacks on, into {tmp_path / 'p'}")


@pytest.mark.parametrize(("var", "value", "says"), [
    ("FLUXTIDE_PROFILE_STEPS", "prefil<=32", "FLUXTIDE_PROFILE_STEPS: step filter 'prefil<=32': 'prefil<=32' is not"),
    ("FLUXTIDE_PROFILE_STEPS", "prefill<1", "prefill<1 matches no step"),
    ("FLUXTIDE_PROFILE_MAX", "0", "FLUXTIDE_PROFILE_MAX must be a whole number of steps >= 1, got '0'"),
    ("FLUXTIDE_PROFILE_MAX", "eight", "FLUXTIDE_PROFILE_MAX must be a whole number of steps >= 1, got 'eight'"),
    ("FLUXTIDE_PROFILE_STACKS", "yes", "FLUXTIDE_PROFILE_STACKS must be 0 or 1, got 'yes'"),
])
def test_ft_serve_refuses_a_malformed_variable_before_loading(var, value, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLUXTIDE_PROFILE_DIR", str(tmp_path / "p"))
    monkeypatch.setenv(var, value)
    assert main(["serve", "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ft serve: ") and says in err, err


def test_a_directory_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"FLUXTIDE_PROFILE_DIR .*file/p: cannot make it"):
        containers.check_step_profiler({"FLUXTIDE_PROFILE_DIR": str(tmp_path / "file" / "p")})


def test_where_the_reference_executor_serves_it_says_so_and_serves(tmp_path):
    with logger_records("fluxtide.serve", logging.INFO) as records:
        containers._no_step_profiler("the reference executor serves", {})
        containers._no_step_profiler("the reference executor serves", {"FLUXTIDE_PROFILE_DIR": str(tmp_path)})
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("WARNING", "step profiler: off: FLUXTIDE_PROFILE_DIR profiles steps of the CUDA fast path in one process only, "
                    "and the reference executor serves")]
