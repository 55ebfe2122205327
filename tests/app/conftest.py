"""Fake-backed servers for the end-to-end API tests: the real container, engine, scheduler and
uvicorn, with the model swapped for domain.fakes (FakeExecutor + FakeTokenizer) via overrides."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import httpx
import pytest
from dependency_injector import providers

import app.containers as containers
from app.containers import Container
from app.serving import RunningServer
from app.settings import ServeSettings
from domain.fakes import FakeExecutor, FakeTokenizer
from domain.model_spec import LayerKind, ModelSpec
from domain.ports import SampledToken

TINY_SPEC = ModelSpec(
    name="tiny-fake",
    architecture="qwen3_5_moe",
    hidden_size=64,
    layer_kinds=(LayerKind.LINEAR_ATTENTION, LayerKind.FULL_ATTENTION),
    num_experts=8,
    top_k=2,
    expert_intermediate=32,
    shared_expert_intermediate=32,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel=4,
    vocab_size=FakeTokenizer.vocab_size,
    max_context=4096,
)
MODEL = "tiny-fake"
GENERATION_CONFIG = {"temperature": 0.0, "top_p": 1.0, "eos_token_id": 256}


class SlowExecutor:
    """FakeExecutor that takes `delay` seconds per step, so requests overlap like on a real model.
    ``fail_resize_to`` makes resize_pools raise once for a target with that many KV pages, after
    freeing the old KV pool (like TorchExecutor: frees first); ``broken_rollback`` then makes the
    rollback keep the freed pool "because the plan still names it" (the bug of issue 12 #1).
    ``fail_sampling_seed``: sampling a request with that seed fails for that request alone."""

    def __init__(self, plan, delay: float = 0.0, vocab_size: int = TINY_SPEC.vocab_size) -> None:
        # NOTE: the spec's layers, which the scheduler divides into layer groups (--layered-prefill, on by default)
        self.inner = FakeExecutor(plan.page_size, plan.kv_pages, plan.state_slots, vocab_size=vocab_size,
                                  num_layers=TINY_SPEC.num_layers,
                                  num_snapshot_slots=plan.snapshot_slots)
        self.delay = delay
        self.fail_resize_to: int | None = None
        self.resize_gate: threading.Event | None = None  # set: resize_pools blocks until it is released
        self.resizing = threading.Event()
        self.resizes: list = []
        self.lock = threading.Lock()
        self.plan = plan
        self.kv_freed = False
        self.broken_rollback = False
        self.fail_sampling_seed: int | None = None
        self.fail_next_step: Exception | None = None  # raised by the next execute (once)
        # While set, each step waits for one permit: a test runs the engine step by step to force
        # an interleaving (see step_until) instead of racing it.
        self.step_gate: threading.Semaphore | None = None
        self.permits_given = self.permits_taken = 0  # step_until's permits: given, and taken by a step
        self.step_breaks_pools = False  # the failing step also leaves the KV pool gone
        self.sampling_seen: dict[str, object] = {}  # request id -> the SamplingParams it ran with

    def execute(self, batch):
        gate = self.step_gate
        if gate is not None and gate.acquire(timeout=10):
            self.permits_taken += 1
        if self.delay:
            time.sleep(self.delay)
        assert not self.kv_freed, "'NoneType' object has no attribute 'page_size'"
        if self.fail_next_step is not None:
            exc, self.fail_next_step = self.fail_next_step, None
            self.kv_freed = self.step_breaks_pools
            raise exc
        out = self.inner.execute(batch)
        for work in batch.works:
            self.sampling_seen[work.request_id] = work.sampling
            if work.sample and work.sampling.seed is not None and work.sampling.seed == self.fail_sampling_seed:
                out[work.request_id] = SampledToken(work.request_id, -1, error="sampling failed: injected NaN")
        return out

    def check_valid(self) -> None:
        self.inner.check_valid()
        assert not self.kv_freed, "the KV pool is missing"
        assert (self.inner.num_pages, self.inner.num_state_slots) == (self.plan.kv_pages, self.plan.state_slots)

    def resize_pools(self, plan) -> None:
        self.resizing.set()
        if self.resize_gate is not None:
            self.resize_gate.wait(10)
        if self.kv_freed and self.broken_rollback and plan == self.plan:
            return  # "unchanged": keeps the pool it already freed
        if self.fail_resize_to is not None and plan.kv_pages == self.fail_resize_to:
            self.fail_resize_to = None
            self.kv_freed = True
            raise MemoryError("injected allocation failure")
        self.resizes.append(plan)
        self.inner.resize_pools(plan)
        self.plan, self.kv_freed = plan, False


def step_until(server: RunningServer, condition, limit: int = 50, timeout: float = 60.0) -> dict:
    """With the executor's step_gate set, let the engine run one step at a time until
    condition(pools snapshot) holds; returns that snapshot. At most `limit` steps.
    A permit is given only once the last one was taken: while the engine idles (a request not yet
    arrived) or runs slowly, permits do not pile up and let it run steps the test never saw."""
    executor = server.container.executor()
    first = executor.permits_given
    deadline = time.monotonic() + timeout
    while True:
        pools = stats(server)["pools"]
        if condition(pools):
            return pools
        if executor.permits_taken >= executor.permits_given:
            assert executor.permits_given - first < limit, f"condition not reached in {limit} steps: {pools}"
            executor.permits_given += 1
            executor.step_gate.release()
        assert time.monotonic() < deadline, f"condition not reached in {timeout}s: {pools}"
        time.sleep(0.005)


def open_gate(server: RunningServer) -> None:
    """Back to free running: no more waiting for permits (and wake a step that waits for one)."""
    executor = server.container.executor()
    gate, executor.step_gate = executor.step_gate, None
    if gate is not None:
        gate.release()


def make_container(blocker: threading.Event | None = None, delay: float = 0.0,
                   vocab_size: int = TINY_SPEC.vocab_size) -> Container:
    """vocab_size: the model's output rows (more than the fake tokenizer's ids: a padded vocabulary)."""
    container = Container()

    def spec():
        if blocker is not None:
            blocker.wait(30)
        return TINY_SPEC if vocab_size == TINY_SPEC.vocab_size else dataclasses.replace(TINY_SPEC, vocab_size=vocab_size)

    container.model_spec.override(providers.Singleton(spec))
    container.generation_config.override(providers.Object(dict(GENERATION_CONFIG)))
    container.tokenizer.override(providers.Singleton(FakeTokenizer))
    container.device.override(providers.Object("cpu"))
    container.executor.override(providers.Singleton(SlowExecutor, container.pool_plan, delay, vocab_size))
    return container


def start_server(container: Container | None = None, *, wait: bool = True, **overrides) -> RunningServer:
    fields = {
        "served_model_name": MODEL,
        "port": 0,
        "gpu_budget_gib": 0.05,
        "kv_tokens": 2048,
        "moe_slots": 8,
        "max_running_requests": 4,
        "max_prefill_length": 256,
        "debug": True,
    }
    fields.update(overrides)
    server = RunningServer(container or make_container(), ServeSettings(**fields))
    server.start(wait_ready=30 if wait else None)
    return server


def read_response_head(sock) -> bytes:
    """What a raw socket receives up to the end of the HTTP response's headers (or until the peer closes).
    The socket's own timeout bounds each read, so a server that never answers fails the test there."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
    return answer


