"""`ft ctl` against a live server, and argument handling of `ft serve` / `python -m app`."""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time

import pytest

from app.cli import main
from tests.app.conftest import make_container, start_server


@pytest.fixture(scope="module")
def ctl_server():
    server = start_server(make_container(), api_key="k3y")
    yield server
    server.stop()


def ctl(server, *args: str, key: str | None = "k3y") -> int:
    extra = ["--api-key", key] if key else []
    return main(["ctl", "--base-url", server.base_url, *extra, *args])


def test_health_and_stats_as_json(ctl_server, capsys):
    assert ctl(ctl_server, "--json", "health") == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    assert ctl(ctl_server, "--json", "stats") == 0
    body = json.loads(capsys.readouterr().out)
    assert body["pools"]["kv_pages_total"] == 128


def test_tables_render(ctl_server, capsys):
    assert ctl(ctl_server, "stats") == 0
    out = capsys.readouterr().out
    assert "kv_pages_total" in out and "decode_tok_s" in out
    # the pools' prefix cache in rows as `ft ctl cache` shows it, not a Python dict repr
    assert "prefix_cache.cached_pages" in out and "{'" not in out, out
    # a figure the server has not got (null: the CPU's streamed-prefill counters) reads n/a, not a blank cell
    assert re.search(r"prefill_streaming\s*│\s*n/a", out), out
    assert ctl(ctl_server, "cache") == 0
    assert "plan.kv_tokens" in capsys.readouterr().out


def test_cache_resize_with_suffixes(ctl_server, capsys):
    assert ctl(ctl_server, "--json", "cache", "--kv", "1k", "--wait", "10") == 0
    body = json.loads(capsys.readouterr().out)
    assert body["after"]["kv_tokens"] == 1024
    assert ctl(ctl_server, "cache", "--kv", "2k") == 0
    assert "2048" in capsys.readouterr().out
    assert ctl(ctl_server, "cache", "--kv", "100m") == 1
    assert "resize refused" in capsys.readouterr().out
    assert ctl(ctl_server, "--json", "cache", "--kv", "1k", "--moe", "auto") == 0
    assert json.loads(capsys.readouterr().out)["after"]["kv_tokens"] == 1024


def test_cache_resize_prints_the_wait_for_requests_apart_from_the_swap(ctl_server, capsys, monkeypatch):
    """`ft ctl cache --kv 256k --moe auto` printed "waited 0.6764 s": the whole resize, of which 0.002 s was the wait
    for in-flight requests, so a slow swap read as requests that had blocked the resize."""
    executor = ctl_server.container.executor()
    swap = executor.resize_pools

    def slow(target):
        time.sleep(0.4)
        swap(target)

    monkeypatch.setattr(executor, "resize_pools", slow)
    assert ctl(ctl_server, "cache", "--kv", "3k") == 0
    out = " ".join(capsys.readouterr().out.split())
    found = re.search(r"waited ([\d.]+) s for in-flight requests, swapped the pools in ([\d.]+) s \(([\d.]+) s in "
                      r"all\)", out)
    assert found, out
    waited, swapped, total = map(float, found.groups())
    assert waited < 0.3 <= 0.4 <= swapped and total == pytest.approx(waited + swapped, abs=2e-4), out
    assert ctl(ctl_server, "--json", "cache", "--kv", "1k") == 0
    body = json.loads(capsys.readouterr().out)
    assert {"waited_s", "swap_s", "total_s"} <= set(body) and body["swap_s"] >= 0.4, body


def test_cache_mamba_says_the_running_limit_and_refuses_slots_past_it(ctl_server, capsys):
    """`ft ctl cache --mamba 8` on a --max-running-requests 4 server applied 8 state slots while at most 4
    sequences could run: the extra slots held memory for nothing and the output did not say so."""
    assert ctl(ctl_server, "cache", "--mamba", "8") == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines at the terminal's width
    assert "resize refused" in out and "state_slots 8 is above --max-running-requests 4" in out, out
    assert "restart with --max-running-requests 8" in out, out
    assert ctl(ctl_server, "cache", "--mamba", "2") == 0
    assert "running limit 2 sequences" in " ".join(capsys.readouterr().out.split())
    assert ctl(ctl_server, "cache", "--mamba", "4") == 0
    assert "running limit 4 sequences" in " ".join(capsys.readouterr().out.split())


