"""scripts/bench_host_overhead.py at tiny scale on the CPU: the null executor keeps the executor
contract, and the script serves it in a child process, streams through the real HTTP stack and
writes a record whose per-step numbers add up."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench_host_overhead.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_host_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_host_overhead"] = module
    spec.loader.exec_module(module)
    return module


def test_the_null_executor_samples_each_sampled_work_once_and_calls_its_launch_hook():
    bench = load_bench()
    ex = bench.NullExecutor([10, 11, 12], step_s=0.001)
    launched = []
    ex.on_launched = lambda: launched.append(True)
    works = (SequenceWork("a", (1, 2, 3), 0, (0,), 0, True, SamplingParams(), 0),
             SequenceWork("b", (4,), 7, (1,), 1, True, SamplingParams(), 3),
             SequenceWork("c", (5, 6), 0, (2,), 2, False, SamplingParams(), 0))
    out = ex.execute(StepBatch(works))
    assert {k: v.token_id for k, v in out.items()} == {"a": 10, "b": 12}  # token at end_position % 3
    assert launched == [True] and ex.waited_s >= 0.001
    plain = bench.NullExecutor([10], step_s=0.0, hook=False)
    assert not hasattr(plain, "on_launched")  # the engine then hands events over before each step


def test_the_script_measures_a_served_null_model_and_writes_its_record(tmp_path):
    out = tmp_path / "host.json"
    code = load_bench().main(["--tokens", "12", "--concurrency", "2", "--repeats", "1", "--step-ms", "1",
                              "--tokenizer", "demo", "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["kind"] == "host_overhead" and record["launch_hook"] is True
    (result,) = record["results"]
    assert result["concurrency"] == 2 and result["tokens"] == 24
    assert result["model_steps"] >= 12 and result["device_wait_us_mean"] >= 1000
    assert result["overhead_us_per_step"] == round(result["period_us_mean"] - result["device_wait_us_mean"], 1)
    assert result["cpu_us_per_step"]["fluxtide-engine"] > 0 and result["cpu_us_per_step"]["fluxtide-http"] > 0
    assert {"schedule", "stream_events", "publish_pools", "flush_to_loops"} <= set(result["engine_phases_us"])