def stats(server: RunningServer, headers: dict | None = None) -> dict:
    return httpx.get(server.base_url + "/v1/stats", headers=headers or {}).json()


def wait_until_idle(server: RunningServer, timeout: float = 30.0) -> dict:
    """The pools snapshot after every request has left (aborts are processed asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        pools = stats(server)["pools"]
        if pools["running"] == 0 and pools["waiting"] == 0 or time.monotonic() > deadline:
            return pools
        time.sleep(0.02)


async def until_running_or_done(server: RunningServer, mates: list) -> None:
    """Until the engine runs a request, or every mate (a future) has ended (on a loaded machine a short stream
    can end between two polls: the wait must not outlive it). One client for all polls, off the event loop's path."""
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        while not all(m.done() for m in mates):
            if (await http.get("/v1/stats")).json()["pools"]["running"] > 0:
                return
            await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.stop()


def fake_model_output(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> tuple[list[int], str]:
    """What FakeExecutor generates (next = hash of the sequence so far), and the finish reason."""
    from domain.fakes import sequence_hash

    seq, out = list(prompt_ids), []
    while len(out) < max_tokens:
        token = sequence_hash(seq) % TINY_SPEC.vocab_size
        seq.append(token)
        out.append(token)
        if not ignore_eos and token in (*FakeTokenizer.eos_token_ids, GENERATION_CONFIG["eos_token_id"]):
            return out, "stop"
    return out, "length"


def chat_prompt_ids(content: str) -> list[int]:
    tok = FakeTokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]))


@pytest.fixture(scope="module")
def demo_server():
    """A real server on 127.0.0.1 serving the embedded demo model on the CPU (one per test module)."""
    settings = ServeSettings(port=0, device="cpu", debug=True, max_running_requests=4)
    server = RunningServer(Container(), settings).start(wait_ready=120)
    yield server
    server.stop()


@pytest.fixture
def fast_path(monkeypatch):
    """The CUDA fast path taken (app.containers._use_fast_path forced) with CudaGraphExecutor replaced by a recorder
    of the keywords it is built with (nothing touches a GPU); returns the list of those keyword dicts."""
    import adapters.cuda_exec.executor as cuda_executor

    built: list[dict] = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            self.prefill_kernels = kwargs["prefill_kernels"]

    monkeypatch.setattr(containers, "_use_fast_path", lambda *a: True)
    monkeypatch.setattr(cuda_executor, "CudaGraphExecutor", Recorder)
    return built
