"""OpenAI-compatible API through a real uvicorn server and the official `openai` client
(model: domain.fakes FakeExecutor + FakeTokenizer, so outputs are deterministic)."""

from __future__ import annotations

import httpx
import openai
import pytest

from domain.fakes import FakeTokenizer
from tests.app.conftest import MODEL, chat_prompt_ids, fake_model_output, stats

TOKENIZER = FakeTokenizer()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def prompt_len(content: str) -> int:
    return len(chat_prompt_ids(content))


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_non_stream_counts_usage_and_honours_max_tokens(client):
    r = chat(client, "count with me", max_tokens=7, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_len("count with me")
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    expected, _ = fake_model_output(chat_prompt_ids("count with me"), 7)
    assert r.choices[0].message.content == TOKENIZER.decode(expected)


def test_eos_ends_generation_without_text(client):
    # Find a prompt whose fake continuation hits EOS quickly, then check stop + usage.
    for i in range(200):
        expected, reason = fake_model_output(chat_prompt_ids(f"eos {i}"), 64, ignore_eos=False)
        if reason == "stop":
            break
    r = chat(client, f"eos {i}", max_tokens=64)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(expected)
    assert r.choices[0].message.content == TOKENIZER.decode(expected[:-1])


def test_max_completion_tokens_is_an_alias(client):
    r = chat(client, "alias", max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_chat_stream_matches_non_stream(client):
    whole = chat(client, "stream me", max_tokens=24, extra_body={"ignore_eos": True})
    chunks = list(
        chat(client, "stream me", max_tokens=24, stream=True, stream_options={"include_usage": True},
             extra_body={"ignore_eos": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == prompt_len("stream me")
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done_marker(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "raw"}], "max_tokens": 3, "stream": True}
    text = httpx.post(server.base_url + "/v1/chat/completions", json=body).text
    events = [line for line in text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_stop_string_truncates_output(client):
    full = chat(client, "stop test", max_tokens=40, extra_body={"ignore_eos": True}).choices[0].message.content
    # Pick a stop string from the middle of the known output (the fake model is deterministic).
    start = next(i for i in range(8, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    cut = full[: full.index(stop)]
    r = chat(client, "stop test", max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == cut
    streamed = chat(client, "stop test", max_tokens=40, stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def test_seed_reproducibility(client):
    a = chat(client, "seeded", max_tokens=16, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    b = chat(client, "seeded", max_tokens=16, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_logprobs_shape(client):
    r = chat(client, "logprobs", max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
    assert chat(client, "logprobs", max_tokens=2).choices[0].logprobs is None


def test_completions_text_and_token_prompts(client):
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, extra_body={"ignore_eos": True})
    ids = client.completions.create(model=MODEL, prompt=[97, 98, 99], max_tokens=6, extra_body={"ignore_eos": True})
    assert text.object == "text_completion"
    assert text.choices[0].text == ids.choices[0].text
    assert text.usage.prompt_tokens == 3 and text.usage.completion_tokens == 6


def test_completions_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL, prompt="defaults", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_completions_stream_and_logprobs(client):
    whole = client.completions.create(model=MODEL, prompt="xyz", max_tokens=8, logprobs=2,
                                      extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 8
    # NOTE: a dict keyed by token text: two byte tokens that both render as U+FFFD collapse.
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert [max(t.values()) for t in lp.top_logprobs] == lp.token_logprobs
    chunks = list(client.completions.create(model=MODEL, prompt="xyz", max_tokens=8, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stats_and_metrics_report_the_work(server, client):
    chat(client, "metrics", max_tokens=4, extra_body={"ignore_eos": True})
    s = stats(server)
    assert s["window"]["decode_tokens"] > 0 and s["window"]["ttft_s"]["count"] > 0
    assert s["pools"]["kv_pages_total"] == s["plan"]["kv_pages"]
    # the CPU serves on the reference executor (wrapped by this module's test executor): neither numerics mode
    # of the fast path is on
    assert s["executor"] == {"kind": "SlowExecutor", "prefill_kernels": False, "prefill_fp8_activations": False,
                           "prefill_graphs": False}
    text = httpx.get(server.base_url + "/metrics").text
    generated = [line for line in text.splitlines() if line.startswith("ft_generation_tokens_total ")]
    assert generated and float(generated[0].split()[1]) > 0
    assert "ft_time_to_first_token_seconds_bucket" in text


def test_health_is_ok(server):
    r = httpx.get(server.base_url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["engine"] == "ready"


def test_cache_status(server):
    body = httpx.get(server.base_url + "/v1/cache/status").json()
    assert body["plan"]["kv_tokens"] == 2048 and body["pools"]["kv_pages_total"] == 128
