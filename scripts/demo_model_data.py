"""The demo model's task, chat template and training conversations (pure Python; no torch, no fluxtide).

scripts/train_demo_model.py trains on what this module builds; tests/app/test_demo_model_data.py
checks it against the server's own chat-template renderer and qwen3_xml tool parser.

Task. The user asks "What is A + B?" / "What is A - B?" (answered with the number) or
"What is A × B?" / "A * B" / "A times B" (A, B in 0..99). A product is answered by a call to the
`multiply` tool when one is offered (Qwen3.5/3.6 XML tool-call format), then, after the tool result,
by the number the tool returned; with no `multiply` tool offered the model declines in one fixed
sentence (NO_TOOL_ANSWER) rather than guess: a 2-million-parameter model does not multiply reliably,
and a fixed refusal is checkable. With ``enable_thinking`` the answer opens with one short reasoning
sentence (THINK_*), in a ``<think>`` block the generation prompt opened.

Chat template (CHAT_TEMPLATE, rendered in Python by ``render``, which the tests hold equal to the
jinja source): Qwen3.6's layout for tools (a system turn "# Tools ... <tools>{tool|tojson}...</tools>"
plus Qwen's call instructions, then the system message), assistant ``tool_calls`` as
``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``,
``tool`` results as ``<tool_response>`` blocks in a user turn, ``reasoning_content`` as a
``<think>`` block. Two deliberate differences from Qwen3.6, both to keep every prompt the previous
demo model answered byte-identical (plain ChatML when no tools and no thinking): thinking is off
unless ``enable_thinking`` is true, and message text is rendered as given (Qwen trims it and drops
an empty system turn).

Long agent-style system prompts (``agent_system_prompt``) are generated procedurally from the word
lists below (no external data): identity lines, rule lists, environment blocks with paths, dates
and version numbers, code and JSON snippets, git status, and example exchanges (some of them
arithmetic, with their right answers) -- so the model learns to answer the *last* user turn.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]  # ids 0, 1, 2 as before; skipped when decoding
# Single tokens as in Qwen3.5/3.6's vocabulary, but not "special": decoding keeps them, so the server's
# reasoning and tool-call parsers see the markup.
MARKUP_TOKENS = [THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE]
# What the server appends when a thinking budget forces the close (app/reasoning.py FORCED_CLOSE).
FORCED_CLOSE = "\n" + THINK_CLOSE + "\n\n"

SPLIT_SEED = 20_260_101  # fixes the +/- held-out set independently of the training seed (unchanged)
PRODUCT_SPLIT_SEED = 20_260_102  # the same for the (A, B) pairs of products
HELDOUT_FRACTION = 0.10
VALIDATION_SIZE = 500
PRODUCT_VALIDATION_SIZE = 300
OPERATORS = ("+", "-")
# Small operands: "What is 1 + 2?" is the first thing a user types, but drawn uniformly from 0..99 x 0..99
# the questions with both operands below SMALL_LIMIT are 1 % of the +/- answers trained, and retrain
# attempt 2 (docs/demo-model.md) got 25 of their 200 wrong while missing none of the 600 in 0..19 with
# an operand of 10..19. So SMALL_SHARE of the +/- questions drawn for training come from the training
# questions with both operands small (an 8.6x higher rate for each of them), the rest from the other
# training questions; the held-out and validation questions stay out of both.
SMALL_LIMIT = 10
SMALL_SHARE = 0.08
PRODUCT_FORMS = ("×", "*", "times")
NO_TOOL_ANSWER = "I need a multiply tool for that."

# ---------------------------------------------------------------- task


def all_questions() -> list[tuple[int, str, int]]:
    return [(a, op, b) for a in range(100) for op in OPERATORS for b in range(100)]


def is_small(question: tuple[int, str, int]) -> bool:
    """Both operands below SMALL_LIMIT (0..9): the region oversampled in training."""
    return question[0] < SMALL_LIMIT and question[2] < SMALL_LIMIT


def small_questions() -> list[tuple[int, str, int]]:
    """The 200 +/- questions with both operands in 0..9, sorted: the `arith_small` suite, whatever the split."""
    return [q for q in all_questions() if is_small(q)]


def question_text(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def is_product(op: str) -> bool:
    return op in PRODUCT_FORMS


def answer_text(a: int, op: str, b: int) -> str:
    """The number for + and -; products have no direct answer (they go through the tool)."""
    if is_product(op):
        raise ValueError(f"{a} {op} {b}: products are answered through the multiply tool")
    return str(a + b if op == "+" else a - b)


def split_questions() -> tuple[list, list, list]:
    """(train, validation, held-out) of the +/- questions; the held-out set depends only on SPLIT_SEED
    (the same 2,000 as the first demo model's)."""
    questions = all_questions()
    shuffled = questions[:]
    random.Random(SPLIT_SEED).shuffle(shuffled)
    n_heldout = int(len(questions) * HELDOUT_FRACTION)
    heldout = sorted(shuffled[:n_heldout])
    validation = sorted(shuffled[n_heldout : n_heldout + VALIDATION_SIZE])
    train = sorted(shuffled[n_heldout + VALIDATION_SIZE :])
    return train, validation, heldout


def split_products() -> tuple[list, list, list]:
    """(train, validation, held-out) of the (A, B) pairs of products: a held-out pair is never
    trained on in any of the three wordings. Depends only on PRODUCT_SPLIT_SEED."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(PRODUCT_SPLIT_SEED).shuffle(pairs)
    n_heldout = int(len(pairs) * HELDOUT_FRACTION)
    heldout = sorted(pairs[:n_heldout])
    validation = sorted(pairs[n_heldout : n_heldout + PRODUCT_VALIDATION_SIZE])
    train = sorted(pairs[n_heldout + PRODUCT_VALIDATION_SIZE :])
    return train, validation, heldout


def product_questions(pairs: list[tuple[int, int]]) -> list[tuple[int, str, int]]:
    """Each pair in one wording, cycling through PRODUCT_FORMS (deterministic)."""
    return [(a, PRODUCT_FORMS[i % len(PRODUCT_FORMS)], b) for i, (a, b) in enumerate(pairs)]


def think_text(a: int, op: str, b: int, tools_offer_multiply: bool) -> str:
    if op == "+":
        return f"Add {a} and {b}."
    if op == "-":
        return f"Subtract {b} from {a}."
    return f"Call multiply with {a} and {b}." if tools_offer_multiply else "No multiply tool is offered."


def think_after_tool(result: str) -> str:
    return f"The tool returned {result}."


def call_message(a: int, b: int, call_id: str = "call_0", content=None, reasoning: str | None = None) -> dict:
    """The assistant turn that calls multiply(a, b), as clients send it back (arguments as an object,
    which is how the server hands them to the template)."""
    message = {"role": "assistant", "content": content, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}]}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def call_text(a: int, b: int) -> str:
    """The exact text the model must generate for multiply(a, b)."""
    return (f"{TOOL_CALL_OPEN}\n<function=multiply>\n<parameter=a>\n{a}\n</parameter>\n"
            f"<parameter=b>\n{b}\n</parameter>\n</function>\n{TOOL_CALL_CLOSE}")


# ---------------------------------------------------------------- chat template

TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
# Qwen3.5/3.6's own instructions after the tool list, verbatim.
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the "
    "specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> "
    "XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function "
    "call in natural language BEFORE the function call, but NOT after\n- If there is no function call "
    "available, answer the question like normal with your current knowledge and do not tell the user about "
    "function calls\n</IMPORTANT>"
)


def _jinja_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid jinja string literal


# NOTE: every tag opens with "-" so the output is the same with or without trim_blocks/lstrip_blocks
# (transformers and the server set them; a plain jinja2.Environment does not).
CHAT_TEMPLATE = "".join(line.strip() for line in f"""
{{%- macro render_content(content) %}}
  {{%- if content is string %}}{{{{- content }}}}
  {{%- elif content is none or content is undefined %}}
  {{%- else %}}{{%- for part in content %}}{{{{- part.text }}}}{{%- endfor %}}
  {{%- endif %}}
{{%- endmacro %}}
{{%- if tools %}}
  {{{{- '<|im_start|>system\\n' + {_jinja_string(TOOLS_PREAMBLE)} }}}}
  {{%- for tool in tools %}}{{{{- '\\n' + tool | tojson }}}}{{%- endfor %}}
  {{{{- {_jinja_string(TOOLS_INSTRUCTIONS)} }}}}
  {{%- if messages and messages[0].role == 'system' %}}
    {{%- set content = render_content(messages[0].content) | trim %}}
    {{%- if content %}}{{{{- '\\n\\n' + content }}}}{{%- endif %}}
  {{%- endif %}}
  {{{{- '<|im_end|>\\n' }}}}
{{%- elif messages and messages[0].role == 'system' %}}
  {{{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}}}
{{%- endif %}}
{{%- for message in messages %}}
  {{%- if loop.first and message.role == 'system' %}}
  {{%- elif message.role == 'assistant' %}}
    {{{{- '<|im_start|>assistant\\n' }}}}
    {{%- if message.reasoning_content is string and message.reasoning_content | trim %}}
      {{{{- '<think>\\n' + message.reasoning_content | trim + '\\n</think>\\n\\n' }}}}
    {{%- endif %}}
    {{%- set content = render_content(message.content) %}}
    {{{{- content }}}}
    {{%- for call in message.tool_calls or [] %}}
      {{%- set fn = call.function if call.function is defined else call %}}
      {{%- if not loop.first %}}{{{{- '\\n' }}}}{{%- elif content | trim %}}{{{{- '\\n\\n' }}}}{{%- endif %}}
      {{{{- '<tool_call>\\n<function=' + fn.name + '>\\n' }}}}
      {{%- if fn.arguments is mapping %}}
        {{%- for name, value in fn.arguments.items() %}}
          {{{{- '<parameter=' + name + '>\\n' }}}}
          {{%- if value is string %}}{{{{- value }}}}{{%- else %}}{{{{- value | tojson }}}}{{%- endif %}}
          {{{{- '\\n</parameter>\\n' }}}}
        {{%- endfor %}}
      {{%- elif fn.arguments %}}
        {{{{- raise_exception('tool call arguments must be an object') }}}}
      {{%- endif %}}
      {{{{- '</function>\\n</tool_call>' }}}}
    {{%- endfor %}}
    {{{{- '<|im_end|>\\n' }}}}
  {{%- elif message.role == 'tool' %}}
    {{%- if loop.first or loop.previtem.role != 'tool' %}}{{{{- '<|im_start|>user' }}}}{{%- endif %}}
    {{{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}}}
    {{%- if loop.last or loop.nextitem.role != 'tool' %}}{{{{- '<|im_end|>\\n' }}}}{{%- endif %}}
  {{%- else %}}
    {{{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}}}
  {{%- endif %}}
{{%- endfor %}}
{{%- if add_generation_prompt %}}
  {{{{- '<|im_start|>assistant\\n' }}}}
  {{%- if enable_thinking is defined and enable_thinking %}}{{{{- '<think>\\n' }}}}{{%- endif %}}
{{%- endif %}}
""".strip().splitlines())


def _content(content) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return "".join(part["text"] for part in content)


def _tojson(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # transformers' tojson: no key sorting, no HTML escaping


def system_head(messages: list[dict], tools: list[dict] | None) -> str:
    """The system turn: tools (if any) and the first message when it is a system message."""
    system = _content(messages[0]["content"]) if messages and messages[0]["role"] == "system" else None
    if tools:
        text = IM_START + "system\n" + TOOLS_PREAMBLE + "".join("\n" + _tojson(t) for t in tools) + TOOLS_INSTRUCTIONS
        if system is not None and system.strip():
            text += "\n\n" + system.strip()
        return text + IM_END + "\n"
    return "" if system is None else IM_START + "system\n" + system + IM_END + "\n"


def message_text(messages: list[dict], i: int) -> str:
    """Message i as the template renders it (tool results group with their neighbours)."""
    message = messages[i]
    role = message["role"]
    if i == 0 and role == "system":
        return ""
    if role == "assistant":
        text = IM_START + "assistant\n"
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning.strip():
            text += THINK_OPEN + "\n" + reasoning.strip() + "\n" + THINK_CLOSE + "\n\n"
        content = _content(message.get("content"))
        text += content
        for j, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function", call)
            text += "\n" if j else ("\n\n" if content.strip() else "")
            text += TOOL_CALL_OPEN + "\n<function=" + fn["name"] + ">\n"
            for name, value in (fn.get("arguments") or {}).items():
                text += f"<parameter={name}>\n" + (value if isinstance(value, str) else _tojson(value)) + "\n</parameter>\n"
            text += "</function>\n" + TOOL_CALL_CLOSE
        return text + IM_END + "\n"
    if role == "tool":
        text = IM_START + "user" if i == 0 or messages[i - 1]["role"] != "tool" else ""
        text += "\n" + TOOL_RESPONSE_OPEN + "\n" + _content(message["content"]) + "\n" + TOOL_RESPONSE_CLOSE
        return text + (IM_END + "\n" if i == len(messages) - 1 or messages[i + 1]["role"] != "tool" else "")
    return IM_START + role + "\n" + _content(message["content"]) + IM_END + "\n"


def generation_prompt(enable_thinking: bool = False) -> str:
    return IM_START + "assistant\n" + (THINK_OPEN + "\n" if enable_thinking else "")


def render(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
           enable_thinking: bool = False) -> str:
    """CHAT_TEMPLATE in Python (what transformers' apply_chat_template would return)."""
    text = system_head(messages, tools) + "".join(message_text(messages, i) for i in range(len(messages)))
    return text + (generation_prompt(enable_thinking) if add_generation_prompt else "")


def prompt_text(a: int, op: str, b: int, system: str | None = None) -> str:
    """A lone question (after an optional system message) plus the generation prompt: plain ChatML."""
    messages = ([] if system is None else [{"role": "system", "content": system}])
    return render(messages + [{"role": "user", "content": question_text(a, op, b)}], add_generation_prompt=True)


# ---------------------------------------------------------------- tools

INT = {"type": "integer"}


def multiply_tool(rng: random.Random) -> dict:
    """The multiply tool in one of the shapes clients send (descriptions, key order as the server's
    function_tool writes it or as clients do)."""
    a, b = dict(INT), dict(INT)
    if rng.random() < 0.4:
        a["description"], b["description"] = rng.choice(
            [("The first factor", "The second factor"), ("First integer", "Second integer"), ("a", "b")])
    parameters = {"type": "object", "properties": {"a": a, "b": b}, "required": ["a", "b"]}
    description = rng.choice(["Multiply two integers", "Multiply two integers and return the product.",
                              "Returns a * b.", "Multiplies a by b.", None])
    function = {"name": "multiply", "parameters": parameters}
    if description:
        function = ({"name": "multiply", "description": description, "parameters": parameters}
                    if rng.random() < 0.5 else dict(function, description=description))
    return {"type": "function", "function": function}


MULTIPLY_TOOL = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers",
    "parameters": {"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a", "b"]}}}

