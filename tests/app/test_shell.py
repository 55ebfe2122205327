"""`ft shell` driven through `ft`'s main with piped stdin: against the real server with a scripted fake model
(what the model saw is what the executor read), and against a small stand-in OpenAI server for what fluxtide
does not send without tools (tool calls) and for a Ctrl-C in the middle of an answer."""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from app.cli import main
from app.shell import NO_TOOLS, NOT_RUN
from tests.app.scripted import scripted_fixture


def script(prompt: str) -> str:
    """Think, then repeat the last user message."""
    last = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
    return f"Mulling.\n</think>\n\nYou said {last}."


scripted = scripted_fixture(script)


def shell(url: str, lines: str, *args: str, monkeypatch) -> int:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    return main(["shell", "--base-url", url, *args])


def new_prompts(scripted, run) -> list[str]:
    """The prompts the model saw during run(), in order (the executor keys them by request id)."""
    before = set(scripted[1].prompts)
    run()
    return [p for rid, p in scripted[1].prompts.items() if rid not in before]


def test_two_turns_stream_the_answers_and_carry_the_history(scripted, monkeypatch, capsys):
    codes = []
    prompts = new_prompts(scripted, lambda: codes.append(shell(scripted[0].base_url, "hello\n\nagain\n",
                                                                 monkeypatch=monkeypatch)))
    out, err = capsys.readouterr()
    assert codes == [0]  # EOF ends it cleanly
    assert out == "You said hello.\nYou said again.\n"  # just the answers: no prompt, no reasoning
    assert err.count("Mulling.") == 2  # the reasoning, apart on stderr
    assert len(prompts) == 2
    assert "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nYou said hello.<|im_end|>\n" \
           "<|im_start|>user\nagain<|im_end|>" in prompts[1]


def test_reset_drops_the_history_and_keeps_the_system_prompt(scripted, monkeypatch, capsys):
    codes = []
    prompts = new_prompts(scripted, lambda: codes.append(shell(scripted[0].base_url, "one\n/reset\ntwo\n",
                                                                 "--system", "Be terse.", monkeypatch=monkeypatch)))
    out, err = capsys.readouterr()
    assert codes == [0] and out == "You said one.\nYou said two.\n"
    assert "conversation cleared" in err
    assert len(prompts) == 2 and all(p.startswith("<|im_start|>system\nBe terse.<|im_end|>\n") for p in prompts)
    assert "one" not in prompts[1] and "<|im_start|>user\ntwo<|im_end|>" in prompts[1]


def test_system_sets_the_system_prompt_for_the_next_turns(scripted, monkeypatch, capsys):
    codes = []
    prompts = new_prompts(scripted, lambda: codes.append(shell(
        scripted[0].base_url, "first\n/system Answer in French.\nsecond\n/system\n", "--system", "Be terse.",
        monkeypatch=monkeypatch)))
    out, err = capsys.readouterr()
    assert codes == [0] and out == "You said first.\nYou said second.\n"
    assert prompts[0].startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
    # the new system prompt, and the conversation so far kept behind it
    assert prompts[1].startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nfirst<|im_end|>")
    assert "system prompt: Answer in French." in err


def test_a_turn_past_the_context_is_one_line_and_the_shell_goes_on(scripted, monkeypatch, capsys):
    codes = []
    long = "x" * 5000  # past the tiny model's 4096-token context (one token a byte)
    prompts = new_prompts(scripted, lambda: codes.append(shell(scripted[0].base_url, f"{long}\nshort\n",
                                                                 monkeypatch=monkeypatch)))
    out, err = capsys.readouterr()
    assert codes == [0] and out == "You said short.\n"
    errors = [line for line in err.splitlines() if "HTTP" in line]
    assert len(errors) == 1 and errors[0].startswith("HTTP 400: ") and "maximum context length" in errors[0]
    assert "/reset" in errors[0] and "Traceback" not in err
    assert len(prompts) == 1 and long not in prompts[0]  # the refused turn was dropped from the history


def test_max_tokens_past_the_context_is_refused_each_turn_without_ending_the_shell(scripted, monkeypatch, capsys):
    prompts = new_prompts(scripted, lambda: shell(scripted[0].base_url, "a\nb\n/help\n", "--max-tokens", "1000000",
                                                  monkeypatch=monkeypatch))
    out, err = capsys.readouterr()
    assert prompts == [] and out == ""
    assert len([line for line in err.splitlines() if line.startswith("HTTP 400: ")]) == 2
    assert "/reset" in err and "/system TEXT" in err  # /help after the errors still ran


def test_exit_ends_the_shell_before_the_lines_after_it(scripted, monkeypatch, capsys):
    codes = []
    prompts = new_prompts(scripted, lambda: codes.append(shell(scripted[0].base_url, "/exit\nhello\n",
                                                                 monkeypatch=monkeypatch)))
    assert codes == [0] and prompts == [] and capsys.readouterr().out == ""


def test_eof_at_once_exits_zero(scripted, monkeypatch, capsys):
    assert shell(scripted[0].base_url, "", monkeypatch=monkeypatch) == 0
    assert capsys.readouterr().out == ""


