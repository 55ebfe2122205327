"""16 concurrent streams equal the same requests run one at a time, and every KV page and
state slot is free afterwards; the same when clients walk away mid-stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from domain.fakes import FakeTokenizer
from tests.app.conftest import (
    MODEL,
    chat_prompt_ids,
    fake_model_output,
    make_container,
    start_server,
    wait_until_idle,
)


@pytest.fixture(scope="module")
def slow_server():
    # 2 ms per step: requests overlap, queue behind max_running=4 and get preempted like on a GPU.
    # A 512-token KV pool is too small for 4 of these at once, so the scheduler must preempt.
    srv = start_server(make_container(delay=0.002), kv_tokens=512)
    yield srv
    srv.stop()


def aborted_count(server) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith('ft_requests_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def prompts(n: int) -> list[str]:
    return [f"request number {i} " + "pad " * (i * 7 % 40) for i in range(n)]


async def stream_one(client: openai.AsyncOpenAI, content: str, max_tokens: int) -> tuple[str, str]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )
    text, finish = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


def test_sixteen_concurrent_streams_equal_sequential_runs_and_free_everything(slow_server):
    work = prompts(16)
    max_tokens = 48

    async def both():
        client = openai.AsyncOpenAI(base_url=slow_server.base_url + "/v1", api_key="x", max_retries=0)
        together = await asyncio.gather(*(stream_one(client, p, max_tokens) for p in work))
        alone = [await stream_one(client, p, max_tokens) for p in work]
        await client.close()
        return together, alone

    together, alone = asyncio.run(both())
    assert together == alone
    tok = FakeTokenizer()
    for content, (text, finish) in zip(work, together, strict=True):
        expected, _ = fake_model_output(chat_prompt_ids(content), max_tokens)
        assert finish == "length" and text == tok.decode(expected)
    pools = httpx.get(slow_server.base_url + "/v1/stats").json()["pools"]
    assert pools["running"] == pools["waiting"] == 0
    assert pools["preemptions"] > 0, "the pool was meant to be tight enough to force preemption"
    assert pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"]  # every page free or cached
    assert pools["state_slots_used"] == 0 and pools["state_slots_free"] == pools["state_slots_total"]


def test_clients_that_disconnect_mid_stream_free_their_pages_and_slots(slow_server):
    url = slow_server.base_url + "/v1/chat/completions"

    async def leave_early(i: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"leaver {i}"}], "max_tokens": 400,
                "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as http, http.stream("POST", url, json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 5:
                    return seen  # leaving the block closes the connection mid-stream

    async def main():
        return await asyncio.gather(*(leave_early(i) for i in range(8)))

    aborted_before = aborted_count(slow_server)
    assert asyncio.run(main()) == [5] * 8
    pools = wait_until_idle(slow_server)
    assert pools["running"] == pools["waiting"] == 0, pools
    assert pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"] and pools["state_slots_used"] == 0, pools
    assert aborted_count(slow_server) - aborted_before == 8, "each walk-away must abort its request"
    # And the server still answers.
    client = openai.OpenAI(base_url=slow_server.base_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "after"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_non_streaming_client_disconnect_aborts(slow_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "impatient"}], "max_tokens": 400,
            "ignore_eos": True}
    aborted_before = aborted_count(slow_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.base_url + "/v1/chat/completions", json=body, timeout=0.3)
    started = time.monotonic()
    pools = wait_until_idle(slow_server)
    assert pools["running"] == 0 and pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"], pools
    assert time.monotonic() - started < 3, "the abandoned request ran on instead of being aborted"
    assert aborted_count(slow_server) - aborted_before == 1


def test_a_stop_string_frees_pages_and_slot_at_once(slow_server):
    content, max_tokens = "stop early", 400
    ids, _ = fake_model_output(chat_prompt_ids(content), max_tokens)
    text = FakeTokenizer().decode(ids[:30])
    start = next(i for i in range(5, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    client = openai.OpenAI(base_url=slow_server.base_url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                       max_tokens=max_tokens, stop=[text[start : start + 2]],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 30
    # No polling: the snapshot is republished before the finish reaches the client.
    pools = httpx.get(slow_server.base_url + "/v1/stats").json()["pools"]
    assert pools["running"] == 0 and pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"] and pools["state_slots_used"] == 0, pools
