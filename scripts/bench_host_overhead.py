"""Host overhead of the serving loop per decode step: everything the host does besides waiting for
the model step (scheduler, sampled-token bookkeeping, detokenization, stop strings, stream events, the
pools snapshot, metrics, the event-loop handoff, SSE encoding), with a model step that costs nothing
but time.

    python scripts/bench_host_overhead.py [--tokens 256] [--concurrency 1,4,16] [--step-ms 2.84] [--out rec.json]
    python scripts/bench_host_overhead.py --base-url http://127.0.0.1:8101 --model NAME   # a running server

Default mode: the script starts a real server (the real container, engine, scheduler, Litestar and
uvicorn on 127.0.0.1) in a CHILD process whose executor is `NullExecutor`: no model; each step returns
the next token of a fixed English/UTF-8 passage (so detokenization does real work). With --step-ms it
acts like the graph-captured executor as the host sees it: a launch that lets go of the GIL once, then
a "device" that runs --step-ms from the launch while the host may do other things (the launch hook,
`on_launched`), then the read-back wait with the GIL released. The tokenizer is the real Qwen3.5/3.6
one (adapters.checkpoint.hf_tokenizer) unless --tokenizer names another. The parent streams chat
completions (the ft bench client: greedy, ignore_eos) at each concurrency, --repeats times, keeps the
median run and reports per decode step (one token for every running stream):

- `overhead_us_per_step`: the step period (step_us_mean + host_us_mean, this run's own means from the
  ft_step_seconds / ft_step_host_seconds histograms) minus the device time (`device_wait_us_mean`,
  launch to result): what serving adds to the device step;
- `cpu_us_per_step` by thread (engine, HTTP event loop, other) from /proc/self/task/<tid>/schedstat;
- `engine_phases_us` / `engine_phases_cpu_us`: the engine thread's wall / CPU time per step in each part
  of its loop (wrappers the child installs on its one engine object; nothing in app/ is changed for it;
  wall minus CPU is time spent waiting: for the GIL, or off the CPU; the last step's deferred work, i.e.
  stream_events, record_step_stats, publish_pools and flush_to_loops, runs inside model_step's launch hook on
  an executor with one, so those phases nest in model_step there: ADR 0019);
- the client's steady inter-token interval and the /v1/stats window percentiles (30 s window).
--profile DIR also writes cProfile stats of the engine thread and of the HTTP thread (pstats files) and
reports `python_calls_per_step` per thread: deterministic where the times are noisy (the profiler slows
everything, so compare times from runs without it).

--base-url measures a running server instead (on the GPU machine): the same streams, the step and
host means from its histograms, no thread CPU or phases (those need the child).
These are HOST-overhead numbers; on the CPU they are not GPU speed claims.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PASSAGE = (
    "The engine streams each request's text as it is decoded. A token's bytes may end in the middle of a "
    "character, as in café, naïve, Zürich, 東京 or 😀, so the detokenizer holds such bytes back until the "
    "next token completes them. Numbers like 3.14159 and code like `def f(x): return x * 2` show up too.\n"
)
MODEL = "host-overhead-null"
_STAGING = bytes(4096)


# -- child: the server with a null executor ---------------------------------------------------------------
class NullExecutor:
    """The ModelExecutor port with no model: every sampled work gets the passage's token at its position
    (deterministic, batch-independent). With `step_s` > 0 it behaves like the graph-captured executor as the
    host sees it: a launch that lets go of the GIL once (the input staging copy), then the "device" runs
    for `step_s` from the launch whatever the host does: the launch hook (`on_launched`, unless `hook` is
    False), then the wait for the rest of `step_s` with the GIL released (the read-back). Keeps no pools (the scheduler owns the ids)."""

    def __init__(self, token_ids: list[int], step_s: float, hook: bool = True) -> None:
        if not token_ids:
            raise ValueError("NullExecutor needs a non-empty token cycle")
        self.token_ids = token_ids
        self.step_s = step_s
        self.waited_s = 0.0  # launch to result, summed (sleep overshoots step_s by tens of microseconds)
        if hook:
            self.on_launched = None

    def execute(self, batch):
        from domain.ports import SampledToken

        if self.step_s > 0:
            # the input staging copy: a short C call that releases the GIL (as torch's bindings do) without
            # giving up the CPU (hashlib lets go of the GIL above 2 KiB)
            hashlib.sha256(_STAGING)
        launched = time.perf_counter()  # the "device" runs from here, whatever the host does meanwhile
        hook = getattr(self, "on_launched", None)
        if hook is not None:
            hook()
        if self.step_s > 0:
            time.sleep(max(0.0, launched + self.step_s - time.perf_counter()))
            self.waited_s += time.perf_counter() - launched
        ids = self.token_ids
        return {w.request_id: SampledToken(w.request_id, ids[w.end_position % len(ids)])
                for w in batch.works if w.sample}

    def resize_pools(self, plan) -> None:
        pass


def _tokenizer_dir(name: str) -> Path:
    if name == "qwen":
        from adapters.checkpoint.hf_tokenizer import cached_tokenizer_files

        return cached_tokenizer_files()
    if name == "demo":
        from app.demo_model import DEMO_MODEL_DIR

        return DEMO_MODEL_DIR
    return Path(name)


def _spec(vocab_size: int):
    from domain.model_spec import LayerKind, ModelSpec

    return ModelSpec(
        name=MODEL, architecture="qwen3_5_moe", hidden_size=64,
        layer_kinds=(LayerKind.LINEAR_ATTENTION, LayerKind.FULL_ATTENTION), num_experts=8, top_k=2,
        expert_intermediate=32, shared_expert_intermediate=32, num_attention_heads=4, num_kv_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel=4, vocab_size=vocab_size, max_context=65536)


class _Phases:
    """Engine-thread time per loop part: wrappers around bound methods of ONE engine object."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)  # wall time
        self.cpu: dict[str, float] = defaultdict(float)  # the engine thread's CPU time (wall - cpu: waiting)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps = 0

    def wrap(self, owner, attr: str, name: str) -> None:
        inner = getattr(owner, attr)
        seconds, cpu, calls, clock, cpu_clock = self.seconds, self.cpu, self.calls, time.perf_counter, time.thread_time

        def timed(*args, **kwargs):
            t0, c0 = clock(), cpu_clock()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[name] += clock() - t0
                cpu[name] += cpu_clock() - c0
                calls[name] += 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.cpu.clear()
        self.calls.clear()


