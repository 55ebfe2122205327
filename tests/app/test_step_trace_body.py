"""GET /v1/stats/steps' body (ServingStats.steps_json): each step's row is encoded once and joined from its bytes,
`since` is found by bisection while the wall clock only rose. Pinned against the per-call dict the body used to be
(`reference`, the former implementation): the same bytes, for any steps, trims and `since`; a wall clock that
stepped back falls back to the full filter."""

from __future__ import annotations

import math

import httpx
import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from app.stats import ServingStats, _round6
from tests.app.conftest import start_server


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reference_row(s) -> dict:
    """The row the handler built per step and call before the body was cached (app/stats.py's former trace_row)."""
    later_group = s.layers is not None and s.layers[0] > 0
    return {"end": s.ended, "seconds": round(s.seconds, 6),
            "host_seconds": None if s.host_seconds is None else round(s.host_seconds, 6),
            "decode_rows": s.decode_tokens,
            "prefill_tokens": s.prefill_tokens + (s.layer_tokens if later_group else 0),
            "prefill_works": s.prefill_works, "layers": None if s.layers is None else list(s.layers),
            "layer_tokens": s.layer_tokens if s.layers is not None else 0,
            "expert_hits": s.expert_hits, "expert_misses": s.expert_misses}


def reference(stats: ServingStats, since: float | None = None) -> bytes:
    """The former body: every step of the window (a linear filter on `since`), as a dict encoded in one call."""
    with stats._lock:
        stats._trim(stats._clock())
        steps = list(stats._steps)
    rows = [reference_row(s) for s in steps if since is None or s.ended > since]
    return msgspec.json.encode({"clock": "unix", "window_s": stats.window_s, "steps": rows})


def record(stats: ServingStats, i: int, ended: float, seconds: float = 0.0031234567,
           host: float | None = 0.000412345) -> None:
    layers = ((0, 2), (2, 4), None, None)[i % 4]
    stats.record_step(prefill_tokens=116 if layers == (0, 2) else 3 * (i % 3 == 0), decode_tokens=i % 5,
                      seconds=seconds, expert_hits=i % 7, expert_misses=i % 3, host_seconds=host, ended=ended,
                      prefill_works=int(layers is not None), layers=layers, layer_tokens=116 if layers else 0)


def test_the_body_is_the_former_dicts_bytes_and_since_the_steps_after_it():
    clock = Clock()
    stats = ServingStats(window_s=1.0, clock=clock)
    assert stats.steps_json() == reference(stats) == b'{"clock":"unix","window_s":1.0,"steps":[]}'
    for i in range(40):
        clock.now += 0.05
        record(stats, i, 1.7e9 + i * 0.0371, seconds=i * 0.0123456789, host=None if i % 9 == 0 else i * 1e-7)
    ends = [s.ended for s in stats._steps]
    assert len(ends) == 21  # the last second's steps: the window trimmed the others
    for since in (None, 0.0, ends[0] - 1, ends[0], ends[5], (ends[5] + ends[6]) / 2, ends[-2], ends[-1], 2e9):
        body = stats.steps_json(since)
        assert body == reference(stats, since), since
        assert body == stats.steps_json(since), "a second read (rows from their cached bytes) differs"
        assert stats.steps(since) == msgspec.json.decode(body)
    # `since` one step's end: the steps after it, that one not included
    assert [r["end"] for r in stats.steps(ends[5])["steps"]] == ends[6:]
    assert stats.steps(ends[-1])["steps"] == [] and len(stats.steps(ends[0] - 1)["steps"]) == 21
    stats.check_valid()


