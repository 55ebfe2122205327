"""What the three agent-facing dialects (Chat Completions, Anthropic Messages, Responses) share:
rendering a conversation with tools through the checkpoint's chat template, ``tool_choice``,
and splitting the generated text into reasoning, content and tool calls as it streams.

Each route translates its own request shape into a ``Conversation`` (OpenAI-style messages and
function tools, which is what chat templates expect) and its own response shape out of the
``Piece``s an ``OutputParser`` yields.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from app.api.errors import OpenAIError, bad_value, unsupported
from app.engine import Engine
from app.reasoning import FORCED_CLOSE, REASONING_PARSERS, ThinkingPlan, ThinkParser, prompt_opens_reasoning
from app.runtime import Runtime
from app.streams import StreamEvent
from app.tool_parsers import TOOL_PARSERS, ToolCall, ToolCallDelta, ToolParser
from app.tool_parsers.base import loads_json
from domain.ports import ChatTemplateError, Tokenizer


@dataclass(frozen=True)
class Reasoning:
    text: str


Piece = str | Reasoning | ToolCallDelta  # str: answer text


@dataclass
class Conversation:
    """A request in the template's terms. tool_choice: "auto" | "none" | "required" | a function name
    (already validated by ``check_tool_choice``). thinking_budget: reasoning tokens allowed before the
    close is forced (None: unbounded), as the client's parameter ``budget_param`` gave it."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)  # OpenAI function tools {"type": "function", "function": {...}}
    tool_choice: str = "auto"
    forced_function: str | None = None
    parallel_tool_calls: bool = True
    template_kwargs: dict = field(default_factory=dict)
    thinking_budget: int | None = None
    budget_param: str = "thinking_token_budget"
    add_generation_prompt: bool = True  # False: the prompt ends after the last message (no assistant header)
    continue_final_message: bool = False  # the prompt ends inside the last message, which the model continues


@dataclass
class Prompt:
    text: str
    ids: list[int]
    parser: OutputParser
    thinking: ThinkingPlan | None = None  # for the engine: count reasoning tokens (and bound them)


def function_tool(name, description, parameters, param: str) -> dict:
    """One OpenAI function tool, checked: a name and an object schema."""
    if not isinstance(name, str) or not name:
        raise bad_value(param, "every tool needs a non-empty name")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_value(param, f"tool {name!r}: the parameters must be a JSON schema object")
    # NOTE: the tool-call parser looks argument types up in `properties` (qwen3_xml): a non-object here
    # is a broken schema, refused now rather than failing the answer after generation.
    if parameters is not None and not isinstance(parameters.get("properties", {}), dict):
        raise bad_value(param, f"tool {name!r}: parameters.properties must be an object mapping names to schemas")
    function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def check_tool_choice(conversation: Conversation, param: str = "tool_choice") -> None:
    names = [t["function"]["name"] for t in conversation.tools]
    if len(set(names)) != len(names):
        raise bad_value("tools", "tool names must be unique")
    if conversation.tool_choice not in ("auto", "none", "required", "function"):
        raise bad_value(param, f"unknown tool_choice {conversation.tool_choice!r}")
    if conversation.tool_choice in ("required", "function") and not conversation.tools:
        raise bad_value(param, f"tool_choice {conversation.tool_choice!r} needs tools")
    if conversation.tool_choice == "function" and conversation.forced_function not in names:
        raise bad_value(param, f"tool_choice names {conversation.forced_function!r}, which is not among the tools")


# Names the server itself hands the chat template (or its render call): a chat_template_kwargs entry with
# one of them would arrive twice (a Python signature error) or silently replace a request field.
_TEMPLATE_OWN = {
    "messages": "the conversation is the request's messages (or input)",
    "tools": "tools are the request's tools field",
    "documents": "documents are not supported",
    "self": "it is not a template variable",
}
GENERATION_SWITCHES = ("add_generation_prompt", "continue_final_message")


def template_kwargs_of(kwargs: dict | None, param: str = "chat_template_kwargs") -> tuple[dict, dict]:
    """A client's chat_template_kwargs, checked: (the variables for the template, the generation switches it
    set). ``add_generation_prompt`` / ``continue_final_message`` given there win over the top-level fields
    (vLLM's rule); the names the server sets itself (``_TEMPLATE_OWN``) are a 400 naming the key."""
    kwargs = dict(kwargs or {})
    for key, why in _TEMPLATE_OWN.items():
        if key in kwargs:
            raise bad_value(param, f"{param} may not set {key!r}: {why}")
    switches = {}
    for key in GENERATION_SWITCHES:
        if key in kwargs:
            value = kwargs.pop(key)
            if not isinstance(value, bool):
                raise bad_value(param, f"{param}.{key} must be a boolean, got {value!r}")
            switches[key] = value
    return kwargs, switches


