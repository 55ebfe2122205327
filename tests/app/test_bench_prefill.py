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


def measure(monkeypatch, server: FakeServer, **kwargs) -> Record:
    monkeypatch.setattr(prefill, "stream_request", server)
    record = Record("prefill", {})
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
        # one filler unit more each request, centred on the target
        assert lengths == list(range(lengths[0], lengths[0] + 5 * PER_UNIT, PER_UNIT))
        assert abs(statistics.median(lengths) - p["prompt_tokens_target"]) <= PER_UNIT / 2
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
    assert runs[1]["prompt_tokens"] == runs[0]["prompt_tokens"] + PER_UNIT  # apart from the lengths
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
    assert prefill.units_of(1500, FIXED, PER_UNIT, 1) == [88]
    assert prefill.units_of(1500, FIXED, PER_UNIT, 4) == [87, 88, 89, 90]
    assert prefill.units_of(10, FIXED, PER_UNIT, 5) == [1, 2, 3, 4, 5]


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
