"""The embedded demo model behind the real wiring (checkpoint loader, HF tokenizer, TorchExecutor
on the CPU): held-out arithmetic through the HTTP API, batching invariance, seeds, resize, and
`python -m app serve` with no --model."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from app.containers import Container
from app.serving import RunningServer
from app.settings import ServeSettings

demo = pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")
DEMO_DIR = demo.DEMO_MODEL_DIR
# NOTE: a deterministic sample keeps CI fast on two cores; FT_DEMO_EVAL_ALL=1 asks every one.
SAMPLE = None if os.environ.get("FT_DEMO_EVAL_ALL") else 200


def heldout_questions() -> list[tuple[int, str, int]]:
    report = json.loads((DEMO_DIR / "heldout_eval.json").read_text())
    questions = [tuple(q) for q in report["heldout_questions"]]
    assert len(questions) >= 1000
    return questions if SAMPLE is None else random.Random(4).sample(questions, SAMPLE)


@pytest.fixture(scope="module")
def demo_server():
    settings = ServeSettings(port=0, device="cpu", debug=True, max_running_requests=4)
    server = RunningServer(Container(), settings).start(wait_ready=120)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def ask(client, question: str, **kw) -> str:
    model = kw.pop("model", DEMO_DIR.name)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       max_tokens=kw.pop("max_tokens", 8), temperature=kw.pop("temperature", 0), **kw)
    return r.choices[0].message.content


def test_default_model_is_the_embedded_demo(client):
    assert [m.id for m in client.models.list()] == [DEMO_DIR.name]
    assert ask(client, "What is 19 + 23?").strip() == "42"


def test_heldout_arithmetic_is_answered_exactly(client, demo_server):
    questions = heldout_questions()

    def one(q):
        a, op, b = q
        return ask(client, f"What is {a} {op} {b}?").strip() == str(a + b if op == "+" else a - b)

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        right = sum(pool.map(one, questions))
    accuracy = right / len(questions)
    print(f"held-out exact match through the server: {right}/{len(questions)} = {accuracy:.3f} "
          f"in {time.monotonic() - started:.1f}s")
    assert accuracy >= 0.95
    pools = httpx.get(demo_server.base_url + "/v1/stats").json()["pools"]
    assert pools["kv_pages_used"] == 0 and pools["state_slots_used"] == 0


def test_sixteen_concurrent_greedy_streams_equal_sequential(demo_server):
    questions = [f"What is {i * 7 % 100} - {i * 13 % 100}?" for i in range(16)]

    async def stream(client, q):
        s = await client.chat.completions.create(model=DEMO_DIR.name, messages=[{"role": "user", "content": q}],
                                                 max_tokens=12, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    async def both():
        client = openai.AsyncOpenAI(base_url=demo_server.base_url + "/v1", api_key="x", max_retries=0)
        together = await asyncio.gather(*(stream(client, q) for q in questions))
        alone = [await stream(client, q) for q in questions]
        await client.close()
        return together, alone

    together, alone = asyncio.run(both())
    assert together == alone
    pools = httpx.get(demo_server.base_url + "/v1/stats").json()["pools"]
    assert pools["running"] == 0 and pools["kv_pages_used"] == 0 and pools["state_slots_used"] == 0


def test_seeded_sampling_is_reproducible(client):
    kw = {"temperature": 1.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    a = ask(client, "What is 3 + 4?", seed=1234, **kw)
    b = ask(client, "What is 3 + 4?", seed=1234, **kw)
    assert a == b
    others = {ask(client, "What is 3 + 4?", seed=s, **kw) for s in range(6)}
    assert len(others) > 1, "different seeds all gave the same sample: the seed is ignored"


def test_resize_while_streaming_with_the_real_executor(demo_server, client):
    expected = ask(client, "What is 55 + 44?")
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(ask, client, f"What is {i} + {i + 1}?") for i in range(6)]
        time.sleep(0.05)
        r = httpx.post(demo_server.base_url + "/v1/cache/rebuild", json={"kv_tokens": "2k", "wait_s": 60},
                       timeout=90)
        answers = [s.result() for s in streams]
    assert r.status_code == 200, r.text
    assert [a.strip() for a in answers] == [str(2 * i + 1) for i in range(6)]
    assert ask(client, "What is 55 + 44?") == expected
    refused = httpx.post(demo_server.base_url + "/v1/cache/rebuild", json={"kv_tokens": "900m"}, timeout=30)
    assert refused.status_code == 409
    assert ask(client, "What is 55 + 44?") == expected


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_m_app_serve_with_no_model_answers_within_seconds():
    port = _free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--port", str(port), "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = started + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["status"] != "loading":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        ready_s = time.monotonic() - started
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        answer = ask(client, "What is 19 + 23?")
        print(f"`python -m app serve` ready in {ready_s:.1f}s")
        assert answer.strip() == "42"
    finally:
        proc.terminate()
        proc.wait(30)
