"""simulator/replay_source.py: the --routing-replay spec grammar and the RoutingSource over the routing
models (bounded memo that regenerates identically, trace assignment kept, trace rows checked)."""

import pytest

from domain.ports import RoutingSource
from simulator.replay_source import parse_replay_spec, replay_source
from simulator.routing import LocalityRouting, write_trace


def test_specs_parse_to_their_canonical_text_and_bad_ones_say_why(tmp_path):
    spec = parse_replay_spec("locality:p_prev=0.6, seed=3")
    assert spec.mode == "locality" and spec.seed == 3 and spec.locality.p_prev == 0.6
    assert spec.text.startswith("locality:p_prev=0.6,p_recent=0.38,window=8,") and spec.text.endswith(",seed=3")
    assert parse_replay_spec(spec.text) == spec  # the canonical text rebuilds it
    assert parse_replay_spec("uniform").text == "uniform:seed=0"
    for text, match in [("locality:p_prev", "NAME=VALUE"), ("locality:window=x", "not a number"),
                        ("locality:p_prev=0.9,p_recent=0.5", "sum to <= 1"), ("zipf", "use locality"),
                        ("trace:", "needs a file"), (f"trace:{tmp_path}/missing", "not a readable file")]:
        with pytest.raises(ValueError, match=match):
            parse_replay_spec(text)


def test_the_source_is_the_model_and_forgets_memos_without_changing_them():
    source = replay_source("locality:seed=4", 3, 16, 2, max_memo_bytes=3 * (56 + 16) * 40)  # ~ 40 positions
    assert isinstance(source, RoutingSource)
    oracle = LocalityRouting(3, 16, 2, seed=4)
    first = list(source.tokens("a", 0, 30))
    source.tokens("b", 0, 30)  # over the bound: a's memo is forgotten
    assert source.describe()["streams_held"] == 1
    source.check_valid()
    assert list(source.tokens("a", 10, 20)) == first[10:] == oracle.stream("a").tokens(10, 20)
    with pytest.raises(ValueError):
        source.tokens("a", -1, 2)


def test_a_trace_keeps_each_keys_recorded_stream_and_its_rows_are_checked(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, {"x": [((0, 1), (2, 3))] * 3, "y": [((4, 5), (6, 7))] * 2})
    source = replay_source(f"trace:{path}", 2, 8, 2, max_memo_bytes=1)  # every other memo forgotten at once
    assert source.tokens("k1", 0, 1)[0] == ((0, 1), (2, 3))
    assert source.tokens("k2", 0, 1)[0] == ((4, 5), (6, 7))
    assert source.tokens("k1", 3, 1)[0] == ((0, 1), (2, 3))  # forgotten memo, same recorded stream; wraps
    assert source.describe()["recorded_streams"] == 2
    bad = tmp_path / "bad.jsonl"
    write_trace(bad, {"x": [((0, 0), (2, 3))]})
    with pytest.raises(ValueError, match="distinct experts"):
        replay_source(f"trace:{bad}", 2, 8, 2)
    with pytest.raises(ValueError, match="layers"):
        replay_source(f"trace:{path}", 3, 8, 2)
