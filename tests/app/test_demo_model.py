"""The embedded demo model behind the real wiring (checkpoint loader, HF tokenizer, TorchExecutor
on the CPU): held-out arithmetic through the HTTP API, batching invariance, seeds, resize, and
`python -m app serve` with no --model."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from app.containers import Container
from app.serving import RunningServer
from app.settings import ServeSettings
from tests.app.processes import FtServe

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
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def ask(client, question: str, **kw) -> str:
    model = kw.pop("model", demo.DEMO_MODEL_NAME)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       max_tokens=kw.pop("max_tokens", 8), temperature=kw.pop("temperature", 0), **kw)
    return r.choices[0].message.content


def test_default_model_is_the_embedded_demo(client):
    assert [m.id for m in client.models.list()] == [demo.DEMO_MODEL_NAME]
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
    assert pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"] and pools["state_slots_used"] == 0


def test_sixteen_concurrent_greedy_streams_equal_sequential(demo_server):
    questions = [f"What is {i * 7 % 100} - {i * 13 % 100}?" for i in range(16)]

    async def stream(client, q):
        s = await client.chat.completions.create(model=demo.DEMO_MODEL_NAME, messages=[{"role": "user", "content": q}],
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
    assert pools["running"] == 0 and pools["kv_pages_used"] == pools["prefix_cache"]["cached_pages"] and pools["state_slots_used"] == 0


def test_seeded_sampling_is_reproducible(client):
    kw = {"temperature": 1.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    a = ask(client, "What is 3 + 4?", seed=1234, **kw)
    b = ask(client, "What is 3 + 4?", seed=1234, **kw)
    assert a == b
    others = {ask(client, "What is 3 + 4?", seed=s, **kw) for s in range(24)}  # peaked model: enough seeds
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


def test_python_m_app_serve_with_no_model_answers_within_seconds():
    started = time.monotonic()
    # NOTE: --port 0, its URL read from its output: a free port picked here could be taken before it binds
    server = FtServe(["--port", "0", "--device", "cpu"])
    try:
        server.wait_ready(120)
        ready_s = time.monotonic() - started
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        answer = ask(client, "What is 19 + 23?")
        print(f"`python -m app serve` ready in {ready_s:.1f}s")
        assert answer.strip() == "42"
        # Ctrl-C: a clean exit that says so in one line (it was silent: nothing in the log said it had stopped)
        assert server.stop(30, signal.SIGINT) == 0, server.output()
        assert re.search(r"^stopped: served 1 request in [\d.]+ s; shut down in [\d.]+ s$", server.output(),
                         re.MULTILINE), server.output()
        assert "Traceback" not in server.output(), server.output()
    finally:
        server.stop(30)


# ---------------------------------------------------------------------------------------------
# The checkpoint itself (no server): an ordinary Hugging Face directory that transformers and our
# own loader + TorchExecutor both answer the held-out questions from, greedily, in full.

HELDOUT_SPLIT_SEED = 20_260_101  # scripts/train_demo_model.py SPLIT_SEED
PROMPT = "<|im_start|>user\nWhat is {} {} {}?<|im_end|>\n<|im_start|>assistant\n"
MAX_ANSWER_TOKENS = 4  # "-99" is three digit/sign tokens, then <|im_end|>


def expected_answer(a: int, op: str, b: int) -> str:
    return str(a + b if op == "+" else a - b)


def all_heldout() -> list[tuple[int, str, int]]:
    return [tuple(q) for q in json.loads((DEMO_DIR / "heldout_eval.json").read_text())["heldout_questions"]]


def exact_fraction(questions, answers) -> float:
    return sum(got == expected_answer(*q) for q, got in zip(questions, answers, strict=True)) / len(questions)


@pytest.fixture
def one_torch_thread():
    # NOTE: on a small shared CPU, torch's intra-op threads fight each other (measured ~14x slower
    # for this model's tiny ops); one thread is also the fastest for 2M parameters anywhere.
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(before)


def test_checkpoint_is_an_ordinary_hf_directory():
    from safetensors import safe_open

    names = {p.name for p in DEMO_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= names
    assert sum(p.stat().st_size for p in DEMO_DIR.iterdir()) <= 20 * 1024 * 1024
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text"
    assert "linear_attention" in config["layer_types"] and "full_attention" in config["layer_types"]
    assert config["num_experts"] > config["num_experts_per_tok"] >= 2
    with safe_open(str(DEMO_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} <= {"F32", "BF16"}
    for e in range(config["num_experts"]):  # per-expert tensors, as in the released checkpoints
        assert f"model.layers.0.mlp.experts.{e}.gate_proj.weight" in keys
    tok_config = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    generation = json.loads((DEMO_DIR / "generation_config.json").read_text())
    tokenizer = json.loads((DEMO_DIR / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert specials["<|im_end|>"] in generation["eos_token_id"]


def test_heldout_set_is_the_fixed_split_never_trained_on():
    questions = [(a, op, b) for a in range(100) for op in "+-" for b in range(100)]
    random.Random(HELDOUT_SPLIT_SEED).shuffle(questions)
    assert all_heldout() == sorted(questions[:2000])
    report = json.loads((DEMO_DIR / "heldout_eval.json").read_text())
    assert report["heldout_exact"] >= 0.95


def test_chat_template_is_chatml_and_digits_are_single_tokens():
    import jinja2
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is 7 - 30?"}]
    template = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())["chat_template"]
    rendered = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)
    assert rendered == PROMPT.format(7, "-", 30)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR)
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    ids = tokenizer(rendered + "-23<|im_end|>").input_ids
    assert tokenizer.convert_ids_to_tokens(ids)[-4:] == ["-", "2", "3", "<|im_end|>"]
    assert tokenizer.decode(ids) == rendered + "-23<|im_end|>"
    assert tokenizer.decode(tokenizer("Ünïcode 123 ok").input_ids) == "Ünïcode 123 ok"  # byte-level: no <unk>


def test_transformers_answers_the_heldout_questions(one_torch_thread):
    torch = one_torch_thread
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR).eval()
    # NOTE: every 4th held-out question: transformers' reference linear attention pads each prompt
    # to a 64-token chunk, 3x slower than our executor, which the next test runs on all of them.
    questions = all_heldout()[::4]
    by_length: dict[int, list[int]] = {}  # equal-length prompts batch without padding
    encoded = [tokenizer(PROMPT.format(*q)).input_ids for q in questions]
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    answers = [""] * len(questions)
    for length, rows in by_length.items():
        ids = torch.tensor([encoded[i] for i in rows])  # [B, L]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_ANSWER_TOKENS)  # [B, L + new]
        for i, row in zip(rows, out[:, length:], strict=True):
            answers[i] = tokenizer.decode(row, skip_special_tokens=True)
    accuracy = exact_fraction(questions, answers)
    print(f"transformers greedy held-out exact match: {accuracy:.4f} of {len(questions)}")
    assert accuracy >= 0.95


def executor_answers(executor, tokenizer, questions, batch: int, page_size: int, prompt: str = PROMPT) -> list[str]:
    """Greedy answers through TorchExecutor: each batch prefills whole prompts in one step, then decodes."""
    from domain.ports import SequenceWork, StepBatch
    from domain.request import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_ANSWER_TOKENS, temperature=0.0)
    eos = tokenizer.token_to_id("<|im_end|>")
    answers = []
    for first in range(0, len(questions), batch):
        chunk = questions[first:first + batch]
        prompts = [tokenizer.encode(prompt.format(*q)).ids for q in chunk]
        pages_each = -(-max(len(p) + MAX_ANSWER_TOKENS for p in prompts) // page_size)
        outputs: list[list[int]] = [[] for _ in chunk]
        live = list(range(len(chunk)))
        while live:
            works = []
            for j in live:
                tokens = prompts[j] + outputs[j]
                start = 0 if not outputs[j] else len(tokens) - 1
                pages = tuple(range(j * pages_each, (j + 1) * pages_each))
                works.append(SequenceWork(f"q{j}", tuple(tokens[start:]), start, pages, j, True, greedy,
                                          len(outputs[j])))
            sampled = executor.execute(StepBatch(tuple(works)))
            for j in live:
                outputs[j].append(sampled[f"q{j}"].token_id)
            live = [j for j in live if outputs[j][-1] != eos and len(outputs[j]) < MAX_ANSWER_TOKENS]
            executor.check_valid()
        answers += [tokenizer.decode([t for t in out if t != eos]) for out in outputs]
    return answers


def test_our_loader_and_torch_executor_answer_the_heldout_questions(one_torch_thread):
    torch = one_torch_thread
    pytest.importorskip("adapters.torch_exec.executor", reason="TorchExecutor not written yet")
    from tokenizers import Tokenizer

    from adapters.checkpoint.loader import load_checkpoint
    from adapters.torch_exec.executor import TorchExecutor
    from domain.budget import GpuBudget, PoolRequest, plan_pools

    checkpoint = load_checkpoint(DEMO_DIR, progress=False)
    assert checkpoint.spec.architecture == "qwen3_5_moe"
    batch = 128
    plan = plan_pools(checkpoint.spec, GpuBudget(total_bytes=1 << 34),
                      PoolRequest(kv_tokens=batch * 64, expert_slots=12, state_slots=batch, page_size=16))
    executor = TorchExecutor(checkpoint, plan, "cpu", torch.float32)
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    questions = all_heldout()
    accuracy = exact_fraction(questions, executor_answers(executor, tokenizer, questions, batch, plan.page_size))
    print(f"TorchExecutor greedy held-out exact match: {accuracy:.4f} of {len(questions)}")
    assert accuracy >= 0.95
    assert executor.expert_misses > 32  # 12 slots for 32 experts: answers survived experts being swapped
    # A system message the model never saw in training, before every 10th held-out question.
    unseen_system = "<|im_start|>system\nBe brief.<|im_end|>\n" + PROMPT
    sample = questions[::10]
    accuracy = exact_fraction(sample, executor_answers(executor, tokenizer, sample, batch, plan.page_size,
                                                       unseen_system))
    print(f"... after an unseen system message: {accuracy:.4f} of {len(sample)}")
    assert accuracy >= 0.95


def test_mmap_experts_serves_from_the_mapped_checkpoint():
    """`ft serve --mmap-experts`: no expert bank in host RAM (rows built from the mapped files on each
    miss), same answers, and the expert cache still works through it."""
    settings = ServeSettings(port=0, device="cpu", mmap_experts=True, moe_slots=8)
    server = RunningServer(Container(), settings).start(wait_ready=120)
    try:
        executor = server.runtime.engine.executor
        assert executor.bank.rows is None, "mmap mode must not materialise the bank"
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert ask(client, "What is 19 + 23?").strip() == "42"
        assert ask(client, "What is 7 - 30?").strip() == "-23"
        assert executor.expert_misses > 0
    finally:
        server.stop()
