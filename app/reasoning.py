"""``<think>…</think>`` reasoning, split from the answer while it streams (``--reasoning-parser``).

The output starts inside the reasoning when the prompt already opened it (templates that end
the generation prompt with ``<think>``, as Qwen3.5/3.6 do with thinking on), or enters it when
the output itself begins with ``<think>``. Text up to ``</think>`` is reasoning, the rest is
content; an output that never closes its reasoning is all reasoning. Whitespace at the edges of
the reasoning and at the start of the answer is dropped. As with the tool parsers, any split of
the same text gives the same result and no markup is released.

``ReasoningTokens`` counts, on the engine thread, which generated *tokens* the same rules make
reasoning (usage's ``reasoning_tokens``) and decides when a thinking budget forces the close
(docs/adr/0007-thinking-budget.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from app.tool_parsers.base import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
# What the engine forces to end reasoning: the close as Qwen3-style templates render it between a
# turn's reasoning and its answer (``<think>\n…\n</think>\n\n``), so the model reads its usual layout.
FORCED_CLOSE = "\n</think>\n\n"
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # the same <think> format under its two usual names
DEFAULT_BY_ARCHITECTURE = {"qwen3_5_moe": "qwen3", "qwen3_moe": "qwen3"}


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open <think> block."""
    return prompt.rstrip().endswith(OPEN)


