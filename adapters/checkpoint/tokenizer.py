"""domain.ports.Tokenizer over a checkpoint's tokenizer.json + tokenizer_config.json.

Encoding uses the `tokenizers` runtime; the chat template (Jinja, as published in
tokenizer_config.json or chat_template.jinja) renders in a sandboxed environment like
transformers does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path

from adapters.checkpoint.chat_template import ChatTemplate
from adapters.checkpoint.safetensors_files import read_json_object
from domain.ports import ChatTemplateError


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HfTokenizer:
    """Implements domain.ports.Tokenizer."""

    def __init__(self, tokenizer_json: Path, config: dict, generation_config: dict | None = None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # NOTE: tokenizers raises a bare Exception ("expected value at line 1 column 1")
            raise ValueError(f"{tokenizer_json}: not a tokenizer the `tokenizers` library can read ({e})") from None
        self.config = config
        self._where = tokenizer_json.parent
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if (t := _token_text(config.get(k))) is not None}
        # NOTE: a checkpoint without a template still serves /v1/completions; chat requests get a clear error.
        self._template = ChatTemplate(template, special) if template else None
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))
        eos: set[int] = set()
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        configured = (generation_config or {}).get("eos_token_id")
        eos.update([configured] if isinstance(configured, int) else configured or [])
        if not eos:
            raise ValueError(f"{tokenizer_json.parent}: no eos token in tokenizer_config.json or generation_config.json")
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """Bound for the cheap size check (domain.ports.Tokenizer): the longest vocabulary string,
        times 4. A byte-level token's string has one character per byte it covers; the margin
        covers normalisers that fold several input characters into one (NFC, compatibility forms)."""
        return 4 * max(len(token) for token in self._tok.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        # NOTE: encode_batch, not encode: `Tokenizer.encode` holds the GIL for the whole call (11 s for a
        # 10 MB chat request), so the server's tokenizing worker thread froze /health and every stream;
        # encode_batch releases it while the Rust side works. Same ids.
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: byte-level BPE strings map back through GPT-2's byte alphabet,
        SentencePiece byte fallbacks (<0xE2>) are that byte, added tokens are their text; b"" for an id
        past the tokenizer's vocabulary (the model's padded rows, which decode also skips)."""
        token = self._tok.id_to_token(token_id)
        if token is None:  # NOTE: a padded row of the model's vocabulary: no text (domain.ports.Tokenizer)
            return b""
        if token_id in self._added_ids:
            return token.encode()
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in token)
        if (match := _BYTE_FALLBACK.fullmatch(token)) is not None:
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode()

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_level(self) -> bool:
        return type(self._tok.decoder).__name__ == "ByteLevel"

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs) -> str:
        if self._template is None:
            raise ChatTemplateError(f"{self._where}: this model has no chat template (tokenizer_config.json "
                                    "chat_template or chat_template.jinja); use /v1/completions", missing=True)
        return self._template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **template_kwargs)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value


def check_fits_model(tok: HfTokenizer, model_dir: str | Path, vocab_size: int) -> None:
    """Every id the tokenizer can produce must index the model's embedding: a tokenizer.json from another
    model of the family loaded fine and failed every prompt that used one of its extra tokens."""
    ids = tok._tok.get_vocab(with_added_tokens=True).values()
    needed = max(ids, default=-1) + 1
    if needed > vocab_size:
        raise ValueError(f"{Path(model_dir) / 'tokenizer.json'}: token ids up to {needed - 1} need {needed} embedding "
                         f"rows, but config.json says vocab_size {vocab_size}: is the tokenizer from another model?")


def load_tokenizer(model_dir: str | Path) -> HfTokenizer:
    model_dir = Path(model_dir)
    tokenizer_json = model_dir / "tokenizer.json"
    if not tokenizer_json.exists():
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json (ft synth writes one; published checkpoints ship one)")
    config_file = model_dir / "tokenizer_config.json"
    config = read_json_object(config_file) if config_file.exists() else {}
    jinja = model_dir / "chat_template.jinja"
    if not config.get("chat_template") and jinja.exists():
        config["chat_template"] = jinja.read_text()
    gen_file = model_dir / "generation_config.json"
    generation = read_json_object(gen_file) if gen_file.exists() else {}
    return HfTokenizer(tokenizer_json, config, generation)