# Agent-style tools that are not multiply: (name, description, {parameter: type}).
DISTRACTOR_TOOLS = [
    ("read_file", "Read a file from the workspace.", {"path": "string", "offset": "integer", "limit": "integer"}),
    ("write_file", "Write content to a file, replacing it.", {"path": "string", "content": "string"}),
    ("edit_file", "Replace old_string with new_string in a file.",
     {"path": "string", "old_string": "string", "new_string": "string"}),
    ("run_command", "Run a shell command and return its output.", {"command": "string", "timeout": "integer"}),
    ("list_directory", "List the entries of a directory.", {"path": "string"}),
    ("grep", "Search file contents with a regular expression.", {"pattern": "string", "path": "string"}),
    ("glob", "Find files whose path matches a pattern.", {"pattern": "string"}),
    ("web_search", "Search the web and return the top results.", {"query": "string", "count": "integer"}),
    ("fetch_url", "Fetch a URL and return its text.", {"url": "string"}),
    ("get_weather", "Current weather for a city.", {"city": "string", "unit": "string"}),
    ("send_email", "Send an email.", {"to": "string", "subject": "string", "body": "string"}),
    ("create_ticket", "Open a ticket in the tracker.", {"title": "string", "priority": "integer"}),
    ("git_commit", "Commit the staged changes.", {"message": "string"}),
    ("sql_query", "Run a read-only SQL query.", {"query": "string", "limit": "integer"}),
    ("translate", "Translate text into another language.", {"text": "string", "target_language": "string"}),
    ("get_time", "The current time in a time zone.", {"timezone": "string"}),
    ("calendar_add", "Add an event to the calendar.", {"title": "string", "start": "string", "minutes": "integer"}),
    ("todo_write", "Replace the task list.", {"todos": "array"}),
    ("ask_user", "Ask the user a question and wait for the answer.", {"question": "string"}),
    ("noop", "Does nothing.", {}),
]


