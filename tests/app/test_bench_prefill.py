"""`ft bench prefill`'s warm-up and prompt lengths against a made-up server whose TTFTs are known: a one-time cost
on the first request of each size class and a cost on each prompt length it has not seen (the real-server run is
in test_bench.py)."""

from __future__ import annotations

import asyncio
import io
import statistics
import time

import pytest
from rich.console import Console

from app.bench import prefill, view
from app.bench.client import RequestResult
from app.bench.context import Ctx
from app.bench.record import Record
from app.cli import main

FIXED, PER_UNIT = 5, 17  # the made-up tokenizer: prompt tokens = 5 + 17 x filler units
COLD_S, NEW_LENGTH_S, PER_TOKEN_S = 2.0, 0.09, 1e-4


class FakeServer:
    """TTFT = prompt tokens x PER_TOKEN_S, + COLD_S for the first prompt of its 1,000-token class,
    + NEW_LENGTH_S for a prompt length not seen before. ``fail`` holds call numbers to answer 503."""

    def __init__(self, fail: frozenset[int] = frozenset()) -> None:
        self.calls = 0
        self.fail = fail
        self.classes: set[int] = set()
        self.lengths: set[int] = set()
        self.sent: list[int] = []  # prompt tokens of every request, calibration included

    async def __call__(self, client, path: str, body: dict, timeout: float) -> RequestResult:
        self.calls += 1
        assert path == "/v1/completions" and body["max_tokens"] == 1
        tokens = FIXED + PER_UNIT * body["prompt"].count(prefill.FILLER)
        self.sent.append(tokens)
        res = RequestResult(sent_at=time.perf_counter())
        if self.calls in self.fail:
            res.status, res.error = 503, "overloaded"
            return res
        ttft = tokens * PER_TOKEN_S
        if tokens // 1000 not in self.classes:
            self.classes.add(tokens // 1000)
            ttft += COLD_S
        if tokens not in self.lengths:
            self.lengths.add(tokens)
            ttft += NEW_LENGTH_S
        res.status, res.ttft_s, res.end_s = 200, ttft, ttft
        res.prompt_tokens, res.completion_tokens, res.finish_reason = tokens, 1, "length"
        return res


def measure(monkeypatch, server: FakeServer, context: int | None = None, **kwargs) -> Record:
    """``context``: the server lists its model with that max_model_len (as vLLM does)."""
    monkeypatch.setattr(prefill, "stream_request", server)
    record = Record("prefill", {})
    if context is not None:
        record.data["server"] = {"models": {"data": [{"id": "m", "max_model_len": context}]}}
    ctx = Ctx(None, "m", record, view.progress(True), 60.0)
    asyncio.run(prefill.run(ctx, **kwargs))
    return record


def test_warmup_is_sent_kept_and_left_out_of_the_medians(monkeypatch):
    server = FakeServer()
    record = measure(monkeypatch, server, sizes=[1500, 4500], repeats=3, warmup=2)
    assert server.calls == 2 + 2 * (2 + 3)  # calibration, then warm-up and measured requests of each size
    assert record.data["failures"] == []
    for p in record.points:
        assert p["ok"] and p["requests"] == 3 and len(p["runs"]) == 3
        assert p["warmup_requests"] == 2 and len(p["warmup_runs"]) == 2 and p["warmup_failed_requests"] == 0
        warm, runs = p["warmup_runs"], p["runs"]
        # the first request paid the size class's one-time cost; it is kept, not measured
        assert p["first_ttft_s"] == warm[0]["ttft_s"] > COLD_S
        assert all(r["ttft_s"] < COLD_S for r in warm[1:] + runs)
        lengths = [r["prompt_tokens"] for r in warm + runs]
        assert len(set(lengths)) == len(lengths)  # no two requests of a point share a length ...
        # ... so every measured request shows the per-length cost, as real traffic (varied lengths) would
        for r in runs:
            assert r["ttft_s"] == pytest.approx(r["prompt_tokens"] * PER_TOKEN_S + NEW_LENGTH_S)
        assert p["ttft_s_median"] == statistics.median(r["ttft_s"] for r in runs)
        assert p["prefill_tok_s_median"] == statistics.median(r["prompt_tokens"] / r["ttft_s"] for r in runs)
        assert p["prompt_tokens"] == statistics.median(r["prompt_tokens"] for r in runs)
        # one filler unit apart, the measured centred on the target: its own units' length in the middle, the
        # warm-ups above them
        centre = FIXED + PER_UNIT * round((p["prompt_tokens_target"] - FIXED) / PER_UNIT)
        assert [r["prompt_tokens"] for r in runs] == [centre - PER_UNIT, centre, centre + PER_UNIT]
        assert [r["prompt_tokens"] for r in warm] == [centre + 2 * PER_UNIT, centre + 3 * PER_UNIT]
        assert p["prompt_tokens"] == centre and abs(centre - p["prompt_tokens_target"]) <= PER_UNIT / 2
    # the table shows the cold cost beside the warm median
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(view.table(record.data))
    lines = console.export_text().splitlines()
    assert "first TTFT s" in next(line for line in lines if "target" in line)
    for p in record.points:
        row = next(line for line in lines if line.lstrip("│ ").startswith(str(p["prompt_tokens_target"])))
        assert f"{p['first_ttft_s']:.4g}" in row and f"{p['prefill_tok_s_median']:.4g}" in row


def test_warmup_0_measures_the_first_request(monkeypatch):
    server = FakeServer()
    record = measure(monkeypatch, server, sizes=[1500], repeats=2, warmup=0)
    (p,) = record.points
    assert server.calls == 2 + 2 and p["warmup_runs"] == [] and p["warmup_requests"] == 0
    runs = p["runs"]
    assert p["first_ttft_s"] == runs[0]["ttft_s"] > COLD_S  # as before: the cold request is in the median
    assert p["ttft_s_median"] == pytest.approx((runs[0]["ttft_s"] + runs[1]["ttft_s"]) / 2)
    # apart from the lengths: one unit either side of the target's own, so their median is it
    assert runs[1]["prompt_tokens"] == runs[0]["prompt_tokens"] + 2 * PER_UNIT
    assert p["prompt_tokens"] == FIXED + PER_UNIT * round((1500 - FIXED) / PER_UNIT)
    # one request: exactly the target's own units, as before
    one = measure(monkeypatch, FakeServer(), sizes=[1500], repeats=1, warmup=0).points[0]
    assert one["prompt_tokens"] == FIXED + PER_UNIT * round((1500 - FIXED) / PER_UNIT)


def test_a_failed_warmup_is_recorded_but_does_not_fail_the_point(monkeypatch):
    server = FakeServer(fail=frozenset({3}))  # the first request after the two calibration ones
    record = measure(monkeypatch, server, sizes=[1500], repeats=2, warmup=1)
    (p,) = record.points
    assert p["ok"] and p["failed_requests"] == 0 and p["warmup_failed_requests"] == 1
    assert p["first_ttft_s"] is None and p["warmup_runs"][0]["status"] == 503
    assert record.data["failures"] == [{"where": "prompt=1500 warm-up", "error": "overloaded", "status": 503}]
    # the cold cost fell on the first measured request: it is in the median, not hidden
    assert p["runs"][0]["ttft_s"] > COLD_S


def test_units_are_all_different_and_never_below_one():
    assert prefill.units_of(1500, FIXED, PER_UNIT, 1) == ([], [88])
    assert prefill.units_of(1500, FIXED, PER_UNIT, 4) == ([], [86, 87, 89, 90])
    assert prefill.units_of(1500, FIXED, PER_UNIT, 2, warmup=1) == ([88], [87, 89])  # the default: 87, 88, 89 sent
    assert prefill.units_of(1500, FIXED, PER_UNIT, 3, warmup=2) == ([90, 91], [87, 88, 89])
    assert prefill.units_of(10, FIXED, PER_UNIT, 5) == ([], [1, 2, 3, 4, 5])


@pytest.mark.parametrize(("repeats", "warmup"), [(1, 1), (2, 1), (3, 1), (4, 2), (2, 0), (5, 3)])
def test_the_measured_lengths_are_centred_on_the_target(monkeypatch, repeats, warmup):
    """`ft bench prefill --sizes 256` measured 293 tokens on the demo model (42 tokens a filler unit): the warm-up
    took the shortest of the lengths centred on the target, and the measured ones sat at it and a unit above."""
    per_unit, fixed = 42, 20

    class Demo(FakeServer):  # the demo tokenizer's sizes: 20 + 42 x units
        async def __call__(self, client, path, body, timeout):
            res = await super().__call__(client, path, body, timeout)
            res.prompt_tokens = fixed + per_unit * body["prompt"].count(prefill.FILLER)
            return res

    for size in (256, 1024, 2048):
        (p,) = measure(monkeypatch, Demo(), sizes=[size], repeats=repeats, warmup=warmup).points
        own = fixed + per_unit * round((size - fixed) / per_unit)  # the target's own units, within half a unit
        lengths = [r["prompt_tokens"] for r in p["runs"]]
        assert p["prompt_tokens"] == statistics.median(lengths) == own, (size, lengths)
        assert sorted(lengths) == lengths and lengths[0] - own == own - lengths[-1]  # symmetric about it
        every = lengths + [r["prompt_tokens"] for r in p["warmup_runs"]]
        assert len(set(every)) == len(every)


def test_a_size_past_the_context_is_refused_before_any_of_its_requests(monkeypatch):
    """`--sizes 4k,8k --repeats 1` on a 4,096-token context: the 4096 row's warm-up (4,094 tokens) went through, its
    measured request (4,136) got a 400, and the table showed a TTFT beside `failed 1`."""
    server = FakeServer()
    record = measure(monkeypatch, server, context=2000, sizes=[1500, 1990, 3000, 1000], repeats=2, warmup=1)
    fits, edge, far, small = record.points
    assert fits["ok"] and small["ok"] and fits["requests"] == small["requests"] == 2
    for p in (edge, far):  # 1990: its own length fits, the one above it does not
        assert p["ok"] is False and p["requests"] == 0 and p["not_sent"] == "over the context"
        assert "runs" not in p and p["prompt_tokens"] is None
        assert "past the server's context of 2000 tokens (from /v1/models max_model_len)" in p["error"], p["error"]
    assert "the largest size whose requests all fit is about 1977 tokens" in edge["error"], edge["error"]
    assert [f["where"] for f in record.data["failures"]] == ["prompt=1990", "prompt=3000"]
    assert max(server.sent) < 2000 and len(server.sent) == 2 + 2 * 3  # calibration, then only the sizes that fit
    assert record.data["settings"]["context"] == {"tokens": 2000, "source": "from /v1/models max_model_len"}
    # the largest size it names does fit
    assert measure(monkeypatch, FakeServer(), context=2000, sizes=[1977], repeats=2).points[0]["ok"]
    # the table says why the row has no figures
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(view.table(record.data))
    row = next(line for line in console.export_text().splitlines() if line.lstrip("│ ").startswith("1990"))
    assert "not sent: over the context" in row, row


def test_a_server_says_its_context_where_it_can():
    from app.bench.target import context_tokens

    def ask(server: dict):
        return context_tokens(server, "m")

    assert ask({"models": {"data": [{"id": "x", "max_model_len": 1}, {"id": "m", "max_model_len": 8192}]}}) == (
        8192, "from /v1/models max_model_len")  # fluxtide, vLLM, SGLang
    assert ask({"props": {"default_generation_settings": {"n_ctx": 4096}}}) == (
        4096, "from /props default_generation_settings.n_ctx")  # llama.cpp: one slot's context
    assert ask({"models": {"data": [{"id": "m"}]}}) == (None, None)  # another server: not known, nothing refused


def test_a_negative_warmup_is_refused():
    with pytest.raises(SystemExit) as info:
        main(["bench", "prefill", "--warmup", "-1", "--quiet"])
    assert info.value.code == 2


def _prompts_of_a_fresh_process() -> list[str]:
    import subprocess
    import sys

    code = "from app.bench.prefill import make_prompt; print(make_prompt(1)); print(make_prompt(1))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.splitlines()


def test_a_second_run_never_resends_the_first_runs_prompts():
    # the nonce counter restarts in every process: without a run id, a second `ft bench prefill` against the same
    # server sent the first run's prompts again and measured its prefix cache (123k tok/s on the CPU demo)
    first, second = _prompts_of_a_fresh_process(), _prompts_of_a_fresh_process()
    assert len(set(first + second)) == 4
    page = 16  # a cached page is 16 tokens: the nonce must differ inside the first one
    assert all(a[:page] != b[:page] for a in first for b in second)
    # and inside one run (one character is at most one token, so a difference in the first 16 characters is one in
    # the first page): the run id first let a mixed run's repeats share a page and resume from it
    assert first[0][:page] != first[1][:page] and second[0][:page] != second[1][:page]
    assert {len(p) for p in first + second} == {len(first[0])}  # same length every run: same token count