def _thread_cpu_ns() -> dict[str, int]:
    """CPU nanoseconds each thread of this process has run (schedstat), by thread name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, int] = defaultdict(int)
    for tid in os.listdir("/proc/self/task"):
        try:
            run_ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        name = names.get(int(tid), "other")
        out[name if name in ("fluxtide-engine", "fluxtide-http") else "other"] += run_ns
    return dict(out)


def _start_profile(profiles: dict, name: str) -> None:
    """Called on the thread to profile (cProfile hooks the calling thread only)."""
    profiles[name] = prof = cProfile.Profile()
    prof.enable()


def _stop_profile(profiles: dict, name: str) -> None:
    if name in profiles:
        profiles[name].disable()


def serve_child(args) -> None:
    """Start the server, print its port, then obey commands on stdin (one per line):
    `mark` (snapshot timers), `report` (JSON of everything since the mark), `quit`."""
    from dependency_injector import providers

    from adapters.checkpoint.tokenizer import load_tokenizer
    from app.containers import Container
    from app.engine import Engine
    from app.serving import RunningServer
    from app.settings import ServeSettings

    tokenizer = load_tokenizer(_tokenizer_dir(args.tokenizer))
    token_ids = tokenizer.encode(PASSAGE)
    phases = _Phases()
    profiles: dict[str, cProfile.Profile] = {}
    want_profile = threading.Event()

    def engine_factory(**kw):
        engine = Engine(**kw)
        phases.wrap(engine, "_drain_commands", "commands")
        phases.wrap(engine.scheduler, "schedule", "schedule")
        phases.wrap(engine.executor, "execute", "model_step")
        phases.wrap(engine.scheduler, "complete", "scheduler_complete")
        phases.wrap(engine._publisher, "measure_step", "measure_step")
        phases.wrap(engine._publisher, "record", "record_step_stats")
        phases.wrap(engine._streams, "on_event", "stream_events")
        phases.wrap(engine, "_publish_pools", "publish_pools")
        phases.wrap(engine._streams, "flush", "flush_to_loops")
        drain = engine._drain_commands

        def drain_and_profile():  # runs on the engine thread: (un)install its profiler there
            prof = profiles.get("engine")
            if want_profile.is_set() and prof is None:
                profiles["engine"] = prof = cProfile.Profile()
                prof.enable()
            elif not want_profile.is_set() and prof is not None and not getattr(prof, "done", False):
                prof.disable()
                prof.done = True
            return drain()

        engine._drain_commands = drain_and_profile
        return engine

    container = Container()
    container.model_spec.override(providers.Object(_spec(tokenizer.vocab_size)))
    container.generation_config.override(providers.Object({"temperature": 0.0, "top_p": 1.0}))
    container.tokenizer.override(providers.Object(tokenizer))
    container.device.override(providers.Object("cpu"))
    executor = NullExecutor(token_ids, args.step_ms / 1000, hook=not args.no_launch_hook)
    container.executor.override(providers.Object(executor))
    container.engine.override(providers.Singleton(
        lambda settings, **kw: engine_factory(debug=False, **kw), container.settings,
        scheduler=container.scheduler, allocator=container.allocator, executor=container.executor,
        tokenizer=container.tokenizer, spec=container.model_spec, budget=container.budget,
        plan=container.pool_plan, stats=container.stats, eos_token_ids=container.eos_token_ids,
        routing_replay=container.routing_replay))
    settings = ServeSettings(served_model_name=MODEL, port=0, device="cpu", gpu_budget_gib=0.5,
                             kv_tokens=262144, moe_slots=8, max_running_requests=16, max_prefill_length=2048,
                             reasoning_parser="none", tool_call_parser="none")
    server = RunningServer(container, settings).start(wait_ready=60)
    # NOTE: uvicorn's event loop (bench-only reach into asyncio.Server's private _loop) runs the HTTP side.
    http_loop = server.http.server.servers[0]._loop
    print(json.dumps({"port": server.port}), flush=True)
    mark_cpu: dict[str, int] = {}
    for line in sys.stdin:
        command = line.strip()
        if command == "mark":
            phases.reset()
            executor.waited_s = 0.0
            mark_cpu = _thread_cpu_ns()
            if args.profile:
                want_profile.set()
                http_loop.call_soon_threadsafe(_start_profile, profiles, "http")
            print(json.dumps({"ok": True}), flush=True)
        elif command == "report":
            cpu = _thread_cpu_ns()
            calls: dict[str, int] = {}
            want_profile.clear()
            if args.profile:
                http_loop.call_soon_threadsafe(_stop_profile, profiles, "http")
                time.sleep(1.2)  # the engine loop wakes at least once a second: it stops its profiler
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                for thread in ("engine", "http"):
                    if thread in profiles:
                        prof = profiles.pop(thread)
                        prof.dump_stats(str(Path(args.profile) / f"{thread}_{args.tag}.pstats"))
                        # Python function calls are deterministic where times are noisy: work, not speed
                        calls[thread] = pstats.Stats(prof).total_calls
            report = {
                "phase_seconds": dict(phases.seconds), "phase_cpu_seconds": dict(phases.cpu),
                "phase_calls": dict(phases.calls),
                "thread_cpu_ns": {k: cpu.get(k, 0) - mark_cpu.get(k, 0) for k in cpu},
                "waited_s": executor.waited_s, "python_calls": calls,
            }
            print(json.dumps(report), flush=True)
        elif command == "quit":
            break
    server.stop()


# -- parent: the client and the record ---------------------------------------------------------------------
def _histograms(base_url: str, api_key: str | None) -> dict[str, float]:
    """Cumulative sums and counts of the step and host-time histograms (/metrics)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("ft_step_seconds_sum", "ft_step_seconds_count", "ft_step_host_seconds_sum",
                    "ft_step_host_seconds_count"):
            out[name] = float(value)
    return out


