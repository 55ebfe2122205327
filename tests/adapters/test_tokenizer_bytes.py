"""HfTokenizer.token_bytes: every token's own bytes (issue 12: byte tokens came back as U+FFFD)."""

import threading
import time
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


def test_ids_past_the_tokenizer_are_padded_model_rows_without_text(tok):
    """Qwen3.6 has 248,320 output rows for fewer tokenizer ids; on the H200 a padded id in a logprobs stream
    raised here and cut the stream (2026-12-05). Such an id has no text and no bytes (domain.ports.Tokenizer)."""
    for padded in (tok.vocab_size, tok.vocab_size + 191):
        assert tok.token_bytes(padded) == b""
        assert tok.decode([padded]) == ""
    assert tok.decode([*tok.encode("ab"), tok.vocab_size]) == "ab"


def test_max_chars_per_token_bounds_every_encoding(tok):
    for text in ("a" * 5000, " " * 3000, "123 + 456 = 579\n" * 200, "ünïcödé " * 300):
        assert len(tok.encode(text)) >= len(text) / tok.max_chars_per_token


def test_encode_lets_other_threads_run_while_it_tokenizes_a_long_text(tok):
    """The server tokenizes prompts on a worker thread so /health and running streams keep their pace
    (app/api/prompts.py); that only helps if encode releases the GIL. `Tokenizer.encode` holds it for
    the whole call: a 300k-message chat request (10 MB) froze every client for 11 s."""
    text = "<|im_start|>user\nWhat is 19 + 23? ☃ é<|im_end|>\n" * 40_000
    gaps: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    started = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - started
    done.set()
    thread.join()
    assert ids == tok._tok.encode(text, add_special_tokens=False).ids  # the same tokens as before
    assert elapsed > 0.2, f"the text encoded in {elapsed:.3f}s, too fast to tell"
    assert max(gaps) < elapsed / 3, f"another thread waited {max(gaps):.2f}s of a {elapsed:.2f}s encode"
