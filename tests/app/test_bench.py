"""`ft bench` end to end against the real embedded demo model served on 127.0.0.1 (tiny token
counts): each subcommand's JSON record, and that its figures agree with each other."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math

import httpx
import pytest

from app.bench.client import RequestResult, chat_body, run_round, stream_request
from app.bench.smoke import passes
from app.cli import main
from app.containers import Container
from app.serving import RunningServer
from app.settings import ServeSettings

pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")
RUNNING = 4  # the server's --max-running-requests
TOP_KEYS = {"schema", "kind", "started_at", "finished_at", "duration_s", "command", "settings", "target",
            "hardware", "model", "budget", "pool_plan", "routing", "server", "points", "failures", "ok"}


@pytest.fixture(scope="module")
def demo():
    settings = ServeSettings(port=0, device="cpu", max_running_requests=RUNNING)
    server = RunningServer(Container(), settings).start(wait_ready=120)
    yield server
    server.stop()


def bench(tmp_path, demo, *args) -> tuple[int, dict]:
    out = tmp_path / "record.json"
    code = main(["bench", *args, "--base-url", demo.base_url, "--out", str(out), "--quiet"])
    return code, json.loads(out.read_text())


def check_common(record: dict, kind: str) -> None:
    assert TOP_KEYS <= set(record), TOP_KEYS - set(record)
    assert record["schema"] == "fluxtide.bench/1" and record["kind"] == kind
    assert record["target"]["fluxtide"] is True and record["target"]["model"] == "fluxtide-demo-arithmetic"
    hw = record["hardware"]
    assert hw["host_ram_bytes"] > 2**30 and hw["cpu"]["logical_cores"] >= 1
    assert hw["gpus"] == [] and hw["pinned_h2d_gb_s"] is None  # this box has no CUDA: null, not made up
    assert hw["libraries"]["httpx"] and hw["libraries"]["python"]
    assert record["model"]["total_experts"] == 32 and record["model"]["expert_bytes"] > 0
    assert record["budget"]["total_bytes"] > 0 and record["pool_plan"]["kv_tokens"] > 0
    assert record["routing"] == "natural"
    assert record["ok"] is (not record["failures"])


def check_rounds(point: dict, concurrency: int, tokens: int, rounds: int) -> None:
    """Aggregate = all tokens over all round time; per-request = aggregate / concurrency."""
    assert point["requests"] == concurrency * rounds and point["failed_requests"] == 0
    assert point["completion_tokens"] == concurrency * rounds * tokens
    assert math.isclose(point["aggregate_tok_s"], point["completion_tokens"] / point["wall_s"], rel_tol=1e-9)
    assert math.isclose(point["per_request_tok_s"], point["aggregate_tok_s"] / concurrency, rel_tol=1e-9)
    per_round = point["round_aggregate_tok_s"]
    assert len(per_round) == rounds and min(per_round) <= point["aggregate_tok_s"] * (1 + 1e-9)
    assert point["aggregate_tok_s"] <= max(per_round) * (1 + 1e-9)  # a mean, never the peak
    assert 0 < point["ttft_s_median"] < point["wall_s"]
    # a request cannot stream faster end to end than after its first token
    assert 0 < point["e2e_tok_s_median"] <= point["steady_decode_tok_s_median"]


def plan_of(server) -> dict:
    plan = httpx.get(server.base_url + "/v1/cache/status").json()["plan"]
    return {k: plan[k] for k in ("kv_tokens", "expert_slots", "state_slots")}


def test_a_streamed_request_leaves_its_connection_for_the_next_one(demo):
    # a round's requests reach the server together only if they find open connections: the client must read each
    # stream to its end (past [DONE]), or httpx drops the connection and the next request connects anew
    connects = []

    async def trace(event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            connects.append(event)

    async def traced(request: httpx.Request) -> None:
        request.extensions["trace"] = trace  # httpcore's documented tracing hook

    async def three_streams() -> list[RequestResult]:
        async with httpx.AsyncClient(base_url=demo.base_url, event_hooks={"request": [traced]}) as client:
            path, body = chat_body("fluxtide-demo-arithmetic", "Count from 1 to 100.", 4)
            return [await stream_request(client, path, body, 60.0) for _ in range(3)]

    results = asyncio.run(three_streams())
    assert all(r.ok and r.completion_tokens == 4 for r in results), [r.error for r in results]
    assert len(connects) == 1, f"{len(connects)} TCP connections for three sequential streams"


def test_sweep_rebuilds_and_records_a_refused_resize(tmp_path, demo):
    png = tmp_path / "sweep.png"
    start = plan_of(demo)
    code, rec = bench(tmp_path, demo, "sweep", "--kv", "1k,64m,2k", "--batch", "1,3", "--warmup", "1",
                      "--warmup-tokens", "4", "--iterations", "2", "--tokens", "12", "--plot", str(png))
    check_common(rec, "sweep")
    assert code == 3  # finished, with a failed point
    assert [(p["kv_tokens_requested"], p["batch_size"]) for p in rec["points"]] == [
        (1024, 1), (1024, 3), (64 * 2**20, 1), (64 * 2**20, 3), (2048, 1), (2048, 3)]
    refused = [p for p in rec["points"] if p["kv_tokens_requested"] == 64 * 2**20]
    assert all(p["ok"] is False and "refused" in p["error"] and p["rebuild"]["status"] == 409 for p in refused)
    assert [f["where"] for f in rec["failures"]] == [f"rebuild kv={64 * 2**20} moe=auto"]
    assert rec["failures"][0]["status"] == 409
    expert_bytes = rec["model"]["expert_bytes"]
    for p in rec["points"]:
        if p["kv_tokens_requested"] == 64 * 2**20:
            continue
        assert p["ok"] and p["kv_tokens"] == p["kv_tokens_requested"] and p["rebuild"]["ok"]
        check_rounds(p, p["batch_size"], tokens=12, rounds=2)
        assert p["warmup"] == {"rounds": 1, "max_tokens": 4, "failed_requests": 0}
        assert p["expert_hits"] + p["expert_misses"] > 0
        assert math.isclose(p["hit_rate"], p["expert_hits"] / (p["expert_hits"] + p["expert_misses"]))
        assert p["pcie_bytes"] == p["expert_misses"] * expert_bytes
    # the last KV size (2k) was in force at the end; the sweep then rebuilt the pools it found and says so
    assert rec["restored"] == {**start, "ok": True, "status": 200, "error": None}, rec["restored"]
    assert plan_of(demo) == start and start["kv_tokens"] not in (1024, 2048)
    assert rec["server_after"]["stats"]["plan"]["kv_tokens"] == start["kv_tokens"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_an_interrupted_sweep_still_restores_the_pools_it_found(tmp_path, demo, monkeypatch, capsys):
    """`ft bench sweep` left the demo server at the last KV size of its list (700,000 tokens by default); a sweep
    stopped part-way (Ctrl-C) left it at whatever size it had reached."""
    from app.bench.context import Ctx

    start = plan_of(demo)
    rounds = []

    async def interrupted(self, concurrency, max_tokens, prompt="x"):
        rounds.append(plan_of(demo)["kv_tokens"])  # the server was resized when the interrupt came
        raise KeyboardInterrupt

    monkeypatch.setattr(Ctx, "chat_round", interrupted)
    out = tmp_path / "r.json"
    code = main(["bench", "sweep", "--base-url", demo.base_url, "--out", str(out), "--kv", "1k,2k", "--batch", "1",
                 "--warmup", "0", "--iterations", "1", "--tokens", "4", "--no-bandwidth"])
    rec = json.loads(out.read_text())
    assert code == 130 and rounds == [1024], (code, rounds)
    assert rec["restored"]["ok"] is True and plan_of(demo) == start, rec.get("restored")
    printed = " ".join(capsys.readouterr().out.split())
    assert (f"server restored to the pools it had before the sweep: KV {start['kv_tokens']} tokens, "
            f"{start['expert_slots']} expert slots, {start['state_slots']} state slots") in printed, printed


def test_ladder_measures_admitted_and_queued(tmp_path, demo):
    code, rec = bench(tmp_path, demo, "ladder", "--levels", "1,2,6", "--tokens", "24", "--rounds", "1",
                      "--warmup", "0", "--sample-s", "0.01")
    check_common(rec, "ladder")
    assert code == 0 and rec["failures"] == []
    assert [p["concurrency"] for p in rec["points"]] == [1, 2, 6]
    for p in rec["points"]:
        c = p["concurrency"]
        check_rounds(p, c, tokens=24, rounds=1)
        # the marks say it all, so nothing polls the server while it is measured (each poll is work in its process)
        assert p["running_capacity"] == RUNNING and p["stats_samples"] == 0
        assert (p["admitted"], p["queued"]) == (min(c, RUNNING), max(0, c - RUNNING)), p
        assert p["admitted_source"] == "high-water mark" and p["admitted_note"] is None, p
    # six requests on four slots: the two that waited decode after the first four, two waves of 24 tokens against
    # c1's one. NOTE: not the median TTFT (it compared c6's against c1's and failed once: the median of six is
    # an admitted request's, which the arrival window can start as early as c1's)
    assert rec["points"][2]["wall_s"] > rec["points"][0]["wall_s"], [p["wall_s"] for p in rec["points"]]


def test_ladder_counts_a_request_the_stats_polls_missed(tmp_path, demo, monkeypatch, capsys):
    """`--levels 1,2,4 --tokens 16`: the c=1 row said `admitted 0` (record: "admitted": 0, "stats_samples": 1) for
    a request that ran 74 ms between two polls. Here every poll would miss (it sees nothing running); the server's
    high-water marks count the request, and with them no poll runs during the measured rounds at all."""
    from app.bench import target

    async def missed(client):
        return {"running": 0, "waiting": 0}

    monkeypatch.setattr(target, "pools", missed)
    code, rec = bench(tmp_path, demo, "ladder", "--levels", "1,2", "--tokens", "16", "--warmup-tokens", "8")
    assert code == 0 and rec["failures"] == []
    for p in rec["points"]:
        assert p["stats_samples"] == 0 and p["admitted_source"] == "high-water mark", p
        assert (p["admitted"], p["queued"]) == (p["concurrency"], 0), p


def test_ladder_without_the_marks_says_not_observed_never_zero(tmp_path, demo, monkeypatch, capsys):
    """A server without POST /v1/stats/reset_peaks (an older fluxtide) whose polls never saw the rung's request:
    admitted is null with the reason and the table shows n/a, not a confident 0."""
    from app.bench import target

    async def missed(client):
        return {"running": 0, "waiting": 0}

    async def no_route(client):
        return None

    monkeypatch.setattr(target, "pools", missed)
    monkeypatch.setattr(target, "reset_peaks", no_route)
    out = tmp_path / "record.json"
    code = main(["bench", "ladder", "--levels", "1", "--tokens", "8", "--base-url", demo.base_url, "--out", str(out)])
    p = json.loads(out.read_text())["points"][0]
    assert code == 0 and (p["admitted"], p["queued"], p["admitted_source"]) == (None, None, None), p
    assert p["admitted_note"] == f"not observed: {p['stats_samples']} stats samples", p
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip(" │").startswith("1 "))
    cells = [cell.strip() for cell in row.split("│")[1:-1]]  # c, agg tok/s, steady p50, TTFT p50 s, admitted, queued
    assert cells[4:6] == ["n/a", "n/a"], row


def test_probe_times_every_token_with_logprobs(tmp_path, demo):
    code, rec = bench(tmp_path, demo, "probe", "--lengths", "5,17", "--repeats", "2", "--warmup-tokens", "4",
                      "--logprobs")
    check_common(rec, "probe")
    assert code == 0
    for p, n in zip(rec["points"], (5, 17), strict=True):
        assert p["max_tokens"] == n and p["requests"] == 2 and p["failed_requests"] == 0
        steady = []
        for run in p["runs"]:
            assert run["completion_tokens"] == n and run["finish_reason"] == "length"
            assert len(run["token_times"]) == n and run["token_times"] == sorted(run["token_times"])
            assert 0 < run["ttft_s"] < run["end_s"]
            assert math.isclose(run["steady_tok_s"], (n - 1) / (run["end_s"] - run["ttft_s"]))
            assert math.isclose(run["e2e_tok_s"], n / run["end_s"])
            steady.append(run["steady_tok_s"])
        # greedy repeats of one prompt stream one text: the record says so without keeping it
        assert len({run["text_sha256"] for run in p["runs"]}) == 1 and "text" not in p["runs"][0]
        assert math.isclose(p["steady_decode_tok_s_median"], sum(steady) / 2)  # median of two


def test_logprobs_give_one_arrival_time_per_token(tmp_path, demo):
    async def one():
        async with httpx.AsyncClient(base_url=demo.base_url) as client:
            return await run_round(client, [chat_body("fluxtide-demo-arithmetic", "Count from 1 to 100.", 9,
                                                      logprobs=True)], 60)

    rnd = asyncio.run(one())
    r = rnd.results[0]
    assert r.ok and r.completion_tokens == 9 and len(r.token_times) == 9
    assert r.token_times == sorted(r.token_times) and r.token_times[0] == r.ttft_s and r.token_times[-1] <= r.end_s
    assert rnd.tokens == 9 and math.isclose(rnd.aggregate_tok_s, 9 / rnd.wall_s)


def test_prefill_sizes_prompts_and_records_a_too_long_one(tmp_path, demo):
    code, rec = bench(tmp_path, demo, "prefill", "--sizes", "100,400,5000", "--repeats", "2")  # --warmup 1
    check_common(rec, "prefill")
    assert code == 3
    cal = rec["settings"]["calibration"]
    assert cal["tokens_per_filler_unit"] > 1 and rec["settings"]["warmup"] == 1
    small, mid, long = rec["points"]
    for p in (small, mid):
        assert p["ok"] and p["failed_requests"] == 0 and p["requests"] == 2 and p["warmup_requests"] == 1
        assert len(p["runs"]) == 2 and len(p["warmup_runs"]) == 1 and p["warmup_failed_requests"] == 0
        runs, warm = p["runs"], p["warmup_runs"][0]
        # the warm-up went first and is its cold cost; it is left out of every median
        assert warm["sent_at"] < runs[0]["sent_at"] < runs[1]["sent_at"]
        assert p["first_ttft_s"] == warm["ttft_s"] > 0
        assert math.isclose(p["ttft_s_median"], (runs[0]["ttft_s"] + runs[1]["ttft_s"]) / 2)
        assert math.isclose(p["prefill_tok_s_median"],
                            sum(r["prompt_tokens"] / r["ttft_s"] for r in runs) / 2)
        assert p["prompt_tokens"] == (runs[0]["prompt_tokens"] + runs[1]["prompt_tokens"]) / 2
        # the measured a filler unit either side of the target's own size (the server's counts), the warm-up on it:
        # the measured median is the target's size to within half a unit
        unit = cal["tokens_per_filler_unit"]
        assert runs[0]["prompt_tokens"] + unit == warm["prompt_tokens"] == runs[1]["prompt_tokens"] - unit
        assert p["prompt_tokens"] == warm["prompt_tokens"]
        assert abs(p["prompt_tokens"] - p["prompt_tokens_target"]) <= unit / 2 + 1
        assert all(r["completion_tokens"] == 1 for r in [warm, *runs])
    assert mid["prompt_tokens"] > small["prompt_tokens"]
    # the demo's context is 4,096 tokens: the 5000 size is refused before any of its requests is sent
    assert rec["settings"]["context"]["tokens"] == 4096
    assert long["ok"] is False and long["requests"] == 0 and long["not_sent"] == "over the context"
    assert "past the server's context of 4096 tokens" in long["error"] and "runs" not in long
    assert [f["where"] for f in rec["failures"]] == ["prompt=5000"]


def test_prefill_refuses_a_size_whose_requests_cannot_all_fit_before_sending_any(tmp_path, demo, monkeypatch, capsys):
    """`ft bench prefill --sizes 4k,8k --repeats 1` on the demo model (context 4,096): the 4096 row's warm-up (4,094
    tokens) went through, the measured request (4,136) got a 400, and the row showed a TTFT beside `failed 1`."""
    from app.bench import prefill

    sent = []  # filler units of every prompt sent (calibration included)
    send = prefill.stream_request

    async def counted(client, path, body, timeout):
        sent.append(body["prompt"].count(prefill.FILLER))
        return await send(client, path, body, timeout)

    monkeypatch.setattr(prefill, "stream_request", counted)
    out = tmp_path / "r.json"
    code = main(["bench", "prefill", "--base-url", demo.base_url, "--out", str(out), "--sizes", "4k,8k,1k",
                 "--repeats", "1", "--no-bandwidth"])
    rec = json.loads(out.read_text())
    printed = capsys.readouterr()
    assert code == 3
    cal = rec["settings"]["calibration"]
    biggest = max(cal["tokens_fixed"] + cal["tokens_per_filler_unit"] * units for units in sent)
    assert biggest < 2000 and len(sent) == 2 + 2  # calibration and 1k's two requests: no 4k or 8k one was sent
    four, eight, one = rec["points"]
    assert one["ok"] and one["failed_requests"] == 0 and one["first_ttft_s"] > 0
    for p in (four, eight):
        assert p["ok"] is False and p["requests"] == 0 and p["not_sent"] == "over the context", p
        assert "past the server's context of 4096 tokens" in p["error"] and p.get("ttft_s_median") is None
    assert [f["where"] for f in rec["failures"]] == ["prompt=4096", "prompt=8192"]
    err = " ".join(printed.err.split())
    assert "failed prompt=4096: not sent: its longest request needs" in err, err
    rows = [line for line in printed.out.splitlines() if line.lstrip("│ ")[:4] in ("4096", "8192")]
    assert len(rows) == 2 and all("not sent: over the context" in row for row in rows), printed.out


def test_prefill_without_warmup_measures_every_request(tmp_path, demo):
    code, rec = bench(tmp_path, demo, "prefill", "--sizes", "200", "--repeats", "1", "--warmup", "0")
    assert code == 0
    cal = rec["settings"]["calibration"]
    (p,) = rec["points"]
    (run,) = p["runs"]
    assert p["warmup_runs"] == [] and p["warmup_requests"] == 0 and p["requests"] == 1
    assert p["first_ttft_s"] == run["ttft_s"] == p["ttft_s_median"]
    # one request: exactly the target's own units, as before the lengths varied
    assert abs(p["prompt_tokens"] - p["prompt_tokens_target"]) <= cal["tokens_per_filler_unit"] / 2 + 1
    assert math.isclose(p["prefill_tok_s_median"], run["prompt_tokens"] / run["ttft_s"])


def test_smoke_checks_the_exact_answer(tmp_path, demo):
    code, rec = bench(tmp_path, demo, "smoke")
    check_common(rec, "smoke")
    assert code == 0 and rec["points"][0]["passed"] is True and rec["points"][0]["answer"] == "42"
    code, rec = bench(tmp_path, demo, "smoke", "--prompt", "What is 7 - 30?", "--expected", "23")
    assert code == 3 and rec["points"][0]["passed"] is False and rec["points"][0]["answer"] == "-23"
    assert "wrong answer" in rec["failures"][0]["error"]


def test_model_dir_gives_geometry_and_a_bad_one_is_refused(tmp_path, demo):
    from app.demo_model import DEMO_MODEL_DIR

    code, rec = bench(tmp_path, demo, "smoke", "--model-dir", str(DEMO_MODEL_DIR))
    assert code == 0 and rec["model"]["geometry"]["hidden_size"] == 128 and rec["model"]["format"] == "float32"
    code, rec = bench(tmp_path, demo, "smoke", "--model-dir", str(tmp_path / "nowhere"))
    assert code == 1 and "cannot read config.json" in rec["failures"][0]["error"]


def test_a_records_text_hash_is_the_outputs():
    one, other = RequestResult(sent_at=0.0, text="1, 2, 3"), RequestResult(sent_at=0.0, text="1, 2, 4")
    assert one.as_dict()["text_sha256"] == hashlib.sha256(b"1, 2, 3").hexdigest()[:16]
    assert one.as_dict()["text_sha256"] != other.as_dict()["text_sha256"]
    assert one.as_dict(keep_text=True)["text"] == "1, 2, 3"


def test_smoke_match_modes():
    assert passes(" 42\n", "42", "exact") and not passes("= 42", "42", "exact")
    assert passes("19 + 23 = 42.", "42", "contains") and not passes("420", "42", "contains")


def test_cold_start_launches_ft_serve_and_orders_milestones(tmp_path):
    out = tmp_path / "cold.json"
    code = main(["bench", "cold-start", "--out", str(out), "--quiet", "--no-bandwidth", "--", "--device", "cpu"])
    rec = json.loads(out.read_text())
    assert code == 0, rec["failures"]
    assert rec["kind"] == "cold-start" and rec["target"]["model"] == "fluxtide-demo-arithmetic"
    # the served checkpoint's config.json (here the embedded demo model's) gives geometry and format
    assert rec["model"]["geometry"]["num_experts"] == 8 and rec["model"]["format"] == "float32"
    t = {p["milestone"]: p["seconds"] for p in rec["points"]}
    assert t["graph_capture_done"] is None  # this engine reports no graph capture: null, not 0
    assert t["prefill_kernels_tuned"] is None  # nor a prefill kernel warm-up (CPU, reference prefill)
    # /v1/models and /health open on the same readiness; a poll can see either first
    ready = (t["first_models_ok"], t["health_ok"])
    assert 0 < t["http_listening"] <= min(ready) and max(ready) < t["first_token"]
    assert t["http_listening"] < t["expert_banks_loaded"] <= t["dense_weights_loaded"] <= t["health_ok"]
    phases = [p["phase"] for p in rec["cold_start"]["phases"]]
    assert phases.index("expert banks") < phases.index("dense weights")
    assert rec["cold_start"]["exit_code"] == 0  # stopped cleanly by SIGTERM


def test_cold_start_of_a_server_with_an_api_key_polls_with_it_and_keeps_it_out_of_the_record(tmp_path):
    """A server launched with --api-key answers /v1/* only with the key: cold-start polled without it and never saw
    /v1/models (a failed start). It now sends the key it passed, and the record's command hides it."""
    out = tmp_path / "cold.json"
    code = main(["bench", "cold-start", "--out", str(out), "--quiet", "--no-bandwidth", "--", "--device", "cpu",
                 "--api-key", "s3cret-key"])
    rec = json.loads(out.read_text())
    assert code == 0, rec["failures"]
    t = {p["milestone"]: p["seconds"] for p in rec["points"]}
    assert t["first_models_ok"] is not None and t["first_token"] is not None
    assert "s3cret-key" not in out.read_text()
    command = rec["settings"]["serve_command"]
    assert command[command.index("--api-key") + 1] == "<redacted>"


def test_a_records_command_line_never_holds_an_api_key():
    from app.bench.record import Record

    rec = Record("ladder", {}, argv=["ft", "bench", "ladder", "--api-key", "k1", "--api-key=k2", "--levels", "1"])
    assert rec.data["command"] == ["ft", "bench", "ladder", "--api-key", "<redacted>", "--api-key=<redacted>",
                                   "--levels", "1"]


def test_unreachable_server_still_writes_a_record(tmp_path):
    out = tmp_path / "r.json"
    code = main(["bench", "ladder", "--base-url", "http://127.0.0.1:9", "--out", str(out), "--quiet"])
    rec = json.loads(out.read_text())
    assert code == 1 and rec["ok"] is False and "cannot reach" in rec["failures"][0]["error"]


@pytest.mark.parametrize("kind", ["probe", "prefill"])
def test_a_run_that_measured_nothing_prints_the_failure_and_no_empty_table(tmp_path, capsys, kind):
    """`ft bench probe` against an unreachable server printed an empty table titled "ft bench probe:" (no model)
    before the failure line."""
    out = tmp_path / "r.json"
    code = main(["bench", kind, "--base-url", "http://127.0.0.1:9", "--out", str(out), "--no-bandwidth"])
    printed = capsys.readouterr()
    assert code == 1 and printed.out == "", printed.out  # no table, no second summary line
    assert f"ft bench {kind}: failed run: cannot reach http://127.0.0.1:9" in printed.err and str(out) in printed.err
    rec = json.loads(out.read_text())
    assert rec["ok"] is False and rec["points"] == [] and "cannot reach" in rec["failures"][0]["error"]


@pytest.mark.parametrize("kind", ["smoke", "ladder", "probe", "prefill", "mixed", "sweep"])
def test_quiet_still_says_why_a_run_failed_on_stderr(tmp_path, capsys, kind):
    """`ft bench smoke --quiet` with nothing listening exited 1 without a word: --quiet silences progress and
    tables, never a failure."""
    out = tmp_path / "r.json"
    code = main(["bench", kind, "--base-url", "http://127.0.0.1:9", "--out", str(out), "--quiet", "--no-bandwidth"])
    printed = capsys.readouterr()
    assert code == 1 and printed.out == "", printed
    assert f"ft bench {kind}: failed run: cannot reach http://127.0.0.1:9" in printed.err, printed.err
    assert str(out) in printed.err  # where the record of the failure is


def test_cold_start_quiet_says_why_it_failed_on_stderr(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "cold-start", "--out", str(out), "--quiet", "--no-bandwidth",
                 "--start-timeout", "60", "--", "--model", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert "ft bench cold-start: failed start: ft serve did not start listening (exit code 2)" in err, err
    # the start is the point this run measures: exit 3 (it was 1), and the record keeps what the server said
    rec = json.loads(out.read_text())
    assert code == 3 and [f["where"] for f in rec["failures"]] == ["start"]
    assert rec["cold_start"]["exit_code"] == 2 and "no such file or directory" in rec["cold_start"]["stderr_tail"][-1]
    assert {p["milestone"]: p["seconds"] for p in rec["points"]}["health_ok"] is None


# Every subcommand against the demo model (a 4,096-token context) with every point failing: a run that finished, so
# exit 3 (mixed and turns exited 1 here, as for an unreachable server, while prefill exited 3)
EVERY_POINT_FAILS = {
    "sweep": ["--kv", "current", "--batch", "1", "--warmup", "0", "--iterations", "1", "--tokens", "5000"],
    "ladder": ["--levels", "1", "--warmup", "0", "--tokens", "5000"],
    "probe": ["--lengths", "5000", "--repeats", "1", "--warmup-tokens", "2"],
    "prefill": ["--sizes", "5000", "--repeats", "1", "--warmup", "0"],
    "mixed": ["--streams", "1", "--prompt-tokens", "5000", "--stream-tokens", "200", "--warmup-tokens", "2",
              "--baseline-tokens", "2", "--repeats", "1", "--warmup-repeats", "0"],
    "turns": ["--prefix-tokens", "5000", "--repeats", "1", "--warmup", "0", "--max-tokens", "2"],
    "smoke": ["--expected", "43"],
}


@pytest.mark.parametrize("kind", list(EVERY_POINT_FAILS))
def test_a_run_whose_every_point_failed_exits_3(tmp_path, demo, kind):
    code, rec = bench(tmp_path, demo, kind, *EVERY_POINT_FAILS[kind], "--no-bandwidth")
    assert code == 3, rec["failures"]
    assert rec["ok"] is False and rec["points"] and not any(p["ok"] if "ok" in p else p["passed"] for p in rec["points"])
    assert "server_after" in rec  # the run went to its end


@pytest.mark.parametrize(("hw", "skipped", "line"), [
    (None, False, ""),  # the run failed before the host was profiled
    ({"gpus": [], "pinned_h2d_gb_s": None}, False, "no CUDA device: pinned host->device bandwidth not measured; "),
    ({"gpus": [{"name": "NVIDIA H200"}], "pinned_h2d_gb_s": 51.234}, False, "NVIDIA H200; pinned host->device 51.23 GB/s; "),
    ({"gpus": [{"name": "NVIDIA H200"}], "pinned_h2d_gb_s": None}, True,
     "NVIDIA H200; pinned host->device bandwidth not measured (--no-bandwidth); "),
])
def test_the_summary_says_what_it_knows_of_the_hardware(hw, skipped, line):
    """A CPU box printed "no GPU; pinned H2D - GB/s"."""
    from app.bench.view import hardware_line

    assert hardware_line(hw, skipped) == line


def test_the_summary_on_a_cpu_box_says_the_bandwidth_was_not_measured(tmp_path, demo, capsys, monkeypatch):
    import app.bench.record as record

    monkeypatch.setattr(record, "hardware_profile", lambda measure: {"gpus": [], "pinned_h2d_gb_s": None})
    out = tmp_path / "r.json"
    assert main(["bench", "smoke", "--base-url", demo.base_url, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA device: pinned host->device bandwidth not measured" in printed and "H2D -" not in printed


def test_a_base_url_from_the_environment_is_checked_too(monkeypatch, capsys):
    monkeypatch.setenv("FT_BASE_URL", "localhost:1919")
    assert main(["bench", "smoke", "--quiet"]) == 2
    assert "did you mean http://localhost:1919?" in capsys.readouterr().err


def test_bad_lists_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "sweep", "--batch", "1,0"])
    assert "positive counts" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "flag"), [
    (["probe", "--timeout", "nan"], "--timeout"),  # a ValueError traceback from the event loop ("deadline must not be NaN")
    (["probe", "--timeout", "inf"], "--timeout"),
    (["smoke", "--base-url", "http://[::1"], "--base-url"),  # an httpx.InvalidURL traceback
    (["smoke", "--base-url", "127.0.0.1:1919"], "--base-url"),  # no scheme: "cannot reach" after the run started
])
def test_bad_numbers_and_urls_are_argument_errors(capsys, args, flag):
    with pytest.raises(SystemExit) as info:
        main(["bench", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and flag in err and "Traceback" not in err, err
    if args[-1] == "127.0.0.1:1919":
        assert "did you mean http://127.0.0.1:1919?" in err, err


def test_sweep_at_the_current_size_needs_no_rebuild(tmp_path, demo):
    before = httpx.get(demo.base_url + "/v1/stats").json()["pools"]["kv_tokens"]
    code, rec = bench(tmp_path, demo, "sweep", "--kv", "current", "--batch", "2", "--warmup", "0",
                      "--iterations", "1", "--tokens", "6")
    assert code == 0
    (p,) = rec["points"]
    assert p["rebuild"] is None and p["kv_tokens"] == before and p["kv_tokens_requested"] == "current"
    check_rounds(p, 2, tokens=6, rounds=1)


def test_a_server_without_the_rebuild_api_is_told_to_sweep_current():
    from app.bench import sweep
    from app.bench.context import Ctx
    from app.bench.record import Record
    from app.bench.target import BenchError

    record = Record("sweep", {})
    record.data["target"] = {"fluxtide": False}
    ctx = Ctx(client=None, model="m", record=record, progress=None, timeout=1)
    with pytest.raises(BenchError, match="--kv current"):
        asyncio.run(sweep.run(ctx, kv_sizes=[8192], moe="auto", batch_sizes=[1], warmup=0, warmup_tokens=1,
                              iterations=1, tokens=1, rebuild_wait=1))


def test_several_servers_in_one_call_give_one_record_each(tmp_path, demo, capsys):
    out = tmp_path / "cmp.json"
    code = main(["bench", "smoke", "--base-url", demo.base_url, "--base-url", demo.base_url + "/",
                 "--out", str(out), "--no-bandwidth"])
    assert code == 0
    records = [json.loads((tmp_path / f"cmp-{i}.json").read_text()) for i in (1, 2)]
    assert [r["target"]["base_url"] for r in records] == [demo.base_url, demo.base_url]  # the server's root
    assert all(r["points"][0]["passed"] for r in records)
    assert "side by side" in capsys.readouterr().out


def test_the_side_by_side_table_names_a_server_that_failed_by_its_url(tmp_path, demo, capsys):
    """A target whose run failed before /v1/models answered was headed `None [-]`: the label came from the target
    the run never reached, and its routing None made the table look routed."""
    out = tmp_path / "cmp.json"
    code = main(["bench", "smoke", "--base-url", demo.base_url, "--base-url", "http://127.0.0.1:9",
                 "--out", str(out), "--no-bandwidth"])
    assert code == 1
    header = capsys.readouterr().out.split("side by side", 1)[1]
    assert "http://127.0.0.1:9" in header and "None" not in header and "[" not in header, header


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
@pytest.mark.parametrize("from_env", [False, True])
def test_bench_accepts_the_openai_style_base_url(tmp_path, demo, monkeypatch, suffix, from_env):
    """`ft bench smoke --base-url http://127.0.0.1:PORT/v1` (as ft ctl and OpenAI clients take it) asked for
    /v1/v1/models and failed with HTTP 404."""
    out = tmp_path / "r.json"
    args = ["bench", "smoke", "--out", str(out), "--quiet", "--no-bandwidth"]
    if from_env:
        monkeypatch.setenv("FT_BASE_URL", demo.base_url + suffix)
    else:
        args += ["--base-url", demo.base_url + suffix]
    assert main(args) == 0, json.loads(out.read_text())["failures"]
    rec = json.loads(out.read_text())
    assert rec["target"]["base_url"] == demo.base_url and rec["points"][0]["passed"]


def test_a_quiet_run_that_succeeded_still_says_where_its_record_is(tmp_path, demo, capsys):
    """--quiet's help says the record's path still goes to stderr; a run without a failure printed nothing."""
    code, rec = bench(tmp_path, demo, "smoke", "--no-bandwidth")
    printed = capsys.readouterr()
    assert code == 0 and rec["ok"] and printed.out == "", printed
    assert printed.err.strip() == f"record: {tmp_path / 'record.json'}", printed.err


# llama-server --metrics (tools/server/server-task.cpp): the gauges the ladder samples off fluxtide
LLAMA_CPP_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""


def test_llama_cpp_load_comes_from_its_metrics_gauges():
    from app.bench import target

    async def load(status: int, text: str):
        transport = httpx.MockTransport(lambda request: httpx.Response(status, text=text))
        async with httpx.AsyncClient(transport=transport, base_url="http://llama") as client:
            return await target.llama_cpp_load(client)

    assert asyncio.run(load(200, LLAMA_CPP_METRICS)) == {"running": 3, "waiting": 2}
    assert asyncio.run(load(501, "metrics disabled")) is None  # llama-server without --metrics
    assert asyncio.run(load(200, "ft_expert_hits_total 3\n")) is None  # neither gauge: not llama.cpp
    assert asyncio.run(load(200, "<html>not prometheus</html>")) is None


def test_llama_cpp_records_the_gguf_it_serves_beside_the_checkpoint_format(tmp_path):
    from app.bench import target

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 2048},
                                                      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}))
    llama = {"props": {"model_path": "/dev/shm/qwen36-q8_0.gguf", "total_slots": 4}}
    facts = target.model_facts(llama, str(tmp_path))
    assert facts["format"] == "gguf qwen36-q8_0.gguf" and facts["checkpoint_format"] == "fp8 e4m3"
    assert facts["geometry"] == {"hidden_size": 2048}
    assert target.model_facts({}, str(tmp_path))["format"] == "fp8 e4m3"  # fluxtide serves the checkpoint


def test_cold_start_reads_the_graph_capture_and_the_prefill_warm_up_from_the_phase_lines():
    from app.bench.cold_start import PHASE_MILESTONES, phase_end, phases

    lines = [(1.0, "[  0.90s] capturing decode graphs for batch sizes 1, 2, 4"),
             (4.5, "[  4.40s] decode graphs captured in 3.5 s"),
             (4.6, "[  4.50s] tuning prefill kernels: 120 keys for steps of up to 2048 tokens"),
             (40.0, "[ 39.90s] prefill kernels tuned in 35.4 s"), (40.1, "[ 40.00s] ready")]
    order = phases(lines)
    ends = {name: phase_end(order, needle) for name, needle in PHASE_MILESTONES}
    assert ends["graph_capture_done"] == 4.5 and ends["prefill_kernels_tuned"] == 40.0


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    # nothing listens on this port: a run that started would fail to connect, not stop at the --plot check
    code = main(["bench", "ladder", "--base-url", "http://127.0.0.1:9", "--quiet", "--levels", "1",
                 "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "l.png")])
    assert code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
