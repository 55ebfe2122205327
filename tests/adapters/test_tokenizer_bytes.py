"""HfTokenizer.token_bytes: every token's own bytes (issue 12: byte tokens came back as U+FFFD)."""

from pathlib import Path

import pytest

from adapters.checkpoint.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[2] / "app" / "demo_model" / "checkpoint"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO)


def test_token_bytes_agree_with_decode_and_byte_tokens_are_single_bytes(tok):
    lone = 0
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            lone += 1
            assert tok.decode([i]) in ("\ufffd", ""), i  # what decode alone can show of it
            continue
        assert text == tok._tok.decode([i], skip_special_tokens=False), i
    assert lone > 0, "a byte-level vocabulary has tokens that are parts of characters"
    assert b"".join(tok.token_bytes(t) for t in tok.encode("héllo ✓")) == "héllo ✓".encode()


def test_max_chars_per_token_bounds_every_encoding(tok):
    for text in ("a" * 5000, " " * 3000, "123 + 456 = 579\n" * 200, "ünïcödé " * 300):
        assert len(tok.encode(text)) >= len(text) / tok.max_chars_per_token
