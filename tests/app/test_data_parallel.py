"""`ft serve --data-parallel N` (app/data_parallel/): the merge rules, device assignment, argument
forwarding and worker choice as units; then the real command with 2 CPU workers on the demo model,
driven with the official openai client: both workers get requests, greedy answers equal a single
server's, streams pass through, stats and metrics aggregate, a resize covers both workers (or
neither), and a killed worker is reported while its requests fail cleanly."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.cli import _add_serve
from app.containers import Container
from app.data_parallel.aggregate import (
    front_status,
    merge,
    merge_arrivals,
    merge_gc,
    merge_metrics,
    plan_totals,
)
from app.data_parallel.serve import worker_argv
from app.data_parallel.workers import WorkerPool, WorkerProcess, assign_devices
from app.serving import RunningServer
from app.settings import ServeSettings
from tests.app.conftest import read_response_head
from tests.app.processes import FtServe, pid_alive

demo = pytest.importorskip("app.demo_model")
MODEL = demo.DEMO_MODEL_NAME
KEY = "front-key"
QUESTIONS = ["What is 19 + 23?", "What is 7 - 9?", "What is 120 + 5?", "What is 3 + 4?", "What is 50 - 8?",
             "What is 11 + 11?"]


# -- units ---------------------------------------------------------------------------------------
def test_merge_adds_counts_keeps_shared_values_and_bounds_percentiles():
    a = {"running": 2, "page_size": 16, "phase": "ready", "busy_fraction": 0.5, "expert_hit_rate": None,
         "ttft_s": {"count": 3, "p99": 0.2}, "decode_tok_s": 10.0}
    b = {"running": 1, "page_size": 16, "phase": "draining", "busy_fraction": 1.0, "expert_hit_rate": 0.8,
         "ttft_s": {"count": 1, "p99": 0.9}, "decode_tok_s": 30.0}
    assert merge([a, b]) == {"running": 3, "page_size": 16, "phase": ["ready", "draining"], "busy_fraction": 0.75,
                             "expert_hit_rate": 0.8, "ttft_s": {"count": 4, "p99": 0.9}, "decode_tok_s": 40.0}
    plan = {"kv_tokens": 4096, "kv_pages": 256, "expert_slots": 32, "state_slots": 4, "pool_bytes": 10,
            "used_bytes": 6, "free_bytes": 4, "page_size": 16}
    assert plan_totals([plan, plan]) == {"kv_tokens": 8192, "kv_pages": 512, "expert_slots": 64, "state_slots": 8,
                                         "pool_bytes": 20, "used_bytes": 12, "free_bytes": 8}


def test_arrivals_and_gc_merge_keep_their_units():
    """/v1/stats `arrivals` and `gc` of the front (it had neither): idle wakes, collections, their pause total and
    frozen objects add up over the workers; the longest pause is the worst worker's (not a sum); each worker's
    burst sizes stay its own, under its index (a round spread over the workers is no one burst)."""
    arrivals = merge_arrivals([(0, {"idle_wakes": 3, "last_burst_sizes": [1, 4, 2]}),
                               (1, {"idle_wakes": 2, "last_burst_sizes": [2, 2]}), (2, None)])
    assert arrivals == {"idle_wakes": 5, "last_burst_sizes_by_worker": {"0": [1, 4, 2], "1": [2, 2]}}
    gc = merge_gc([{"full_collections": 2, "full_pause_s_total": 0.1, "full_pause_s_max": 0.07, "frozen_objects": 10},
                   {"full_collections": 1, "full_pause_s_total": 0.2, "full_pause_s_max": 0.2, "frozen_objects": 12},
                   None])
    assert gc == {"full_collections": 3, "full_pause_s_total": 0.3, "full_pause_s_max": 0.2, "frozen_objects": 22}
    assert merge_gc([]) == {} and merge_arrivals([]) == {"idle_wakes": 0, "last_burst_sizes_by_worker": {}}


def test_a_resize_message_reports_every_workers_prefix_cache():
    """With --data-parallel 2 the resize said worker 0's "0 cached pages dropped" though worker 1 dropped 1."""
    from types import SimpleNamespace

    from app.data_parallel.front import _applied

    def body(note: str, waited_s: float = 0.1, swap_s: float = 0.2) -> dict:
        return {"message": f"pools rebuilt; {note}", "experts_kept": True, "kept": "expert slots kept warm",
                "waited_s": waited_s, "swap_s": swap_s, "total_s": waited_s + swap_s, "max_running": 4,
                "peak_bytes": 5, "steps": [], "before": {}, "after": {}}

    def cleared(n: int) -> str:
        return f"prefix cache cleared ({n} cached pages dropped: the KV or snapshot pool was rebuilt)"

    w0, w1 = SimpleNamespace(index=0), SimpleNamespace(index=1)
    message = _applied([(w0, body(cleared(0))), (w1, body(cleared(1)))])["message"]
    assert message == f"pools rebuilt on all 2 workers; worker 0: {cleared(0)}; worker 1: {cleared(1)}", message
    same = _applied([(w0, body(cleared(2))), (w1, body(cleared(2)))])["message"]
    assert same == f"pools rebuilt; {cleared(2)} (on all 2 workers)", same
    # the wait for in-flight requests and the swap stay apart, each the slowest worker's
    times = _applied([(w0, body(cleared(0), 0.5, 0.1)), (w1, body(cleared(0), 0.0, 0.3))])
    assert (times["waited_s"], times["swap_s"], times["total_s"]) == (0.5, 0.3, 0.6)


