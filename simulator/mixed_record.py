"""`python -m simulator mixed --record FILE`: the scenario and the server a measured `ft bench mixed` record ran,
as the `mixed` command's own arguments, and the prediction set beside what the record measured (docs/simulator.md,
"Held out: the measured record, replayed").

The record (schema fluxtide.bench/1, kind mixed; app/bench/mixed.py and app/bench/record.py write it) gives, per
argument (argparse dest <- record field):

- the scenario: streams, stream_tokens, warmup_tokens, baseline_tokens, repeats, warmup_repeats <- `settings`;
  prompt_tokens <- the measured points' `prompt_tokens` (the long prompt as the server counted it: the benchmark's
  filler unit overshoots `--prompt-tokens`; every measured point must agree); stream_prompt_tokens <-
  `settings.calibration` (each stream's prompt is 2 filler units: tokens_fixed + 2 x tokens_per_filler_unit);
- the server: gpu_budget_gib, memory_ratio <- `budget`; kv, snapshot_slots, staging_experts <- `pool_plan`;
  max_prefill_length, mixed_prefill_length, max_running_requests, layered_prefill <- `summary.server_step_budgets`;
  layer_group_length <- its `layer_group_tokens` (since session 25), else its `mixed_step_tokens` (the groups'
  budget before then); layer_short_prompts <- its `layer_short_prompts` (since session 28: auto when true), else off
  (a server before then layered only prompts longer than the mixed budget); short_prompt_replays <- the server's
  `executor.short_prompt_replays` where stated, else by `started_at`: 0 before session 32's A/B records (which
  set it by hand: give the flag), auto since (short_prompts.served_replays; ADR 0026);
  cache_type, prefill_kernels <- the server's /v1/stats (`server.stats.prefix_cache`, `.executor`);
- model <- the built-in model whose geometry and expert bytes are `model.geometry` / `model.expert_bytes`;
  hardware <- the built-in profile named in every `hardware.gpus[].name` (the client's GPUs: the benchmark's host);
- repeat_prompt_tokens <- each measured repeat's own chunks, from its step trace (`points[].window_steps`: a layer
  group's chunk once, at its first group, plus every other prefill step's tokens): before session 26 a repeat could
  resume 16 tokens from the prefix cache and compute an 8,180-token chunk with no tail step. A record without step
  traces leaves it unset (every repeat computes the whole prompt).

Beside the figures, `compare` sets every window step of the record (the steps whose model call overlaps [send, first
token]) beside its simulated twin (`step_comparison`): its kind (mixed.step_kind: decode, layer group, tail, ...),
measured and predicted ms, and per kind the summary errors.

An argument given on the command line beside --record wins; an argument the record cannot give (a field missing,
points that disagree, a model or GPU with no built-in match) is an error naming the flag that would supply it.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from simulator.hardware import BUILTIN_PROFILES, GIB
from simulator.mixed import step_kind
from simulator.short_prompts import served_replays
from simulator.sweep import BUILTIN_MODELS, resolve_model

SCHEMA, KIND = "fluxtide.bench/1", "mixed"
STREAM_PROMPT_UNITS = 2  # app/bench/mixed.py: every stream's prompt is make_prompt(2)
# the record's model.geometry field -> ModelSpec attribute
GEOMETRY = {"hidden_size": "hidden_size", "num_hidden_layers": "num_layers", "num_experts": "num_experts",
            "num_experts_per_tok": "top_k", "moe_intermediate_size": "expert_intermediate",
            "shared_expert_intermediate_size": "shared_expert_intermediate",
            "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_kv_heads",
            "vocab_size": "vocab_size", "max_position_embeddings": "max_context"}
# compare's figure -> its path in the record's summary and in the prediction (the same names: app/bench/mixed.py)
FIGURES = {"window_p50_ms": ("window", "p50_ms"), "window_p99_ms": ("window", "p99_ms"),
           "window_max_ms": ("window", "max_ms"), "baseline_p50_ms": ("baseline", "p50_ms"),
           "baseline_p99_ms": ("baseline", "p99_ms"), "ttft_s_median": ("ttft_s_median",)}
PLAN_FIELDS = ("kv_tokens", "expert_slots", "state_slots", "snapshot_slots", "staging_experts", "pool_bytes")


class RecordError(ValueError):
    """The record cannot be replayed; the message is one line naming the file."""


class _Missing(Exception):
    """The record gives no usable value for one argument; the message says which field."""


def _field(data: Any, dotted: str) -> Any:
    """data's value at a dotted path; _Missing if a step is absent or null."""
    for key in dotted.split("."):
        if not isinstance(data, dict) or data.get(key) is None:
            raise _Missing(f"no {dotted}")
        data = data[key]
    return data