def check_generation_prompt(conversation: Conversation) -> None:
    """vLLM's rules for the two switches; a forced call needs somewhere to be written."""
    if conversation.continue_final_message and conversation.add_generation_prompt:
        raise bad_value("continue_final_message", "continue_final_message and add_generation_prompt can not both be "
                        "true: send add_generation_prompt: false to continue the last message")
    if conversation.continue_final_message and not (conversation.messages[-1].get("content") or "").strip():
        raise bad_value("continue_final_message", "continue_final_message needs a last message with text to continue")
    if conversation.tool_choice in ("required", "function") and conversation.tools and not (
            conversation.add_generation_prompt or conversation.continue_final_message):
        raise bad_value("tool_choice", f"tool_choice {conversation.tool_choice!r} writes the call's opening after the "
                        "generation prompt: it needs add_generation_prompt (or continue_final_message)")


# OpenAI's reasoning_effort values. "none" turns thinking off in the template (enable_thinking=False);
# the others leave it on: OpenAI ties no token count to a level, so none sets a budget (a hard cap is
# thinking_token_budget). The value also reaches the template as ``reasoning_effort``, for templates
# that read it (gpt-oss style); chat_template_kwargs the client sent win over both.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def apply_reasoning_effort(template_kwargs: dict, effort, param: str) -> None:
    if effort is None:
        return
    if effort not in REASONING_EFFORTS:
        raise bad_value(param, f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    template_kwargs.setdefault("enable_thinking", effort != "none")
    template_kwargs.setdefault("reasoning_effort", effort)


def thinking_budget(value, param: str = "thinking_token_budget") -> int | None:
    """A client's reasoning-token budget: None or an int >= 0 (400 naming ``param`` otherwise)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise bad_value(param, f"{param} must be an integer >= 0, got {value!r}")
    return value


def arguments_object(arguments, param: str) -> dict:
    """Tool-call arguments for a template: templates iterate them, so a JSON string becomes a dict."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        # NOTE: held to what the parsers accept from the model: a string nested ~1,000 deep was a RecursionError (500)
        try:
            value = loads_json(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise bad_value(param, f"tool call arguments must be a JSON object ({exc})") from None
        if isinstance(value, dict):
            return value
    raise bad_value(param, "tool call arguments must be a JSON object")


def refuse_if_it_cannot_fit(runtime: Runtime, tokenizer: Tokenizer, chars: int, param: str) -> None:
    """400 context_length_exceeded when `chars` characters of prompt text must encode to more tokens
    than the context holds (the bound is the tokenizer's ``max_chars_per_token``; none, no check)."""
    per_token = getattr(tokenizer, "max_chars_per_token", None)
    if not per_token:
        return
    limit, which = runtime.context_limit()
    at_least = -(-chars // per_token)
    if at_least >= limit:
        raise OpenAIError(
            400,
            f"{which} However, your prompt has {chars} "
            f"characters, at least {at_least} tokens, with no room left for the completion. Please reduce "
            f"the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def prepare(runtime: Runtime, engine: Engine, conversation: Conversation, param: str = "messages",
            call_id_prefix: str = "call_") -> Prompt:
    """Render, force a tool call if asked, encode; errors are 400s naming the parameter."""
    use_tools = bool(conversation.tools) and conversation.tool_choice != "none"
    parser_name = runtime.model.tool_call_parser
    if use_tools and parser_name is None:
        raise unsupported("tools", "this server parses no tool calls (start it with --tool-call-parser)")
    tools = conversation.tools if use_tools else None
    for i, tool in enumerate(tools or []):
        function = tool["function"]
        properties = (function.get("parameters") or {}).get("properties") or {}
        problem = TOOL_PARSERS[parser_name].unusable_name(function["name"], [str(k) for k in properties])
        if problem is not None:
            raise bad_value(f"tools[{i}]", problem)
    check_generation_prompt(conversation)
    text = render(engine, conversation, tools, param)
    # NOTE: the messages' own text passed the size check, but the template adds its markup per message:
    # 300k empty messages render to 8.4 MB. Checked again before the second render and the tokenizer.
    refuse_if_it_cannot_fit(runtime, engine.tokenizer, len(text), param)
    if tools and text == render(engine, conversation, None, param):
        raise unsupported("tools", "this model's chat template does not render tools, so it can not call them")
    new_id = lambda: call_id_prefix + secrets.token_hex(12)  # noqa: E731
    # NOTE: a call must name an offered function, and under a named tool_choice that one (OpenAI's guarantee)
    allowed = [conversation.forced_function] if conversation.tool_choice == "function" else None
    tool_parser = TOOL_PARSERS[parser_name]([t["function"] for t in tools], new_id=new_id,
                                            allowed=allowed) if tools else None
    reasoning = runtime.model.reasoning_parser in REASONING_PARSERS
    budget = conversation.thinking_budget
    if budget is not None and not reasoning:
        raise unsupported(conversation.budget_param, "this server splits no reasoning from the answer (start it "
                          "with --reasoning-parser), so it can not count thinking tokens against a budget")
    primed: list[Piece] = []
    if tool_parser is not None and conversation.tool_choice in ("required", "function"):
        # NOTE: no grammar engine here: the call is forced by writing its opening into the prompt.
        if reasoning and prompt_opens_reasoning(text):
            text += FORCED_CLOSE
        prefix = tool_parser.forced_prefix(conversation.forced_function)
        text += prefix
        primed = list(tool_parser.feed(prefix))
    think = ThinkParser(prompt_opens_reasoning(text)) if reasoning else None
    parser = OutputParser(think, tool_parser, primed, single_call=not conversation.parallel_tool_calls)
    thinking = ThinkingPlan(prompt_opens_reasoning(text), budget, engine.tokenizer.encode) if reasoning else None
    return Prompt(text, engine.tokenizer.encode(text), parser, thinking)


def render(engine: Engine, conversation: Conversation, tools, param: str) -> str:
    add_generation_prompt = conversation.add_generation_prompt and not conversation.continue_final_message
    try:
        text = engine.tokenizer.apply_chat_template(conversation.messages, tools=tools,
                                                    add_generation_prompt=add_generation_prompt,
                                                    **conversation.template_kwargs)
    except ChatTemplateError as exc:
        code = "chat_template_missing" if exc.missing else "chat_template_error"
        raise OpenAIError(400, str(exc), param=param, code=code) from None
    except TypeError as exc:  # a chat_template_kwargs key that clashes with a render argument: name it, no internals
        clash = re.search(r"argument '([^']+)'", str(exc))
        key = f" {clash.group(1)!r}" if clash else ""
        raise bad_value("chat_template_kwargs", f"chat_template_kwargs may not set{key or ' these keys'}: "
                        "the server passes it to the chat template itself") from None
    return open_final_message(text, conversation.messages[-1]) if conversation.continue_final_message else text


def open_final_message(text: str, final: dict) -> str:
    """The rendered prompt cut right after the last message's text, so the model continues it (Hugging Face's
    continue_final_message: the last occurrence of that text; trailing spaces kept when the template kept them)."""
    content = final.get("content") or ""
    at = text.rfind(content.strip())
    if at == -1:
        raise bad_value("continue_final_message", "the last message's text does not appear in the rendered prompt "
                        "(the chat template changes it), so it can not be continued")
    kept = content.lstrip()
    return text[: at + (len(kept) if text[at: at + len(kept)] == kept else len(content.strip()))]


class OutputParser:
    """Generated text -> Pieces, in order, for one request (reasoning first, then the answer,
    which the tool parser splits into content and calls)."""

    def __init__(self, think: ThinkParser | None, tools: ToolParser | None, primed: list[Piece],
                 single_call: bool = False) -> None:
        self._think = think
        self._tools = tools
        self._pending: list[Piece] = list(primed)
        self._single_call = single_call

    def feed(self, text: str) -> list[Piece]:
        return self._step(*(self._think.feed(text) if self._think else ("", text)), final=False)

    def finish(self) -> list[Piece]:
        return self._step(*(self._think.finish() if self._think else ("", "")), final=True)

    @property
    def tool_calls(self) -> list[ToolCall]:
        calls = self._tools.calls if self._tools else []
        return calls[:1] if self._single_call else calls

    @property
    def parses_tools(self) -> bool:
        """Whether a "stop" may become "tool_calls" (the engine then leaves its count to the handler)."""
        return self._tools is not None

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason

    def settle(self, last: StreamEvent) -> str | None:
        """The finish reason of the request whose last event this is, after the parser has read all of its text;
        ft_requests_total counts the request under it (StreamEvent.settle)."""
        reason = self.finish_reason(last.finish_reason)
        last.settle(reason)
        return reason

    def _step(self, reasoning: str, content: str, final: bool) -> list[Piece]:
        out, self._pending = self._pending, []
        if reasoning:
            out.append(Reasoning(reasoning))
        if self._tools is None:
            if content:
                out.append(content)
            return out
        events = self._tools.feed(content) if content else []
        if final:
            events += self._tools.finish()
        out += [e for e in events if not (self._single_call and isinstance(e, ToolCallDelta) and e.index > 0)]
        return out


def split(pieces: list[Piece]) -> tuple[str, str, list[ToolCallDelta]]:
    """(reasoning text, content text, tool-call deltas) of a list of pieces."""
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    content = "".join(p for p in pieces if isinstance(p, str))
    return reasoning, content, [p for p in pieces if isinstance(p, ToolCallDelta)]