def distractor_tool(spec: tuple, rng: random.Random) -> dict:
    name, description, params = spec
    properties = {p: {"type": t} for p, t in params.items()}
    parameters = {"type": "object", "properties": properties, "required": list(params)[:1]}
    function = {"name": name, "parameters": parameters}
    if rng.random() < 0.8:
        function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


def tool_set(rng: random.Random, with_multiply: bool, distractors: int) -> list[dict]:
    tools = [distractor_tool(s, rng) for s in rng.sample(DISTRACTOR_TOOLS, distractors)]
    if with_multiply:
        tools.insert(rng.randint(0, len(tools)), multiply_tool(rng))
    return tools


def offers_multiply(tools: list[dict] | None) -> bool:
    return any((t.get("function") or t).get("name") == "multiply" for t in tools or [])


# ---------------------------------------------------------------- agent-style system prompts

NAMES = ["Atlas", "Forge", "Nova", "Pilot", "Quill", "Relay", "Sable", "Tern", "Vega", "Wren", "Orbit", "Cinder",
         "Harbor", "Lumen", "Mosaic", "Drift", "Kestrel", "Onyx", "Pulse", "Summit"]
ROLES = ["coding assistant", "software engineering agent", "command line assistant", "research assistant",
         "customer support agent", "data analysis assistant", "DevOps helper", "writing assistant",
         "code reviewer", "teaching assistant", "travel planner", "operations bot"]
