"""Incremental detokenisation and stop-string hold-back, against a whole-text oracle."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from app.detokenize import IncrementalDetokenizer, StopStringMatcher
from domain.fakes import FakeTokenizer

TOKENIZER = FakeTokenizer()


def stream(ids: list[int], stop: tuple[str, ...] = ()) -> tuple[str, bool, list[str]]:
    detok, matcher = IncrementalDetokenizer(TOKENIZER), StopStringMatcher(stop)
    deltas = []
    for i in ids:
        deltas.append(matcher.feed(detok.push(i)))
        detok.check_valid()
        matcher.check_valid()
    deltas.append(matcher.feed(detok.flush()) + matcher.flush())
    return "".join(deltas), matcher.stopped, deltas


def test_multibyte_characters_are_held_until_complete():
    ids = TOKENIZER.encode("a€b")  # € is three bytes
    _, _, deltas = stream(ids)
    assert deltas[:5] == ["a", "", "", "€", "b"]
    assert "\ufffd" not in "".join(deltas)


def test_stop_string_cuts_text_and_is_not_sent():
    text, stopped, deltas = stream(TOKENIZER.encode("hello world, bye"), stop=("world",))
    assert stopped and text == "hello "
    assert all("w" not in d for d in deltas), "a prefix of the stop string leaked out before the match"


def test_text_that_only_resembles_a_stop_prefix_is_released_at_the_end():
    text, stopped, deltas = stream(TOKENIZER.encode("abc wor"), stop=("world",))
    assert not stopped and text == "abc wor"
    assert deltas[-1] == "wor", "'wor' could start 'world' and must be held until the stream ends"


def test_earliest_of_several_stop_strings_wins():
    text, stopped, _ = stream(TOKENIZER.encode("one two three"), stop=("three", "two"))
    assert stopped and text == "one "


@settings(max_examples=300)
@given(
    text=st.text(alphabet="ab€ \n", max_size=30),
    stops=st.lists(st.text(alphabet="ab€ ", min_size=1, max_size=3), max_size=3),
)
def test_stream_equals_the_whole_text_oracle(text, stops):
    out, stopped, _ = stream(TOKENIZER.encode(text), tuple(stops))
    # Oracle: generation stops at the first character after which some stop string is complete;
    # the answer is the text before the earliest match at that moment.
    for end in range(len(text) + 1):
        hits = [text[:end].find(s) for s in stops if s in text[:end]]
        if hits:
            assert stopped and out == text[: min(hits)]
            return
    assert not stopped and out == text


@settings(max_examples=200)
@given(st.lists(st.integers(0, 258), max_size=40))
def test_arbitrary_bytes_decode_to_the_same_text_as_a_whole_decode(ids):
    out, _, _ = stream(ids)
    assert out == TOKENIZER.decode(ids)


@settings(max_examples=100)
@given(text=st.text(alphabet="ab€ \n", max_size=30), stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=2),
                                                                   max_size=2))
def test_the_matcher_reports_what_it_released_with_or_without_stop_strings(text, stops):
    """Without stop strings deltas pass straight through (no search); `text` is what went out either way."""
    matcher = StopStringMatcher(tuple(stops))
    out = [matcher.feed(ch) for ch in text] + [matcher.flush()]
    assert matcher.text == "".join(out)
    if not stops:
        assert out[:-1] == list(text) and out[-1] == ""
    matcher.check_valid()


@settings(max_examples=300)
@given(text=st.text(alphabet="ab", max_size=40), stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=5),
                                                                 min_size=1, max_size=3))
def test_the_matcher_holds_back_exactly_the_longest_stop_prefix_at_every_step(text, stops):
    """Oracle for the search that looks at the unreleased text only: after every character, what went out is the
    text less its longest suffix that begins a stop string (the search over the whole text)."""
    matcher = StopStringMatcher(tuple(stops))
    for end in range(1, len(text) + 1):
        matcher.feed(text[end - 1])
        if matcher.stopped:
            return
        seen = text[:end]
        held = max((n for s in stops for n in range(min(len(s) - 1, len(seen)) + 1) if seen.endswith(s[:n])), default=0)
        assert matcher.text == seen[: len(seen) - held], (seen, stops)


class _Sliced(str):
    """A stop string that counts the characters sliced out of it (the held-back search's work)."""

    chars = 0

    def __getitem__(self, key):
        part = str.__getitem__(self, key)
        _Sliced.chars += len(part)
        return part


def test_the_held_back_search_costs_each_token_its_own_text_not_the_whole_output():
    """16 stop strings of 4,000 characters that never match: the search sliced ~16 x 1,750 characters per
    token (3,500 tokens: ~10^8 in all), on the engine thread; it is now bounded by the text not yet released."""
    _Sliced.chars = 0
    matcher = StopStringMatcher([_Sliced(chr(0x4E00 + i) * 4000) for i in range(16)])
    for _ in range(3500):
        matcher.feed("ab")
    assert matcher.text == "ab" * 3500 and not matcher.stopped
    assert _Sliced.chars <= 16 * 3500 * 3, _Sliced.chars
