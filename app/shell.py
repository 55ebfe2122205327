"""`ft shell`: an interactive chat with a running server (fluxtide or any OpenAI-compatible one) over HTTP.

Answers (and the tool calls a model makes) go to stdout; reasoning, notes and errors go to stderr, so
`ft shell < questions.txt > answers.txt` keeps just the answers. With stdin not a terminal there is no prompt
and no banner: one answer per line read."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import httpx

from app.ctl import _add_connection_options, _client, _Console, _positive_int, _temperature, base_url_problem

HELP = """\
Type a message and press Enter; the whole conversation goes to the server each turn.
  /help          this text
  /reset         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (/system alone shows it)
  /exit          leave (also /quit, Ctrl-D; Ctrl-C at the prompt)
Ctrl-C while an answer streams stops that answer and keeps what arrived."""
NO_TOOLS = "ft shell runs no tools: a tool call is shown, not run, and the model is told so"
NOT_RUN = "ft shell has no tools: this call was not run."


def add_shell_parser(sub) -> None:
    p = sub.add_parser("shell", help="interactive chat with a running server (or any OpenAI-compatible one)")
    # NOTE: ft ctl's connection options, defaults and checks (less --json, which means nothing to a chat)
    _add_connection_options(p, defaults=True, json_option=False,
                            timeout_help="seconds to wait for the server: to connect, and between two streamed "
                                         "pieces (default 30)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="the model to chat with (default: the server's first /v1/models entry)")
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt (/system changes it)")
    p.add_argument("--temperature", type=_temperature, default=None, metavar="T",
                   help="sampling temperature, 0 to 2 (default: the server's)")
    p.add_argument("--max-tokens", type=_positive_int, default=None, metavar="N",
                   help="output tokens per answer at most (default: the server's; fluxtide: the rest of the context)")


def _text(body: dict, key: str) -> str:
    value = body.get(key)
    return value if isinstance(value, str) else ""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _error_body(body, fallback: str) -> tuple[str, str | None]:
    """The message and code of an OpenAI-style error body ({"error": {"message", "code"}}), else ``fallback``."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"]), error.get("code")
    if isinstance(error, str) and error:
        return error, None
    return fallback, None


def _http_error(r: httpx.Response) -> str:
    """One line for an error answer, as ft ctl words it: "HTTP 400: the server's message"."""
    try:
        body = r.json()
    except ValueError:
        body = None
    message, code = _error_body(body, r.text.strip()[:300] or r.reason_phrase)
    line = f"HTTP {r.status_code}: {_one_line(message)}"
    if code == "context_length_exceeded":
        line += " (/reset starts a new conversation)"
    return line


class Startup(Exception):
    """The shell cannot start: the message, and the exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _pick_model(args, client: httpx.Client) -> str:
    """--model, else the server's first model. An unreachable server is a Startup error either way."""
    try:
        r = client.get("/v1/models")
    except httpx.InvalidURL as exc:
        raise Startup(f"--base-url {args.base_url}: {exc}", 2) from None
    except httpx.HTTPError as exc:
        raise Startup(f"cannot reach {args.base_url}: {exc}") from None
    if args.model:  # NOTE: a server without /v1/models still serves a named model
        return args.model
    if r.status_code != 200:
        raise Startup(_http_error(r))
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise Startup(f"{args.base_url} lists no model at /v1/models (is it an OpenAI-compatible server?); "
                      "name one with --model") from None


@dataclass
class Reply:
    """One assistant turn as it streams in."""

    content: str = ""
    reasoning: bool = False  # some reasoning was shown
    calls: dict[int, dict] = field(default_factory=dict)  # index -> {"id", "name", "arguments"}
    finish: str | None = None