@pytest.mark.parametrize("statuses, expected", [
    (["ok", "ok"], "ok"), (["ok", "loading"], "loading"), (["starting", "exited"], "loading"),
    (["ok", "exited"], "degraded"), (["unreachable", "ok"], "degraded"), (["error", "exited"], "error")])
def test_front_status(statuses, expected):
    assert front_status(statuses) == expected


def test_metrics_are_labelled_per_worker_and_sum_back():
    text = "# HELP ft_x_total x\n# TYPE ft_x_total counter\nft_x_total {}\n"
    families = {f.name: f for f in merge_metrics({0: text.format(3.0), 1: text.format(4.0)})}
    samples = [s for s in families["ft_x"].samples if s.name == "ft_x_total"]
    assert {s.labels["worker"]: s.value for s in samples} == {"0": 3.0, "1": 4.0}


def test_devices_one_gpu_each_by_visible_id():
    gpus = assign_devices("cuda", 2, cuda_count=2, visible="4,5")
    assert [(d.flag, d.env, d.label) for d in gpus] == [("cuda", {"CUDA_VISIBLE_DEVICES": "4"}, "cuda:4"),
                                                         ("cuda", {"CUDA_VISIBLE_DEVICES": "5"}, "cuda:5")]
    assert [d.label for d in assign_devices("auto", 3, cuda_count=3, visible=None)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [d.flag for d in assign_devices("auto", 2, cuda_count=0, visible=None)] == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="needs 2 CUDA devices, 1 visible"):
        assign_devices("cuda", 2, cuda_count=1, visible=None)
    with pytest.raises(ValueError, match="use --device cuda"):
        assign_devices("cuda:1", 2, cuda_count=2, visible=None)
    with pytest.raises(ValueError, match=">= 1"):
        assign_devices("cpu", 0, cuda_count=0, visible=None)


def test_worker_argv_forwards_every_flag_but_the_fronts_own():
    parser = argparse.ArgumentParser()
    serve = _add_serve(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--kv-tokens", "8k", "--debug", "--port", "9", "--api-key", "k",
                              "--data-parallel", "2", "--device", "cuda", "--executor", "reference"])
    argv = worker_argv(serve, args)
    assert argv == ["--kv-tokens", "8192", "--debug", "--executor", "reference", "--host", "127.0.0.1",
                    "--port", "0"]


def test_pool_gives_the_least_loaded_worker_and_alternates_on_ties():
    workers = [WorkerProcess(i, []) for i in range(2)]
    for w in workers:
        w.status = "ok"
    pool = WorkerPool(workers, "k")
    first, second = pool.acquire(), pool.acquire()
    assert {first.index, second.index} == {0, 1}  # one each while both are busy
    pool.release(first)
    assert pool.acquire() is first  # the one with nothing in flight
    pool.release(first)
    pool.release(second)
    assert pool.acquire() is second  # a tie: the one given fewer so far
    pool.release(second)
    workers[1].status = "exited"
    assert pool.acquire() is workers[0]
    workers[0].status = "unreachable"
    assert pool.acquire() is None


@pytest.mark.parametrize("path", ["/v1/cache/rebuild", "/v1/routing"])
def test_the_front_answers_a_body_that_stops_arriving_with_a_408(monkeypatch, path):
    """As one server does (test_hardening): half a body and then silence held the front's handler forever."""
    import socket

    import app.api.schemas as schemas
    from app.data_parallel.front import Front, create_front_app
    from app.server import ServerThread

    monkeypatch.setattr(schemas, "BODY_IDLE_S", 0.5)
    pool = WorkerPool([WorkerProcess(0, ["unused"])], "k")  # never started: these routes read the body first
    http = ServerThread(create_front_app(Front(pool)), "127.0.0.1", 0)
    http.start()
    try:
        port = next(s.getsockname()[1] for srv in http.server.servers for s in srv.sockets)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 40\r\n\r\n{\"kv_tokens\": ")
            answer = read_response_head(s)  # NOTE: socket timeout 10 s: a hang fails here
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        http.stop()