def _count(data: dict, dotted: str, allow_zero: bool = False) -> int:
    """An integer field (>= 1, or >= 0 with allow_zero)."""
    value = _field(data, dotted)
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise _Missing(f"{dotted} is {value!r}, not a count")
    return value


def _group_budget(data: dict, budgets: str) -> int:
    """The server's layer-group budget: its own field since session 25, else the mixed budget (a server before then
    sized its layer groups by it)."""
    try:
        return _count(data, f"{budgets}.layer_group_tokens")
    except _Missing:
        return _count(data, f"{budgets}.mixed_step_tokens")


def _short_prompts(data: dict, budgets: str) -> str:
    """The server's --layer-short-prompts: its own field since session 28 (auto when true), else off (a server before
    then layered only the prompts longer than the mixed budget)."""
    try:
        return "auto" if _field(data, f"{budgets}.layer_short_prompts") else "off"
    except _Missing:
        return "off"


def _number(data: dict, dotted: str) -> float:
    """A positive, finite number field."""
    value = _field(data, dotted)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise _Missing(f"{dotted} is {value!r}, not a positive number")
    return float(value)


def _prompt_tokens(points: list[dict]) -> int:
    """The long prompt's size as the server counted it, the same in every measured point."""
    sizes = [p.get("prompt_tokens") for p in points]
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise _Missing(f"a measured point has no prompt_tokens count ({sizes})")
    if len(set(sizes)) > 1:
        raise _Missing(f"the measured points' prompt_tokens differ ({', '.join(map(str, sizes))}), and one "
                       "simulation runs one prompt size")
    return sizes[0]


def computed_tokens(steps: list[dict]) -> int:
    """The prompt tokens a repeat's window steps computed: a layer group's chunk once (its first group; the server's
    trace repeats the chunk's tokens in every group), every other step's prefill tokens."""
    return sum(s.get("layer_tokens") or 0 for s in steps if s.get("layers") and s["layers"][0] == 0) + sum(
        s.get("prefill_tokens") or 0 for s in steps if not s.get("layers"))


def _repeat_prompt_tokens(data: dict, points: list[dict]) -> list[int] | None:
    """Per recorded repeat (settings.repeats; a failed one computes the whole prompt), the tokens its long prompt
    computed, from its step trace; None when a measured repeat has none (a record before the trace)."""
    repeats, prompt = _count(data, "settings.repeats"), _prompt_tokens(points)
    computed = {}
    for p in points:
        steps = p.get("window_steps")
        if not isinstance(steps, list) or not steps:
            return None
        n = computed_tokens(steps)
        if not 1 <= n <= prompt:
            raise _Missing(f"repeat {p.get('repeat')}'s window steps compute {n} prompt tokens, not 1..{prompt}")
        computed[p.get("repeat")] = n
    return [computed.get(r, prompt) for r in range(repeats)]


def _stream_prompt_tokens(data: dict) -> int:
    """The streams' prompt in tokens: the benchmark's calibration line at STREAM_PROMPT_UNITS filler units."""
    fixed = _field(data, "settings.calibration.tokens_fixed")
    per_unit = _number(data, "settings.calibration.tokens_per_filler_unit")
    if isinstance(fixed, bool) or not isinstance(fixed, int | float):
        raise _Missing(f"settings.calibration.tokens_fixed is {fixed!r}, not a number")
    return round(fixed + STREAM_PROMPT_UNITS * per_unit)


