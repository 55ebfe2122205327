"""StepProfiler: torch.profiler around the server's own steps, those a step filter picks (FLUXTIDE_PROFILE_DIR,
docs/serving.md "Step profiles").

Why: a step's recorded host time says when the host returned, not where the device's time went. On an H100 (2026-12-05) the
8,196-token prompt's tail step of `ft bench mixed` (4 prompt tokens beside 3 decode rows, 40 layers) took 61-69 ms
with every expert resident against 4.6 ms for a 3-row decode step, with 0.4-1.7 ms of host time recorded. A
separate harness would not run that step (its pools, graphs, residency and neighbours), so the executor profiles
the very steps it serves: each picked step runs between two device synchronisations under torch.profiler (CPU, and
CUDA where the step runs on it; no shapes, Python stacks only on request: they make traces large), and leaves a
gzipped chrome trace and a JSON summary: the step's shape, wall time, the device's kernel sum, busy time and largest
idle gaps (with when the host launched the kernel after each), the top kernels and host ops, the launch calls and
every host synchronisation. Profiling slows the host (CUPTI callbacks): compare the device figures, not the wall.
Summarising never fails a step: a failure is logged and the trace kept.

Filter grammar (parse_step_filter): terms joined by "," (or), each of conditions joined by "&" (and); a condition
is a keyword (all, decode: no prefill token, prefill: some, mixed: prefill tokens and decode rows, prefill-only:
prefill tokens without decode rows, layered: a layer group) or FIELD OP N with FIELD prefill (tokens of the works
that are not decodes, a layer group's every time) or decode (rows), OP one of < <= == = >= >, N >= 0. A comparison
matches only steps that have some of its FIELD: prefill<=32 is 1..32 prompt tokens, decode<=2 one or two rows.
"""

from __future__ import annotations

import gzip
import json
import logging
import operator
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from domain.ports import StepBatch

log = logging.getLogger(__name__)
STEP_LABEL = "fluxtide.step"  # the record_function around the step: the summary's time window
HOOK_LABEL = "fluxtide.on_launched"  # the engine's launch hook (its text work), timed apart from the step
TOP = 25
GAPS = 10
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cuGraphLaunch")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
NOTE = ("times in ms; wall_ms: host perf_counter from the step's call to the device synchronised after it (the "
        "profiler's own overhead included: compare device_time); offsets from the step's call; host.outside_ops_ms: "
        "the step's host time in no op (Python); idle_gaps.host_launch_bound_ms: gaps whose next work was launched "
        "after the device went idle")


# ---- which steps -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepShape:
    """What a filter looks at and a summary reports of one StepBatch."""

    decode_rows: int
    prefill_tokens: int  # tokens of the works that are not decodes (a layer group's, whichever group it is)
    spans: tuple[tuple[int, int, tuple[int, int] | None], ...]  # (start position, tokens, layers) per prefill work

    @classmethod
    def of(cls, batch: StepBatch) -> StepShape:
        # NOTE: a decode as StepBatch.num_decode_tokens counts one (one token fed back after an output)
        prefills = [w for w in batch.works if not (w.layers is None and len(w.token_ids) == 1 and w.sample
                                                   and w.output_index > 0)]
        return cls(len(batch.works) - len(prefills), sum(len(w.token_ids) for w in prefills),
                   tuple((w.start_position, len(w.token_ids), w.layers) for w in prefills))

    @property
    def layers(self) -> tuple[int, int] | None:
        return next((lay for _, _, lay in self.spans if lay is not None), None)

    @property
    def label(self) -> str:
        layers = f"-L{self.layers[0]}-{self.layers[1]}" if self.layers else ""
        return f"p{self.prefill_tokens}-d{self.decode_rows}{layers}"

    def as_dict(self) -> dict:
        return {"decode_rows": self.decode_rows, "prefill_tokens": self.prefill_tokens,
                "prefill_works": len(self.spans), "layers": list(self.layers) if self.layers else None,
                "spans": [{"start": s, "tokens": n, "layers": list(lay) if lay else None} for s, n, lay in self.spans]}