# -- the real command: 2 CPU workers on the demo model ------------------------------------------------
@pytest.fixture(scope="module")
def front():
    server = FtServe(["--data-parallel", "2", "--device", "cpu", "--port", "0", "--api-key", KEY,
                      "--kv-tokens", "4096", "--debug"])
    try:
        yield server.wait_ready()
    finally:
        pids = [w["pid"] for w in httpx.get(server.url + "/health").json()["workers"]] if server.url else []
        assert server.stop() == 0, server.output()
        assert "stopped: dispatched" in server.output(), server.output()  # the front's last line, as ft serve's
        deadline = time.monotonic() + 15
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids), "workers outlived the front"


@pytest.fixture(scope="module")
def single():
    settings = ServeSettings(port=0, device="cpu", kv_tokens=4096, debug=True)
    server = RunningServer(Container(), settings).start(wait_ready=120)
    yield server
    server.stop()


def client_for(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)


def ask(client: openai.OpenAI, question: str, **kw) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                       max_tokens=kw.pop("max_tokens", 8), temperature=0, **kw)
    return r.choices[0].message.content


def admin(front, path: str, method: str = "GET", **kw) -> httpx.Response:
    return httpx.request(method, front.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=120, **kw)


def test_health_shows_each_worker_on_its_own_process(front):
    body = httpx.get(front.url + "/health").json()  # open, like a single server's
    assert body["status"] == "ok" and body["data_parallel"] == 2 and body["model"] == MODEL
    pids = {w["pid"] for w in body["workers"]}
    assert len(pids) == 2 and front.proc.pid not in pids
    assert all(w["status"] == "ok" and w["device"] == "cpu" for w in body["workers"])
    assert httpx.get(front.url + "/v1/models").status_code == 401  # the front's key guards the API


def test_the_routing_mode_is_the_workers_and_its_switch_reaches_every_worker(front):
    assert httpx.get(front.url + "/health").json()["routing"] == {"mode": "natural"}
    assert admin(front, "/v1/stats").json()["routing"] == {"mode": "natural"}
    r = admin(front, "/v1/routing", "POST", json={"replay": True})  # fanned out: the workers' own refusal
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_routing_replay"


def test_greedy_answers_equal_a_single_server_and_both_workers_serve(front, single):
    dp, one = client_for(front.url), client_for(single.base_url)
    assert [ask(dp, q) for q in QUESTIONS] == [ask(one, q) for q in QUESTIONS]
    with ThreadPoolExecutor(4) as pool:  # concurrent too: the same answers
        assert list(pool.map(lambda q: ask(dp, q), QUESTIONS)) == [ask(one, q) for q in QUESTIONS]
    workers = admin(front, "/v1/stats").json()["workers"]
    assert all(w["dispatched"] >= 4 for w in workers), workers


def test_streams_pass_through_chunk_by_chunk(front, single):
    dp = client_for(front.url)
    stream = dp.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                        max_tokens=8, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 4 and chunks[-1].usage is not None
    assert text == ask(client_for(single.base_url), QUESTIONS[0]) == "42"


