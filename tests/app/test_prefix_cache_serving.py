"""The prefix cache through HTTP on the fake model: usage reports cached prompt tokens (OpenAI chat and
completions, Anthropic messages), /v1/stats and /metrics report hit rate, cached tokens and snapshot use,
`--cache-type none` turns it off, a KV resize clears it and says so, and a soak of concurrent conversations
sharing a system prompt, with client aborts and a resize, ends with every page and snapshot slot free or
the cache's and every manager's check_valid passing."""

from __future__ import annotations

import asyncio
import random

import anthropic
import httpx
import pytest

from tests.app.conftest import MODEL, make_container, start_server, stats, wait_until_idle

SYSTEM = "You are a careful assistant. " * 6  # ~170 tokens of the fake byte tokenizer: many pages


def chat(server, messages, max_tokens=8) -> dict:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def srv():
    server = start_server(kv_tokens=4096)
    yield server
    server.stop()


def test_second_turn_reports_cached_prompt_tokens_and_stats_count_the_hit(srv):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    first = chat(srv, messages)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "second question"}]
    second = chat(srv, messages)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the first turn's prompt (and more) came from the cache; never the whole prompt (its last token is recomputed)
    assert first["usage"]["prompt_tokens"] <= cached + 16 and cached < second["usage"]["prompt_tokens"]
    assert cached % 16 == 0  # resumed on a page boundary
    body = stats(srv)
    cache = body["prefix_cache"]
    assert cache["enabled"] and cache["hits"] >= 1 and cache["cached_tokens"] >= cached
    assert 0 < cache["hit_rate"] <= 1 and 0 < cache["token_hit_rate"] < 1
    assert cache["snapshot_slots_total"] == 16 and 0 < cache["snapshot_slots_used"] <= 16  # 4 x 4 running
    assert body["pools"]["prefix_cache"]["cached_pages"] == body["pools"]["kv_pages_used"]  # idle: all cached
    metrics = httpx.get(srv.base_url + "/metrics").text
    for name in ("ft_prefix_cache_cached_tokens_total", "ft_prefix_cache_hits_total", "ft_snapshot_slots_used",
                 "ft_prefix_cache_pages"):
        assert name in metrics, name
    assert body["plan"]["snapshot_slots"] == 16 and body["plan"]["snapshot_bytes"] > 0


def test_completions_and_messages_report_cache_reads(srv):
    prompt = SYSTEM + "complete this"
    r1 = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    r2 = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt + " again",
                                                             "max_tokens": 4})
    assert r1.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160
    # NOTE: warmed here, whatever ran before: a prompt is snapshotted at its last page boundary (past where the
    # next user message differs) and where a later prompt leaves it, so two conversations parting after the
    # system prompt put a snapshot inside it, and a third resumes from there
    body = {"model": MODEL, "max_tokens": 4, "system": SYSTEM, "messages": [{"role": "user", "content": ""}]}
    for content in ("hi there", "hi again"):
        body["messages"][0]["content"] = content
        assert httpx.post(srv.base_url + "/v1/messages", json=body, timeout=30).status_code == 200
    body["messages"][0]["content"] = "hi once more"
    usage = httpx.post(srv.base_url + "/v1/messages", json=body, timeout=30).json()["usage"]
    assert usage["cache_read_input_tokens"] >= 160
    prompt_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]  # Anthropic: reads counted apart
    assert usage["input_tokens"] > 0 and prompt_tokens > usage["cache_read_input_tokens"]


def test_a_streamed_message_counts_cache_reads_once(srv):
    """The official client's final usage of a stream adds up as the whole answer's does: message_start's
    input_tokens (the whole prompt: cache reads are not known yet) is corrected on message_delta. It once
    stayed the whole prompt, so input_tokens + cache_read_input_tokens counted the reads twice."""
    body = {"model": MODEL, "max_tokens": 4, "system": SYSTEM, "messages": [{"role": "user", "content": "stream me"}]}
    counted = httpx.post(srv.base_url + "/v1/messages/count_tokens", json=body, timeout=30).json()["input_tokens"]
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="x", max_retries=0)
    for turn in range(2):  # the second resumes from the first's pages
        with client.messages.stream(**body) as stream:
            final = stream.get_final_message().usage
        assert final.input_tokens + final.cache_read_input_tokens == counted, (turn, final)
    assert final.cache_read_input_tokens >= 160


def test_same_output_with_and_without_the_cache():
    plain = start_server(cache_type="none")
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
        a = chat(plain, messages, max_tokens=6)
        b = chat(plain, messages + [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                                    {"role": "user", "content": "r"}], max_tokens=6)
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        body = stats(plain)
        assert not body["prefix_cache"]["enabled"] and body["plan"]["snapshot_slots"] == 0
        assert body["pools"]["kv_pages_used"] == 0
    finally:
        plain.stop()
    cached = start_server()
    try:
        a2 = chat(cached, messages, max_tokens=6)
        b2 = chat(cached, messages + [{"role": "assistant", "content": a2["choices"][0]["message"]["content"]},
                                      {"role": "user", "content": "r"}], max_tokens=6)
        assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        cached.stop()
    assert (a2["choices"][0]["message"], b2["choices"][0]["message"]) == (a["choices"][0]["message"],
                                                                        b["choices"][0]["message"])