# a card's variant words: a profile matches a name only with the same ones. "pcie": 'NVIDIA H100 PCIe' is another
# card (114 SMs, 2.0 TB/s HBM2e) than the SXM5 one the h100 profile describes ('NVIDIA H100 80GB HBM3')
_VARIANTS = {"laptop", "mobile", "pcie"}


def _tokens(text: str) -> list[str]:
    """Lower-case words of a GPU or profile name, "rtx" joined to its number ('NVIDIA GeForce RTX 4090' -> [...,
    'rtx4090'])."""
    return re.findall(r"[a-z0-9]+", re.sub(r"\brtx[\s_-]+(?=\d)", "rtx", text.lower()))


def _names_profile(name: str, profile: str) -> bool:
    """Whether a GPU's name is the built-in profile's card: every word of the profile a whole word of the name, and
    the same variant words ('NVIDIA GH200 480GB' is no h200; 'RTX 4090 Laptop GPU' no rtx4090)."""
    words, wanted = set(_tokens(name)), set(_tokens(profile))
    return wanted <= words and words & _VARIANTS == wanted & _VARIANTS


def _hardware(data: dict) -> str:
    """The built-in profile every GPU of the record names ('NVIDIA H200' -> h200)."""
    gpus = _field(data, "hardware.gpus")
    names = [g.get("name") if isinstance(g, dict) else None for g in gpus] if isinstance(gpus, list) else []
    found = {p for n in names if isinstance(n, str) for p in BUILTIN_PROFILES if _names_profile(n, p)}
    if not names or len(found) != 1 or not all(isinstance(n, str) for n in names):
        raise _Missing(f"the record's GPUs {names} name no one built-in profile ({sorted(BUILTIN_PROFILES)})")
    return found.pop()


def _model(data: dict) -> str:
    """The built-in model whose geometry and bytes per expert (which tell its weight format) are the record's."""
    geometry, expert_bytes = _field(data, "model.geometry"), _field(data, "model.expert_bytes")
    if not isinstance(geometry, dict):
        raise _Missing(f"model.geometry is {geometry!r}, not an object")
    for name in BUILTIN_MODELS:
        spec = resolve_model(name)[1]
        if expert_bytes == spec.expert_bytes() and all(
                key in geometry and geometry[key] == getattr(spec, attr) for key, attr in GEOMETRY.items()):
            return name
    raise _Missing(f"the record's model ({(data.get('model') or {}).get('name')!r}, "
                   f"{(data.get('model') or {}).get('format')!r}, {expert_bytes} bytes an expert) is none of the "
                   f"built-in models {sorted(BUILTIN_MODELS)}")


def _arguments(data: dict, points: list[dict]) -> tuple[dict[str, Any], dict[str, str]]:
    """The `mixed` command's arguments (dest -> value) the record gives, and those it cannot (dest -> why)."""
    stats, budgets = "server.stats", "summary.server_step_budgets"
    readers = {
        "hardware": lambda: _hardware(data), "model": lambda: _model(data),
        "streams": lambda: _count(data, "settings.streams"), "prompt_tokens": lambda: _prompt_tokens(points),
        "stream_tokens": lambda: _count(data, "settings.stream_tokens"),
        "stream_prompt_tokens": lambda: _stream_prompt_tokens(data),
        "warmup_tokens": lambda: _count(data, "settings.warmup_tokens"),
        "baseline_tokens": lambda: _count(data, "settings.baseline_tokens"),
        "repeats": lambda: _count(data, "settings.repeats"),
        "warmup_repeats": lambda: _count(data, "settings.warmup_repeats", allow_zero=True),
        "gpu_budget_gib": lambda: _count(data, "budget.total_bytes") / GIB,
        "memory_ratio": lambda: _number(data, "budget.memory_ratio"),
        "kv": lambda: _count(data, "pool_plan.kv_tokens"),
        "snapshot_slots": lambda: _count(data, "pool_plan.snapshot_slots", allow_zero=True),
        "staging_experts": lambda: _count(data, "pool_plan.staging_experts", allow_zero=True),
        "cache_type": lambda: "radix" if _field(data, f"{stats}.prefix_cache.enabled") else "none",
        "prefill_kernels": lambda: "triton" if _field(data, f"{stats}.executor.prefill_kernels") else "reference",
        "max_prefill_length": lambda: _count(data, f"{budgets}.max_step_tokens"),
        "mixed_prefill_length": lambda: _count(data, f"{budgets}.mixed_step_tokens"),
        "layer_group_length": lambda: _group_budget(data, budgets),
        "max_running_requests": lambda: _count(data, f"{budgets}.max_running"),
        "layered_prefill": lambda: "on" if _field(data, f"{budgets}.layered_prefill") else "off",
        "layer_short_prompts": lambda: _short_prompts(data, budgets),
        "repeat_prompt_tokens": lambda: _repeat_prompt_tokens(data, points),
        "short_prompt_replays": lambda: _short_prompt_replays(data),
    }
    values, missing = {}, {}
    for dest, read in readers.items():
        try:
            values[dest] = read()
        except _Missing as exc:
            missing[dest] = str(exc)
    return values, missing


