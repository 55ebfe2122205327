"""`ft bench turns` end to end against the demo model on 127.0.0.1 (tiny sizes: the figures are the CPU's, the
structure and the bookkeeping are what is checked), its failures, its summary and its arguments."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest
from rich.console import Console

from app.bench import client, turns, view
from app.bench.client import RequestResult, stream_request
from app.bench.context import Ctx
from app.bench.record import Record
from app.cli import main
from app.containers import Container
from app.serving import RunningServer
from app.settings import ServeSettings
from tests.app.test_bench import bench, check_common

SMALL = ["--prefix-tokens", "512", "--follow-up-tokens", "32", "--max-tokens", "4", "--repeats", "1", "--warmup", "0"]


@pytest.fixture(scope="module")
def demo():
    pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")
    server = RunningServer(Container(), ServeSettings(port=0, device="cpu", max_running_requests=4)).start(wait_ready=120)
    yield server
    server.stop()


def test_turn_2_resumes_the_prefix_from_the_cache(tmp_path, demo):
    code, rec = bench(tmp_path, demo, "turns", *SMALL, "--max-ratio", "100")
    check_common(rec, "turns")
    assert code == 0 and rec["failures"] == [], rec["failures"]
    cal = rec["settings"]["calibration"]
    assert rec["settings"]["prefix_tokens"] == 512 and rec["settings"]["max_ratio"] == 100
    (p,) = rec["points"]
    one, two = p["turn1"], p["turn2"]
    assert p["ok"] and p["error"] is None and p["prefix_tokens_target"] == 512
    for turn in (one, two):
        assert turn["status"] == 200 and turn["completion_tokens"] == 4 and 0 < turn["ttft_s"] <= turn["end_s"]
    # the prefix is at least the asked size (rounded up to a filler unit), the chat template and question on top
    assert 512 <= one["prompt_tokens"] <= 512 + cal["tokens_per_filler_unit"] + 100
    assert one["cached_tokens"] == 0  # a fresh nonce leads every prefix: turn 1 never resumes
    # turn 2 is turn 1's conversation, its answer and a new question: it resumed turn 1's prompt (but a partial page)
    assert two["prompt_tokens"] > one["prompt_tokens"] + one["completion_tokens"]
    assert one["prompt_tokens"] - 16 < two["cached_tokens"] < two["prompt_tokens"]
    assert p["turn2_new_tokens"] == two["prompt_tokens"] - two["cached_tokens"]
    assert p["ratio"] == two["ttft_s"] / one["ttft_s"]
    s = rec["summary"]
    assert s["ratio_median"] == p["ratio"] and s["turn2_ttft_s_median"] == two["ttft_s"]
    assert s["every_turn2_hit_the_cache"] is True and s["meets_max_ratio"] is True and s["max_ratio"] == 100
    assert s["warmup_runs"] == [] and s["measured_repeats"] == 1
    before, after = s["prefix_cache_before"], s["prefix_cache_after"]
    assert after["requests"] - before["requests"] == 2 and after["hits"] - before["hits"] == 1
    assert after["cached_tokens"] - before["cached_tokens"] == two["cached_tokens"]


def test_a_turn_2_without_a_cache_hit_fails_the_run(tmp_path, demo, monkeypatch):
    async def forgetful(*args, **kwargs) -> RequestResult:  # the server's answer, as a server without a cache says it
        res = await stream_request(*args, **kwargs)
        res.cached_tokens = 0
        return res

    monkeypatch.setattr(turns, "stream_request", forgetful)
    code, rec = bench(tmp_path, demo, "turns", *SMALL[:-2], "--warmup", "1", "--max-ratio", "100")
    assert code == 3 and rec["ok"] is False
    # the warm-up's miss is not a failure (only its failed requests are); the measured repeat's is
    assert [f["where"] for f in rec["failures"]] == ["repeat 0"]
    assert rec["failures"][0]["error"].startswith("turn 2: no prefix-cache hit (0 of ")
    (p,) = rec["points"]
    assert p["ok"] is False and p["ratio"] is not None  # measured all the same: the ratio of a miss
    assert rec["summary"]["every_turn2_hit_the_cache"] is False and len(rec["summary"]["warmup_runs"]) == 1


def _ctx(record: Record) -> Ctx:
    return Ctx(None, "m", record, view.progress(True), 60.0)


def _res(ttft: float | None = 0.5, prompt: int | None = 100, cached: int | None = 0, error: str | None = None,
         status: int = 200) -> RequestResult:
    return RequestResult(sent_at=0.0, ttft_s=ttft, end_s=(ttft or 0) + 0.1, prompt_tokens=prompt, cached_tokens=cached,
                         completion_tokens=4, status=status, error=error)


def test_problems_name_each_reason_a_conversation_is_not_measured():
    assert turns.problems(_res(), _res(prompt=150, cached=96)) == []
    assert turns.problems(_res(error="HTTP 400: too long", status=400), None) == ["turn 1: HTTP 400: too long"]
    assert turns.problems(_res(prompt=None), _res(prompt=None)) == [
        "turn 1: no usage reported (stream_options.include_usage)",
        "turn 2: no usage reported (stream_options.include_usage)"]
    assert turns.problems(_res(), _res(prompt=150, cached=None)) == [
        "turn 2: no cached_tokens reported (usage.prompt_tokens_details)"]
    assert turns.problems(_res(), _res(prompt=150, cached=0)) == [
        "turn 2: no prefix-cache hit (0 of 150 prompt tokens cached)"]
    failed = turns.point_of(0, _res(error="HTTP 503: busy", status=503), None)
    assert failed["ratio"] is None and failed["turn2"] is None and failed["turn2_new_tokens"] is None
    assert failed["ok"] is False and failed["error"] == "turn 1: HTTP 503: busy"


def test_the_summary_takes_medians_over_the_measured_repeats():
    points = [turns.point_of(0, _res(ttft=1.0), _res(ttft=0.1, prompt=150, cached=96)),
              turns.point_of(1, _res(ttft=2.0), _res(ttft=0.4, prompt=150, cached=96)),
              turns.point_of(2, _res(ttft=4.0), _res(ttft=0.4, prompt=150, cached=96)),
              turns.point_of(3, _res(error="HTTP 500: x", status=500), None)]
    assert [p["ratio"] for p in points] == [pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.1), None]
    s = turns.summary(points, 0.15)
    assert s["repeats"] == 4 and s["measured_repeats"] == 3
    assert s["ratio_median"] == pytest.approx(0.1) and s["meets_max_ratio"] is True
    assert s["turn1_ttft_s_median"] == 2.0 and s["turn2_ttft_s_median"] == 0.4
    assert s["turn2_cached_tokens_median"] == 96 and s["turn2_prompt_tokens_median"] == 150
    assert s["every_turn2_hit_the_cache"] is False  # the repeat whose turn 1 failed never resumed
    assert turns.summary(points[:3], 0.05)["meets_max_ratio"] is False
    assert turns.summary(points[:3], 0.15)["every_turn2_hit_the_cache"] is True
    empty = turns.summary([], 0.15)
    assert empty["ratio_median"] is None and empty["meets_max_ratio"] is None
    assert empty["every_turn2_hit_the_cache"] is False
    # the table reads the turns' nested figures; the verdict line says what was judged
    record = {"kind": "turns", "target": {"model": "m"}, "points": points}
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(view.table(record))
    row = next(line for line in console.export_text().splitlines() if line.strip("│ ").startswith("1 "))
    assert [c.strip() for c in row.split("│")[1:-1]] == ["1", "100", "2", "150", "96", "0.4", "0.2", "True"]
    assert view.turns_line(s).startswith("turn 2 TTFT / turn 1 TTFT: median 0.1 (<= 0.15: met)")
    assert "not judged" in view.turns_line(empty) and "hit the prefix cache: no" in view.turns_line(empty)


def test_nothing_measured_is_a_failed_run(monkeypatch):
    async def refuse(client, path, body, timeout) -> RequestResult:
        assert path == "/v1/chat/completions" and body["stream_options"] == {"include_usage": True}
        assert body["messages"][0]["role"] == "system" and body["messages"][0]["content"][:6].isdigit()  # nonce first
        return _res(ttft=None, prompt=None, error="HTTP 400: too long", status=400)

    async def calibrated(ctx):
        return 20.0, 42.0

    async def no_stats(client):
        return None  # not fluxtide

    monkeypatch.setattr(turns, "stream_request", refuse)
    monkeypatch.setattr(turns, "calibrate", calibrated)
    monkeypatch.setattr(turns.target, "prefix_cache", no_stats)
    record = Record("turns", {})
    # NOTE: a run that finished with every repeat failed, not one that could not be done (a BenchError: exit 1)
    asyncio.run(turns.run(_ctx(record), prefix_tokens=1000, follow_up_tokens=64, max_tokens=8, repeats=2, warmup=1))
    assert record.data["settings"]["calibration"]["prefix_units"] == 24  # ceil((1000 - 20) / 42)
    failures = record.data["failures"]
    assert [f["where"] for f in failures] == ["conversation 0 warm-up", "repeat 0", "repeat 1", "run"]
    assert all(f["status"] == 400 and f["error"].startswith("turn 1: HTTP 400") for f in failures[1:3])
    assert failures[3]["error"] == "no repeat could be measured (see failures)"
    s = record.data["summary"]
    assert s["prefix_cache_before"] is None and s["prefix_cache_after"] is None and s["ratio_median"] is None


def test_the_client_reads_cached_tokens_and_times_a_reasoning_token_as_the_first():
    chunks = [{"choices": [{"delta": {"role": "assistant"}}]},
              {"choices": [{"delta": {"reasoning_content": "Let me add."}}]},
              {"choices": [{"delta": {"content": "42"}}]},
              {"choices": [{"delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 5,
                                        "prompt_tokens_details": {"cached_tokens": 32}}}]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    async def one() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=sse))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            return await stream_request(http, *client.chat_body("m", [{"role": "user", "content": "hi"}], 5), 10)

    res = asyncio.run(one())
    assert res.ok and res.text == "42" and (res.prompt_tokens, res.cached_tokens) == (40, 32)
    assert len(res.token_times) == 2 and res.ttft_s == res.token_times[0]  # the reasoning token came first


@pytest.mark.parametrize(("args", "flag", "why"), [
    (["--max-ratio", "-0.1"], "--max-ratio", "finite number > 0"),
    (["--max-ratio", "nan"], "--max-ratio", "finite number > 0"),
    (["--prefix-tokens", "0"], "--prefix-tokens", "positive count"),
    (["--follow-up-tokens", "lots"], "--follow-up-tokens", "not a size"),
    (["--warmup", "-1"], "--warmup", ">= 0"),
])
def test_bad_arguments_exit_2_with_a_clear_message(capsys, args, flag, why):
    with pytest.raises(SystemExit) as info:
        main(["bench", "turns", *args, "--quiet"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and flag in err and why in err and "Traceback" not in err, err


def test_an_unreachable_server_says_why_on_stderr(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "turns", "--base-url", "http://127.0.0.1:9", "--out", str(out), "--quiet", "--no-bandwidth"])
    assert code == 1 and json.loads(out.read_text())["ok"] is False
    assert "ft bench turns: failed run: cannot reach http://127.0.0.1:9" in capsys.readouterr().err