def test_a_wall_clock_that_stepped_back_still_gets_every_later_step():
    """`ended` is the wall clock (time.time()); an NTP step back breaks its order, and bisection would miss steps
    that ended after `since`: while such a step is in the window the filter reads every step."""
    clock = Clock()
    stats = ServingStats(window_s=1.0, clock=clock)
    ends = [100.0, 101.0, 102.0, 99.5, 100.5, 103.0]  # stepped back 2.5 s after the third step
    for i, end in enumerate(ends):
        clock.now += 0.1
        record(stats, i, end)
    stats.check_valid()
    assert stats._ended_inversions == 1
    assert [r["end"] for r in stats.steps(100.2)["steps"]] == [101.0, 102.0, 100.5, 103.0]
    assert stats.steps_json(100.2) == reference(stats, 100.2)
    clock.now += 0.75  # the first three steps leave the window: the order is whole again
    assert [r["end"] for r in stats.steps(100.2)["steps"]] == [100.5, 103.0]
    assert stats._ended_inversions == 0
    stats.check_valid()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.4), st.floats(-3, 3), st.floats(0, 20, allow_subnormal=False),
                          st.one_of(st.none(), st.floats(0, 1, allow_subnormal=False))), max_size=30),
       st.lists(st.one_of(st.none(), st.floats(-20, 80)), min_size=1, max_size=4))
def test_any_steps_trims_and_since_give_the_former_bytes(steps, sinces):
    """A shadow of the former implementation: steps arriving at random gaps (some trimmed), their wall clock going
    forward or back, `seconds` of any digits; every read of any `since` gives the former bytes."""
    clock = Clock()
    stats = ServingStats(window_s=1.0, clock=clock)
    wall = 0.0
    for i, (gap, wall_step, seconds, host) in enumerate(steps):
        clock.now += gap
        wall += wall_step
        record(stats, i, wall, seconds=seconds, host=host)
        stats.check_valid()
        for since in sinces:
            assert stats.steps_json(since) == reference(stats, since)


# ties of the 7th decimal that are exact in binary (odd / 128), halves a double's product misses by an ulp, the
# 8,000 bound, the smallest and largest doubles, signed zeros, negatives, infinities and nan
EDGES = [0.0078125, 0.0234375, 2.5e-6, 0.0000005, 1.0000005, 0.1234565, 7999.9999995, 7999.9999994999, 8e3,
         8000.0000005, 5e-324, 1.7976931348623157e308, 0.0, -0.0, -0.0000004, -1.2345675, math.inf, -math.inf,
         math.nan, 0.0031234567, 1e-7, 4.9999999e-7, 123.4567895]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(), st.floats(0, 10), st.floats(0, 0.01),
                          st.integers(0, 10**10).map(lambda n: n / 2e7),  # halves of the 7th decimal, as doubles
                          st.sampled_from(EDGES)), max_size=40))
def test_the_vectorised_rounding_is_round_to_the_bit(values):
    """The rows' `seconds` and `host_seconds` are rounded in one pass (app.stats._round6); they must be the floats
    round(v, 6) gives, bit for bit (repr: nan and -0.0 included), or the body's bytes would change."""
    assert [repr(v) for v in _round6(values)] == [repr(round(v, 6)) for v in values]
    assert [repr(v) for v in _round6(EDGES)] == [repr(round(v, 6)) for v in EDGES]


def test_the_route_serves_the_stats_bytes_as_json():
    """Through HTTP: the body is steps_json's bytes, `application/json`, `since` passed on; HEAD answers the same
    status without a body."""
    server = start_server()
    try:
        stats = server.runtime.engine.stats
        for i in range(30):
            record(stats, i, 1.7e9 + i * 0.01)
        url = server.base_url + "/v1/stats/steps"
        since = 1.7e9 + 12 * 0.01
        for after in (None, since):
            r = httpx.get(url, params={} if after is None else {"since": repr(after)}, timeout=30)
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            assert r.content == stats.steps_json(after), "the body is not the stats' own bytes"
            assert r.content == reference(stats, after)
        assert len(r.json()["steps"]) >= 17 and all(row["end"] > since for row in r.json()["steps"])
        head = httpx.head(url, timeout=30)
        assert head.status_code == 200 and head.content == b""
        assert math.isclose(httpx.get(url, timeout=30).json()["window_s"], stats.window_s)
    finally:
        server.stop()
