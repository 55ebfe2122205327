"""With logprobs every generated token streams in its own chunk, sent when it is sampled, even a token with no
text (a special token the decode skips, a byte of an incomplete character): `ft bench probe --logprobs` times
each token by its chunk. It used to ride in the next chunk with text, so several tokens had one arrival time.
Without logprobs a token with no text sends nothing (no empty-content chunks)."""

from __future__ import annotations

import openai
import pytest

from app.streams import LiveStream, TokenLogprob
from tests.app.conftest import MODEL, chat_prompt_ids, fake_model_output

TOKENS = 24


def textless_prompt(prompt_ids, n: int = TOKENS) -> str:
    """A prompt whose first n fake-model tokens include a special token (its text is skipped) and a byte of
    a multi-byte character (no text until a later token completes it), each followed by a token with text."""
    for i in range(100_000):
        content = f"t{i}"
        ids, _ = fake_model_output(prompt_ids(content), n)
        special = [k for k, t in enumerate(ids[:-2]) if t >= 256 and ids[k + 1] < 128]
        partial = [k for k, t in enumerate(ids[:-2]) if 128 <= t < 256]
        if special and partial:
            return content
    raise AssertionError("no prompt found")


CHAT_PROMPT = textless_prompt(chat_prompt_ids)
TEXT_PROMPT = textless_prompt(lambda text: list(text.encode()))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)


def chat_args(content: str, model: str = MODEL, **kw) -> dict:
    return dict(model=model, messages=[{"role": "user", "content": content}], temperature=0.0,
                extra_body={"ignore_eos": True}, **kw)


def check_chat_stream_one_chunk_per_token(client, content: str, max_tokens: int, model: str = MODEL) -> list:
    """Stream with logprobs, and answer the same (greedy) request whole: one chunk with one logprobs entry per
    token, the entries and the text those of the whole answer. Returns the choices that carry an entry."""
    whole = client.chat.completions.create(**chat_args(content, model, max_tokens=max_tokens, logprobs=True))
    chunks = list(client.chat.completions.create(**chat_args(content, model, max_tokens=max_tokens, logprobs=True,
                                                             stream=True, stream_options={"include_usage": True})))
    tokens = chunks[-1].usage.completion_tokens
    assert tokens == whole.usage.completion_tokens == max_tokens
    carrying = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content]
    assert [len(c.logprobs.content) for c in carrying] == [1] * len(carrying), "a chunk carried several tokens"
    assert len(carrying) == tokens, "each token its own chunk"
    streamed = [(e.token, e.logprob) for c in carrying for e in c.logprobs.content]
    assert streamed == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content], "one entry a token, in order"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    return carrying


def test_chat_stream_with_logprobs_sends_every_token_in_its_own_chunk(client):
    carrying = check_chat_stream_one_chunk_per_token(client, CHAT_PROMPT, TOKENS)
    assert any(c.delta.content == "" for c in carrying), "a token without text has its own, empty, chunk"


def test_completions_stream_with_logprobs_sends_every_token_in_its_own_chunk(client):
    args = dict(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TOKENS, logprobs=0, temperature=0.0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == TOKENS
    carrying = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.tokens]
    assert [len(c.logprobs.tokens) for c in carrying] == [1] * TOKENS
    streamed = [(t, lp, offset) for c in carrying for t, lp, offset in
                zip(c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset, strict=True)]
    lp = whole.choices[0].logprobs
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset, strict=True))
    assert any(c.text == "" for c in carrying)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_without_logprobs_a_token_without_text_sends_no_chunk(client):
    whole = client.chat.completions.create(**chat_args(CHAT_PROMPT, max_tokens=TOKENS))
    role, *chunks = list(client.chat.completions.create(**chat_args(CHAT_PROMPT, max_tokens=TOKENS, stream=True)))
    assert role.choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.content != "" for c in chunks), "an empty-content chunk"
    assert all(c.choices[0].logprobs is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    args = dict(model=MODEL, prompt=TEXT_PROMPT, max_tokens=TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**args, stream=True))
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks), "an empty-text chunk"
    assert "".join(c.choices[0].text for c in chunks) == client.completions.create(**args).choices[0].text


def test_the_demo_models_special_tokens_each_get_their_own_chunk(demo_server):
    """The user's case (`ft bench probe --logprobs` on the CPU demo server): the greedy answer to this prompt
    holds <|im_end|>, whose text the decode skips; it rode in the next chunk with text."""
    client = openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    carrying = check_chat_stream_one_chunk_per_token(client, "Hello there", 32, model)
    assert any(c.delta.content == "" for c in carrying), "the answer should hold a token without text"


# -- the bookkeeping behind it: a token without text never overtakes text held back before it ------------
def entry(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -1.0)


def test_a_token_without_text_goes_out_at_once_unless_held_text_comes_before_it():
    live = LiveStream(request=None, loop=None, events=None, detok=None, matcher=None, arrival=0.0)  # type: ignore[arg-type]
    live.add_token_text(entry(1), "a")
    assert live.take_logprobs("a", everything=False) == (entry(1),)
    live.add_token_text(entry(2), "")  # nothing held before it: out at once, with no text
    assert live.take_logprobs("", everything=False) == (entry(2),)
    live.add_token_text(entry(3), "b")  # a stop string may hold "b" back ...
    assert live.take_logprobs("", everything=False) == ()
    live.add_token_text(entry(4), "")  # ... and the token after it waits behind it
    assert live.take_logprobs("", everything=False) == ()
    assert live.take_logprobs("b", everything=False) == (entry(3), entry(4))
    live.add_token_text(entry(5), "")
    live.add_token_text(entry(6), "c")
    assert live.take_logprobs("", everything=True) == (entry(5), entry(6)), "the end takes every one left"
