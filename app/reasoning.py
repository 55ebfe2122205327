"""``<think>…</think>`` reasoning, split from the answer while it streams (``--reasoning-parser``).

The output starts inside the reasoning when the prompt already opened it (templates that end
the generation prompt with ``<think>``, as Qwen3.5/3.6 do with thinking on), or enters it when
the output itself begins with ``<think>``. Text up to ``</think>`` is reasoning, the rest is
content; an output that never closes its reasoning is all reasoning. Whitespace at the edges of
the reasoning and at the start of the answer is dropped. As with the tool parsers, any split of
the same text gives the same result and no markup is released.
"""

from __future__ import annotations

from app.tool_parsers.base import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
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