def test_an_unknown_command_is_said_and_sent_nowhere(scripted, monkeypatch, capsys):
    prompts = new_prompts(scripted, lambda: shell(scripted[0].base_url, "/frobnicate\n", monkeypatch=monkeypatch))
    assert prompts == [] and "unknown command /frobnicate" in capsys.readouterr().err


def test_an_unreachable_server_at_start_exits_1_with_a_message(monkeypatch, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # NOTE: closed below, before the shell connects: nothing listens there
    assert shell(f"http://127.0.0.1:{port}", "hello\n", monkeypatch=monkeypatch) == 1
    out, err = capsys.readouterr()
    assert out == "" and f"cannot reach http://127.0.0.1:{port}" in err and "Traceback" not in err


def test_a_base_url_without_a_scheme_is_an_argument_error(monkeypatch, capsys):
    assert shell("localhost:1919", "hello\n", monkeypatch=monkeypatch) == 2
    assert "did you mean http://localhost:1919" in capsys.readouterr().err


class StandIn:
    """An OpenAI-style server on 127.0.0.1 that streams canned chunks: ``answers`` maps the last user message to
    the deltas to send. "stall" sends one piece and then waits for the client to hang up. Records each request."""

    def __init__(self, answers: dict[str, list[dict]]) -> None:
        self.answers, self.requests, self.hung_up = answers, [], threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10

            def log_message(self, *args):
                pass

            def do_GET(self):
                body = json.dumps({"object": "list", "data": [{"id": "stand-in", "object": "model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(request)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                last = request["messages"][-1]["content"]
                for delta in outer.answers[last]:
                    self.event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
                if last == "stall":
                    try:
                        if self.rfile.read(1) == b"":  # the client closed the connection
                            outer.hung_up.set()
                    except OSError:
                        outer.hung_up.set()
                    return
                finish = "tool_calls" if any("tool_calls" in d for d in outer.answers[last]) else "stop"
                self.event({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
                self.wfile.write(b"data: [DONE]\n\n")

            def event(self, chunk: dict) -> None:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"  # as OpenAI clients take it
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def call_deltas(call_id: str) -> list[dict]:
    return [{"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                             "function": {"name": "multiply", "arguments": ""}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 6,'}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": ' "b": 7}'}}]}]


def test_tool_calls_are_shown_said_once_to_run_nowhere_and_answered_in_the_history(monkeypatch, capsys):
    stand_in = StandIn({"calc": [{"content": "Let me compute."}, *call_deltas("call_1")],
                        "again": call_deltas("call_2"), "thanks": [{"content": "You're welcome."}]})
    try:
        assert shell(stand_in.url, "calc\nagain\nthanks\n", monkeypatch=monkeypatch) == 0
    finally:
        stand_in.close()
    out, err = capsys.readouterr()
    assert out == ('Let me compute.\ntool call: multiply({"a": 6, "b": 7})\ntool call: multiply({"a": 6, "b": 7})\n'
                   "You're welcome.\n")
    assert err.count(NO_TOOLS) == 1
    assert [r["model"] for r in stand_in.requests] == ["stand-in"] * 3  # the first /v1/models entry
    history = stand_in.requests[2]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "user", "assistant", "tool", "user"]
    assert history[1]["content"] == "Let me compute."
    assert history[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                         "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]
    assert history[2] == {"role": "tool", "tool_call_id": "call_1", "content": NOT_RUN}
    assert history[4]["content"] is None and history[5]["tool_call_id"] == "call_2"


class CtrlCOnWrite(io.StringIO):
    """stdout that raises KeyboardInterrupt (a Ctrl-C) once the answer's first piece is written."""

    def __init__(self, trigger: str) -> None:
        super().__init__()
        self.trigger = trigger

    def write(self, text: str) -> int:
        n = super().write(text)
        if self.trigger and self.trigger in text:
            self.trigger = ""
            raise KeyboardInterrupt
        return n


def test_ctrl_c_during_an_answer_closes_the_stream_and_returns_to_the_prompt(monkeypatch):
    stand_in = StandIn({"stall": [{"content": "partial"}], "next": [{"content": "ok"}]})
    out, err = CtrlCOnWrite("partial"), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    try:
        assert shell(stand_in.url, "stall\nnext\n", monkeypatch=monkeypatch) == 0
        assert stand_in.hung_up.wait(10), "the interrupted stream was not closed"
    finally:
        stand_in.close()
    assert out.getvalue() == "partial\nok\n" and "(stopped)" in err.getvalue()
    # what arrived before the Ctrl-C stays in the conversation
    assert stand_in.requests[1]["messages"] == [{"role": "user", "content": "stall"},
                                                {"role": "assistant", "content": "partial"},
                                                {"role": "user", "content": "next"}]


def test_model_names_the_model_sent(monkeypatch, capsys):
    stand_in = StandIn({"hi": [{"content": "hello"}]})
    try:
        assert shell(stand_in.url, "hi\n", "--model", "other", "--temperature", "0.5", "--max-tokens", "7",
                     monkeypatch=monkeypatch) == 0
    finally:
        stand_in.close()
    assert capsys.readouterr().out == "hello\n"
    request = stand_in.requests[0]
    assert (request["model"], request["temperature"], request["max_tokens"], request["stream"]) == ("other", 0.5, 7, True)
