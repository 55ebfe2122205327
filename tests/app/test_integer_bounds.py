"""Integer request fields at and past 64 bits, on every generation route of the real server (the demo
model, the real sampler): an answer or a 400 naming the field, never a 5xx, streamed or not."""

from __future__ import annotations

import httpx
import openai
import pytest

from app.demo_model import DEMO_MODEL_NAME

HUGE = [2**63 - 1, 2**63, 2**64, 10**30]
QUESTION = "What is 1 + 1?"
CHAT = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 1}
ROUTES = {
    "/v1/chat/completions": (CHAT, ["top_k", "seed", "max_tokens", "max_completion_tokens", "n", "top_logprobs",
                                    "thinking_token_budget", "min_tokens"]),
    "/v1/completions": ({"prompt": QUESTION, "max_tokens": 4, "temperature": 1},
                        ["top_k", "seed", "max_tokens", "logprobs", "n", "best_of", "min_tokens"]),
    "/v1/responses": ({"input": QUESTION, "max_output_tokens": 4, "temperature": 1},
                      ["top_k", "seed", "max_output_tokens", "thinking_token_budget", "top_logprobs", "max_tool_calls"]),
    "/v1/messages": ({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "temperature": 1},
                     ["top_k", "seed", "max_tokens"]),
}


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("top_k", [1030, 2**63, 10**30])
def test_a_top_k_past_the_vocabulary_samples_without_a_cut(client, stream, top_k):
    r = client.chat.completions.create(model=DEMO_MODEL_NAME, messages=CHAT["messages"], max_tokens=4, temperature=1,
                                       seed=5, stream=stream, extra_body={"top_k": top_k})
    chunks = list(r) if stream else [r]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    same = client.completions.create(model=DEMO_MODEL_NAME, prompt=QUESTION, max_tokens=4, temperature=1, seed=5,
                                     extra_body={"top_k": top_k})
    unfiltered = client.completions.create(model=DEMO_MODEL_NAME, prompt=QUESTION, max_tokens=4, temperature=1, seed=5,
                                           extra_body={"top_k": -1})
    assert same.choices[0].text == unfiltered.choices[0].text


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_no_integer_field_gives_a_5xx(demo_server, route):
    base, fields = ROUTES[route]
    with httpx.Client(base_url=demo_server.base_url, timeout=120) as http:
        for field in fields:
            for value in HUGE + [-v for v in HUGE]:
                for stream in (False, True):
                    body = {**base, field: value, "stream": stream}
                    r = http.post(route, json=body)
                    assert r.status_code < 500, (field, value, stream, r.text)
                    if stream and r.status_code == 200:  # no failure after the 200 either
                        lines = r.text.splitlines()
                        assert not any(line.startswith('data: {"error"') or line in ("event: error", "event: "
                                       "response.failed") for line in lines), (field, value, r.text)