def _get_json(base_url: str, path: str, api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(base_url + path, headers=headers, timeout=30).json()


async def _round(base_url: str, model: str, concurrency: int, tokens: int, api_key: str | None,
                 prompt_tokens: int = 0):
    import httpx

    from app.bench.client import chat_body, run_round

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as client:
        filler = " lorem" * prompt_tokens  # about one token each
        bodies = [chat_body(model, f"Say something long ({i}).{filler}", tokens) for i in range(concurrency)]
        return await run_round(client, bodies, timeout=120)


def _steady_interval_us(rnd) -> float | None:
    gaps = []
    for r in rnd.ok_results:
        times = r.token_times
        gaps += [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # skip the first (TTFT) gap
    return statistics.median(gaps) * 1e6 if gaps else None


def measure(args, child: subprocess.Popen | None, base_url: str, model: str) -> list[dict]:
    def command(cmd: str) -> dict:
        child.stdin.write(cmd + "\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    results = []
    for concurrency in args.concurrency:
        asyncio.run(_round(base_url, model, concurrency, min(args.tokens, 32), args.api_key,
                           args.prompt_tokens))  # warm-up
        runs = []
        for _ in range(args.repeats):
            time.sleep(0.5)  # the last run's stragglers (aborts, metrics) settle before the mark
            if child is not None:
                command("mark")
            before = _histograms(base_url, args.api_key)
            t0 = time.perf_counter()
            rnd = asyncio.run(_round(base_url, model, concurrency, args.tokens, args.api_key, args.prompt_tokens))
            wall = time.perf_counter() - t0
            window = _get_json(base_url, "/v1/stats", args.api_key)
            window["histograms"] = _histograms(base_url, args.api_key)
            report = command("report") if child is not None else None
            if len(rnd.ok_results) != concurrency:
                raise SystemExit(f"c{concurrency}: {[r.error for r in rnd.results if not r.ok]}")
            runs.append(_summarise(concurrency, rnd, wall, before, window, report))
        results.append(_median_run(runs))
        print(json.dumps(results[-1]), flush=True)
    return results


def _stats_numbers(stats: dict) -> dict:
    w = stats.get("window", stats)
    return {"steps": w.get("steps"), "step_p50": (w.get("step_s") or {}).get("decode_p50"),
            "host_p50": (w.get("host_s") or {}).get("p50"), "host_p90": (w.get("host_s") or {}).get("p90"),
            "decode_tokens": w.get("decode_tokens")}


def _summarise(concurrency: int, rnd, wall: float, before: dict, after: dict, report: dict | None) -> dict:
    s = _stats_numbers(after)
    tokens = rnd.tokens
    out = {
        "concurrency": concurrency, "tokens": tokens, "wall_s": round(wall, 4),
        "aggregate_tok_s": round(rnd.aggregate_tok_s or 0, 1),
        "client_steady_interval_us": _round_or_none(_steady_interval_us(rnd)),
        # /v1/stats percentiles: its window spans the last 30 s (earlier runs too)
        "window_step_us_p50": _round_or_none(s["step_p50"] and s["step_p50"] * 1e6),
        "window_host_us_p50": _round_or_none(s["host_p50"] and s["host_p50"] * 1e6),
        "window_host_us_p90": _round_or_none(s["host_p90"] and s["host_p90"] * 1e6),
    }
    # This run's own means, from the histograms' cumulative sums (the /v1/stats window spans 30 s).
    h, b = after["histograms"], before
    steps_n = h.get("ft_step_seconds_count", 0) - b.get("ft_step_seconds_count", 0)
    host_n = h.get("ft_step_host_seconds_count", 0) - b.get("ft_step_host_seconds_count", 0)
    if steps_n and host_n:
        out["step_us_mean"] = round((h["ft_step_seconds_sum"] - b["ft_step_seconds_sum"]) / steps_n * 1e6, 1)
        out["host_us_mean"] = round((h["ft_step_host_seconds_sum"] - b["ft_step_host_seconds_sum"]) / host_n * 1e6, 1)
        out["period_us_mean"] = round(out["step_us_mean"] + out["host_us_mean"], 1)
    if report is not None:
        calls = report["phase_calls"].get("model_step", 0) or 1
        steps = calls  # the model calls this run made (more than tokens / concurrency when streams stagger)
        cpu = report["thread_cpu_ns"]
        out["cpu_us_per_step"] = {k: round(v / 1e3 / steps, 1) for k, v in sorted(cpu.items())}
        out["cpu_us_per_step"]["total"] = round(sum(cpu.values()) / 1e3 / steps, 1)
        out["cpu_us_per_token"] = round(sum(cpu.values()) / 1e3 / max(1, tokens), 1)
        if report.get("python_calls"):
            out["python_calls_per_step"] = {k: round(v / steps) for k, v in report["python_calls"].items()}
        out["engine_phases_us"] = {k: round(v * 1e6 / calls, 1) for k, v in sorted(report["phase_seconds"].items())}
        out["engine_phases_cpu_us"] = {k: round(v * 1e6 / calls, 1)
                                       for k, v in sorted(report["phase_cpu_seconds"].items())}
        out["model_steps"] = calls
        if "period_us_mean" in out:  # what serving adds to the device step: the host overhead per step
            out["device_wait_us_mean"] = round(report["waited_s"] * 1e6 / calls, 1)
            out["overhead_us_per_step"] = round(out["period_us_mean"] - out["device_wait_us_mean"], 1)
    return out


def _round_or_none(x):
    return None if x is None else round(x, 1)


def _median_run(runs: list[dict]) -> dict:
    """The run with the median overhead (or host time, or interval): one coherent run, not a mix of medians."""
    key = next(k for k in ("overhead_us_per_step", "host_us_mean", "client_steady_interval_us")
               if runs[0].get(k) is not None)
    ordered = sorted(runs, key=lambda r: r.get(key) or 0)
    chosen = dict(ordered[len(ordered) // 2])
    chosen["repeats"] = len(runs)
    chosen[f"all_{key}"] = [r.get(key) for r in runs]
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256, help="completion tokens per request")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--prompt-tokens", type=int, default=0, help="pad each prompt with about this many tokens")
    p.add_argument("--repeats", type=int, default=3, help="runs per concurrency; the median run is kept")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="null executor: device time per step, from its launch (the GPU's bs1 step: 2.84)")
    p.add_argument("--no-launch-hook", action="store_true",
                   help="null executor without the on_launched hook (events handed over before each step)")
    p.add_argument("--tokenizer", default="qwen", help="qwen | demo | a directory with tokenizer.json")
    p.add_argument("--profile", default=None, help="directory for cProfile stats of the engine thread")
    p.add_argument("--tag", default="run", help="label in the record and the profile file names")
    p.add_argument("--out", default=None, help="write the JSON record here")
    p.add_argument("--base-url", default=None, help="measure this running server instead of a child")
    p.add_argument("--model", default=MODEL, help="served model name (with --base-url)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_child:
        serve_child(args)
        return 0
    child = None
    base_url, model = args.base_url, args.model
    if base_url is None:
        cmd = [sys.executable, __file__, "--serve-child", "--step-ms", str(args.step_ms), "--tokenizer",
               args.tokenizer, "--tag", args.tag] + (["--profile", args.profile] if args.profile else []) + (
               ["--no-launch-hook"] if args.no_launch_hook else [])
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = child.stdout.readline()
        if not line:
            raise SystemExit("the server child did not start")
        base_url, model = f"http://127.0.0.1:{json.loads(line)['port']}", MODEL
    try:
        results = measure(args, child, base_url, model)
    finally:
        if child is not None:
            child.stdin.write("quit\n")
            child.stdin.flush()
            child.wait(30)
    record = {"kind": "host_overhead", "tag": args.tag, "mode": "child-null-executor" if args.base_url is None
              else "running-server", "step_ms": args.step_ms, "launch_hook": not args.no_launch_hook, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens, "tokenizer": args.tokenizer,
              "python": sys.version.split()[0], "cpus": os.cpu_count(), "results": results,
              "note": "host-side overhead per decode step; CPU numbers are not GPU speed claims"}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