def _short_prompt_replays(data: dict) -> int | str:
    """FLUXTIDE_SHORT_PROMPT_REPLAYS of the record's server (simulator.short_prompts.served_replays), "auto" for auto."""
    try:
        value = served_replays(data)
    except ValueError as exc:
        raise _Missing(f"no executor.short_prompt_replays in the server's stats and {exc}") from None
    return "auto" if value is None else value


def flag(dest: str) -> str:
    """The command-line flag of an argument (every one the record sets is spelled --its-dest)."""
    return "--" + dest.replace("_", "-")


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in percent; None without both or with a measured 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured * 100


def _figure(data: dict, path: tuple[str, ...]) -> float | None:
    """The number at `path` in a summary or a prediction (FIGURES), or None."""
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data if isinstance(data, int | float) and not isinstance(data, bool) else None


@dataclass(frozen=True)
class MixedRecord:
    """What one `ft bench mixed` record ran and measured, read for a replay."""

    path: str
    arguments: dict[str, Any]  # the `mixed` command's argument (dest) -> the record's value
    unmapped: dict[str, str]  # argument -> why the record gives none (an error unless the flag is given)
    summary: dict  # the record's pooled figures (window, baseline: p50_ms/p99_ms/max_ms; ttft_s_median, s)
    points: list[dict]  # the measured repeats (ok), each with its window_gaps_ms
    pool_plan: dict = field(default_factory=dict)
    routing: Any = None

    def apply(self, args, given: set[str]) -> dict:
        """Sets on args every argument the record gives and the command line (`given`, dests) does not; returns
        what the command line overrode, {dest: {"record": value or None, "used": value}}. RecordError if an
        argument the record cannot give is not given either."""
        missing = {dest: why for dest, why in self.unmapped.items() if dest not in given}
        if missing:
            raise RecordError(f"{self.path}: cannot replay: " + "; ".join(
                f"{why} (give {flag(dest)})" for dest, why in missing.items()))
        overridden = {}
        for dest in set(self.arguments) | set(self.unmapped):
            if dest in given:
                overridden[dest] = {"record": self.arguments.get(dest), "used": getattr(args, dest)}
            else:
                setattr(args, dest, self.arguments[dest])
        if given & {"prompt_tokens", "repeats"} and "repeat_prompt_tokens" not in given \
                and self.arguments.get("repeat_prompt_tokens") is not None:
            # NOTE: the record's chunk sizes are its prompt's and its repeats'; another prompt or count computes whole
            overridden["repeat_prompt_tokens"] = {"record": self.arguments.get("repeat_prompt_tokens"), "used": None}
            args.repeat_prompt_tokens = None
        return dict(sorted(overridden.items()))

    def compare(self, result: dict, overridden: dict, top_k: int = 8, max_keys: int = 256) -> dict:
        """The prediction `result` (predict_mixed's dict) beside the record: each figure measured, predicted and
        its error in percent, the plan's pools, per measured repeat the largest difference between its window gaps
        and the simulated repeat's (gap_differences), and every window step beside its simulated twin
        (step_comparison; `top_k`, `max_keys`: the model's, which tell a tail step)."""
        figures = {}
        for name, path in FIGURES.items():
            measured, predicted = _figure(self.summary, path), _figure(result, path)
            figures[name] = {"measured": measured, "predicted": predicted,
                             "error_pct": error_pct(predicted, measured)}
        plan = result.get("plan") or {}
        return {"record": self.path, "figures": figures,
                "plan": {k: {"record": self.pool_plan.get(k), "predicted": plan.get(k)} for k in PLAN_FIELDS},
                "gaps": gap_differences(self.points, result.get("points") or [],
                                        (result.get("scenario") or {}).get("streams", 0)),
                "steps": step_comparison(self.points, result.get("points") or [], top_k, max_keys),
                "routing": {"record": self.routing, "simulated": result.get("routing")},
                "overridden": overridden}