MAKERS = ["built by a small team", "made for internal use", "running inside an editor", "running in a terminal",
          "deployed on a private server", "working for the platform team"]
USERS = ["developers", "the user", "our customers", "analysts", "students", "the on-call engineer", "the team"]
DOMAINS = ["software engineering tasks", "questions about their code", "debugging and testing", "writing reports",
           "planning trips", "database questions", "shell commands", "infrastructure changes", "data cleaning"]
HEADERS = ["Tone and style", "Rules", "Doing tasks", "Tool usage policy", "Safety", "Code conventions",
           "Following conventions", "Proactiveness", "Output format", "Security", "Task management",
           "Communication", "Environment", "Memory", "Project notes", "Git workflow", "Testing", "Examples"]
IMPERATIVES = ["Always", "Never", "Prefer to", "Avoid", "Do not", "Make sure to", "Remember to", "Try to",
               "Only", "You must", "You should", "It is important to"]
VERBS = ["edit", "delete", "create", "read", "run", "commit", "push", "install", "mention", "reveal", "guess",
         "invent", "summarize", "explain", "format", "quote", "cite", "print", "check", "verify", "refactor",
         "rename", "test", "document", "log", "answer", "ask about", "search for", "open", "close"]
OBJECTS = ["files outside the workspace", "secrets or API keys", "the user's code", "long outputs", "the tests",
           "new dependencies", "URLs", "unrelated topics", "emojis", "markdown tables", "your instructions",
           "the changelog", "temporary files", "the lock file", "comments", "error messages", "the build",
           "configuration files", "database migrations", "the README", "credentials", "large binaries",
           "the main branch", "pull requests", "log files", "environment variables", "user data"]
CONDITIONS = ["unless the user asks", "before checking the docs", "without confirmation", "when the user asks",
              "in the final answer", "if you are unsure", "more than {n} times", "for more than {n} seconds",
              "after every change", "when a test fails", "before you finish", "at the start of a task",
              "in fewer than {n} words", "when it is safe", "on a new branch", "with a short summary"]
ADJECTIVES = ["concise", "direct", "friendly", "precise", "careful", "honest", "brief", "polite", "calm", "clear",
              "thorough", "helpful", "neutral", "accurate"]
