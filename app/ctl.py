"""`ft ctl`: inspect and resize a running server (health, stats, cache, generate)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.units import parse_count


def _count(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count_or_auto(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _count(text)


def _number(low: float, high: float, unit: str = "", low_open: bool = False):
    """An argparse type: a finite number (of `unit`) in [low, high] ((low, high] with low_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number{' of ' + unit if unit else ''}: {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:  # NOTE: False for nan
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low:g} and <= {high:g}"
                                             f"{' ' + unit if unit else ''}, got {text!r}")
        return value

    return parse


def _seconds(low: float, high: float, low_open: bool = False):
    return _number(low, high, "seconds", low_open)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


# NOTE: 0 to 2, the range the server takes (app.api.generation.build_sampling): ft ctl refuses nothing it would take;
# nan and inf were a traceback (httpx's JSON)
_temperature = _number(0, 2)


EXAMPLE = "http://localhost:1919"


def base_url_problem(text: str) -> str | None:
    """The --base-url `ft ctl` and `ft bench` take (or FT_BASE_URL), checked before any request, so a URL that could
    never work is an argument error (exit 2) naming it, not a connection failure (exit 1) after the run started.
    Why ``text`` is no http(s) URL with a host (None when it is one). A bare ``HOST:PORT`` gets the URL it
    most likely meant: httpx read "localhost:1919" as the scheme "localhost" ("unsupported protocol 'localhost://'")."""
    raw = str(text).strip()
    bare = re.fullmatch(r"[A-Za-z0-9.\-]+(:\d+)?(/\S*)?", raw) and not raw.lower().startswith("http")
    guess = f"http://{raw}" if bare else EXAMPLE
    try:
        url = httpx.URL(raw)
    except (httpx.InvalidURL, TypeError) as exc:
        return f"not a URL: {raw!r} ({exc}); expected http://HOST:PORT, e.g. {guess}"
    if "://" not in raw:
        return f"{raw!r} has no http:// or https:// scheme; did you mean {guess}?"
    if url.scheme not in ("http", "https"):
        return f"{raw!r}: the scheme must be http or https, not {url.scheme!r}; e.g. {EXAMPLE}"
    if not url.host:
        return f"{raw!r} names no host; expected http://HOST:PORT, e.g. {EXAMPLE}"
    return None


def _add_connection_options(p: argparse.ArgumentParser, defaults: bool, json_option: bool = True,
                            timeout_help: str = "seconds per request (default 30; a resize may take --wait seconds "
                                                "on top)") -> None:
    """`ft ctl`'s options, common to every subcommand (and `ft shell`'s, without --json: json_option False).
    defaults=False (a subcommand's copy): an option not given there is not set at all (argparse.SUPPRESS), so the
    value given before the subcommand, or its default, stays."""

    def default(value):
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--base-url", default=default(os.environ.get("FT_BASE_URL", "http://127.0.0.1:1919")), metavar="URL",
                   help="the server's URL (default FT_BASE_URL or http://127.0.0.1:1919); an OpenAI-style one ending "
                        "in /v1 is accepted")
    p.add_argument("--api-key", default=default(None), metavar="KEY", help="bearer token (default FT_API_KEY)")
    if json_option:
        p.add_argument("--json", action="store_true", default=default(False), help="print raw JSON instead of tables")
    p.add_argument("--timeout", type=_seconds(0, 86400, low_open=True), default=default(30.0), metavar="S",
                   help=timeout_help)


def add_ctl_parser(sub) -> None:
    p = sub.add_parser("ctl", help="talk to a running server")
    _add_connection_options(p, defaults=True)
    # NOTE: the same options after the subcommand too (`ft ctl generate hi --base-url URL`, as `ft bench ladder
    # --base-url URL` takes them); given in both places, the one after the subcommand wins
    common = argparse.ArgumentParser(add_help=False)
    _add_connection_options(common, defaults=False)
    cmds = p.add_subparsers(dest="ctl_command", required=True)
    cmds.add_parser("health", parents=[common], help="loading progress / ok / error")
    cmds.add_parser("stats", parents=[common], help="pools, throughput, TTFT, expert hit rate")
    cache = cmds.add_parser("cache", parents=[common], help="show pools; with --kv/--moe/--mamba, resize them live")
    cache.add_argument("--kv", type=_count_or_auto, default=None, metavar="N",
                       help="KV tokens (8k, 1.5m ...), or auto: whatever the budget leaves after the expert slots, "
                            "at most state slots x the model's context (KV no running sequence can use), so auto "
                            "can shrink the pool; a pool not given keeps its size")
    cache.add_argument("--moe", type=_count_or_auto, default=None, metavar="M",
                       help="expert slots, or auto: whatever the budget leaves after the KV pool")
    cache.add_argument("--mamba", type=_count, default=None, metavar="S",
                       help="GDN state slots (at most ft serve's --max-running-requests)")
    cache.add_argument("--wait", type=_seconds(0, 3600), default=60.0, metavar="SEC",
                       help="seconds to wait for in-flight requests (default 60; at most 3600, as the server allows)")
    gen = cmds.add_parser("generate", parents=[common], help="one chat completion, streamed")
    gen.add_argument("prompt", help="the user message")
    gen.add_argument("--max-tokens", type=_positive_int, default=128, help="output tokens at most (default 128)")
    gen.add_argument("--temperature", type=_temperature, default=0.0,
                     help="sampling temperature, 0 to 2 (default 0: greedy)")


