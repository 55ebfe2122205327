"""A checkpoint's Jinja chat template, rendered the way Hugging Face's ``apply_chat_template`` does.

Same environment as transformers (sandboxed, ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block tag, ``tojson`` without HTML escaping,
``raise_exception``, ``strftime_now``) and the same variables: ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the special tokens, and any extra keyword
(``chat_template_kwargs`` such as ``enable_thinking``). ``tests/adapters/test_chat_template.py``
checks the output equals transformers' own for the same template and inputs.
"""

from __future__ import annotations

import json
from datetime import datetime

from domain.ports import ChatTemplateError


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # NOTE: jinja's built-in tojson HTML-escapes <, > and &; templates embed tool schemas verbatim.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template. ``render`` raises ChatTemplateError for anything the template refuses
    (its own ``raise_exception``) or cannot render (undefined attribute access on a bad message)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Generation(jinja2.ext.Extension):
            """``{% generation %}...{% endgeneration %}`` (assistant-token masks): render the body."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None
        self._special = dict(special_tokens or {})
        self._errors = (jinja2.TemplateError, TypeError, AttributeError, KeyError)

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> str:
        """messages: OpenAI-style dicts (role, content, tool_calls, tool_call_id, reasoning_content);
        tools: OpenAI function tools ({"type": "function", "function": {...}}) or None."""
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self._special, **template_kwargs},
            )
        except ChatTemplateError:
            raise
        except self._errors as exc:
            raise ChatTemplateError(f"chat template failed to render these messages: {exc}") from None