def _per_stream(gaps: list, streams: int) -> list[list]:
    """A repeat's window gaps (stream 0's, then stream 1's...) split per stream when they divide evenly (the
    streams decode in the same steps, so their counts agree), else as one sequence."""
    n = len(gaps) // streams if streams > 0 and len(gaps) % streams == 0 else len(gaps)
    return [gaps[k:k + n] for k in range(0, len(gaps), n)] if n else []


def gap_differences(measured: list[dict], predicted: list[dict], streams: int) -> list[dict]:
    """Per measured repeat with a simulated twin (same `repeat`): the gap counts, and where the two differ most,
    aligned by index within a stream (when both split evenly over `streams`, else over the whole list): the
    stream (None: the whole list), the index, both gaps and predicted - measured, in ms."""
    simulated = {p.get("repeat"): p.get("window_gaps_ms") or [] for p in predicted if p.get("ok")}
    rows = []
    for point in measured:
        gaps, twin = point.get("window_gaps_ms"), simulated.get(point.get("repeat"))
        if not isinstance(gaps, list) or not all(isinstance(g, int | float) for g in gaps) or twin is None:
            continue
        row = {"repeat": point["repeat"], "measured_gaps": len(gaps), "predicted_gaps": len(twin)}
        a, b = _per_stream(gaps, streams), _per_stream(twin, streams)
        if len(a) != len(b):
            a, b = [gaps], [twin]
        pairs = [(k if len(a) > 1 else None, i, x[i], y[i]) for k, (x, y) in enumerate(zip(a, b, strict=True))
                 for i in range(min(len(x), len(y)))]
        if pairs:
            stream, i, m, p = max(pairs, key=lambda pair: abs(pair[3] - pair[2]))
            row.update(stream=stream, index=i, measured_ms=m, predicted_ms=p, difference_ms=round(p - m, 3))
        rows.append(row)
    return rows


def _in_window(steps: list[dict], ttft_ms: float) -> list[tuple[int, dict]]:
    """(index, step) of the steps whose model call overlaps [send, first token] (end_ms from the send)."""
    return [(i, s) for i, s in enumerate(steps) if s["end_ms"] > 0 and s["end_ms"] - s["ms"] < ttft_ms]


def _step_key(step: dict, kind: str) -> tuple:
    """What aligns a recorded step with a simulated one: its kind and, for a layer group, its layers (the n-th step
    of a key in the record is the n-th of that key in the simulation)."""
    return (kind, tuple(step["layers"]) if step.get("layers") else None)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def step_comparison(measured: list[dict], predicted: list[dict], top_k: int, max_keys: int) -> dict:
    """Every window step of each measured repeat with a step trace (`window_steps`) and a simulated twin (same
    `repeat`, its `window_step_trace`): the steps whose model call overlaps [send, first token] on each side, aligned
    by kind and layer group in order (_step_key), each with measured ms (the model call; host_ms, the host's time
    before it, beside) and predicted ms (the simulated step, its host overhead included) and the error in percent;
    steps of one side without a twin are listed with None on the other. `by_kind`: per kind the aligned steps' count,
    median measured and predicted ms, median and mean absolute error in percent, the totals, and the unaligned
    steps. Empty rows (and a note) for a record without step traces."""
    simulated = {p.get("repeat"): p for p in predicted if p.get("ok")}
    rows: list[dict] = []
    traced = 0
    for point in measured:
        steps, twin = point.get("window_steps"), simulated.get(point.get("repeat"))
        if not isinstance(steps, list) or not steps or twin is None or not isinstance(point.get("ttft_s"), int | float):
            continue
        traced += 1
        mine = _in_window(steps, point["ttft_s"] * 1e3)
        theirs = [s for _, s in _in_window(twin.get("window_step_trace") or [], twin["ttft_s"] * 1e3)]
        queues: dict[tuple, list[dict]] = {}
        for s in theirs:
            queues.setdefault(_step_key(s, step_kind(s, top_k, max_keys)), []).append(s)
        for index, s in mine:
            kind = step_kind(s, top_k, max_keys)
            queue = queues.get(_step_key(s, kind)) or []
            twin_step = queue.pop(0) if queue else None
            rows.append(_step_row(point["repeat"], index, kind, s, twin_step))
        for queue in queues.values():
            rows += [_step_row(point["repeat"], None, step_kind(s, top_k, max_keys), None, s) for s in queue]
    by_kind = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        both = [r for r in mine if r["measured_ms"] is not None and r["predicted_ms"] is not None]
        errors = [r["error_pct"] for r in both]
        by_kind[kind] = {
            "steps": len(both), "measured_median_ms": _median([r["measured_ms"] for r in both]),
            "predicted_median_ms": _median([r["predicted_ms"] for r in both]), "median_error_pct": _median(errors),
            "mean_abs_error_pct": statistics.fmean(abs(e) for e in errors) if errors else None,
            "measured_total_ms": sum(r["measured_ms"] for r in both),
            "predicted_total_ms": sum(r["predicted_ms"] for r in both),
            "measured_only": sum(1 for r in mine if r["predicted_ms"] is None),
            "predicted_only": sum(1 for r in mine if r["measured_ms"] is None)}
    out = {"rows": rows, "by_kind": by_kind, "repeats_traced": traced}
    if not traced:
        out["note"] = "the record has no step trace (points[].window_steps: ft bench mixed since session 25)"
    return out


def _step_row(repeat, index, kind: str, step: dict | None, twin: dict | None) -> dict:
    """One aligned pair (either may be None): the record's fields, measured and predicted ms and the error."""
    base = step if step is not None else twin
    measured = step["ms"] if step is not None else None
    predicted = twin["ms"] if twin is not None else None
    return {"repeat": repeat, "index": index, "kind": kind, "layers": base.get("layers"),
            "decode_rows": base.get("decode_rows"), "prefill_tokens": base.get("prefill_tokens"),
            "measured_ms": measured, "host_ms": step.get("host_ms") if step is not None else None,
            "predicted_ms": predicted, "error_pct": error_pct(predicted, measured),
            "measured_misses": step.get("expert_misses") if step is not None else None,
            "predicted_misses": twin.get("expert_misses") if twin is not None else None,
            "predicted_staged": twin.get("experts_staged") if twin is not None else None}


def read_record(path: str) -> MixedRecord:
    """The record at `path`; RecordError for a file that cannot be read, is not JSON, is not an `ft bench mixed`
    record, or has no measured repeat."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}: not JSON ({exc})") from None
    except OSError as exc:
        raise RecordError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    kind = (data.get("schema"), data.get("kind")) if isinstance(data, dict) else (None, None)
    if kind != (SCHEMA, KIND):
        raise RecordError(f"{path}: not an `ft bench mixed` record (schema {kind[0]!r}, kind {kind[1]!r}; "
                          f"expected {SCHEMA!r}, {KIND!r})")
    points = [p for p in data.get("points") or [] if isinstance(p, dict) and p.get("ok")]
    if not points:
        failures = [" ".join(str(f.get("error")).split()) for f in data.get("failures") or [] if isinstance(f, dict)]
        raise RecordError(f"{path}: no measured repeat to compare with (ok {data.get('ok')!r}, "
                          f"{len(failures)} failures{': ' + str(failures[0]) if failures else ''})")
    arguments, unmapped = _arguments(data, points)
    summary = data.get("summary") if isinstance(data.get("summary"), dict) else {}
    pool_plan = data.get("pool_plan") if isinstance(data.get("pool_plan"), dict) else {}
    return MixedRecord(str(path), arguments, unmapped, summary, points, pool_plan, data.get("routing"))