class Shell:
    def __init__(self, args, client: httpx.Client, model: str, interactive: bool) -> None:
        self.args, self.client, self.model, self.interactive = args, client, model, interactive
        self.system: str | None = args.system
        self.history: list[dict] = []
        self.told_no_tools = False
        # NOTE: markup, emoji and highlighting off: what the model or the server says is printed as it is
        self.err = _Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)

    def note(self, text: str, style: str = "dim") -> None:
        self.err.print(text, style=style)

    def error(self, text: str) -> None:
        self.note(_one_line(text), "red")

    def run(self) -> int:
        if self.interactive:
            self.note(f"ft shell: {self.model} at {self.args.base_url}; /help for commands, Ctrl-D to leave")
        while True:
            try:
                line = input("> ") if self.interactive else sys.stdin.readline()
            except EOFError:
                line = ""
            except KeyboardInterrupt:  # NOTE: at the prompt Ctrl-C ends the shell (during an answer it stops that)
                line = ""
            if not line:  # EOF: Ctrl-D, or the end of piped input
                if self.interactive:
                    print()
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return 0
                continue
            self.turn(text)

    def command(self, text: str) -> bool:
        """Run a slash command; False to leave."""
        name, _, rest = text.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit"):
            return False
        if name in ("/help", "/?"):
            self.note(HELP, "")
        elif name == "/reset":
            self.history.clear()
            self.note("conversation cleared" + (" (the system prompt stays)" if self.system else ""))
        elif name == "/system" and rest:
            self.system = rest
            self.note("system prompt set")
        elif name == "/system":
            self.note(f"system prompt: {self.system}" if self.system else "no system prompt (/system TEXT sets one)")
        else:
            self.error(f"unknown command {name}; /help lists them")
        return True

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def turn(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        payload = {"model": self.model, "messages": self.messages(), "stream": True}
        if self.args.temperature is not None:
            payload["temperature"] = self.args.temperature
        if self.args.max_tokens is not None:
            payload["max_tokens"] = self.args.max_tokens
        reply = Reply()
        problem, interrupted = None, False
        try:
            problem = self.stream(payload, reply)
        except KeyboardInterrupt:  # NOTE: leaving the `with` closed the stream: the server stops generating
            interrupted = True
            self.client.close()  # a connection interrupted mid-read is not reused
            self.client = _client(self.args)
        except httpx.TimeoutException:
            problem = f"no answer from {self.args.base_url} within --timeout {self.args.timeout:g} s"
        except httpx.ConnectError as exc:
            problem = f"cannot reach {self.args.base_url}: {exc}"
        except (httpx.HTTPError, httpx.StreamError) as exc:  # NOTE: a connection lost part-way, say
            problem = f"{self.args.base_url}: {exc or type(exc).__name__}"
        except ValueError:  # NOTE: json.JSONDecodeError too
            problem = f"{self.args.base_url} streamed something that is not an OpenAI chat completion"
        self.end_lines(reply)
        if problem is not None:
            self.history.pop()  # NOTE: a refused turn is forgotten, or every later turn would be refused too
            self.error(problem)
            return
        if interrupted:
            self.note("(stopped)")
            reply.calls.clear()  # half-streamed arguments are no call
            if not reply.content:
                self.history.pop()
                return
        self.keep(reply)
        if reply.finish == "length":
            self.note("(cut off at the token limit: --max-tokens, or the context)")

    def stream(self, payload: dict, reply: Reply) -> str | None:
        """Stream one answer onto the terminal into ``reply``; an error line, or None."""
        with self.client.stream("POST", "/v1/chat/completions", json=payload) as r:
            if r.status_code != 200:
                r.read()
                return _http_error(r)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(data)
                if "error" in chunk:  # an error after the 200 (fluxtide sends one as a last event)
                    return _error_body(chunk, "the server ended the answer with an error")[0]
                for choice in chunk.get("choices") or []:
                    if not isinstance(choice, dict) or not isinstance(choice.get("delta") or {}, dict):
                        raise ValueError(data)
                    if choice.get("index", 0) == 0:
                        self.show(choice.get("delta") or {}, reply)
                        reply.finish = choice.get("finish_reason") or reply.finish
        return None

    def show(self, delta: dict, reply: Reply) -> None:
        if thought := _text(delta, "reasoning_content") or _text(delta, "reasoning"):
            reply.reasoning = True
            self.err.print(thought, style="dim", end="")
        if text := _text(delta, "content"):
            if reply.reasoning and not reply.content:
                self.err.print()  # NOTE: the reasoning ends on its own line, apart from the answer
            reply.content += text  # NOTE: before the write: a Ctrl-C inside it keeps what the user saw
            sys.stdout.write(text)
            sys.stdout.flush()
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict):
                raise ValueError(call)
            slot = reply.calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
            slot["id"] = _text(call, "id") or slot["id"]
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            slot["name"] += _text(fn, "name")
            slot["arguments"] += _text(fn, "arguments")

    def end_lines(self, reply: Reply) -> None:
        if reply.reasoning and not reply.content:
            self.err.print()
        if reply.content:
            print()

    def keep(self, reply: Reply) -> None:
        """Show the tool calls and keep the turn: each call is paired with a result saying it did not run, as an
        OpenAI-compatible server refuses a call left without one."""
        message: dict = {"role": "assistant", "content": reply.content}
        results = []
        for n, i in enumerate(sorted(reply.calls)):
            call = reply.calls[i]
            call["id"] = call["id"] or f"call_{len(self.history)}_{n}"
            print(f"tool call: {call['name']}({call['arguments']})")
            results.append({"role": "tool", "tool_call_id": call["id"], "content": NOT_RUN})
        if results:
            message["content"] = reply.content or None
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in (reply.calls[i] for i in sorted(reply.calls))]
            if not self.told_no_tools:
                self.told_no_tools = True
                self.note(NO_TOOLS)
        self.history += [message, *results]


def run_shell(args: argparse.Namespace) -> int:
    if (problem := base_url_problem(args.base_url)) is not None:  # NOTE: before any request: an argument error
        print(f"ft shell: error: --base-url (or FT_BASE_URL): {problem}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    err = _Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)
    try:
        with _client(args) as client:
            model = _pick_model(args, client)
            if interactive:
                try:
                    import readline  # noqa: F401  (line editing and this session's history for input())
                except ImportError:
                    pass
            shell = Shell(args, client, model, interactive)
            try:
                return shell.run()
            finally:
                shell.client.close()  # NOTE: the one an interrupted answer replaced, if any
    except Startup as exc:
        err.print(f"ft shell: {exc}", style="red")
        return exc.code
    except KeyboardInterrupt:  # NOTE: between the prompt and a request, or while connecting
        print()
        return 130