KEYWORDS: dict[str, Callable[[StepShape], bool]] = {
    "all": lambda s: True,
    "decode": lambda s: s.prefill_tokens == 0,
    "prefill": lambda s: s.prefill_tokens > 0,
    "mixed": lambda s: s.prefill_tokens > 0 and s.decode_rows > 0,
    "prefill-only": lambda s: s.prefill_tokens > 0 and s.decode_rows == 0,
    "layered": lambda s: s.layers is not None,
}
FIELDS = {"prefill": "prefill_tokens", "decode": "decode_rows"}
OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "=": operator.eq, "<": operator.lt, ">": operator.gt}
COMPARISON = re.compile(r"(prefill|decode)\s*(<=|>=|==|=|<|>)\s*(\d+)")
GRAMMAR = ("terms joined by ',' (or) of conditions joined by '&' (and); a condition is one of "
           f"{', '.join(KEYWORDS)} or FIELD OP N (FIELD prefill or decode, OP one of < <= == = >= >), "
           "e.g. 'prefill<=32', 'mixed&prefill<=32,layered'")


@dataclass(frozen=True)
class StepFilter:
    text: str  # normalised: what parse_step_filter reads back
    terms: tuple[tuple[Callable[[StepShape], bool], ...], ...]

    def matches(self, shape: StepShape) -> bool:
        return any(all(cond(shape) for cond in term) for term in self.terms)

    def __str__(self) -> str:
        return self.text


def parse_step_filter(text: str) -> StepFilter:
    """The filter `text` says (the module docstring's grammar), or ValueError naming the part that is wrong."""
    terms, norm = [], []
    for term in text.split(","):
        conds, words = [], []
        for cond in term.split("&"):
            word = cond.strip().lower()
            if word in KEYWORDS:
                conds.append(KEYWORDS[word])
                words.append(word)
                continue
            m = COMPARISON.fullmatch(word)
            if m is None:
                raise ValueError(f"step filter {text!r}: {cond.strip() or 'an empty condition'!r} is not a "
                                 f"condition ({GRAMMAR})")
            field, op, n = m.group(1), m.group(2), int(m.group(3))
            if not any(OPS[op](k, n) for k in (1, max(n, 1), n + 1)):  # NOTE: a comparison matches counts >= 1
                raise ValueError(f"step filter {text!r}: {field}{op}{n} matches no step (a comparison matches only "
                                 f"steps with {field} {'tokens' if field == 'prefill' else 'rows'}: for none use "
                                 f"{'decode' if field == 'prefill' else 'prefill-only'})")
            conds.append(_comparison(FIELDS[field], OPS[op], n))
            words.append(f"{field}{op}{n}")
        terms.append(tuple(conds))
        norm.append("&".join(words))
    return StepFilter(",".join(norm), tuple(terms))


def _comparison(attr: str, op, n: int) -> Callable[[StepShape], bool]:
    return lambda s: getattr(s, attr) > 0 and op(getattr(s, attr), n)