LANGS = ["python", "bash", "typescript", "go", "rust", "sql", "yaml"]
SYLLABLES = ["ka", "lo", "mi", "ren", "to", "sha", "vi", "zu", "pe", "dor", "ax", "qui", "bel", "nor", "tra",
             "el", "fin", "gro", "hal", "jun", "ost", "pri", "sel", "und"]
EXAMPLE_QA = [("which file defines the router?", "src/router.py"), ("list the files in src", "[calls list_directory]"),
              ("is the build green?", "Yes."), ("what does this function return?", "A list of ids."),
              ("can you fix the failing test?", "[calls read_file]"), ("what is the capital of France?", "Paris"),
              ("how do I undo the last commit?", "git reset --soft HEAD~1"), ("hello", "Hello! How can I help?"),
              ("what time is it in Tokyo?", "[calls get_time]"), ("is 11 a prime number?", "Yes")]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def _identifier(rng: random.Random) -> str:
    return "_".join(_word(rng) for _ in range(rng.randint(1, 3)))


def _path(rng: random.Random) -> str:
    parts = [rng.choice(["src", "lib", "app", "tests", "docs", "scripts", "pkg", "cmd"])]
    parts += [_word(rng) for _ in range(rng.randint(0, 2))]
    return "/".join(parts) + "/" + _identifier(rng) + rng.choice([".py", ".ts", ".go", ".rs", ".md", ".json", ".yaml"])


def _number(rng: random.Random) -> str:
    return str(rng.choice([rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 9999), rng.randint(1, 200000)]))


def _sentence_rule(rng: random.Random) -> str:
    condition = rng.choice(CONDITIONS).format(n=_number(rng))
    return f"{rng.choice(IMPERATIVES)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {condition}."


def _section(rng: random.Random) -> str:
    kind = rng.randrange(11)
    if kind == 0:
        return (f"You are {rng.choice(NAMES)}, a {rng.choice(ADJECTIVES)} {rng.choice(ROLES)} {rng.choice(MAKERS)}. "
                f"Your job is to help {rng.choice(USERS)} with {rng.choice(DOMAINS)}.")
    if kind in (1, 2):
        header = "#" * rng.randint(1, 2) + " " + rng.choice(HEADERS)
        bullet = rng.choice(["- ", "* ", "1. "])
        return header + "\n" + "\n".join(bullet + _sentence_rule(rng) for _ in range(rng.randint(2, 7)))
    if kind == 3:
        return (f"<env>\nWorking directory: /home/{_word(rng)}/{_identifier(rng)}\nIs directory a git repo: "
                f"{rng.choice(['Yes', 'No'])}\nPlatform: {rng.choice(['linux', 'darwin', 'win32'])}\nOS Version: "
                f"{rng.choice(['Linux', 'Darwin'])} {rng.randint(4, 24)}.{rng.randint(0, 20)}.{rng.randint(0, 99)}\n"
                f"Today's date: {rng.randint(2020, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\n</env>")
    if kind == 4:
        fn, arg = _identifier(rng), _word(rng)
        return (f"Example of the house style:\n```{rng.choice(LANGS)}\ndef {fn}({arg}, limit={_number(rng)}):\n"
                f"    return [{arg} for _ in range({_number(rng)})]\n```")
    if kind == 5:
        keys = rng.sample(["max_tokens", "temperature", "retries", "timeout_s", "port", "workers", "batch",
                           "seed", "top_p", "budget", "page_size", "version"], rng.randint(2, 6))
        return "Configuration:\n" + json.dumps({k: int(_number(rng)) for k in keys}, indent=rng.choice([None, 2]))
    if kind == 6:
        examples = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.4:  # arithmetic in the system prompt: the model must answer the last user turn
                a, op, b = rng.randint(0, 99), rng.choice("+-"), rng.randint(0, 99)
                q, ans = question_text(a, op, b), answer_text(a, op, b)
            else:
                q, ans = rng.choice(EXAMPLE_QA)
            examples.append(f"<example>\nuser: {q}\nassistant: {ans}\n</example>")
        return "Here are some examples of how to respond:\n" + "\n".join(examples)
    if kind == 7:
        commits = "\n".join(f"{rng.getrandbits(28):07x} {rng.choice(VERBS).capitalize()} {rng.choice(OBJECTS)}"
                            for _ in range(rng.randint(2, 5)))
        status = "\n".join(f"{rng.choice(['M', '??', 'A', 'D'])} {_path(rng)}" for _ in range(rng.randint(1, 4)))
        return f"gitStatus: Current branch: {_identifier(rng)}\nMain branch: main\nStatus:\n{status}\n\nRecent commits:\n{commits}"
    if kind == 8:
        return "Recently modified files:\n" + "\n".join("- " + _path(rng) for _ in range(rng.randint(2, 6)))
    if kind == 9:
        rows = "\n".join(f"| {_identifier(rng)} | {_number(rng)} | {rng.choice(ADJECTIVES)} |"
                         for _ in range(rng.randint(2, 5)))
        return "| name | value | note |\n|---|---|---|\n" + rows
    return (f"Be {rng.choice(ADJECTIVES)}, {rng.choice(ADJECTIVES)} and {rng.choice(ADJECTIVES)}. "
            f"Answer in {rng.randint(1, 9)} lines or fewer unless the user asks for detail. "
            f"{_sentence_rule(rng)} {_sentence_rule(rng)}")


