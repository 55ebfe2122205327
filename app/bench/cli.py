"""`ft bench ...`: the parser and the runner that writes one JSON record per run.

Exit codes, the same for every subcommand (docs/benchmarks.md): 0 every point measured; 3 the run went to its end
but something it measured failed, a point or every point (the record says which and why); 1 the run could not be
done, nothing was measured (unreachable server, no model, calibration failed, ...); 2 bad arguments; 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path

from app.bench import cold_start, ladder, mixed, prefill, probe, routing, smoke, sweep, target, turns, view
from app.bench.context import Ctx
from app.bench.plot import missing as plot_missing
from app.bench.plot import plot
from app.bench.record import Record, default_out, redacted
from app.bench.target import BenchError
from app.ctl import base_url_problem, server_root
from app.units import parse_count


def _counts(text: str) -> list[int]:
    try:
        values = [parse_count(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive counts, got {text!r}")
    return values


def _count(text: str) -> int:
    """One positive count (16384, 16k)."""
    try:
        value = parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive count (e.g. 512 or 16k), got {text!r}")
    return value


def _kv_list(text: str) -> list:
    return ["current"] if text.strip() == "current" else _counts(text)


def _moe(text: str) -> int | str:
    return "auto" if text == "auto" else _counts(text)[0]


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not 0 < value < math.inf:  # NOTE: False for nan (a ValueError traceback from the event loop) and inf
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value
    return parse


def _seconds(text: str) -> float:
    """Seconds a rebuild may wait: the server's own range, [0, 3600] (a value past it was a refused rebuild per point)."""
    value = float(text)
    if not 0 <= value <= 3600:  # NOTE: False for nan
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600 seconds, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _url(text: str) -> str:
    """An http(s) URL with a host (app.ctl.base_url_problem): a malformed one was an httpx.InvalidURL traceback, one without a
    scheme a 'cannot reach' failure after the run had started. Returned as the server's root (app.ctl.server_root, as
    ft ctl and ft shell take it): the OpenAI-style `.../v1` users paste was asked for /v1/v1/models (HTTP 404)."""
    if (problem := base_url_problem(text)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return server_root(text)


class _Help(argparse.HelpFormatter):
    """Each option's default after its help, where the help does not give it already (lists as typed: 1,3,4,6)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == argparse.SUPPRESS \
                or not action.option_strings:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


EXIT_CODES = ("exit status: 0 every point measured; 3 the run went to its end but something it measured failed (the "
              "record's failures say what); 1 the run could not be done (unreachable server, no model, ...); 2 bad "
              "arguments; 130 interrupted (docs/benchmarks.md)")


def _common(plot_option: bool = False, http: bool = True) -> argparse.ArgumentParser:
    """The options every subcommand takes; http=False (cold-start, which launches its own server): only those of the
    record, not those of a server to reach."""
    p = argparse.ArgumentParser(add_help=False)
    if http:
        p.add_argument("--base-url", action="append", default=None, type=_url,
                       help="the OpenAI-compatible server (fluxtide or any other; default FT_BASE_URL or "
                            "http://127.0.0.1:1919; one ending in /v1 is accepted); repeat it to measure several "
                            "servers one after another in one call: one record each (OUT-1.json, OUT-2.json ...) "
                            "and a side-by-side table")
        p.add_argument("--api-key", default=None, help="bearer token (default FT_API_KEY)")
        p.add_argument("--model", default=None, help="model id to ask for (default: the first /v1/models lists)")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="checkpoint folder: its config.json gives the record's geometry and format")
    p.add_argument("--out", default=None, metavar="FILE", help="JSON record path (default ft-bench-KIND-TIMESTAMP.json)")
    if http:
        p.add_argument("--timeout", type=_positive(float), default=600.0, help="seconds per request")
        p.add_argument("--logprobs", action="store_true",
                       help="ask for logprobs so every token gets its own arrival time (costs the server a little)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the pinned host->device copy measurement")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or tables (failures and the record's path still go to stderr)")
    if http:
        p.add_argument("--routing", choices=routing.CHOICES, default="both",
                       help="a server started with --routing-replay: both (its replay, then natural routing beside "
                            "it into OUT-natural.json, linked), server (its mode only) or natural (replay switched "
                            "off)")
    if plot_option:
        p.add_argument("--plot", default=None, metavar="FILE",
                       help="also draw the figures (png, svg, pdf); needs matplotlib (pip install -e '.[sim]')")
    return p


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark a server over HTTP (writes a JSON record)", epilog=EXIT_CODES)
    cmds = p.add_subparsers(dest="bench_command", required=True)

    def command(name: str, common: argparse.ArgumentParser, text: str) -> argparse.ArgumentParser:
        return cmds.add_parser(name, parents=[common], help=text, description=text, epilog=EXIT_CODES,
                               formatter_class=_Help)

    s = command("sweep", _common(plot_option=True), "the customer's KV-pool sweep")
    s.add_argument("--kv", type=_kv_list, default=[8192, 65536, 131072, 262144, 400000, 524288, 655360, 700000],
                   help="KV sizes to rebuild to, in order (8k,64k,...), or 'current' (no rebuild)")
    s.add_argument("--moe", type=_moe, default="auto", help="expert slots at each point (auto: fill the budget)")
    s.add_argument("--batch", type=_counts, default=[1, 3, 4, 6], help="batch sizes (concurrent requests)")
    s.add_argument("--warmup", type=_non_negative, default=2, help="warm-up rounds per point")
    s.add_argument("--warmup-tokens", type=_positive(int), default=64, help="output tokens per warm-up request")
    s.add_argument("--iterations", type=_positive(int), default=2, help="measured rounds per point")
    s.add_argument("--tokens", type=_positive(int), default=128, help="output tokens per measured request")
    s.add_argument("--rebuild-wait", type=_seconds, default=120.0,
                   help="seconds a rebuild may wait for requests still running (0 to 3600)")
    s = command("ladder", _common(plot_option=True), "concurrency ladder")
    s.add_argument("--levels", type=_counts, default=[1, 2, 4, 8, 16], help="simultaneous requests of each rung")
    s.add_argument("--tokens", type=_positive(int), default=128, help="output tokens per measured request")
    s.add_argument("--rounds", type=_positive(int), default=1, help="measured rounds per rung")
    s.add_argument("--warmup", type=_non_negative, default=1, help="warm-up rounds per rung")
    s.add_argument("--warmup-tokens", type=_positive(int), default=64, help="output tokens per warm-up request")
    s.add_argument("--sample-s", type=_positive(float), default=0.05,
                   help="seconds between polls of the running and waiting requests (llama.cpp's /metrics; a server "
                        "with high-water marks, fluxtide's, is not polled)")
    s = command("probe", _common(), "warmed single streams")
    s.add_argument("--lengths", type=_counts, default=[127, 255, 1023], help="output tokens of each stream")
    s.add_argument("--repeats", type=_positive(int), default=3,
                   help="measured streams per length, one after another (after one warm-up request)")
    s.add_argument("--warmup-tokens", type=_positive(int), default=64, help="output tokens of the warm-up request")
    s = command("prefill", _common(), "TTFT and prefill tok/s of long prompts")
    s.add_argument("--sizes", type=_counts, default=[1024, 4096, 8192, 16384, 32768],
                   help="prompt sizes in tokens (1k,4k,...; sized on the server's tokenizer)")
    s.add_argument("--repeats", type=_positive(int), default=2, help="measured requests per size")
    s.add_argument("--warmup", type=_non_negative, default=1,
                   help="unmeasured requests per size first (a new size's first request can pay one-time costs; "
                        "kept in the record as warmup_runs and first_ttft_s)")
    s = command("mixed", _common(), "gaps between the tokens of running streams while a long prompt prefills")
    s.add_argument("--streams", type=_positive(int), default=3, help="running streams")
    s.add_argument("--prompt-tokens", type=lambda t: _counts(t)[0], default=8192,
                   help="the long prompt's size in tokens (sized on the server's tokenizer)")
    s.add_argument("--stream-tokens", type=_positive(int), default=2048,
                   help="max_tokens of each stream (they are closed once the prompt's first token is in)")
    s.add_argument("--warmup-tokens", type=_positive(int), default=16,
                   help="tokens every stream has before the baseline window opens (steady decode)")
    s.add_argument("--baseline-tokens", type=_positive(int), default=64,
                   help="tokens every stream gets in the baseline window, before the long prompt is sent")
    s.add_argument("--repeats", type=_positive(int), default=3, help="repeats, each with fresh streams")
    s.add_argument("--warmup-repeats", type=_non_negative, default=1,
                   help="unrecorded repeats first (the first long prefill compiles and tunes kernels)")
    s.add_argument("--target-gap-ms", type=_positive(float), default=mixed.TARGET_GAP_P99_MS,
                   help="a p99 gap to judge the run against (within_gap_threshold); meets_target is always "
                        "issue 9's 150 ms, and only for a run of its scenario (3 streams, an 8,192-token "
                        "prompt or longer, H200, block FP8, <= 24 GiB budget, >= 8k KV)")
    s = command("turns", _common(), "turn 2's TTFT after a long shared prefix, resumed from the prefix cache, "
                                    "against turn 1's")
    s.add_argument("--prefix-tokens", type=_count, default=16384,
                   help="the shared prefix's size in tokens (a system message, sized on the server's tokenizer)")
    s.add_argument("--follow-up-tokens", type=_count, default=64, help="about the size of turn 2's new question")
    s.add_argument("--max-tokens", type=_positive(int), default=32, help="tokens each turn generates (turn 1's answer)")
    s.add_argument("--repeats", type=_positive(int), default=3, help="measured conversations, each with a fresh prefix")
    s.add_argument("--warmup", type=_non_negative, default=1, help="unmeasured conversations first")
    s.add_argument("--max-ratio", type=_positive(float), default=0.15,
                   help="the criterion: median turn-2 TTFT / turn-1 TTFT at most this (meets_max_ratio; issue 14)")
    s = command("smoke", _common(), "one question with one exact answer (a wrong one fails the run)")
    s.add_argument("--prompt", default="What is 19 + 23?", help="the question, sent greedily as one chat message")
    s.add_argument("--expected", default="42", help="the answer it must give")
    s.add_argument("--match", choices=("exact", "contains"), default="exact",
                   help="exact: the whole answer, whitespace trimmed; contains: the expected answer as a whole word")
    s.add_argument("--max-tokens", type=_positive(int), default=16, help="output tokens at most")
    s = command("cold-start", _common(http=False),
                "launch `ft serve ARGS` and time its start-up (ft bench cold-start -- --model DIR)")
    s.add_argument("--poll-s", type=_positive(float), default=0.02,
                   help="seconds between polls of /v1/models and /health")
    s.add_argument("--start-timeout", type=_positive(float), default=1800.0,
                   help="seconds the server may take to answer /health ok")
    s.add_argument("serve_args", nargs=argparse.REMAINDER, help="arguments for ft serve, after --")


def _settings(args) -> dict:
    skip = {"command", "bench_command", "api_key"}
    settings = {k: v for k, v in vars(args).items() if k not in skip}
    if "serve_args" in settings:  # cold-start: ft serve's own --api-key stays out of the record too
        settings["serve_args"] = redacted(settings["serve_args"])
    return settings


async def _http_run(args, record: Record) -> None:
    async with target.client_for(args.base_url, args.api_key or os.environ.get("FT_API_KEY"),
                                 max(getattr(args, "batch", None) or getattr(args, "levels", None)
                                     or [getattr(args, "streams", 0) + 1]),
                                 args.timeout) as client:
        model = await target.model_id(client, args.model)
        await record.describe_target(client, args.base_url, model, args.model_dir)
        record.profile_hardware(not args.no_bandwidth)
        with view.progress(args.quiet) as progress:
            ctx = Ctx(client, model, record, progress, args.timeout, args.logprobs)
            kind = args.bench_command
            if kind == "sweep":
                await sweep.run(ctx, kv_sizes=args.kv, moe=args.moe, batch_sizes=args.batch, warmup=args.warmup,
                                warmup_tokens=args.warmup_tokens, iterations=args.iterations, tokens=args.tokens,
                                rebuild_wait=args.rebuild_wait)
            elif kind == "ladder":
                await ladder.run(ctx, levels=args.levels, tokens=args.tokens, rounds=args.rounds,
                                 warmup=args.warmup, warmup_tokens=args.warmup_tokens, sample_s=args.sample_s)
            elif kind == "probe":
                await probe.run(ctx, lengths=args.lengths, repeats=args.repeats, warmup_tokens=args.warmup_tokens)
            elif kind == "prefill":
                await prefill.run(ctx, sizes=args.sizes, repeats=args.repeats, warmup=args.warmup)
            elif kind == "mixed":
                await mixed.run(ctx, streams=args.streams, prompt_tokens=args.prompt_tokens,
                                stream_tokens=args.stream_tokens, warmup_tokens=args.warmup_tokens,
                                baseline_tokens=args.baseline_tokens, repeats=args.repeats,
                                warmup_repeats=args.warmup_repeats, target_gap_p99_ms=args.target_gap_ms)
            elif kind == "turns":
                await turns.run(ctx, prefix_tokens=args.prefix_tokens, follow_up_tokens=args.follow_up_tokens,
                                max_tokens=args.max_tokens, repeats=args.repeats, warmup=args.warmup,
                                max_ratio=args.max_ratio)
            elif kind == "smoke":
                await smoke.run(ctx, prompt=args.prompt, expected=args.expected, match=args.match,
                                max_tokens=args.max_tokens)
        record.data["server_after"] = {"stats": (await target.describe(client))["stats"]}


async def _cold_start(args, record: Record) -> None:
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    with view.progress(args.quiet) as progress:
        await cold_start.run(record, progress, serve_args=serve_args, timeout=args.start_timeout,
                             poll_s=args.poll_s, model_dir=args.model_dir, measure_bandwidth=not args.no_bandwidth)


def _one(args, out: str) -> tuple[int, Record, str]:
    kind = args.bench_command
    record = Record(kind, _settings(args))
    code = 0
    try:
        asyncio.run(_cold_start(args, record) if kind == "cold-start" else _http_run(args, record))
    except BenchError as exc:
        record.fail("run", str(exc))
        code = 1
    except KeyboardInterrupt:
        record.fail("run", "interrupted")
        code = 130
    finally:
        path = record.finish(out)
    view.show(record.data, path, args.quiet)
    if getattr(args, "plot", None) and record.points:
        plot(record.data, args.plot)
    return code or (3 if record.data["failures"] else 0), record, str(path)


def _numbered(path: str | None, i: int) -> str | None:
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{i}{p.suffix}"))


def run_bench(args) -> int:
    kind = args.bench_command
    if getattr(args, "plot", None) and (why := plot_missing()):
        print(f"ft bench: error: {why}", file=sys.stderr)
        return 2
    out = args.out or default_out(kind)
    if kind == "cold-start":  # NOTE: it reaches the server it launches, not FT_BASE_URL's
        return _one(args, out)[0]
    urls = args.base_url or [os.environ.get("FT_BASE_URL", "http://127.0.0.1:1919")]
    if not args.base_url:  # NOTE: --base-url is checked and made a root by argparse (_url)
        if (problem := base_url_problem(urls[0])) is not None:
            print(f"ft bench: error: FT_BASE_URL: {problem}", file=sys.stderr)
            return 2
        urls = [server_root(urls[0])]
    codes, records = [], []
    for i, url in enumerate(urls, 1):
        several = len(urls) > 1
        plot_path = _numbered(getattr(args, "plot", None), i) if several else getattr(args, "plot", None)
        one = argparse.Namespace(**{**vars(args), "base_url": url, "plot": plot_path})
        url_out = _numbered(out, i) if several else out

        def one_pass(path: str, one=one, url_out=url_out) -> tuple[int, Record, str]:
            natural = path != url_out  # the natural pass beside a replay: its own plot file
            plot = routing.natural_path(one.plot) if natural and one.plot else one.plot
            return _one(argparse.Namespace(**{**vars(one), "plot": plot}), path)

        key = args.api_key or os.environ.get("FT_API_KEY")
        try:
            code, done = routing.run_passes(args.routing, url, key, url_out, one_pass,
                                            routing.server_replay(url, key))
        except BenchError as exc:
            print(f"ft bench: {exc}", file=sys.stderr)
            code, done = 1, []
        codes.append(code)
        records += done
    if len(records) > 1 and not args.quiet:
        view.wide_console().print(view.side_by_side(records))
    return max(codes)
