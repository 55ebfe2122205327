"""Chat templates render exactly like transformers' apply_chat_template (tools, tool calls, tool
results, reasoning, chat_template_kwargs), and a checkpoint without a template still loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adapters.checkpoint.chat_template import ChatTemplate
from adapters.checkpoint.tokenizer import load_tokenizer
from domain.ports import ChatTemplateError

FIXTURES = Path(__file__).parents[1] / "fixtures"
DEMO_DIR = Path(__file__).parents[2] / "app" / "demo_model" / "checkpoint"
QWEN3_XML = (FIXTURES / "qwen3_xml_template.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two integers <exactly> & return the product",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
ROUND_TRIP = [
    {"role": "system", "content": "Be brief. Ünïcode ok."},
    {"role": "user", "content": [{"type": "text", "text": "What is 6 × 7?"}]},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Use the tool.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]


def _hf_tokenizer(tmp_path: Path, template: str | None):
    from transformers import AutoTokenizer

    folder = tmp_path / "ckpt"
    shutil.copytree(DEMO_DIR, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if template is None:
        config.pop("chat_template")
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize(
    ("messages", "tools", "kwargs"),
    [
        (ROUND_TRIP, TOOLS, {}),
        (ROUND_TRIP, TOOLS, {"enable_thinking": False}),
        (ROUND_TRIP[:2], None, {"enable_thinking": False}),
        (ROUND_TRIP[1:2], TOOLS, {}),
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(tmp_path, messages, tools, kwargs, add_generation_prompt):
    folder, hf = _hf_tokenizer(tmp_path, QWEN3_XML)
    expected = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    ours = load_tokenizer(folder).apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert ours == expected
    if tools:
        assert '"description": "Multiply two integers <exactly> & return the product"' in ours  # no HTML escaping
    if add_generation_prompt:
        assert ours.endswith("<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else "<think>\n")


def test_generation_block_and_loop_controls_render_like_transformers(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}{{ bos_token or '' }}{{ eos_token }}"
    )
    folder, hf = _hf_tokenizer(tmp_path, template)
    messages = [{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}, {"role": "user", "content": "b"}]
    ours = load_tokenizer(folder).apply_chat_template(messages)
    assert ours == hf.apply_chat_template(messages, tokenize=False) == "[a][b]<|im_end|>"


def test_template_refusal_is_a_chat_template_error():
    bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatTemplateError, match="system message must be the first") as info:
        ChatTemplate(QWEN3_XML).render(bad)
    assert not info.value.missing


def test_a_checkpoint_without_a_template_loads_and_refuses_chat_by_name(tmp_path):
    folder, _ = _hf_tokenizer(tmp_path, None)
    tok = load_tokenizer(folder)
    assert tok.decode(tok.encode("1 + 2")) == "1 + 2"  # completions still work
    with pytest.raises(ChatTemplateError, match="no chat template") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.missing


def test_a_template_that_does_not_compile_is_refused_at_load():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
