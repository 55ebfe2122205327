"""ReasoningTokens: which generated tokens are reasoning (by the text each released), and the thinking
budget's state machine (when the close is forced), against a whole-text oracle and ThinkParser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.reasoning import CLOSE, FORCED_CLOSE, OPEN, ReasoningTokens, ThinkingPlan, ThinkParser


def count(pieces: list[str], starts_inside: bool = True, flush: str = "") -> int:
    tokens = ReasoningTokens(ThinkingPlan(starts_inside))
    for piece in pieces:
        tokens.push(piece)
    return tokens.finish(flush)


@pytest.mark.parametrize(
    ("pieces", "starts_inside", "expected"),
    [
        (list("abc\n") + ["</think>", "\n\n", "Yes"], True, 4),  # whitespace inside the block is reasoning
        (list("abc\n</think>\n\nYes"), True, 4),  # the tag spelled byte by byte is not
        (["I think", " so\n</th", "ink>\n\nYes"], True, 2),  # straddles the close carrying " so\n": counts
        (["ok", "</think>\n\nA", "B"], True, 1),
        (["hm", "m</think>"], True, 2),
        (["  ", "<th", "ink>", "hmm", "</think>", "ans"], False, 1),  # the output opens it itself
        (["<think>hmm", " more", "</think>x"], False, 2),  # straddles the open carrying "hmm": counts
        (["<think>", "</think>", "x"], False, 0),  # an empty block
        (["Hello", " world"], False, 0),  # no block
        (["<thinking", " about it"], False, 0),  # not the tag: content, as ThinkParser says
        (["<th"], False, 0),  # the output ends inside a possible opening tag: content
        (["a", "b"], True, 2),  # never closed: all reasoning
        (["x", "</th", "is", " and that"], True, 4),  # a partial close that was not one
        (["x", "</th"], True, 2),  # ... nor at the very end
        (["", "é", "</think>"], True, 2),  # "é" in two tokens: the textless one goes with the one completing it
        (["ok", "</think>", "", "é"], True, 1),  # ... and after the close it is not reasoning
    ],
)
def test_reasoning_tokens_by_the_text_they_carry(pieces, starts_inside, expected):
    assert count(pieces, starts_inside) == expected


def test_textless_tokens_completed_by_the_flush_at_the_end():
    assert count(["a", "", ""], flush="\ufffd") == 3


def oracle(pieces: list[str], starts_inside: bool, forced: list[bool] | None = None) -> int:
    """From the whole text at once: the tokens whose span overlaps the body (empty-text tokens take the
    span of the next token with text), forced tokens left out."""
    text = "".join(pieces)
    if starts_inside:
        start = 0
    else:
        body = text.lstrip()
        if not body.startswith(OPEN):
            return 0
        start = len(text) - len(body) + len(OPEN)
    end = text.find(CLOSE, start)
    end = len(text) if end == -1 else end
    spans, offset, waiting = [], 0, 0
    for piece in pieces:
        if not piece:
            waiting += 1
            continue
        spans += [(offset, offset + len(piece))] * (waiting + 1)
        waiting, offset = 0, offset + len(piece)
    forced = forced or [False] * len(spans)
    return sum(1 for (s, e), f in zip(spans, forced, strict=True) if s < end and e > start and not f)


ALPHABET = st.sampled_from(["a", " ", "\n", "<", "/", "t", "h", "i", "n", "k", ">", "<think>", "</think>", "</th", "ink>"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.lists(ALPHABET, min_size=0, max_size=3).map("".join), max_size=14),  # "": textless
       starts_inside=st.booleans())
def test_streamed_count_equals_the_whole_text_oracle_and_agrees_with_the_parser(pieces, starts_inside):
    n = count(pieces, starts_inside)
    assert n == oracle(pieces, starts_inside)
    parser = ThinkParser(starts_inside)
    reasoning = "".join(parser.feed(p)[0] for p in pieces) + parser.finish()[0]
    if reasoning:  # text split as reasoning was carried by reasoning tokens
        assert n > 0


# ---- the budget's state machine -------------------------------------------------------------------

def encode(text: str) -> list[int]:  # one token per character (ASCII here: a byte-level tokenizer)
    return [ord(c) for c in text]


def run_budget(model: list[str], budget: int, starts_inside: bool = True, pieces: list | None = None
               ) -> tuple[str, int, list[bool]]:
    """Simulates the engine: each step the model emits its next piece unless the close is being forced
    (then the forced pieces, one per step, and the model resumes after them). Returns the output text,
    the reasoning count and which tokens were forced (``pieces`` collects every token's text)."""
    tokens = ReasoningTokens(ThinkingPlan(starts_inside, budget, encode))
    out, forced_flags, queue = "", [], []
    model = list(model)

    def maybe_force():
        if tokens.should_force():
            queue.extend(chr(i) for i in tokens.close_ids())

    maybe_force()
    while model or queue:
        forced = bool(queue)
        piece = queue.pop(0) if forced else model.pop(0)
        tokens.push(piece, forced=forced)
        if pieces is not None:
            pieces.append(piece)
        out += piece
        forced_flags.append(forced)
        maybe_force()
    return out, tokens.finish(), forced_flags


def test_a_budget_forces_the_close_after_exactly_n_reasoning_tokens():
    text, n, forced = run_budget(list("abcdefgh") + ["\n", "</think>", "\n\n", "A"], budget=3)
    assert text.startswith("abc" + FORCED_CLOSE) and n == 3
    assert forced == [False] * 3 + [True] * len(FORCED_CLOSE) + [False] * 9
    reasoning, content = ThinkParser(True).feed(text)
    assert reasoning == "abc"


def test_a_model_that_closes_within_its_budget_is_never_forced():
    text, n, forced = run_budget(list("ab\n") + ["</think>", "A"], budget=4)
    assert n == 3 and not any(forced) and text == "ab\n</think>A"
    text, n, forced = run_budget(list("abcd") + ["</think>", "A"], budget=5)
    assert n == 4 and not any(forced)
    # after N reasoning tokens the next token is the close: forced, even if the model would have closed
    text, n, forced = run_budget(list("abcd") + ["</think>", "A"], budget=4)
    assert n == 4 and text.startswith("abcd" + FORCED_CLOSE)


def test_budget_zero_closes_a_prompt_opened_block_before_the_first_token():
    tokens = ReasoningTokens(ThinkingPlan(True, 0, encode))
    assert tokens.should_force() and tokens.close_ids() == encode(FORCED_CLOSE) and not tokens.should_force()
    text, n, forced = run_budget(list("abc"), budget=0)
    assert text.startswith(FORCED_CLOSE) and n == 0 and all(forced[: len(FORCED_CLOSE)])


def test_budget_waits_for_the_output_to_open_its_own_block():
    text, n, forced = run_budget(["<think>", "a", "b", "c"], budget=1, starts_inside=False)
    assert text == "<think>a" + FORCED_CLOSE + "bc" and n == 1


def test_a_close_the_model_began_at_the_budget_is_completed_not_made_reasoning():
    # at the budget (1 reasoning token + 2 that may be the close) the model was half-way through
    # "</think>": the rest of its tag is forced, so its own close stands
    text, n, forced = run_budget(["a", "<", "/", "t", "h", "i", "n", "k", ">", "A"], budget=3)
    assert text == "a</think>\n\nthink>A" and n == 1
    assert forced == [False] * 3 + [True] * len("think>\n\n") + [False] * 7
    assert ThinkParser(True).feed(text) == ("a", "think>A")
    # with a character still incomplete in between, it can not be the tag: the whole close is forced
    text, n, _ = run_budget(["a", "<", "", "b"], budget=3)
    assert text == "a<" + FORCED_CLOSE + "b" and n == 3


def test_no_budget_never_forces_and_a_closed_block_is_not_reopened():
    tokens = ReasoningTokens(ThinkingPlan(True))
    for piece in "x" * 50:
        tokens.push(piece)
        assert not tokens.should_force()
    tokens = ReasoningTokens(ThinkingPlan(True, 1, encode))
    for piece in ["</think>", "a", "<think>", "b"]:
        tokens.push(piece)
        assert not tokens.should_force()
    assert tokens.finish() == 0


def test_plan_refuses_a_budget_without_an_encoder_or_below_zero():
    with pytest.raises(ValueError):
        ThinkingPlan(True, 5)
    with pytest.raises(ValueError):
        ThinkingPlan(True, -1, encode)


@settings(max_examples=300, deadline=None)
@given(model=st.lists(st.lists(ALPHABET, min_size=1, max_size=2).map("".join), max_size=20),
       budget=st.integers(1, 8), starts_inside=st.booleans())
def test_the_count_never_exceeds_the_budget_and_a_forced_full_close_lands_exactly_on_it(model, budget, starts_inside):
    pieces: list[str] = []
    text, n, forced = run_budget(model, budget, starts_inside, pieces)
    assert n <= budget
    assert n == oracle(pieces, starts_inside, forced)
    if any(forced):
        first = forced.index(True)
        forced_text = "".join(pieces[first : first + forced[first:].index(False)] if False in forced[first:]
                              else pieces[first:])
        if forced_text == FORCED_CLOSE:
            assert n == budget
        else:  # the model had begun its own </think>: the rest of it was forced
            assert forced_text.endswith("\n\n") and CLOSE.endswith(forced_text[:-2])