def test_a_refusal_with_brackets_is_printed_whole(ctl_server, capsys):
    """The server's reason names the allowed range in brackets; rich read "[top_k 2, ...]" as markup and dropped it,
    so the table output ended at "outside " (the --json output had it all)."""
    assert ctl(ctl_server, "--json", "cache", "--moe", "1") == 1
    message = json.loads(capsys.readouterr().out)["error"]["message"]
    assert "[" in message and "]" in message, message
    assert ctl(ctl_server, "cache", "--moe", "1") == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines at the terminal's width
    assert " ".join(message.split()) in out, out


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_ctl_accepts_the_openai_style_base_url(ctl_server, suffix, capsys):
    """`--base-url http://127.0.0.1:1919/v1`, the URL OpenAI clients take, printed only "HTTP 404: Not Found"."""
    base = ["ctl", "--base-url", ctl_server.base_url + suffix, "--api-key", "k3y"]
    assert main([*base, "--json", "stats"]) == 0
    assert json.loads(capsys.readouterr().out)["pools"]["kv_pages_total"] > 0
    assert main([*base, "--json", "health"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"


def test_generate_streams_text(ctl_server, capsys):
    assert ctl(ctl_server, "generate", "hello", "--max-tokens", "5") == 0
    printed = capsys.readouterr()
    # the usage line went to stdout after the answer: `ft ctl generate ... | ...` read it as part of the answer
    assert "completion tokens" not in printed.out and "5 completion tokens" in printed.err, printed
    assert printed.out.endswith("\n") and printed.out.strip()


def test_generate_under_json_prints_one_json_object(ctl_server, capsys):
    """`ft ctl --json generate` printed the plain streamed text, not the raw JSON docs/serving.md promises."""
    assert ctl(ctl_server, "--json", "generate", "hello", "--max-tokens", "5") == 0
    printed = capsys.readouterr()
    body = json.loads(printed.out)
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] > 0, body
    assert isinstance(body["text"], str) and body["text"] and body["finish_reason"] == "length", body
    assert body["model"] and "completion tokens" not in printed.err


@pytest.mark.parametrize("command", [("health",), ("stats",), ("cache",), ("generate", "hello", "--max-tokens", "3")])
def test_ctl_options_are_taken_after_the_subcommand_too(ctl_server, command, capsys):
    """`ft ctl generate hi --base-url URL` was `ft: error: unrecognized arguments: --base-url ...`: every subcommand
    takes ft ctl's options after it as well, `--json` included."""
    name, *rest = command
    assert main(["ctl", name, "--base-url", ctl_server.base_url, "--api-key", "k3y", "--timeout", "20", *rest]) == 0
    assert "unrecognized" not in capsys.readouterr().err
    assert main(["ctl", name, *rest, "--json", "--base-url", ctl_server.base_url, "--api-key", "k3y"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)


def test_ctl_options_before_the_subcommand_still_count_and_after_it_win(ctl_server, capsys):
    # before the subcommand only: kept (the subcommand's copy leaves an option it was not given unset)
    assert main(["ctl", "--base-url", ctl_server.base_url, "--api-key", "k3y", "--json", "health"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "ok"
    # both places: the one after the subcommand wins
    assert main(["ctl", "--base-url", "http://127.0.0.1:9", "--api-key", "wrong", "stats",
                 "--base-url", ctl_server.base_url, "--api-key", "k3y", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pools"]["kv_pages_total"] > 0
    with pytest.raises(SystemExit) as info:
        main(["ctl", "health", "--base-url", ctl_server.base_url, "--timeout", "-1"])
    assert info.value.code == 2 and "--timeout" in capsys.readouterr().err


def test_missing_key_is_reported(ctl_server, capsys):
    assert ctl(ctl_server, "stats", key=None) == 1
    assert "401" in capsys.readouterr().out


def test_unreachable_server(capsys):
    assert main(["ctl", "--base-url", "http://127.0.0.1:9", "health"]) == 1
    assert "cannot reach" in capsys.readouterr().out


@pytest.mark.parametrize("args", [
    ("cache", "--kv", "8k", "--wait", "nan"),
    ("cache", "--kv", "8k", "--wait", "inf"),
    ("cache", "--kv", "8k", "--wait", "-1"),
    ("--timeout", "-1", "health"),
    ("--timeout", "nan", "health"),
    ("--timeout", "0", "health"),
])
def test_ctl_refuses_bad_seconds_as_argument_errors(args, capsys):
    """`--wait nan` was a ValueError traceback from json.dumps, `--timeout -1` one from the socket."""
    with pytest.raises(SystemExit) as info:
        main(["ctl", "--base-url", "http://127.0.0.1:9", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("--wait" in err or "--timeout" in err) and "Traceback" not in err


@pytest.mark.parametrize(("args", "why"), [
    (("--max-tokens", "0"), "must be >= 1"),
    (("--max-tokens", "-5"), "must be >= 1"),
    (("--max-tokens", "1.5"), "not a whole number"),
    (("--temperature", "nan"), "must be >= 0 and <= 2"),  # nan and inf were a ValueError traceback from httpx
    (("--temperature", "inf"), "must be >= 0 and <= 2"),
    (("--temperature", "-1"), "must be >= 0 and <= 2"),  # -1 and 2.5 went out as a request, refused with a 400
    (("--temperature", "2.5"), "must be >= 0 and <= 2"),
    (("--temperature", "warm"), "not a number"),
])
def test_ctl_generate_refuses_bad_sampling_values_as_argument_errors(args, why, capsys):
    """Checked by argparse (exit 2) before any request: the base URL is a port nobody listens on."""
    with pytest.raises(SystemExit) as info:
        main(["ctl", "--base-url", "http://127.0.0.1:9", "generate", "hi", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {args[0]}: " in err and why in err and "Traceback" not in err, err


@pytest.mark.parametrize("args", [("--temperature", "0"), ("--temperature", "2"), ("--max-tokens", "1")])
def test_ctl_generate_takes_the_edges_the_server_takes(ctl_server, args, capsys):
    assert ctl(ctl_server, "generate", "hello", "--max-tokens", "2", *args) == 0
    assert "completion tokens" in capsys.readouterr().err  # the usage line: on stderr, beside the answer


def test_ctl_reports_a_base_url_it_cannot_use(capsys):
    """`--base-url http://[::1` (a typo) was an httpx.InvalidURL traceback."""
    assert main(["ctl", "--base-url", "http://[::1", "health"]) == 2
    out = capsys.readouterr()
    assert "--base-url" in out.out + out.err and "Traceback" not in out.out + out.err


@pytest.mark.parametrize(("url", "hint"), [
    ("localhost:1919", "did you mean http://localhost:1919?"),  # was exit 1: "unsupported protocol 'localhost://'"
    ("127.0.0.1:9", "did you mean http://127.0.0.1:9?"),
    ("ftp://localhost:1919", "must be http or https"),
    ("http://:1919", "names no host"),
])
@pytest.mark.parametrize("where", ["flag", "env"])
def test_ctl_refuses_a_base_url_without_scheme_or_host_as_an_argument_error(url, hint, where, capsys, monkeypatch):
    """The docs promise exit 2 for a malformed --base-url; `localhost:1919` went out as a request (exit 1, httpx's
    "Request URL has an unsupported protocol 'localhost://'"). Checked before any request, from the flag or
    FT_BASE_URL, with the URL it most likely meant."""
    if where == "env":
        monkeypatch.setenv("FT_BASE_URL", url)
        argv = ["ctl", "health"]
    else:
        argv = ["ctl", "--base-url", url, "health"]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "--base-url" in out.err and hint in out.err and out.out == "", out
    assert "unsupported protocol" not in out.err


@pytest.fixture
def not_fluxtide():
    """Something else on the port that answers HTML (another web server, a proxy's error page)."""
    import http.server
    import threading

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html><body>It works!</body></html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("command", [("health",), ("stats",), ("cache",), ("generate", "hi")])
def test_ctl_against_a_server_that_answers_html_says_so(not_fluxtide, command, capsys):
    """`ft ctl health` against a port where something else answers was a JSONDecodeError traceback."""
    assert main(["ctl", "--base-url", not_fluxtide, *command]) == 1
    out = capsys.readouterr()
    assert "not JSON" in out.out and "Traceback" not in out.out + out.err


def test_bad_sizes_are_argument_errors():
    with pytest.raises(SystemExit) as info:
        main(["ctl", "cache", "--kv", "lots"])
    assert info.value.code == 2


@pytest.mark.parametrize("size", ["1.0e999", "inf", "nan"])
def test_serve_refuses_a_size_that_overflows_without_a_traceback(size, capsys):
    """Issue 12 #3: `ft serve --kv-tokens 1.0e999` was an OverflowError traceback."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--kv-tokens", size])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-tokens" in err and "Traceback" not in err


def test_serve_refuses_an_unknown_log_level_without_a_traceback(capsys):
    """`ft serve --log-level bogus` was a ValueError traceback from logging."""
    with pytest.raises(SystemExit) as info:
        main(["serve", "--log-level", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--log-level" in err and "Traceback" not in err


def test_ft_sim_without_the_sim_extra_says_what_to_install():
    """After the quick start (`.[serve]`, no simpy) `ft sim predict` was a ModuleNotFoundError traceback."""
    code = ("import sys; sys.modules['simpy'] = None; from app.cli import main; "
            "sys.exit(main(['sim', 'predict', '--hardware', 'rtx3090', '--model', 'qwen3.6-35b-a3b-fp8']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        'ft sim: the simulator needs simpy, which the sim extra installs: pip install -e ".[sim]"'], out.stderr


def test_ft_help_names_every_simulator_command(capsys):
    """`ft --help` said "predict, calibrate, expert-parallel" for `ft sim`, leaving out `mixed`."""
    pytest.importorskip("simpy")
    from simulator.__main__ import build_parser

    (sim_commands,) = [a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    line = text[text.index("the simulator:"):]
    for name in sim_commands:
        assert re.search(rf"[:,] {re.escape(name)}[,( ]", line), (name, line)


def test_python_dash_m_simulator_without_the_sim_extra_says_what_to_install():
    """README's capacity planning runs `python -m simulator predict`: without simpy, one line, not a traceback."""
    code = "import sys, runpy; sys.modules['simpy'] = None; sys.argv = ['simulator', 'predict']; " \
           "runpy.run_module('simulator', run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        'python -m simulator needs simpy, which the sim extra installs: pip install -e ".[sim]"'], out.stderr


def test_python_dash_m_app_is_the_ft_command():
    out = subprocess.run([sys.executable, "-m", "app", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--port", "--served-model-name", "--max-running-requests", "--max-prefill-length",
                 "--mixed-prefill-length",
                 "--memory-ratio", "--gpu-budget-gib", "--kv-tokens", "--moe-slots", "--kv-reserve-tokens",
                 "--device", "--api-key", "--mmap-experts"):
        assert flag in out.stdout, flag
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--max-running-requests", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "max-running-requests" in bad.stderr


def test_serve_refuses_a_routing_trace_path_it_cannot_write(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--record-routing", str(tmp_path / "no" / "t.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--record-routing" in bad.stderr and "does not exist" in bad.stderr


def test_serve_refuses_the_graph_executor_where_it_cannot_run():
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--device", "cpu", "--executor", "cuda-graph",
                          "--mmap-experts"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--executor cuda-graph" in bad.stderr
    assert "--device cpu" in bad.stderr and "--mmap-experts" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(("args", "message"), [
    (("--device", "tpu"), "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (("--device", "cuda:x"), "--device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    (("--gpu-budget-gib", "nan"), "--gpu-budget-gib must be a positive number of GiB, got nan"),
    (("--gpu-budget-gib", "inf"), "--gpu-budget-gib must be a positive number of GiB, got inf"),
])
def test_serve_refuses_a_bad_device_or_budget_before_loading(args, message):
    """These passed the argument checks, opened the port, and failed the load with a traceback
    (torch's RuntimeError for `tpu`, an OverflowError for `inf`) while the process kept running."""
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--port", "0", *args], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and "listening on" not in bad.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_serve_refuses_cuda_on_a_host_without_it_before_loading(device):
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--port", "0", "--device", device],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and f"--device {device}: no CUDA device" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and "listening on" not in bad.stderr


def test_serve_names_why_it_cannot_listen(capsys):
    """A --host this machine does not have was reported as "uvicorn did not start (port in use?)"."""
    assert main(["serve", "--host", "192.0.2.1", "--port", "0"]) == 1  # TEST-NET-1: never a local address
    err = capsys.readouterr().err
    assert "cannot listen on 192.0.2.1:0" in err and "assign requested address" in err, err
    assert "port in use" not in err


def test_serve_names_a_port_in_use_in_one_line_before_loading():
    """uvicorn printed its own "ERROR: [Errno 98] error while attempting to bind ..." before ft serve's line, which
    named no flag. Now: one line naming the address and --port, exit 1, and the model never starts loading."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra in ([], ["--data-parallel", "2"]):  # the data-parallel front binds the same way, before its workers
            bad = subprocess.run([sys.executable, "-m", "app", "serve", "--device", "cpu", "--port", str(port), *extra],
                                 capture_output=True, text=True, timeout=120)
            assert bad.returncode == 1, bad.stderr
            assert bad.stderr.splitlines() == [f"ft serve: cannot listen on 127.0.0.1:{port}: address already in use; "
                                               "pass another --port (or stop what listens there)"], bad.stderr
            assert bad.stdout == ""


def test_serve_names_a_host_name_it_cannot_resolve(capsys):
    assert main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "cannot listen on no-such-host.invalid:0:" in err and "check --host" in err, err


def test_the_listening_url_of_an_ipv6_host_has_brackets():
    from app.containers import Container
    from app.serving import RunningServer
    from app.settings import ServeSettings

    url = lambda host: RunningServer(Container(), ServeSettings(host=host, port=1919)).base_url  # noqa: E731
    assert url("::1") == "http://[::1]:1919" and url("127.0.0.1") == "http://127.0.0.1:1919"
    assert url("[::1]") == "http://[::1]:1919"  # was http://[[::1]]:1919


@pytest.mark.parametrize(("host", "written"), [
    ("127.0.0.1", "127.0.0.1:1919"),
    ("0.0.0.0", "0.0.0.0:1919"),
    ("::1", "[::1]:1919"),
    ("::", "[::]:1919"),
    ("2001:db8::1", "[2001:db8::1]:1919"),
    ("::ffff:127.0.0.1", "[::ffff:127.0.0.1]:1919"),
    ("localhost", "localhost:1919"),
    ("no-such-host.invalid", "no-such-host.invalid:1919"),
    ("[::1]", "[::1]:1919"),  # already in brackets: not twice
])
def test_host_port_brackets_ipv6_literals_only(host, written):
    """The data-parallel front printed "listening on http://::1:1919", which no client can use (RFC 3986)."""
    from app.server import host_port

    assert host_port(host, 1919) == written


def test_listen_problem_brackets_an_ipv6_host():
    import errno

    from app.server import listen_problem

    exc = OSError(errno.EADDRINUSE, "Address already in use")
    assert listen_problem("::1", 1919, exc).startswith("cannot listen on [::1]:1919: address already in use")
    assert listen_problem("127.0.0.1", 1919, exc).startswith("cannot listen on 127.0.0.1:1919: ")


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")
def test_serve_names_an_ipv6_address_in_use_with_brackets(capsys):
    import socket

    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--host", "::1", "--port", str(port)]) == 1
    assert f"cannot listen on [::1]:{port}: address already in use" in capsys.readouterr().err


def test_serve_writes_each_echo_line_whole_newline_included(monkeypatch):
    """`ft serve` printed "load failed: ..." and its newline in two writes; a log record written from another
    thread (Litestar's queue listener) between them ran onto the line. Every echo line is now one write."""
    import io

    from dependency_injector import providers

    from app.runtime import Runtime
    from app.serving import build_engine

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return super().write(text)

    def broken_spec():
        raise ValueError("no such checkpoint")

    container = make_container()
    container.model_spec.override(providers.Singleton(broken_spec))
    err = Writes()
    monkeypatch.setattr(sys, "stderr", err)
    # NOTE: the failure's log record would reach handlers an earlier test in this worker left behind (a queue
    # listener whose stream pytest has closed: a "Logging error" in the output); this test is about the echo
    monkeypatch.setattr(logging.getLogger("fluxtide.serve"), "disabled", True)
    runtime = Runtime("m")
    build_engine(container, runtime, echo=True)
    assert runtime.status == "error"
    assert "load failed: no such checkpoint\n" in err.calls, err.calls  # a ValueError: the message, no class name
    assert all(call.endswith("\n") for call in err.calls), err.calls  # no line is split across writes


def test_serve_says_when_it_is_ready(monkeypatch, capsys):
    """The echo ended at "building executor": a user watching `ft serve` could not tell when it took requests
    (only /health said so). The last line names the served model."""
    from app.runtime import Runtime
    from app.serving import build_engine

    runtime = Runtime("m")
    build_engine(make_container(), runtime, echo=True)
    try:
        assert runtime.status == "ok"
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.endswith(f"] ready: serving {runtime.model.served_name}"), last
    finally:
        runtime.engine.stop()


@pytest.mark.parametrize("key", ["", "   ", " k3y", "k3y\t", "ключ"])
def test_serve_refuses_an_api_key_no_client_can_send(key):
    """`ft serve --api-key "$KEY"` with KEY unset served with the API key OFF (one "(API key off)" line to notice);
    a key with surrounding spaces or non-ASCII characters could never match a header, so every request got 401."""
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--port", "0", "--api-key", key],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--api-key" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and "listening on" not in bad.stderr


def test_the_graph_executor_is_chosen_only_where_it_can_run():
    from types import SimpleNamespace

    from app.containers import _use_fast_path
    from app.settings import ServeSettings

    unpinned = SimpleNamespace(experts=SimpleNamespace(rows=None))
    assert not _use_fast_path(ServeSettings(), unpinned, "cpu")  # auto: the reference path here
    with pytest.raises(ValueError, match="needs a CUDA device"):  # --device auto resolved to the CPU
        _use_fast_path(ServeSettings(executor="cuda-graph"), unpinned, "cpu")


@pytest.mark.parametrize("args", [("stats",), ("--json", "stats")])
def test_a_reader_that_closes_the_pipe_early_ends_ctl_quietly(ctl_server, args):
    # `ft ctl stats | head -1`, deterministically: the reader closes its end before ft writes a byte, so every
    # write (and the final flush) meets a broken pipe
    cmd = [sys.executable, "-m", "app", "ctl", "--base-url", ctl_server.base_url, "--api-key", "k3y", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err  # 128 + SIGPIPE, as a shell reports `cat` cut short by `head`
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_the_http_app_leaves_the_root_logger_as_ft_serve_set_it():
    """Litestar's default logging config replaced the root logger's handlers, format and level when the app was built:
    `ft serve`'s log lines came out in Litestar's format ("INFO - time - name - module - msg") and, in tests, threads
    logged through a stream pytest had closed ("Logging error" in CI's output)."""
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    server = start_server(make_container())
    try:
        assert (list(root.handlers), root.level) == before
    finally:
        server.stop()


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / "missing", "no such file or directory"),
    (lambda d: (d / "weights.safetensors").write_bytes(b"x") and d / "weights.safetensors", "not a directory"),
    (lambda d: d, "not a checkpoint directory (no config.json)"),
])
def test_serve_refuses_a_model_path_that_is_no_checkpoint_before_listening(tmp_path, make, message):
    """A new user's `ft serve --model /wrong/path` listened and answered 503 until killed; vLLM exits at once."""
    path = make(tmp_path)
    bad = subprocess.run([sys.executable, "-m", "app", "serve", "--port", "0", "--model", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and f"--model {path}: {message}" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and "listening on" not in bad.stderr


def _exits(server, timeout: float = 120.0) -> int:
    try:
        return server.proc.wait(timeout)
    finally:
        server.stop()  # NOTE: kills it if it did not exit (the old behaviour): the test fails on the code


def test_serve_exits_1_when_the_pools_can_never_fit_and_names_the_options_that_fix_it():
    """`ft serve --kv-tokens 100m` on the CPU demo model logged "the pools do not fit" and then kept running with
    /health 503 until killed: it looked hung. A deterministic start-up error now ends the process (exit 1, as vLLM
    and SGLang do), its reason on stderr naming the options that fix it."""
    from tests.app.processes import FtServe

    server = FtServe(["--device", "cpu", "--port", "0", "--kv-tokens", "100m"])
    assert _exits(server) == 1, server.output()
    out = server.output()
    line = next(line for line in out.splitlines() if line.startswith("load failed: "))
    assert "the pools do not fit" in line and "short by" in line, line
    assert "lower --kv-tokens or --moe-slots" in line and "--gpu-budget-gib (now 0.5 GiB)" in line, line
    assert "stopped: no model served (load failed)" in out.splitlines()[-1], out


def test_serve_names_only_the_flag_and_the_range_of_an_impossible_slot_count():
    """`ft serve --moe-slots 2k` on the demo model (32 experts) said "load failed: ValueError: the pools do not fit:
    expert_slots 2048 outside [top_k 2, total experts 32]; lower --moe-slots ... or raise the CPU budget with
    --gpu-budget-gib": no budget fixes a slot count above the expert total, and the class name leaked."""
    from tests.app.processes import FtServe

    server = FtServe(["--device", "cpu", "--port", "0", "--moe-slots", "2k"])
    assert _exits(server) == 1, server.output()
    out = server.output()
    line = next(line for line in out.splitlines() if line.startswith("load failed: "))
    assert line == "load failed: --moe-slots: expert_slots 2048 outside [top_k 2, total experts 32]", line
    assert "ValueError" not in out and "--gpu-budget-gib" not in out and "do not fit" not in out, out
    assert "model load failed: --moe-slots: expert_slots 2048 outside" in out, out  # the log line says the same


def test_serve_exits_1_on_a_checkpoint_it_cannot_load(tmp_path):
    import shutil
    from pathlib import Path

    from tests.app.processes import FtServe

    demo = Path(__file__).resolve().parents[2] / "app" / "demo_model" / "checkpoint"
    dst = tmp_path / "c"
    shutil.copytree(demo, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["hidden_size"]
    (dst / "config.json").write_text(json.dumps(config))
    server = FtServe(["--device", "cpu", "--port", "0", "--model", str(dst)])
    assert _exits(server) == 1, server.output()
    assert "config field 'hidden_size' is missing" in server.output()


@pytest.mark.parametrize(("pool", "device", "first", "budget"), [
    ("kv", "cpu", "lower --kv-tokens or --moe-slots", "raise the CPU budget with --gpu-budget-gib (now 0.5 GiB)"),
    ("moe", "cuda:0", "lower --moe-slots or --kv-tokens", "--gpu-budget-gib (at most the card's memory) or --memory-ratio"),
    ("state", "cpu", "lower --max-running-requests or --kv-tokens or --moe-slots", "--gpu-budget-gib"),
    ("budget", "cuda", "lower --kv-tokens or --moe-slots", "--memory-ratio"),
])
def test_a_refused_start_up_plan_names_what_to_change(pool, device, first, budget):
    from app.containers import _refusal_fix
    from app.settings import ServeSettings

    fix = _refusal_fix(pool, ServeSettings(), device)
    assert fix.startswith(first) and budget in fix, fix


def _parsers(parser, path=("ft",)):
    """Every (command path, parser) under `parser`, itself included."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


def test_every_option_of_every_command_says_what_it_does():
    """`ft serve --help` listed --host, --port, --memory-ratio, --kv-reserve-tokens ... with no word; `ft bench ladder`
    --levels, --tokens, --warmup, smoke's --prompt and --expected, `ft ctl`'s --timeout likewise."""
    import argparse

    from app.cli import build_parser

    silent = [f"{' '.join(path)} {action.option_strings[-1]}"
              for path, parser in _parsers(build_parser()[0]) for action in parser._actions
              if action.option_strings and action.help is None]
    assert silent == [], silent
    # the defaults a new user needs are shown
    parsers = dict(_parsers(build_parser()[0]))
    ladder = " ".join(parsers[("ft", "bench", "ladder")].format_help().split())  # NOTE: unwrapped
    assert "(default: 1,2,4,8,16)" in ladder and "exit status: 0 every point measured; 3 " in ladder
    serve = " ".join(parsers[("ft", "serve")].format_help().split())
    for default in ("default 127.0.0.1", "default 1919", "default 4", "default 0.9", "default 8192"):
        assert default in serve, default
    assert argparse.SUPPRESS not in serve and "(default: None)" not in ladder


def test_cold_start_takes_no_option_of_a_server_to_reach(capsys):
    """cold-start measures the server it launches: --base-url, --model, --timeout, --routing and --logprobs were listed
    in its help and ignored."""
    for option in (["--base-url", "http://127.0.0.1:9"], ["--routing", "natural"], ["--logprobs"]):
        with pytest.raises(SystemExit) as info:
            main(["bench", "cold-start", *option, "--", "--device", "cpu"])
        assert info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["sweep", "--rebuild-wait", "4000"], ["sweep", "--rebuild-wait", "nan"],
                                  ["sweep", "--warmup", "-1"], ["ladder", "--warmup", "-1"],
                                  ["mixed", "--warmup-repeats", "-1"]])
def test_bench_refuses_counts_and_waits_the_run_could_not_use(args, capsys):
    """--rebuild-wait past the server's 3600 s was a refused rebuild at every point; a negative warm-up ran none."""
    with pytest.raises(SystemExit) as info:
        main(["bench", *args])
    assert info.value.code == 2 and args[1] in capsys.readouterr().err
