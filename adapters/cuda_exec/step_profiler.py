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

from adapters.cuda_exec.step_summary import STEP_LABEL, summarise
from adapters.cuda_exec.step_summary import ms as _ms
from domain.ports import StepBatch

log = logging.getLogger(__name__)
HOOK_LABEL = "fluxtide.on_launched"  # the engine's launch hook (its text work), timed apart from the step
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