def test_stats_and_metrics_aggregate_the_workers(front):
    sent = 4
    dp = client_for(front.url)
    before = _admitted(front)
    for q in QUESTIONS[:sent]:
        ask(dp, q)
    after = _admitted(front)
    # the workers' own counters (not the front's): together they admitted exactly what was sent
    assert sum(after.values()) - sum(before.values()) == sent and set(after) == {"0", "1"}
    assert all(v > 0 for v in after.values()), after
    stats = admin(front, "/v1/stats").json()
    per = stats["workers"]
    # the high-water marks: the front answers the reset itself, every worker's peak summed (one worker's alone was
    # what a front without the route gave `ft bench ladder`); both workers ran a request since start
    peaks = admin(front, "/v1/stats/reset_peaks", method="POST").json()
    assert peaks["data_parallel"] == 2 and [w["worker"] for w in peaks["workers"]] == [0, 1]
    assert peaks["running_peak"] == sum(w["running_peak"] for w in peaks["workers"]) >= 2
    assert all(w["running_peak"] >= 1 for w in peaks["workers"])
    again = admin(front, "/v1/stats/reset_peaks", method="POST").json()
    assert again["running_peak"] == 0 and again["waiting_peak"] == 0  # restarted from the idle pools
    assert stats["pools"]["kv_pages_total"] == sum(w["pools"]["kv_pages_total"] for w in per) == 2 * 256
    assert stats["totals"]["state_slots"] == sum(w["plan"]["state_slots"] for w in per)
    assert stats["plan"]["kv_tokens"] == 4096  # one worker's plan: what one request can use
    assert stats["executor"] == per[0]["executor"] and stats["executor"]["kind"] == "TorchExecutor"
    assert stats["window"]["decode_tokens"] == sum(w["window"]["decode_tokens"] for w in per) > 0
    # idle: every used page is a worker's prefix cache's
    assert stats["pools"]["running"] == 0
    assert stats["pools"]["kv_pages_used"] == stats["pools"]["prefix_cache"]["cached_pages"]
    assert stats["prefix_cache"]["requests"] == sum(w["prefix_cache"]["requests"] for w in per) > 0
    assert stats["pools"]["prefix_cache"]["snapshot_interval"] == per[0]["pools"]["prefix_cache"]["snapshot_interval"]
    # arrivals and gc, as a single server has them (the front had neither): idle wakes add, each worker's bursts
    # under its index; full collections, their pauses and frozen objects add, the longest pause is one worker's
    arrivals, gc = stats["arrivals"], stats["gc"]
    assert arrivals["idle_wakes"] == sum(w["arrivals"]["idle_wakes"] for w in per) >= 2  # both woke to a request
    assert arrivals["last_burst_sizes_by_worker"] == {str(w["worker"]): w["arrivals"]["last_burst_sizes"] for w in per}
    assert all(w["arrivals"]["last_burst_sizes"] for w in per)
    for key in ("full_collections", "frozen_objects"):
        assert gc[key] == sum(w["gc"][key] for w in per), key
    assert gc["frozen_objects"] > 0  # both workers froze their start-up heap
    assert gc["full_pause_s_total"] == pytest.approx(sum(w["gc"]["full_pause_s_total"] for w in per), abs=1e-6)
    assert gc["full_pause_s_max"] == max(w["gc"]["full_pause_s_max"] for w in per)
    # the front's own process: it relays every stream, so it freezes its start-up heap too and counts its pauses
    assert gc["front"]["frozen_objects"] > 0 and gc["front"]["full_collections"] >= 0


def test_the_step_trace_is_each_workers_own(front):
    """/v1/stats/steps through the front: every worker's steps under `workers` (not merged), `since` passed on, the
    key asked for as on a single server."""
    started = time.time()
    dp = client_for(front.url)
    for q in QUESTIONS[:4]:  # the front alternates on ties: both workers run steps
        ask(dp, q)
    body = admin(front, "/v1/stats/steps", params={"since": started}).json()
    assert body["clock"] == "unix" and body["window_s"] == 30.0 and body["data_parallel"] == 2
    assert "steps" not in body and [w["worker"] for w in body["workers"]] == [0, 1]
    for worker in body["workers"]:
        rows = worker["steps"]
        assert rows and all(r["end"] > started for r in rows) and worker["clock"] == "unix", worker
        assert [r["end"] for r in rows] == sorted(r["end"] for r in rows)
        # `since` reaches the worker: after its last step, nothing
        last = rows[-1]["end"]
        again = admin(front, "/v1/stats/steps", params={"since": last}).json()["workers"][worker["worker"]]
        assert all(r["end"] > last for r in again["steps"])
    for bad in ("nan", "abc"):  # the front's answer has a single server's shape (abc had code and param null)
        r = admin(front, "/v1/stats/steps", params={"since": bad})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
        assert r.json()["error"]["param"] == "since" and "finite number" in r.json()["error"]["message"], r.text
    assert httpx.get(front.url + "/v1/stats/steps").status_code == 401