def test_a_resize_keeping_kv_keeps_the_cache_and_one_changing_kv_clears_it():
    server = start_server(kv_tokens=2048)
    try:
        chat(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}])
        cached = stats(server)["pools"]["prefix_cache"]["cached_pages"]
        assert cached > 0
        r = httpx.post(server.base_url + "/v1/cache/rebuild", json={"mamba_slots": 3}, timeout=30)
        assert r.status_code == 200 and "prefix cache kept" in r.json()["message"], r.text
        assert stats(server)["pools"]["prefix_cache"]["cached_pages"] == cached
        r = httpx.post(server.base_url + "/v1/cache/rebuild", json={"kv_tokens": 1024}, timeout=30)
        assert r.status_code == 200, r.text
        assert f"prefix cache cleared ({cached} cached pages dropped" in r.json()["message"]
        pools = stats(server)["pools"]
        assert pools["prefix_cache"]["cached_pages"] == 0 == pools["kv_pages_used"]
        assert pools["prefix_cache"]["snapshot_slots_used"] == 0
    finally:
        server.stop()


def test_soak_conversations_sharing_a_system_prompt_with_aborts_and_a_resize_leave_only_cache_pages():
    server = start_server(make_container(delay=0.001), kv_tokens=1536, max_running_requests=4, snapshot_slots=6)

    async def conversation(client, i: int, turns: int) -> int:
        # NOTE: one seeded rng per conversation: with one shared by all, which of them draw the aborts and
        # lengths would depend on how they interleave (the run would not be the same twice)
        rng = random.Random(i)
        messages = [{"role": "system", "content": SYSTEM}]
        hits = 0
        for t in range(turns):
            messages.append({"role": "user", "content": f"conversation {i} turn {t}"})
            body = {"model": MODEL, "messages": messages, "max_tokens": rng.randrange(4, 24), "temperature": 0}
            if rng.random() < 0.2:  # a client that goes away mid-stream
                async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        break
                return hits
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
            hits += answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        return hits

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            first = asyncio.gather(*(conversation(client, i, 3) for i in range(8)))
            await asyncio.sleep(0.2)
            resize = asyncio.to_thread(httpx.post, server.base_url + "/v1/cache/rebuild",
                                       json={"kv_tokens": 2048, "wait_s": 60}, timeout=90)
            hits, response = await asyncio.gather(first, resize)
            more = await asyncio.gather(*(conversation(client, 100 + i, 3) for i in range(8)))
            return hits + more, response

    try:
        hits, response = asyncio.run(main())
        assert response.status_code == 200, response.text
        # later turns and shared system prompts hit the cache (these seeds: 20 later turns complete, 11 of
        # them after the resize cleared the cache)
        assert sum(hits) >= 8, hits
        pools = wait_until_idle(server)
        engine = server.container.engine()
        cache = pools["prefix_cache"]
        assert pools["kv_pages_used"] == cache["cached_pages"] and pools["state_slots_used"] == 0
        assert cache["snapshot_slots_used"] <= cache["snapshot_slots_total"] == 6
    finally:
        server.stop()
    # the engine thread has stopped: every manager's invariants, cache and snapshot pool included
    engine.check_valid()
    prefix = engine.scheduler.prefix
    assert prefix.snapshots.num_used == len(prefix.cache.snapshot_handles())
    assert engine._allocator.num_used == prefix.num_cached_pages


def test_cache_options_are_checked_and_a_default_snapshot_pool_that_does_not_fit_is_dropped():
    from app.cli import main
    from app.containers import _pool_plan
    from app.settings import ServeSettings
    from domain.budget import GpuBudget
    from tests.app.conftest import TINY_SPEC

    with pytest.raises(SystemExit) as info:
        main(["serve", "--cache-type", "lru"])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="--cache-type"):
        ServeSettings(cache_type="lru")
    with pytest.raises(ValueError, match="--snapshot-slots"):
        ServeSettings(snapshot_slots=-1)
    settings = ServeSettings(kv_tokens=1024, moe_slots=8, max_running_requests=4)
    roomy = _pool_plan(settings, TINY_SPEC, GpuBudget(total_bytes=1 << 30, memory_ratio=1.0))
    assert roomy.snapshot_slots == 16  # 4 per running request
    assert _pool_plan(ServeSettings(kv_tokens=1024, moe_slots=8, cache_type="none"), TINY_SPEC,
                      GpuBudget(total_bytes=1 << 30, memory_ratio=1.0)).snapshot_slots == 0
    tight = GpuBudget(total_bytes=roomy.used_bytes - roomy.snapshot_bytes + 1, memory_ratio=1.0)
    assert _pool_plan(settings, TINY_SPEC, tight).snapshot_slots == 0  # started without them (and logged)
    with pytest.raises(ValueError, match="snapshot"):  # asked for explicitly: refused, naming the pool
        _pool_plan(ServeSettings(kv_tokens=1024, moe_slots=8, snapshot_slots=16), TINY_SPEC, tight)
