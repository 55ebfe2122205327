"""domain.routing_streams: the stream-key rule the simulator and `--routing-replay` share, and its bound."""

import pytest

from domain.ports import SequenceWork
from domain.request import SamplingParams
from domain.routing_streams import KEY_TOKENS, StreamKeys, stream_key

GREEDY = SamplingParams(temperature=0.0)


def work(rid: str, tokens, start: int = 0, sampling: SamplingParams = GREEDY) -> SequenceWork:
    return SequenceWork(rid, tuple(tokens), start, (), 0, True, sampling, 0)


def test_greedy_requests_with_one_prompt_head_share_a_stream_others_do_not():
    head = list(range(KEY_TOKENS))
    assert stream_key(work("a", head + [1])) == stream_key(work("b", head + [2]))  # only the head names it
    assert stream_key(work("a", [1, 2, 3])) != stream_key(work("a", [1, 2, 4]))
    seeded = SamplingParams(temperature=0.7, seed=5)
    assert stream_key(work("a", [1, 2], sampling=seeded)) == stream_key(work("b", [1, 2], sampling=seeded))
    assert stream_key(work("a", [1, 2], sampling=seeded)) != stream_key(work("a", [1, 2], sampling=SamplingParams(
        temperature=0.7, seed=6)))
    unseeded = SamplingParams(temperature=0.7)
    assert stream_key(work("a", [1, 2], sampling=unseeded)) != stream_key(work("b", [1, 2], sampling=unseeded))
    assert stream_key(work("a", [1, 2], start=32)).endswith("@32")  # a prefix computed elsewhere


def test_stream_keys_remember_the_first_work_and_forget_the_least_recently_used():
    keys = StreamKeys(capacity=2)
    first = keys.key_for(work("a", [1, 2, 3]))
    assert keys.key_for(work("a", [9], start=3)) == first  # a decode token keeps the request's stream
    keys.key_for(work("b", [4]))
    keys.key_for(work("a", [9], start=4))  # a is used again: b is now the oldest
    keys.key_for(work("c", [5]))
    assert "a" in keys and "c" in keys and "b" not in keys and len(keys) == 2
    keys.check_valid()
    with pytest.raises(ValueError):
        StreamKeys(capacity=0)