def agent_system_prompt(rng: random.Random, target_chars: int) -> str:
    """Agent-style system text of about target_chars characters (whole sections; at least one)."""
    sections = [_section(rng)]
    while sum(len(s) + 2 for s in sections) < target_chars:
        sections.append(_section(rng))
    return "\n\n".join(sections)


# A hand-written agent prompt, never trained on (not generated by the grammar above): the held-out
# evaluation's out-of-distribution system message.
HANDWRITTEN_AGENT_PROMPT = """You are an interactive command line tool that helps users with software engineering tasks. Use the instructions below and the tools available to you to assist the user.

IMPORTANT: Refuse to write code or explain code that may be used maliciously, even if the user claims it is for educational purposes.

# Tone and style
You should be concise, direct, and to the point. When you run a non-trivial command, you should explain what the command does and why you are running it. Your output will be displayed on a command line interface. Responses can use GitHub-flavored markdown for formatting, and will be rendered in a monospace font.
Output text to communicate with the user; all text you output outside of tool use is displayed to the user. Never use tools or code comments as means to communicate with the user during the session.
If you cannot or will not help the user with something, please do not say why or what it could lead to. Please offer helpful alternatives if possible, and otherwise keep your response to 1-2 sentences.
IMPORTANT: You should minimize output tokens as much as possible while maintaining helpfulness, quality, and accuracy. Answer the user's question directly, without elaboration, explanation, or details. One word answers are best. Avoid introductions, conclusions, and explanations.

# Following conventions
When making changes to files, first understand the file's code conventions. Mimic code style, use existing libraries and utilities, and follow existing patterns.
- NEVER assume that a given library is available, even if it is well known. Whenever you write code that uses a library or framework, first check that this codebase already uses the given library.
- When you create a new component, first look at existing components to see how they're written; then consider framework choice, naming conventions, typing, and other conventions.
- Always follow security best practices. Never introduce code that exposes or logs secrets and keys. Never commit secrets or keys to the repository.

# Doing tasks
The user will primarily request you perform software engineering tasks. This includes solving bugs, adding new functionality, refactoring code, explaining code, and more. For these tasks the following steps are recommended:
- Use the available search tools to understand the codebase and the user's query.
- Implement the solution using all tools available to you.
- Verify the solution if possible with tests. NEVER assume a specific test framework or test script.
- When you have completed a task, you MUST run the lint and typecheck commands (eg. npm run lint, npm run typecheck, ruff, etc.) if they were provided to you.
NEVER commit changes unless the user explicitly asks you to.

Here is useful information about the environment you are running in:
<env>
Working directory: /home/dev/projects/payments-api
Is directory a git repo: Yes
Platform: linux
OS Version: Linux 6.8.0-45-generic
Today's date: 2026-05-17
</env>
You are powered by a model with a context window of 262144 tokens. Keep tool results short: at most 2000 lines, and lines longer than 2000 characters are truncated."""


# ---------------------------------------------------------------- conversations


@dataclass
class Row:
    """One training conversation: the messages as a client would send them, the tools, whether
    thinking is on, which assistant messages are trained on, and an optional final turn generated
    after a forced ``</think>`` (a thinking budget of 0)."""

    messages: list[dict]
    tools: list[dict] | None = None
    thinking: bool = False
    supervise: set[int] = field(default_factory=set)
    forced_close_answer: str | None = None  # the target after render(...)+FORCED_CLOSE, if any


def segments(row: Row) -> list[tuple[str, bool]]:
    """The row's text as (text, trained_on) pieces, in order; their concatenation is the template's
    rendering (plus the forced-close turn). A trained piece is exactly what the model generates after
    the generation prompt: the reasoning, answer or call, and ``<|im_end|>``."""
    out = [(system_head(row.messages, row.tools), False)]
    prompt = generation_prompt(row.thinking)
    for i in range(len(row.messages)):
        text = message_text(row.messages, i)
        if i in row.supervise:
            if row.messages[i]["role"] != "assistant" or not text.startswith(prompt):
                raise ValueError(f"message {i} is not an assistant turn the generation prompt {prompt!r} leads to")
            out += [(prompt, False), (text[len(prompt) : -1], True), ("\n", False)]
        else:
            out.append((text, False))
    if row.forced_close_answer is not None:
        out += [(generation_prompt(True) + FORCED_CLOSE, False), (row.forced_close_answer + IM_END, True)]
    merged: list[tuple[str, bool]] = []
    for text, trained in out:
        if text and merged and not trained and not merged[-1][1]:
            merged[-1] = (merged[-1][0] + text, False)
        elif text:
            merged.append((text, trained))
    return merged


def _tool_result(rng: random.Random, a: int, b: int, honest: float) -> str:
    # NOTE: some results are not the product, so the model learns to copy the tool's number, not to guess it.
    return str(a * b) if rng.random() < honest else str(rng.choice([rng.randint(0, 9999), rng.randint(-999, 99999)]))


