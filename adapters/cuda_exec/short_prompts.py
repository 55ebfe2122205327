"""FLUXTIDE_SHORT_PROMPT_REPLAYS: the longest prompt chunk (tokens) a step of the fast path runs as replays of the
captured decode step (domain/short_prompt_replays.py, docs/adr/0026-short-prompts-as-decode-replays.md); 0 off,
unset domain.short_prompt_replays.DEFAULT_TOKENS. Read once, at import."""

from __future__ import annotations

import os

from domain.short_prompt_replays import DEFAULT_TOKENS, Row, unroll

__all__ = ["DEFAULT_TOKENS", "MAX_TOKENS", "Row", "unroll"]


def _max_tokens(value: str) -> int:
    """FLUXTIDE_SHORT_PROMPT_REPLAYS: a whole number of tokens >= 0 (0: off); anything else is refused."""
    if not value.isdigit():
        raise ValueError(f"FLUXTIDE_SHORT_PROMPT_REPLAYS must be a token count >= 0 (0: off), got {value!r}")
    return int(value)


MAX_TOKENS = _max_tokens(os.environ.get("FLUXTIDE_SHORT_PROMPT_REPLAYS", str(DEFAULT_TOKENS)))
