"""`ft serve --expert-parallel 2` on the CPU (gloo): rank 0 serves HTTP and drives the scheduler, rank 1
follows every step; greedy answers equal a single server's, live resize reaches both ranks, the expert
cache stays consistent, and stopping the server stops the follower. Bad flags exit 2 before anything starts.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from app import demo_model as demo
from app.containers import Container
from app.serving import RunningServer
from app.settings import ServeSettings
from tests.app.processes import FtServe, pid_alive

MODEL = demo.DEMO_MODEL_NAME
QUESTIONS = ["What is 19 + 23?", "What is 7 - 9?", "What is 120 + 5?", "What is 50 - 8?"]


def followers_of(pid: int) -> list[int]:
    """Child processes of `pid` (Linux /proc): the ranks ft serve started."""
    import pathlib

    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.fixture(scope="module")
def ep():
    server = FtServe(["--expert-parallel", "2", "--device", "cpu", "--port", "0", "--kv-tokens", "4096",
                      "--moe-slots", "6", "--debug"])
    try:
        yield server.wait_ready()
    finally:
        children = followers_of(server.proc.pid)
        assert server.stop() == 0, server.output()
        deadline = time.monotonic() + 20
        while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in children), "a rank outlived ft serve"
        assert "rank 1: stopped after" in server.output(), server.output()
        assert "stopped: served " in server.output(), server.output()  # rank 0's last line, as a single server's


@pytest.fixture(scope="module")
def single():
    settings = ServeSettings(port=0, device="cpu", kv_tokens=4096, moe_slots=6, debug=True)
    server = RunningServer(Container(), settings).start(wait_ready=120)
    yield server
    server.stop()


def ask(url: str, question: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                       max_tokens=8, temperature=0)
    return r.choices[0].message.content


def test_greedy_answers_equal_a_single_server(ep, single):
    assert len(followers_of(ep.proc.pid)) == 1
    expected = [ask(single.base_url, q) for q in QUESTIONS]
    assert [ask(ep.url, q) for q in QUESTIONS] == expected
    with ThreadPoolExecutor(4) as pool:  # batched steps on both ranks: still the same answers
        assert list(pool.map(lambda q: ask(ep.url, q), QUESTIONS)) == expected
    # rank 0's expert cache (6 slots over its 16 of the 32 keys) missed and is counted in /metrics
    metrics = httpx.get(ep.url + "/metrics", timeout=30).text
    misses = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("ft_expert_misses_total")]
    assert misses and misses[0] > 0, metrics[:2000]


def test_live_resize_reaches_every_rank(ep, single):
    r = httpx.post(ep.url + "/v1/cache/rebuild", json={"kv_tokens": "2k", "moe_slots": 4}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["after"]["kv_tokens"] == 2048
    # rank 1 rebuilt its pools too: the next steps' collectives still pair up and the answers are unchanged
    assert ask(ep.url, QUESTIONS[0]) == ask(single.base_url, QUESTIONS[0])
    assert httpx.get(ep.url + "/health", timeout=30).json()["status"] == "ok"


def test_bad_expert_parallel_arguments_exit_2(capsys):
    from app.cli import main

    assert main(["serve", "--expert-parallel", "0", "--device", "cpu", "--port", "0"]) == 2
    assert "--expert-parallel must be >= 1" in capsys.readouterr().err
    # the fast path runs under expert parallelism; what does not compose with it yet is refused up front
    assert main(["serve", "--expert-parallel", "2", "--routing-replay", "uniform", "--port", "0"]) == 2
    assert "--expert-parallel cannot run with --routing-replay" in capsys.readouterr().err
    assert main(["serve", "--expert-parallel", "2", "--executor", "cuda-graph", "--device", "cpu", "--port", "0"]) == 2
    assert "--executor cuda-graph cannot run with --device cpu" in capsys.readouterr().err
    assert main(["serve", "--expert-parallel", "2", "--data-parallel", "2", "--device", "cpu", "--port", "0"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
    assert main(["serve", "--expert-parallel", "2", "--device", "cuda:1", "--port", "0"]) == 2
    assert "--expert-parallel" in capsys.readouterr().err


def test_the_fast_path_is_wired_for_expert_parallelism_where_it_runs(monkeypatch):
    """Where _use_fast_path takes the fast path (CUDA and a pinned bank; forced here, on the CPU), a rank's
    executor is the fast path's FastExpertParallelExecutor, wrapped in the StepLeader on rank 0 (a group of
    one rank, so nothing waits for a peer)."""
    import socket

    import torch.distributed as dist

    import app.containers as containers
    from adapters.checkpoint.loader import load_checkpoint
    from adapters.cuda_exec.expert_parallel import FastExpertParallelExecutor
    from adapters.torch_exec.expert_parallel import StepLeader

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    settings = ServeSettings(device="cpu", ep_address=address, max_running_requests=2)
    ckpt = load_checkpoint(containers.default_model_dir(), progress=False)
    plan = containers._pool_plan(settings, ckpt.spec, containers.GpuBudget(total_bytes=1 << 34))
    monkeypatch.setattr(containers, "_use_fast_path", lambda *a: True)
    try:
        run = containers._expert_parallel_executor(settings, ckpt, plan, "cpu", torch.float32)
        assert isinstance(run, StepLeader) and isinstance(run.executor, FastExpertParallelExecutor)
        assert run.executor.shard.computes_shared and run.executor.decode_rows >= 1
        run.check_valid()
    finally:
        dist.destroy_process_group()