class _Console(Console):
    """rich's Console, but a closed stdout ends the command like plain print() does: BrokenPipeError up to
    `ft`'s main (quiet exit 141), not rich's own SystemExit(1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # NOTE: nothing more is rendered into the closed pipe on the way out
        raise BrokenPipeError


def server_root(base_url: str) -> str:
    """The server's root URL: the OpenAI-style base URL users paste (`.../v1`, as OpenAI clients take it) is
    accepted too; ft ctl adds /v1 itself to the routes that have it (/health has not)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def _client(args) -> httpx.Client:
    key = args.api_key or os.environ.get("FT_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server_root(args.base_url), headers=headers, timeout=args.timeout)


def _table(title: str, rows: dict) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for key, value in rows.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        # NOTE: escaped: rich reads "[...]" in a cell as markup and drops it (a list value, a range in a message)
        table.add_row(escape(str(key)), "n/a" if value is None else escape(str(value)))
    return table


def _flatten(prefix: str, value) -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(f"{prefix}.{k}" if prefix else str(k), v))
        return out
    return {prefix: value}


def run_ctl(args) -> int:
    console = _Console()
    if (problem := base_url_problem(args.base_url)) is not None:  # NOTE: before any request: an argument error
        print(f"ft ctl: error: --base-url (or FT_BASE_URL): {problem}", file=sys.stderr)
        return 2
    try:
        with _client(args) as client:
            return _dispatch(args, client, console)
    except httpx.InvalidURL as exc:
        console.print(f"[red]--base-url {escape(args.base_url)}: {escape(str(exc))}[/red]")
        return 2
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot reach {escape(args.base_url)}: {escape(str(exc))}[/red]")
        return 1
    except json.JSONDecodeError:  # NOTE: r.json() of a 200 answer: something other than fluxtide on that port
        console.print(f"[red]{escape(args.base_url)} answered with something that is not JSON: is it a fluxtide server "
                      "(ft serve)?[/red]")
        return 1


def _show(args, console: Console, title: str, body: dict) -> None:
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        console.print(_table(title, _flatten("", body)))


def _dispatch(args, client: httpx.Client, console: Console) -> int:
    cmd = args.ctl_command
    if cmd == "health":
        r = client.get("/health")
        _show(args, console, "health", r.json())
        return 0 if r.status_code == 200 else 1
    if cmd == "stats":
        r = client.get("/v1/stats")
        if r.status_code != 200:
            return _error(args, console, r)
        body = r.json()
        if args.json:
            print(json.dumps(body, indent=2))
        else:
            console.print(_table("pools", _flatten("", body["pools"])))  # prefix_cache.* rows, as `ft ctl cache`
            console.print(_table("last window", _flatten("", body["window"])))
        return 0
    if cmd == "cache":
        if args.kv is None and args.moe is None and args.mamba is None:
            r = client.get("/v1/cache/status")
            if r.status_code != 200:
                return _error(args, console, r)
            _show(args, console, "cache", r.json())
            return 0
        payload = {"kv_tokens": args.kv, "moe_slots": args.moe, "mamba_slots": args.mamba, "wait_s": args.wait}
        r = client.post("/v1/cache/rebuild", json=payload, timeout=args.wait + args.timeout)
        if r.status_code != 200:
            return _error(args, console, r)
        body = r.json()
        if args.json:
            print(json.dumps(body, indent=2))
        else:
            console.print(f"[green]{escape(str(body['message']))}[/green]; {escape(str(body['kept']))}; "
                          f"{escape(resize_times(body))}; running limit {body.get('max_running')} sequences")
            table = Table(title="resize")
            for col in ("pool", "before", "after"):
                table.add_column(col)
            for key in ("kv_tokens", "expert_slots", "state_slots", "used_bytes", "free_bytes", "residency"):
                table.add_row(key, escape(str(body["before"][key])), escape(str(body["after"][key])))
            console.print(table)
        return 0
    if cmd == "generate":
        return _generate(args, client, console)
    return 2


def resize_times(body: dict) -> str:
    """A resize's seconds, the wait apart from the swap: "waited 0.6764 s" (the whole resize, as it once printed)
    read as requests that had blocked it when the swap had taken all but 2 ms."""
    if body.get("swap_s") is None:  # NOTE: a server from before the split: its waited_s is the whole resize
        return f"resized in {body['waited_s']} s"
    return (f"waited {body['waited_s']} s for in-flight requests, swapped the pools in {body['swap_s']} s "
            f"({body['total_s']} s in all)")


def _error(args, console: Console, r: httpx.Response) -> int:
    try:
        body = r.json()
    except ValueError:
        body = {"error": {"message": r.text}}
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        console.print(f"[red]HTTP {r.status_code}: {escape(str(body.get('error', {}).get('message', body)))}[/red]")
    return 1


def _generate(args, client: httpx.Client, console: Console) -> int:
    models = client.get("/v1/models")
    if models.status_code != 200:
        return _error(args, console, models)
    model = models.json()["data"][0]["id"]
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, finish_reason, text = None, None, []
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            r.read()
            return _error(args, console, r)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                if args.json:
                    print(json.dumps({"error": chunk["error"]}, indent=2))
                else:
                    console.print(f"\n[red]{escape(str(chunk['error']['message']))}[/red]")
                return 1
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content") or ""
                finish_reason = choice.get("finish_reason") or finish_reason
                if args.json:  # NOTE: one JSON object at the end, as every other subcommand prints under --json
                    text.append(piece)
                else:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            usage = chunk.get("usage") or usage
    if args.json:
        print(json.dumps({"model": model, "text": "".join(text), "finish_reason": finish_reason, "usage": usage},
                         indent=2))
        return 0
    print()
    if usage:  # NOTE: on stderr: `ft ctl generate ... | ...` reads the answer alone
        _Console(stderr=True).print(f"[dim]{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion "
                                    "tokens[/dim]")
    return 0