def _admitted(front) -> dict[str, float]:
    text = admin(front, "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "ft_requests_admitted_total":
                out[s.labels["worker"]] = s.value
    return out


def _plans(front) -> list[int]:
    return [w["plan"]["kv_tokens"] for w in admin(front, "/v1/cache/status").json()["workers"]]


def test_resize_covers_every_worker_or_none(front, capsys):
    r = admin(front, "/v1/cache/rebuild", "POST", json={"kv_tokens": "2k"})
    assert r.status_code == 200, r.text
    assert r.json()["after"]["kv_tokens"] == 2048 and len(r.json()["workers"]) == 2
    assert _plans(front) == [2048, 2048]
    from app.cli import main

    assert main(["ctl", "--base-url", front.url, "--api-key", KEY, "cache", "--kv", "4096"]) == 0
    assert "on all 2 workers" in capsys.readouterr().out
    assert _plans(front) == [4096, 4096]
    r = admin(front, "/v1/cache/rebuild", "POST", json={"kv_tokens": "100m"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "plan_refused"
    assert [w["status"] for w in r.json()["workers"]] == [409, 409]
    assert _plans(front) == [4096, 4096]


def test_resize_refused_by_one_worker_is_undone_on_the_others(front):
    dp = client_for(front.url)
    stream = dp.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 1 + 1?"}],
                                        max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # one worker now has a request in flight that will not drain in 0 s
    busy = [w["worker"] for w in httpx.get(front.url + "/health").json()["workers"] if w["in_flight"]]
    r = admin(front, "/v1/cache/rebuild", "POST", json={"kv_tokens": "2k", "wait_s": 0})
    stream.close()
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "resize_partial_reverted", error
    assert f"refused by worker {busy[0]}" in error["message"] and "nothing changed" in error["message"]
    assert all(item["ok"] for item in r.json()["reverted"])
    assert _plans(front) == [4096, 4096]
    _wait(lambda: admin(front, "/v1/stats").json()["pools"]["running"] == 0)
    # the client's close reached the worker through the front, and the front's count came back
    _wait(lambda: all(w["in_flight"] == 0 for w in httpx.get(front.url + "/health").json()["workers"]))


def _wait(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_killed_workers_are_reported_and_their_requests_fail_cleanly(front):
    """Last in this module: it kills both workers, one after the other."""
    dp = client_for(front.url)
    failures: list[Exception] = []

    def long_answer():
        try:
            ask(dp, "What is 2 + 2?", max_tokens=900, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:
            failures.append(exc)

    waiting = threading.Thread(target=long_answer)
    waiting.start()
    _wait(lambda: any(w["in_flight"] for w in httpx.get(front.url + "/health").json()["workers"]))
    victim = next(w for w in httpx.get(front.url + "/health").json()["workers"] if w["in_flight"])
    stream = dp.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 5 + 5?"}],
                                        max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # on the other worker (the least loaded)
    os.kill(victim["pid"], signal.SIGKILL)
    waiting.join(30)
    assert not waiting.is_alive(), "the request on the killed worker hangs"
    assert failures and failures[0].status_code == 503 and failures[0].body["code"] == "worker_down"
    _wait(lambda: httpx.get(front.url + "/health").json()["status"] == "degraded")
    health = httpx.get(front.url + "/health")
    assert health.status_code == 200  # it still serves, on one worker
    dead = health.json()["workers"][victim["worker"]]
    assert dead["status"] == "exited" and "exited with code -9" in dead["error"]
    assert "exited with code -9" in health.json()["error"]
    assert ask(dp, QUESTIONS[0]) == "42"  # served by the survivor
    r = admin(front, "/v1/cache/rebuild", "POST", json={"kv_tokens": "2k"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_not_serving"
    assert len(admin(front, "/v1/stats").json()["workers"]) == 1

    survivor = next(w for w in health.json()["workers"] if w["worker"] != victim["worker"])
    os.kill(survivor["pid"], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    assert time.monotonic() - started < 30
    _wait(lambda: httpx.get(front.url + "/health").status_code == 503)
    assert httpx.get(front.url + "/health").json()["status"] == "error"
    with pytest.raises(openai.APIStatusError) as refused:
        ask(dp, QUESTIONS[0])
    assert refused.value.status_code == 503 and refused.value.body["code"] == "worker_down"


def test_bad_data_parallel_arguments_exit_2_before_any_worker_starts(capsys):
    from app.cli import main

    assert main(["serve", "--data-parallel", "2", "--device", "cuda:1", "--port", "0"]) == 2
    assert "use --device cuda" in capsys.readouterr().err
    assert main(["serve", "--data-parallel", "0", "--device", "cpu", "--port", "0"]) == 2
    assert ">= 1" in capsys.readouterr().err


def test_a_front_whose_every_worker_failed_to_load_exits_1():
    """Each worker is an `ft serve`, which exits on a failed load; the front kept answering 503 with no worker left
    and no way to get one. It exits 1 too, with a worker's reason on its last lines."""
    server = FtServe(["--data-parallel", "2", "--device", "cpu", "--port", "0", "--kv-tokens", "100m"])
    try:
        code = server.proc.wait(120)
    finally:
        server.stop()
    out = server.output()
    assert code == 1, out
    assert "ft serve: every worker exited before serving; load failed: the pools do not fit" in out, out
    assert "--kv-tokens" in out and out.splitlines()[-1].startswith("stopped: dispatched 0 requests"), out