class ThinkParser:
    def __init__(self, starts_in_reasoning: bool) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._buf = ""
        self._held = ""  # trailing whitespace of the reasoning, released only if more reasoning follows
        self._lead = True  # dropping whitespace at the start of the current part

    def feed(self, text: str) -> tuple[str, str]:
        """Returns (reasoning, content) released by this piece of text."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self._state == "start":
                body = self._buf.lstrip()
                if body.startswith(OPEN):
                    self._buf, self._state, self._lead = body[len(OPEN) :], "reasoning", True
                    continue
                if not final and OPEN.startswith(body):
                    return reasoning, content
                self._state, self._lead = "content", False
                continue
            if self._state == "reasoning":
                end = self._buf.find(CLOSE)
                upto = end if end != -1 else len(self._buf) - (0 if final else partial_suffix(self._buf, CLOSE))
                reasoning += self._reasoning_text(self._buf[:upto])
                if end == -1:
                    self._buf = self._buf[upto:]
                    return reasoning, content
                self._buf, self._state, self._held, self._lead = self._buf[end + len(CLOSE) :], "content", "", True
                continue
            text, self._buf = self._buf, ""
            if self._lead:
                text = text.lstrip()
                self._lead = not text
            return reasoning, content + text

    def _reasoning_text(self, text: str) -> str:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        stripped = text.rstrip()
        if not stripped:
            self._held += text
            return ""
        out = self._held + stripped
        self._held = text[len(stripped) :]
        return out


@dataclass(frozen=True)
class ThinkingPlan:
    """How one request's reasoning is counted and bounded. ``budget``: reasoning tokens the model may
    generate before the close is forced (None = unbounded); ``encode``: the tokenizer's text -> ids,
    for the forced close."""

    starts_inside: bool
    budget: int | None = None
    encode: Callable[[str], Sequence[int]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.budget is not None and (self.budget < 0 or self.encode is None):
            raise ValueError(f"a thinking budget needs budget >= 0 and an encoder, got {self.budget}")


class ReasoningTokens:
    """Which generated tokens are reasoning, from the text each one released, and the thinking
    budget's state machine. Engine thread; one per request; fed token by token in output order.

    A token is reasoning when its text overlaps the reasoning *body*: after ``<think>`` (or from the
    start of the output when the prompt opened the block) and before ``</think>``, by the rules of
    ``ThinkParser`` (so the count and the split text agree). Hence:
    - a token straddling a tag counts when it carries any body text ("ok</th" does; "ink>\n\n" does not);
    - the tags' own tokens, and everything after the close, do not; an output that never closes its
      reasoning is all reasoning; one that never opens it (and was not opened by the prompt) has none;
    - a token with no text yet (part of a UTF-8 character) is classified with the next token that
      releases text (the one completing the character, or a forced token that cut it short);
    - a token whose text may still be the start of ``</think>`` waits until that is decided (it is
      reasoning unless the close completes);
    - forced tokens (the budget's close) are never reasoning: they are the engine's, not the model's.

    Budget: ``should_force()`` is true once the reasoning is open and ``spent`` (the reasoning tokens
    so far plus the undecided ones, counted as reasoning so the budget can never be overshot)
    reached the budget; the caller then forces ``close_ids()``: ``FORCED_CLOSE``, or, when the model
    was half-way through writing ``</think>`` itself (a tokenizer that spells the tag in pieces), the
    rest of its tag and the blank line, so its own close stands and the half is not made reasoning.
    """

    def __init__(self, plan: ThinkingPlan) -> None:
        self.plan = plan
        self.count = 0  # decided reasoning tokens
        # NOTE: the output's text is not kept (appending to a long str attribute copies it each time):
        # its length, the text while the start is undecided, and a window of the newest text with the
        # tag's length before it, enough to see a tag split across tokens.
        self._len = 0
        self._head = ""  # the whole output while it is not known whether it opens a block
        self._window, self._window_at = "", 0  # newest text (with the previous tail), and its offset
        self._body_start: int | None = 0 if plan.starts_inside else None  # None: not known yet
        self._no_body = False  # decided: the output has no reasoning block
        self._body_end: int | None = None  # where </think> starts, once seen
        self._pending: list[tuple[int, int]] = []  # undecided model tokens' [start, end) text spans
        self._textless = 0  # model tokens waiting for the token that completes their character
        self._forced = False
        self._final = False

    @property
    def open(self) -> bool:
        """Inside the reasoning body: it started and has not closed."""
        return self._body_start is not None and self._body_end is None and not self._final

    @property
    def spent(self) -> int:
        """Reasoning tokens for the budget: decided ones plus every undecided one inside an open body."""
        return self.count + (len(self._pending) + self._textless if self.open else 0)

    @property
    def bounded(self) -> bool:
        """A thinking budget applies (the close may be forced)."""
        return self.plan.budget is not None

    def should_force(self) -> bool:
        budget = self.plan.budget
        return budget is not None and not self._forced and self.open and self.spent >= budget

    def close_ids(self) -> list[int]:
        """The tokens to force now (call when ``should_force()``); marks the close as forced (the
        tokens that follow come back with ``forced=True``)."""
        assert self.should_force()
        self._forced = True
        # NOTE: a character still incomplete (textless tokens) would come between: not a tag then.
        begun = 0 if self._textless else self._partial_close()
        text = CLOSE[begun:] + FORCED_CLOSE[FORCED_CLOSE.index(CLOSE) + len(CLOSE) :] if begun else FORCED_CLOSE
        return list(self.plan.encode(text))

    def push(self, text: str, forced: bool = False) -> None:
        """One generated token and the text its detokenization released ("" while a character is incomplete)."""
        start, end = self._len, self._len + len(text)
        if text and self._textless:  # their character is complete (U+FFFD if a forced token cut it short)
            self._pending += [(start, end)] * self._textless
            self._textless = 0
        if not forced:
            if text:
                self._pending.append((start, end))
            else:
                self._textless += 1
        self._append(text)
        self._decide()

    def finish(self, text: str = "") -> int:
        """End of the output (``text``: what the detokenizer flushed, completing any textless tokens);
        returns the final count."""
        self._pending += [(self._len, self._len + len(text))] * self._textless
        self._textless = 0
        self._append(text)
        self._final = True
        self._decide()
        assert not self._pending, "undecided tokens after the end of the output"
        return self.count

    def _append(self, text: str) -> None:
        tail = self._window[-len(CLOSE) :]
        self._window, self._window_at = tail + text, self._len - len(tail)
        self._len += len(text)
        if self._body_start is None and not self._no_body:
            self._head += text

    def _body_window(self) -> str:
        """The newest text from the body's start on (the body has started)."""
        return self._window[max(0, self._body_start - self._window_at) :]

    def _partial_close(self) -> int:
        """Length of the body's tail that is a proper prefix of </think>."""
        return partial_suffix(self._body_window(), CLOSE)

    def _decide(self) -> None:
        if self._body_start is None and not self._no_body:
            body = self._head.lstrip()
            if body.startswith(OPEN):
                self._body_start = len(self._head) - len(body) + len(OPEN)
            elif self._final or not OPEN.startswith(body):
                self._no_body = True
        if self._no_body:
            self._pending.clear()
            return
        if self._body_start is None:
            return  # still possibly "<think>": undecided
        start = self._body_start
        if self._body_end is None:
            # NOTE: the body's text before the window was searched already (the window overlaps it by a tag).
            found = self._body_window().find(CLOSE)
            if found != -1:
                self._body_end = self._window_at + max(0, start - self._window_at) + found
        if self._body_end is not None:
            frontier = self._body_end
        elif self._final:
            frontier = self._len
        else:  # text that may yet become </think> is not known to be body
            frontier = self._len - self._partial_close()
        decided = 0
        for begin, end in self._pending:
            if begin < frontier and end > start:
                self.count += 1
            elif not (end <= start or self._body_end is not None or self._final):
                break  # inside a possible close tag: wait
            decided += 1
        del self._pending[:decided]
