"""A fake model that follows a script, for driving the tool-call and reasoning paths end to end:
the real server, engine and scheduler, a byte-level tokenizer with a real (Qwen3-XML-style)
chat template, and an executor whose next token is the next byte of ``script(prompt_text)``,
then EOS. A *reactive* script is ``script(prompt_text, generated_text)`` and returns the whole output
it wants given what was generated so far (which forced tokens may have changed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from dependency_injector import providers

from adapters.checkpoint.chat_template import ChatTemplate
from domain.fakes import FakeTokenizer
from domain.ports import SampledToken
from tests.app.conftest import SlowExecutor, make_container, start_server

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen3_xml_template.jinja").read_text()
EOS = 258  # <|im_end|>


class TemplateTokenizer(FakeTokenizer):
    """FakeTokenizer's bytes with a real chat template (tools, tool calls, thinking)."""

    def __init__(self) -> None:
        self._template = ChatTemplate(TEMPLATE, {"eos_token": "<|im_end|>"})

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=True, **kwargs) -> str:
        return self._template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)


class ScriptedExecutor(SlowExecutor):
    def __init__(self, plan, script: Callable[..., str], reactive: bool = False) -> None:
        super().__init__(plan)
        self.script = script
        self.reactive = reactive
        self.prompts: dict[str, str] = {}
        self.sampling: dict[str, object] = {}  # request id -> the SamplingParams its works carried
        self._prompt_len: dict[str, int] = {}

    def execute(self, batch):
        sampled = self.inner.execute(batch)  # the fake still checks the executor contract
        for work in batch.works:
            # NOTE: the whole sequence from the KV pages, not just this request's works: with the prefix
            # cache a request's first work may start past a cached prefix it never computed itself.
            seq = self.inner._read(work)
            if not work.sample:
                continue
            n = self._prompt_len.setdefault(work.request_id, len(seq))
            prompt = bytes(t for t in seq[:n] if t < 256).decode()
            self.prompts[work.request_id] = prompt
            self.sampling[work.request_id] = work.sampling
            if self.reactive:  # NOTE: what the model "sees" is its KV: forced tokens included
                out = self.script(prompt, bytes(t for t in seq[n:] if t < 256).decode(errors="replace")).encode()
            else:
                out = self.script(prompt).encode()
            done = len(seq) - n
            sampled[work.request_id] = SampledToken(work.request_id, out[done] if done < len(out) else EOS)
        return sampled


def start_scripted_server(script: Callable[..., str], reactive: bool = False, **overrides):
    container = make_container()
    container.tokenizer.override(providers.Singleton(TemplateTokenizer))
    container.executor.override(providers.Singleton(ScriptedExecutor, container.pool_plan, script, reactive))
    server = start_server(container, **overrides)
    return server, container.executor()


def scripted_fixture(script: Callable[..., str], reactive: bool = False, **overrides):
    """A module-scoped pytest fixture giving (server, executor) of start_scripted_server(script, reactive,
    **overrides), stopped after the module: `scripted = scripted_fixture(script)` in a test module."""

    @pytest.fixture(scope="module")
    def scripted():
        server, executor = start_scripted_server(script, reactive, **overrides)
        yield server, executor
        server.stop()

    return scripted