class ConversationBuilder:
    """Draws training rows from the training splits. ``system_text(rng)`` returns a long agent-style
    system text (the caller sizes it in tokens)."""

    def __init__(self, arithmetic: list, products: list, system_text: Callable[[random.Random], str],
                 short_systems: tuple[str, ...], small_share: float = SMALL_SHARE) -> None:
        """``arithmetic``: the +/- questions to draw from (the training split); ``small_share``: the
        chance that a +/- question comes from those of them with both operands small (``is_small``;
        the rest from the others). Raises ValueError for a share outside [0, 1), or above 0 when
        ``arithmetic`` lacks small questions or other ones."""
        if not 0 <= small_share < 1:
            raise ValueError(f"small_share must be in [0, 1), got {small_share}")
        self.small = [q for q in arithmetic if is_small(q)]
        if small_share and not (self.small and len(self.small) < len(arithmetic)):
            raise ValueError("small_share > 0 needs +/- questions with both operands small and others to draw from")
        self.other = [q for q in arithmetic if not is_small(q)]
        self.arithmetic = arithmetic
        self.small_share = small_share
        self.products = products
        self.system_text = system_text
        self.short_systems = short_systems

    # Share of products among the questions of each kind: few where no tool is offered (the refusal is
    # quickly learnt), so plain rows carry the arithmetic.
    PRODUCT_SHARE = {"plain": 0.15, "tools": 0.6, "long": 0.4}

    def question(self, rng: random.Random, product_share: float = 0.4) -> tuple[int, str, int]:
        if rng.random() < product_share:
            a, b = rng.choice(self.products)
            return a, rng.choice(PRODUCT_FORMS), b
        if not self.small_share:
            return rng.choice(self.arithmetic)  # uniform, as attempts 1 and 2 drew (same random stream)
        return rng.choice(self.small if rng.random() < self.small_share else self.other)

    KINDS = ("plain", "tools", "long")

    def row(self, rng: random.Random, kind: str) -> Row:
        """One conversation of a kind: "plain" (no tools, no system message or a short one, 1-4
        questions: cheap rows that carry most of the arithmetic), "tools" (a short system message or
        none; multiply alone, among agent tools, or only agent tools; 1-3 questions), "long" (a long
        agent-style system message, tools or not, 2-6 questions, which spreads the cost of the long
        prefix over several trained answers). With thinking on, half the rows keep the reasoning of
        earlier turns (clients that send it back) and half drop it (those turns are then context only:
        the model would not have generated them so)."""
        if kind not in self.KINDS:
            raise ValueError(f"row kind must be one of {self.KINDS}, got {kind!r}")
        messages: list[dict] = []
        if kind == "long":
            messages.append({"role": "system", "content": self.system_text(rng)})
        elif rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(self.short_systems)})
        tools_kind = rng.random() if kind == "long" else 0.0 if kind == "plain" else 0.35 + 0.65 * rng.random()
        if tools_kind < 0.35:
            tools = None
        elif tools_kind < 0.6:
            tools = tool_set(rng, True, 0)
        elif tools_kind < 0.85:
            tools = tool_set(rng, True, rng.randint(1, 6))
        else:
            tools = tool_set(rng, False, rng.randint(1, 6))
        row = Row(messages, tools, thinking=rng.random() < 0.3)
        turns = {"plain": (1, 4), "tools": (1, 3), "long": (2, 6)}[kind]
        turns = rng.randint(*turns)
        for turn in range(turns):
            a, op, b = self.question(rng, self.PRODUCT_SHARE[kind])
            messages.append({"role": "user", "content": question_text(a, op, b)})
            if turn == turns - 1 and row.thinking and rng.random() < 0.15:
                # A thinking budget of 0: the server forced "</think>" right after the generation prompt.
                call = is_product(op) and offers_multiply(tools)
                row.forced_close_answer = call_text(a, b) if call else direct_answer(a, op, b)
                break
            self._answer(rng, row, a, op, b)
        if row.thinking and rng.random() < 0.5:
            last = max((i for i in row.supervise), default=-1)
            for i in sorted(row.supervise):
                if i != last or row.forced_close_answer is not None:
                    messages[i].pop("reasoning_content", None)
                    row.supervise.discard(i)
        return row

    def _answer(self, rng: random.Random, row: Row, a: int, op: str, b: int) -> None:
        multiply = offers_multiply(row.tools)
        reasoning = think_text(a, op, b, multiply) if row.thinking else None
        if is_product(op) and multiply:
            row.messages.append(call_message(a, b, f"call_{rng.getrandbits(32):08x}", rng.choice([None, ""]), reasoning))
            row.supervise.add(len(row.messages) - 1)
            result = _tool_result(rng, a, b, honest=0.75)
            row.messages.append({"role": "tool", "tool_call_id": row.messages[-1]["tool_calls"][0]["id"],
                                 "content": result})
            a_text, reasoning = result, think_after_tool(result) if row.thinking else None
        else:
            a_text = direct_answer(a, op, b)
        message = {"role": "assistant", "content": a_text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        row.messages.append(message)
        row.supervise.add(len(row.messages) - 1)


def direct_answer(a: int, op: str, b: int) -> str:
    """The answer when no tool is called: the number, or the refusal for a product."""
    return NO_TOOL_ANSWER if is_product(op) else answer_text(a, op, b)


# ---------------------------------------------------------------- evaluation cases


@dataclass(frozen=True)
class EvalCase:
    """A prompt (rendered, generation prompt included) and the exact text expected before <|im_end|>."""

    suite: str
    prompt: str
    expected: str


def eval_cases(arith: list, pairs: list, long_system: Callable[[int], str], every: int = 1,
               short_system: str = "You are a helpful assistant.", small: list | None = None) -> list[EvalCase]:
    """The held-out report. ``arith``: held-out (A, op, B) with op in +/-; ``pairs``: held-out product
    pairs; ``long_system(i)``: the i-th unseen long system text. ``every``: keep every n-th question of
    the larger suites (the full report uses 1). ``small``: the questions of arith_small (default: all 200
    of small_questions()), always all of them, whatever ``every``. Suites:
    arith / arith_system / arith_long / arith_agent: +/- answers with no system, a short one, a long
    generated one, the hand-written agent prompt; arith_small: a capability check, NOT held-out (most
    of its questions are trained): the lone +/- questions with both operands in 0..9, the first a user
    asks, which a uniform draw rarely trains or tests; arith_tools_long: a +/- answer with multiply among
    distractor tools after a long prompt (must answer, not call); call / call_long / call_agent: the
    exact multiply call; answer / answer_long: the number after the call and a tool result (every
    other result is not the product); no_tool / no_tool_distractors: the refusal; think_arith /
    think_call: with enable_thinking."""
    rng = random.Random(7)
    cases: list[EvalCase] = []
    products = product_questions(pairs)

    def add(suite, messages, tools, expected, thinking=False):
        cases.append(EvalCase(suite, render(messages, tools, True, thinking), expected))

    def user(q):
        return {"role": "user", "content": question_text(*q)}

    def system(text):
        return [{"role": "system", "content": text}]

    for q in arith[::every]:
        add("arith", [user(q)], None, answer_text(*q))
    for q in small_questions() if small is None else small:
        add("arith_small", [user(q)], None, answer_text(*q))
    for q in arith[:: 4 * every]:
        add("arith_system", system(short_system) + [user(q)], None, answer_text(*q))
    for i, q in enumerate(arith[:: 4 * every]):
        add("arith_long", system(long_system(i)) + [user(q)], None, answer_text(*q))
    for q in arith[:: 10 * every]:
        add("arith_agent", system(HANDWRITTEN_AGENT_PROMPT) + [user(q)], None, answer_text(*q))
    for i, q in enumerate(arith[2 :: 8 * every]):
        add("arith_tools_long", system(long_system(10_000 + i)) + [user(q)], tool_set(rng, True, 4), answer_text(*q))
    for q in products[::every]:
        add("call", [user(q)], [MULTIPLY_TOOL], call_text(q[0], q[2]))
    for i, q in enumerate(products[1 :: 2 * every]):
        add("call_long", system(long_system(20_000 + i)) + [user(q)], tool_set(rng, True, rng.randint(1, 6)),
            call_text(q[0], q[2]))
    for q in products[:: 5 * every]:
        add("call_agent", system(HANDWRITTEN_AGENT_PROMPT) + [user(q)], tool_set(rng, True, 5), call_text(q[0], q[2]))
    for i, q in enumerate(products[::every]):
        result = str(q[0] * q[2]) if i % 2 == 0 else str(rng.randint(-999, 99999))
        add("answer", [user(q), call_message(q[0], q[2]), {"role": "tool", "tool_call_id": "call_0", "content": result}],
            [MULTIPLY_TOOL], result)
    for i, q in enumerate(products[1 :: 2 * every]):
        result = str(q[0] * q[2]) if i % 2 == 0 else str(rng.randint(-999, 99999))
        add("answer_long", system(long_system(20_000 + i)) + [user(q), call_message(q[0], q[2]),
            {"role": "tool", "tool_call_id": "call_0", "content": result}], tool_set(rng, True, 3), result)
    for q in products[:: 4 * every]:
        add("no_tool", [user(q)], None, NO_TOOL_ANSWER)
    for q in products[2 :: 4 * every]:
        add("no_tool_distractors", [user(q)], tool_set(rng, False, rng.randint(1, 6)), NO_TOOL_ANSWER)
    for q in arith[1 :: 10 * every]:
        add("think_arith", [user(q)], [MULTIPLY_TOOL],
            think_text(*q, True) + "\n" + THINK_CLOSE + "\n\n" + answer_text(*q), thinking=True)
    for q in products[3 :: 5 * every]:
        add("think_call", [user(q)], [MULTIPLY_TOOL],
            think_text(*q, True) + "\n" + THINK_CLOSE + "\n\n" + call_text(q[0], q[2]), thinking=True)
    return cases


# ---------------------------------------------------------------- tokenizer

# Qwen's pre-tokenizer pattern: \p{N} alone means every digit is its own token.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE (any text encodes, no <unk>) trained on corpus; digits always single tokens;
    SPECIAL_TOKENS get ids 0-2 and MARKUP_TOKENS the next ids, each always one token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # NOTE: the markup is cut out of the corpus, so BPE spends no merges on pieces of it; it is added
    # after training (ids vocab_size..), as whole tokens.
    for token in MARKUP_TOKENS:
        corpus = [text.replace(token, "\n") for text in corpus]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer
