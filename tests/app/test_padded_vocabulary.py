"""A model whose vocabulary is larger than its tokenizer's (Qwen3.5/3.6: 248,320 output rows, fewer tokenizer ids)
can sample or rank a padded row. On the H200 (2026-12-05) such a token in a logprobs stream raised in the
server's SSE generator and cut four streams of `ft bench mixed` mid-body; such a token has no text: "" and no bytes.

Real server on 127.0.0.1 (fake model with 512 rows, fake tokenizer with 259 ids), official openai client."""

from __future__ import annotations

import openai
import pytest

from domain.fakes import FakeTokenizer, sequence_hash
from tests.app.conftest import MODEL, make_container, start_server, wait_until_idle

ROWS = 512  # the model's vocabulary; FakeTokenizer has 259 ids
PROMPT = [1, 2, 3]
TOKENS = 48


@pytest.fixture(scope="module")
def server():
    srv = start_server(make_container(vocab_size=ROWS))
    yield srv
    srv.stop()


def _expected_ids() -> list[int]:
    seq, out = list(PROMPT), []
    for _ in range(TOKENS):
        seq.append(sequence_hash(seq) % ROWS)
        out.append(seq[-1])
    return out


def test_the_fake_model_samples_padded_rows():
    assert any(t >= FakeTokenizer.vocab_size for t in _expected_ids()), "the test needs a padded token"


def test_streamed_completion_logprobs_give_padded_tokens_no_text(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True})
    tokens, finish = [], None
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
        finish = choice.finish_reason or finish
    ids = _expected_ids()
    assert finish == "length" and len(tokens) == TOKENS
    padded = [i for i, t in enumerate(ids) if t >= FakeTokenizer.vocab_size]
    assert padded and all(tokens[i] == "" for i in padded)
    assert all(tokens[i] != "" for i, t in enumerate(ids) if 0 < t < 256)  # the others keep their text
    assert wait_until_idle(server)["running"] == 0


def test_chat_logprobs_give_padded_tokens_empty_bytes(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "pad"}], max_tokens=TOKENS,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    entries = [e for c in r.choices[0].logprobs.content for e in (c, *c.top_logprobs)]
    padded = [e for e in entries if e.token == "" and e.bytes == []]
    assert padded, "a fake model of 512 rows ranks padded rows among 48 tokens' top 3"
    pools = wait_until_idle(server)
    assert pools["running"] == 0 and pools["waiting"] == 0
