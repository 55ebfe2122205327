"""How a token appears in a logprobs object: its own bytes, and a string that tells tokens apart.

A byte-fallback token (one byte of a multi-byte character) decodes alone to U+FFFD, so three
different tokens used to come back as the same "\ufffd" with the same bytes [239, 191, 189].
Its string is now OpenAI's ``bytes:\\xe2`` form and ``bytes`` are the token's real bytes.
"""

from __future__ import annotations

from domain.ports import Tokenizer


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The token's own bytes (tokenizer.token_bytes where it has one, else its decoded text)."""
    raw = getattr(tokenizer, "token_bytes", None)
    return raw(token_id) if raw is not None else tokenizer.decode([token_id]).encode()


def token_string(tokenizer: Tokenizer, token_id: int) -> str:
    """The token's text, or ``bytes:\\x..`` when its bytes are not whole UTF-8 characters."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