# ---- the profiler ----------------------------------------------------------------------------------------------
class StepProfiler:
    """Profiles up to `max_steps` steps that `steps` matches, writing into `out_dir` (made here). The executor asks
    `wants(batch)` for every step (a count and a filter: nothing else when it says no) and hands the matching ones
    to `profile`."""

    def __init__(self, out_dir: str | os.PathLike, steps: StepFilter, max_steps: int = 8, with_stack: bool = False):
        if max_steps < 1:
            raise ValueError(f"the step profiler's max_steps must be >= 1, got {max_steps}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.steps, self.max_steps, self.with_stack = steps, max_steps, with_stack
        self.seen = 0  # steps the executor ran (profiled or not)
        self.profiled = 0
        if torch.cuda.is_available():
            # NOTE: a CUDA graph captured before the profiler's first use can go unprofiled (or worse) when replayed
            # under it (pytorch#100441's workaround): this runs before the executor captures any
            with torch.profiler.profile(activities=_activities(True)):
                pass

    def wants(self, batch: StepBatch) -> bool:
        self.seen += 1
        return self.profiled < self.max_steps and self.steps.matches(StepShape.of(batch))

    def profile(self, batch: StepBatch, run: Callable[[StepBatch], Any], executor: Any) -> Any:
        """run(batch) (the step), profiled; its result. The executor's `on_launched` hook (the engine's text work)
        is timed under its own label while the step runs and restored after; `executor.device` says what to
        synchronise and whether CUDA is traced."""
        self.profiled += 1
        index, shape = self.profiled, StepShape.of(batch)
        device = torch.device(getattr(executor, "device", "cpu"))
        cuda = device.type == "cuda" and torch.cuda.is_available()
        hook, hook_s = getattr(executor, "on_launched", None), []
        if hook is not None:
            def timed_hook() -> None:
                t = time.perf_counter()
                with torch.profiler.record_function(HOOK_LABEL):
                    hook()
                hook_s.append(time.perf_counter() - t)
            executor.on_launched = timed_hook
        _sync(device, cuda)
        try:
            with torch.profiler.profile(activities=_activities(cuda), record_shapes=False,
                                        with_stack=self.with_stack) as prof:
                start = time.perf_counter()
                with torch.profiler.record_function(STEP_LABEL):
                    out = run(batch)
                returned = time.perf_counter()
                _sync(device, cuda)
                end = time.perf_counter()
        finally:
            if hook is not None:
                executor.on_launched = hook
        head = {"step": {"profile": index, "executed_steps": self.seen, "label": shape.label, **shape.as_dict()},
                "filter": str(self.steps), "note": NOTE,
                "device": str(device), "activities": ["cpu", "cuda"] if cuda else ["cpu"],
                "wall_ms": _ms((end - start) * 1e6), "host_return_ms": _ms((returned - start) * 1e6),
                "on_launched_ms": _ms(sum(hook_s) * 1e6) if hook_s else None}
        self._write(prof, head, f"step-{os.getpid()}-{index:03d}-{shape.label}")
        return out

    def _write(self, prof, head: dict, stem: str) -> None:
        trace_path, summary_path = self.out_dir / f"{stem}.trace.json.gz", self.out_dir / f"{stem}.json"
        summary = dict(head)
        try:
            raw = self.out_dir / f".{stem}.trace.json"
            prof.export_chrome_trace(str(raw))
            text = raw.read_bytes()
            raw.unlink()
            trace_path.write_bytes(gzip.compress(text, compresslevel=6))
            summary["trace"] = trace_path.name
            summary["trace_gz_bytes"] = trace_path.stat().st_size
            events = json.loads(text).get("traceEvents", [])
            summary.update(summarise(events, device_traced="cuda" in head["activities"]))
        except Exception as exc:  # NOTE: confined: the step stands, and so does whatever of the trace was written
            log.warning("step profile %s: summary incomplete: %s: %s", stem, type(exc).__name__, exc)
            summary["summary_error"] = f"{type(exc).__name__}: {exc}"
        try:
            summary_path.write_text(json.dumps(summary, indent=1))
        except Exception as exc:  # a full disk or a removed directory must not fail the step either
            log.warning("step profile %s: not written: %s: %s", stem, type(exc).__name__, exc)
            return
        dev = summary.get("device_time") or {}
        log.info("step profile %d/%d (%s): wall %.2f ms, device busy %s ms, %s kernels, %s host syncs -> %s",
                 head["step"]["profile"], self.max_steps, head["step"]["label"], head["wall_ms"],
                 dev.get("busy_union_ms"), dev.get("kernels"), (summary.get("host_syncs") or {}).get("count"),
                 summary_path)
        if head["step"]["profile"] == self.max_steps:
            log.info("step profiler: %d steps profiled, no more (FLUXTIDE_PROFILE_MAX)", self.max_steps)


def _activities(cuda: bool) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    return [*acts, torch.profiler.ProfilerActivity.CUDA] if cuda else acts


def _sync(device: torch.device, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize(device)


def _ms(us: float) -> float:
    return round(us / 1e3, 4)


# ---- the summary -----------------------------------------------------------------------------------------------
def summarise(events: list[dict], device_traced: bool = True) -> dict:
    """The summary's figures from a chrome trace's events (times in µs; offsets from the step's start); without
    device_traced (a CPU step) no idle gaps (the device's timeline is not in the trace)."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    for e in xs:
        e["_t0"] = float(e["ts"])
        e["_t1"] = e["_t0"] + float(e.get("dur", 0.0))
    step = next((e for e in xs if e.get("name") == STEP_LABEL and e.get("cat") in ("user_annotation", "cpu_op")),
                None)
    t0 = step["_t0"] if step else min((e["_t0"] for e in xs), default=0.0)
    t1 = step["_t1"] if step else max((e["_t1"] for e in xs), default=0.0)
    in_window = [e for e in xs if e.get("cat") in HOST_CATS and t0 <= e["_t0"] <= t1]
    # the host figures are the step's thread's (the engine's); other threads' ops only summed (GIL contention)
    thread = (step.get("pid"), step.get("tid")) if step else None
    host = [e for e in in_window if thread is None or (e.get("pid"), e.get("tid")) == thread]
    others = [e for e in in_window if thread is not None and (e.get("pid"), e.get("tid")) != thread]
    others_parents = _nest(others)
    parents = _nest(host)  # for the op or Python frame around a call
    ops_parents = _nest([e for e in host if e.get("cat") != "python_function"])  # for self times
    device = sorted((e for e in xs if e.get("cat") in DEVICE_CATS and e["_t1"] >= t0), key=lambda e: e["_t0"])
    kernels = [e for e in device if e.get("cat") == "kernel"]
    runtime = [e for e in host if e.get("cat") in RUNTIME_CATS]
    by_corr = {e.get("args", {}).get("correlation"): e for e in runtime}
    busy = _union([(e["_t0"], e["_t1"]) for e in device])
    out: dict = {"device_time": {
        "kernels": len(kernels), "kernel_sum_ms": _ms(sum(e["_t1"] - e["_t0"] for e in kernels)),
        "busy_union_ms": _ms(sum(b - a for a, b in busy)),
        "span_ms": _ms(busy[-1][1] - busy[0][0]) if busy else 0.0,
        "first_start_offset_ms": _ms(busy[0][0] - t0) if busy else None,
        "last_end_offset_ms": _ms(busy[-1][1] - t0) if busy else None,
        "memcpy": _table([e for e in device if e.get("cat") == "gpu_memcpy"], lambda e: e["_t1"] - e["_t0"]),
        "memset": _table([e for e in device if e.get("cat") == "gpu_memset"], lambda e: e["_t1"] - e["_t0"])},
        "top_kernels": _table(kernels, lambda e: e["_t1"] - e["_t0"])[:TOP]}
    selfs = {id(e): e["_t1"] - e["_t0"] for e in host}
    for e in host:
        p = ops_parents.get(id(e))
        if p is not None:
            selfs[id(p)] -= e["_t1"] - e["_t0"]
    ops = [e for e in host if e.get("cat") in ("cpu_op", "user_annotation") and e.get("name") != STEP_LABEL]
    in_ops = [e for e in host if e.get("cat") in ("cpu_op", "user_annotation", *RUNTIME_CATS)
              and e.get("name") != STEP_LABEL]
    out["host"] = {
        "step_ms": _ms(t1 - t0),
        "in_ops_ms": _ms(sum(selfs[id(e)] for e in in_ops)),
        "outside_ops_ms": _ms(selfs[id(step)]) if step else None,  # Python between the ops: interpreter time
        "runtime_ms": _ms(sum(e["_t1"] - e["_t0"] for e in runtime)),
        "other_threads_ops_ms": _ms(sum(e["_t1"] - e["_t0"] for e in others
                                        if e.get("cat") == "cpu_op" and id(e) not in others_parents)),
        "top_cpu_ops": _table(ops, lambda e: selfs[id(e)], "self_ms", total=lambda e: e["_t1"] - e["_t0"])[:TOP],
        "runtime_calls": _table(runtime, lambda e: e["_t1"] - e["_t0"])[:TOP]}
    launches = _table([e for e in runtime if e.get("name") in LAUNCH_CALLS], lambda e: e["_t1"] - e["_t0"])
    out["launches"] = {r["name"]: {"count": r["count"], "total_ms": r["total_ms"]} for r in launches}
    corr_device = {e.get("args", {}).get("correlation"): e for e in device if e.get("cat") == "gpu_memcpy"}
    syncs, sync_us = [], 0.0
    for e in runtime:
        name = e.get("name", "")
        copy = corr_device.get(e.get("args", {}).get("correlation"))
        copy_name = copy.get("name", "") if copy else ""
        if name in SYNC_CALLS or ("emcpy" in name and ("DtoH" in copy_name or "Pageable" in copy_name
                                                       or "Async" not in name)):
            sync_us += e["_t1"] - e["_t0"]
            syncs.append({"name": name, "offset_ms": _ms(e["_t0"] - t0), "dur_ms": _ms(e["_t1"] - e["_t0"]),
                          "op": _ancestor(e, parents, ("cpu_op",)), "py": _ancestor(e, parents, ("python_function",)),
                          **({"copy": copy_name} if copy_name else {})})
    out["host_syncs"] = {"count": len(syncs), "total_ms": _ms(sync_us), "calls": syncs[:50]}
    out["idle_gaps"] = _gaps(device, busy, t0, t1, by_corr, parents) if device_traced else None
    return out


def _nest(host: list[dict]) -> dict[int, dict]:
    """id(event) -> its innermost enclosing host event on the same thread."""
    parents, threads = {}, {}
    for e in host:
        threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in threads.values():
        stack: list[dict] = []
        for e in sorted(evs, key=lambda e: (e["_t0"], -(e["_t1"] - e["_t0"]))):
            while stack and stack[-1]["_t1"] <= e["_t0"]:
                stack.pop()
            if stack:
                parents[id(e)] = stack[-1]
            stack.append(e)
    return parents


def _ancestor(e: dict, parents: dict, cats: tuple[str, ...]) -> str | None:
    p = parents.get(id(e))
    while p is not None and p.get("cat") not in cats:
        p = parents.get(id(p))
    return p.get("name", "")[:200] if p is not None else None


def _table(evs: list[dict], value, key: str = "total_ms", total=None) -> list[dict]:
    """Events grouped by name, the largest summed `value` (µs) first: name, count, `key` in ms (and with_children_ms:
    the summed `total`)."""
    rows: dict[str, list[float]] = {}
    for e in evs:
        row = rows.setdefault(e.get("name", "")[:200], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += value(e)
        row[2] += total(e) if total else 0.0
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
    return [{"name": k, "count": int(n), key: _ms(v), **({"with_children_ms": _ms(w)} if total else {})}
            for k, (n, v, w) in ranked]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _gaps(device: list[dict], busy: list[tuple[float, float]], t0: float, t1: float, by_corr: dict,
          parents: dict) -> dict:
    """The device's idle stretches from the step's start to the later of its end and the last device work: each
    with the device work either side and when the host launched the work after it (a launch inside the gap: the
    device waited for the host)."""
    first_at, last_at = {}, {}
    for e in device:
        first_at.setdefault(e["_t0"], e)
        last_at[e["_t1"]] = e
    gaps, idle_from = [], t0
    for a, b in busy:
        if a > idle_from:
            gaps.append((idle_from, a, first_at.get(a)))
        idle_from = max(idle_from, b)
    if t1 > idle_from:
        gaps.append((idle_from, t1, None))
    rows, host_bound = [], 0.0
    for a, b, after in gaps:
        before = last_at.get(a)
        launch = by_corr.get(after.get("args", {}).get("correlation")) if after is not None else None
        if launch is not None and launch["_t0"] > a:
            host_bound += b - a
        rows.append({"start_offset_ms": _ms(a - t0), "dur_ms": _ms(b - a),
                     "prev_work": before.get("name", "")[:120] if before else None,
                     "next_work": after.get("name", "")[:120] if after else None,
                     "next_launch_offset_ms": _ms(launch["_t0"] - t0) if launch else None,
                     "next_launch_op": _ancestor(launch, parents, ("cpu_op", "user_annotation")) if launch else None})
    rows.sort(key=lambda r: -r["dur_ms"])
    return {"count": len(gaps), "total_ms": _ms(sum(b - a for a, b, _ in gaps)),
            "host_launch_bound_ms": _ms(host_bound), "largest": rows[:GAPS]}
