"""Routing models: published locality statistics, determinism, trace format."""

import json

import pytest

from simulator.calibration import LOCALITY_CANDIDATES
from simulator.routing import (
    LocalityParams,
    LocalityRouting,
    TraceRouting,
    UniformRouting,
    load_trace,
    make_routing,
    routing_statistics,
    write_trace,
)


def _stats(model, tokens=600, key="s"):
    return routing_statistics(model.stream(key).tokens(0, tokens), model.num_experts)


@pytest.mark.parametrize("params", [LocalityParams(), *LOCALITY_CANDIDATES], ids=str)
def test_locality_model_reproduces_published_qwen3_30b_statistics(params):
    # SPEC.md: Qwen3-30B-A3B, 128 experts, top-8: 45 % reuse at the next token, 80 % within 8,
    # median reuse distance 2, 58-65 of 128 experts carry 90 % of the mass, top expert 4-6 %.
    s = _stats(LocalityRouting(8, 128, 8, seed=3, params=params))
    assert 0.40 <= s.next_token_reuse <= 0.50, s
    assert 0.75 <= s.within_8_reuse <= 0.85, s
    assert s.median_reuse_distance == 2, s
    assert 55 <= s.experts_for_90pct_mass <= 68, s
    assert 0.035 <= s.top_expert_share <= 0.065, s


def test_uniform_routing_has_no_locality_and_no_skew():
    s = _stats(UniformRouting(8, 128, 8, seed=1))
    assert s.next_token_reuse < 0.10  # 8/128 by chance
    assert s.experts_for_90pct_mass > 100


def test_every_token_picks_k_distinct_valid_experts():
    for model in (LocalityRouting(5, 32, 4, seed=2), UniformRouting(5, 32, 4, seed=2)):
        for token in model.stream("x").tokens(0, 200):
            assert len(token) == 5
            for row in token:
                assert len(row) == 4 and len(set(row)) == 4 and all(0 <= e < 32 for e in row)


def test_same_seed_and_key_give_the_same_stream_and_other_keys_differ():
    a = LocalityRouting(4, 64, 8, seed=7).stream("p").tokens(0, 50)
    b = LocalityRouting(4, 64, 8, seed=7).stream("p").tokens(0, 50)
    c = LocalityRouting(4, 64, 8, seed=7).stream("q").tokens(0, 50)
    d = LocalityRouting(4, 64, 8, seed=8).stream("p").tokens(0, 50)
    assert a == b
    assert a != c and a != d


def test_streams_are_independent_of_the_order_they_are_drawn_in():
    m1 = LocalityRouting(4, 64, 8, seed=5)
    m1.stream("a").tokens(0, 30)
    first = m1.stream("b").tokens(0, 30)
    m2 = LocalityRouting(4, 64, 8, seed=5)
    assert m2.stream("b").tokens(0, 30) == first


def test_trace_round_trip_and_replay(tmp_path):
    src = LocalityRouting(3, 16, 2, seed=0)
    streams = {"0": src.stream("a").tokens(0, 20), "1": src.stream("b").tokens(0, 10)}
    path = tmp_path / "trace.jsonl"
    write_trace(path, streams)
    assert load_trace(path) == {k: list(v) for k, v in streams.items()}
    replay = make_routing(f"trace:{path}", 3, 16, 2)
    assert isinstance(replay, TraceRouting)
    assert replay.stream("first").tokens(0, 20) == streams["0"]
    assert replay.stream("second").tokens(0, 10) == streams["1"]
    assert replay.stream("third").at(0) == streams["0"][0]  # more requests than recorded streams
    assert replay.stream("second").at(12) == streams["1"][2]  # wraps past the end


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"layer_experts": [[1, 2], [3]], "extra": 1}', "unknown fields"),
        ('{"experts": [[1]]}', "not a routing record"),
        ('{"layer_experts": [[1, -2]]}', "expert ids"),
        ('{"layer_experts": [[1]], "position": 5}', "position 5"),
        ("not json", "not a routing record"),
    ],
)
def test_malformed_traces_are_rejected_with_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def test_trace_geometry_must_match_the_model(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"layer_experts": [[0, 1], [2, 3]]}) + "\n")
    with pytest.raises(ValueError, match="2 layers"):
        make_routing(f"trace:{path}", 4, 16, 2)


def test_unknown_routing_kind_and_bad_locality_params_are_rejected():
    with pytest.raises(ValueError, match="unknown routing"):
        make_routing("zipf", 2, 8, 2)
    with pytest.raises(ValueError):
        LocalityParams.from_dict({"p_prev": 0.8, "p_recent": 0.5})
    with pytest.raises(ValueError, match="unknown field"):
        LocalityParams.from_dict({"p_next": 0.4})
