"""Prompt text -> token ids without stalling the server: a cheap size check first (a prompt that
cannot fit the context is refused before any templating or tokenizing), then the templating and
tokenizing (``app.api.agent.prepare``) on a worker thread, so /health and every running stream
keep their pace while a 10 MB prompt is read.
"""

from __future__ import annotations

import asyncio

from app.api.agent import Conversation, Prompt, prepare, refuse_if_it_cannot_fit
from app.engine import Engine
from app.runtime import Runtime
from domain.ports import Tokenizer


def _text_chars(value) -> int:
    """Characters of text in a message's content (a string, or parts with text)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(part.get("text")) if isinstance(part, dict) else 0 for part in value)
    return 0


async def prepare_off_loop(runtime: Runtime, engine: Engine, conversation: Conversation, param: str = "messages",
                           **kwargs) -> Prompt:
    """``prepare`` (render, encode) on a worker thread, after the size check over the messages."""
    chars = sum(_text_chars(m.get("content")) for m in conversation.messages)
    refuse_if_it_cannot_fit(runtime, engine.tokenizer, chars, param)
    return await asyncio.to_thread(prepare, runtime, engine, conversation, param, **kwargs)


async def text_prompt_ids(runtime: Runtime, tokenizer: Tokenizer, text: str, param: str = "prompt") -> list[int]:
    """A text prompt's ids: size-checked, then tokenized off the event loop."""
    refuse_if_it_cannot_fit(runtime, tokenizer, len(text), param)
    return await asyncio.to_thread(tokenizer.encode, text)
