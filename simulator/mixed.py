"""Issue 9's mixed scenario, predicted: `python -m simulator mixed` (docs/simulator.md, "Layered prefill").

The scenario and its figures are `ft bench mixed`'s (app/bench/mixed.py), so a prediction reads beside that
benchmark's record: N streams are started (short greedy prompts, ignore_eos; each its own prompt, as the
benchmark's fresh nonces make them, unless `same_prompt`). Once each has `warmup_tokens` tokens the baseline
window opens; once each has `baseline_tokens` more, one long prompt is sent (fresh, greedy, max_tokens 1). The
prefill window runs from that send to the long prompt's first token; once every stream has a token after it, the
streams are aborted (the benchmark closes them) and the next repeat starts. `warmup_repeats` unrecorded repeats
go first (on the engine they compile kernels; here they warm the expert LRU as the benchmark's warm-up does).

Definitions (app/bench/mixed.py): a gap is the time between two consecutive tokens of one stream; the window's
gaps are those that overlap [send, first token] (later token after the send, earlier one before the first
token), the baseline's those wholly inside [baseline start, send]; percentiles interpolate linearly between
ranks; TTFT is first token - send. Each request reaches the scheduler CostParams.request_overhead_s after it is
sent (HTTP, as in predict's workload); tokens reach the client as their step ends.

The engine loop is the server's: the domain Scheduler, configured as app/containers.py configures it for
`ft serve` (budgets, prefix cache, `--layered-prefill`, `--layer-short-prompts` over the plan's residency), over the
pools `plan_deployment` plans as the server
does, with a SimExecutor; a request that arrives while a step runs is admitted at the next schedule().
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from domain.gap_stats import gap_figures, gaps_between
from domain.kv_pages import PageAllocator
from domain.model_spec import ModelSpec
from domain.prefix_store import snapshot_interval
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from domain.step_budget import DEFAULT_MAX_STEP_TOKENS, DEFAULT_MIXED_STEP_TOKENS, layer_group_tokens
from simulator.cost_model import CostModel, CostParams
from simulator.hardware import GB, HardwareProfile
from simulator.host import SimHost
from simulator.layering_policy import CandidateScheduler, LayeringPolicy
from simulator.params import StrictParams, require_positive
from simulator.predict import Deployment, plan_deployment, plan_summary
from simulator.routing import RoutingModel
from simulator.short_prompts import resolve
from simulator.sim_executor import SimExecutor

TARGET_GAP_P99_MS = 150.0  # issue 9 (app/bench/mixed.py TARGET_GAP_P99_MS)


@dataclass(frozen=True)
class MixedScenario(StrictParams):
    """`ft bench mixed`'s arguments (its defaults, but 128-token streams: the customer's output length)."""

    streams: int = 3  # --streams
    stream_prompt_tokens: int = 18  # the streams' prompt (the customer's prompt as the server counted it)
    stream_tokens: int = 128  # --stream-tokens
    warmup_tokens: int = 16  # --warmup-tokens
    baseline_tokens: int = 64  # --baseline-tokens
    prompt_tokens: int = 8192  # --prompt-tokens
    repeats: int = 3  # --repeats
    warmup_repeats: int = 1  # unrecorded repeats first (ft bench mixed: 1)
    same_prompt: bool = False  # every stream one prompt (they decode in lockstep); the benchmark's differ
    # per recorded repeat, the long prompt's tokens that repeat computes (a replayed record's own chunk sizes: before
    # session 26 a repeat could resume 16 tokens from the prefix cache, "Repeat 2 has no tail step"), simulated as a
    # fresh prompt of that many tokens; () = prompt_tokens in every repeat
    repeat_prompt_tokens: tuple[int, ...] = ()

    def check_valid(self) -> None:
        require_positive(self, "streams", "stream_prompt_tokens", "stream_tokens", "warmup_tokens",
                         "baseline_tokens", "prompt_tokens", "repeats")
        require_positive(self, "warmup_repeats", allow_zero=True)
        if not isinstance(self.same_prompt, bool):
            raise ValueError("MixedScenario.same_prompt must be a bool")
        per_repeat = self.repeat_prompt_tokens
        if isinstance(per_repeat, list):  # from JSON
            object.__setattr__(self, "repeat_prompt_tokens", per_repeat := tuple(per_repeat))
        if not isinstance(per_repeat, tuple) or any(
                isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.prompt_tokens for n in per_repeat):
            raise ValueError(f"MixedScenario.repeat_prompt_tokens must be counts in [1, prompt_tokens "
                             f"{self.prompt_tokens}], got {per_repeat!r}")
        if per_repeat and len(per_repeat) != self.repeats:
            raise ValueError(f"MixedScenario.repeat_prompt_tokens has {len(per_repeat)} counts for {self.repeats} "
                             "repeats")
        if self.warmup_tokens + self.baseline_tokens >= self.stream_tokens:
            raise ValueError(f"stream_tokens ({self.stream_tokens}) must exceed warmup_tokens + baseline_tokens "
                             f"({self.warmup_tokens + self.baseline_tokens}): the streams must still decode when "
                             "the long prompt arrives")

    def long_prompt_tokens(self, repeat: int) -> int:
        """The tokens the long prompt computes in recorded repeat `repeat` (0-based)."""
        return self.repeat_prompt_tokens[repeat] if self.repeat_prompt_tokens else self.prompt_tokens








def mixed_step_tokens(max_prefill_length: int, max_running: int, mixed_prefill_length: int | None = None) -> int:
    """`ft serve`'s budget of a step that carries decodes (app/settings.py ServeSettings.mixed_step_tokens)."""
    if mixed_prefill_length is not None:
        return mixed_prefill_length
    return min(max_prefill_length, max(DEFAULT_MIXED_STEP_TOKENS, max_running))


class _Broken(Exception):
    """A repeat cannot be measured (a stream ended, the engine went idle); the message says why."""


class _Loop:
    """The engine loop with arrivals in simulated time: a request reaches the scheduler at its arrival (a step
    in flight finishes first, as on the server); every token's time is kept per request."""

    def __init__(self, executor: SimExecutor, scheduler: Scheduler, check: bool = False) -> None:
        self.executor, self.scheduler, self.check = executor, scheduler, check
        self.host = executor.host
        self._arrivals: list[tuple[float, int, Request]] = []
        self._order = 0
        self.tokens: dict[str, list[float]] = {}
        self.ended: dict[str, str | None] = {}
        self.steps: list[dict] = []  # every step: what the server's step trace records of it (step_row)

    def submit(self, request: Request, at: float) -> None:
        self.tokens[request.request_id] = []
        heapq.heappush(self._arrivals, (at, self._order, request))
        self._order += 1

    def step(self) -> bool:
        """One engine step (or an idle wait for the next arrival); False when nothing is left to do."""
        while self._arrivals and self._arrivals[0][0] <= self.host.now():
            self.scheduler.add(heapq.heappop(self._arrivals)[2])
        batch = self.scheduler.schedule()
        if batch is None:
            if not self._arrivals:
                return False
            self.host.advance_to(self._arrivals[0][0])
            return True
        start, counters = self.host.now(), self.executor.counters.copy()
        sampled = self.executor.execute(batch)
        now = self.host.now()
        self.steps.append(step_row(batch, start, now, self.executor.counters.minus(counters)))
        for event in self.scheduler.complete(batch, sampled):
            if event.token_id is not None:
                self.tokens[event.request_id].append(now)
            if event.finished:
                self.ended[event.request_id] = event.finish_reason
        if self.check:
            self.scheduler.check_valid()
            self.executor.check_valid()
        return True

    def until(self, condition: Callable[[], bool], streams: list[str], what: str) -> None:
        """Steps until condition() holds; _Broken if a stream ends first or the engine has nothing left to do."""
        while not condition():
            for k, rid in enumerate(streams):
                if rid in self.ended:
                    raise _Broken(f"stream {k} ended ({self.ended[rid]}) after {len(self.tokens[rid])} tokens "
                                  f"while waiting for {what} (raise --stream-tokens?)")
            if not self.step():
                raise _Broken(f"the engine went idle waiting for {what}")


def step_row(batch, start: float, end: float, counted) -> dict:
    """One simulated step as the server's step trace records it (app/bench/step_trace.py's window_steps fields;
    times in seconds of simulated time): decode rows, the prefill works beside them and their tokens (a layer group's
    chunk counted in its first group only), the layer group and its chunk's tokens, the LRU's misses, and the
    experts the step staged (streamed prefill; the record has no such field)."""
    layered = batch.layered
    decode_rows = batch.num_decode_tokens
    return {"start": start, "end": end, "decode_rows": decode_rows, "prefill_tokens": batch.num_prefill_tokens,
            "prefill_works": len(batch.works) - decode_rows,
            "layers": None if layered is None else list(layered.layers),
            "layer_tokens": 0 if layered is None else len(layered.token_ids), "expert_misses": counted.expert_misses,
            "experts_staged": counted.streamed_staged}


def step_kind(step: dict, top_k: int, max_keys: int) -> str:
    """A step trace row's kind: "layer group"; "decode" (no prefill work); "tail" (a prefill work in a step of at
    most `max_keys` (token, top-k) pairs a layer call: the prefill graphs' steps, e.g. a prompt's last tokens beside
    the decodes); "mixed" (a longer prefill beside decodes) or "prefill chunk" (alone). app/bench/step_trace.py's
    kinds, with its short mixed or prefill steps apart as "tail"."""
    if step.get("layers") is not None:
        return "layer group"
    if not step.get("prefill_works"):
        return "decode"
    tokens = step["prefill_tokens"] + step["decode_rows"]
    if tokens * top_k <= max_keys:
        return "tail"
    return "mixed" if step["decode_rows"] else "prefill chunk"


def _prompt(seed: int, tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31 + 11) % 50000 for i in range(tokens)]


def _repeat(loop: _Loop, scenario: MixedScenario, index: int, overhead: float, prompt_tokens: int) -> dict:
    host, ex, s = loop.host, loop.executor, scenario
    t0 = host.now()
    greedy = dict(temperature=0.0, ignore_eos=True)
    ids = []
    for k in range(s.streams):
        seed = 1 if s.same_prompt else 2 + index * s.streams + k
        request = Request(f"rep{index}-stream{k}", _prompt(seed, s.stream_prompt_tokens),
                          SamplingParams(max_tokens=s.stream_tokens, **greedy), arrival_time=t0)
        loop.submit(request, t0 + overhead)
        ids.append(request.request_id)
    loop.until(lambda: all(len(loop.tokens[i]) >= s.warmup_tokens for i in ids), ids,
               f"{s.warmup_tokens} tokens on every stream")
    baseline_start = host.now()
    counts = [len(loop.tokens[i]) for i in ids]
    loop.until(lambda: all(len(loop.tokens[i]) >= c + s.baseline_tokens for i, c in zip(ids, counts, strict=True)),
               ids, f"{s.baseline_tokens} baseline tokens on every stream")
    send = host.now()
    long = Request(f"rep{index}-long", _prompt(1_000_003 + index, prompt_tokens),
                   SamplingParams(max_tokens=1, **greedy), arrival_time=send)
    reason = loop.scheduler.check_request(long)
    if reason is not None:
        raise _Broken(f"the long prompt can never run on these pools: {reason}")
    loop.submit(long, send + overhead)
    before, traced = ex.counters.copy(), len(loop.steps)
    loop.until(lambda: bool(loop.tokens[long.request_id]), ids, "the long prompt's first token")
    first = loop.tokens[long.request_id][0]
    during = ex.counters.minus(before)
    # the steps whose model call overlaps [send, first token], as the record's window steps read (ms from the send)
    window_steps = [{"end_ms": (row["end"] - send) * 1e3, "ms": (row["end"] - row["start"]) * 1e3,
                     **{k: v for k, v in row.items() if k not in ("start", "end")}}
                    for row in loop.steps[traced:] if row["end"] > send and row["start"] < first]
    loop.until(lambda: all(loop.tokens[i] and loop.tokens[i][-1] > first for i in ids), ids,
               "a token after the prefill window on every stream")
    for rid in ids:
        loop.scheduler.abort(rid)  # the benchmark closes the streams; the server aborts them
    window = [g for i in ids for g in gaps_between(loop.tokens[i], send, first, overlapping=True)]
    baseline = [g for i in ids for g in gaps_between(loop.tokens[i], baseline_start, send, overlapping=False)]
    return {"window_gaps_s": window, "baseline_gaps_s": baseline, "ttft_s": first - send, "window_s": first - send,
            "steps": during.steps, "step_trace": window_steps, "prompt_tokens": prompt_tokens,
            "layered_steps": during.layered_steps, "streamed_steps": during.streamed_steps,
            "streamed_staged": during.streamed_staged, "expert_misses": during.expert_misses,
            "stream_tokens_seen": [len(loop.tokens[i]) for i in ids]}


def not_modelled(cost: CostParams) -> list[str]:
    """What this prediction leaves out, in the words a reader of its figures needs (docs/simulator.md)."""
    notes = []
    if cost.layer_overhead_s == 0 and cost.eager_layer_s == 0:
        notes.append("the eager step's own fixed cost: ADR 0011 measured c = 81.1 ms per uncaptured prefill step "
                     "on the H200 (resident, t = c + 52.6 us x tokens); this calibration has no term for it "
                     "(layer_overhead_s 0; step_overhead_s was fitted on captured decode steps), so every mixed "
                     "step and every layer group here lacks it, and how it splits over a group's layers is unknown")
    if cost.eager_compute_efficiency == 0:
        notes.append("prefill compute is not calibrated: the resident 32k prefill simulates at 0.51 s (pool "
                     "preloaded; 0.83 s from a cold LRU) against 1.57 s measured (docs/simulator.md, 'Prefill compute'), so compute-bound steps (resident) come "
                     "out short")
    elif cost.eager_token_s == 0:
        notes.append("the eager terms (eager_layer_s, eager_compute_efficiency) were fitted on 8,192-token chunks "
                     "only: the fixed cost is charged pro rata per layer (a layer group pays its layers' share) and "
                     "the split between fixed and per-token cost is not identified; held out, 1k-4k HTTP prefills "
                     "come out +23 to +53 % (docs/simulator.md, 'Prefill compute'), so short unlayered mixed steps "
                     "(512 tokens) are likely over-costed")
    else:
        notes.append("the eager prefill's fixed and per-token costs were split on the H100's 4k and 32k resident "
                     "prompts (docs/simulator.md, 'Short steps'); a layer group pays its layers' share of the fixed "
                     "cost (pro rata, unmeasured), and chunks under 4,096 tokens (a 512-token mixed step) are an "
                     "extrapolation (the H200's 1k HTTP prefill held out at -30 %)")
    if cost.eager_mixer_layer_s == 0:
        notes.append("a short uncaptured step (at most 32 tokens, e.g. the prompt's tail beside the decodes) is costed "
                     "as a graph replay; the engine launches its token mixers eagerly layer by layer: the H100 took "
                     "61-69 ms for such a tail step, resident, where this costs ~6 ms (docs/simulator.md, 'Short "
                     "steps')")
    else:
        notes.append("the short step's eager token mixers (eager_mixer_layer_s) were fitted on a resident tail step "
                     "(4 prompt tokens beside 3 decodes) of the H100's host; with experts to copy the model overlaps "
                     "them with the copies, and the H100's 24 GiB tail steps came out 10-17 % short; a pure short "
                     "prefill is likely over-costed (session 20's 2-token prefills: TTFT +37 to +65 %)")
    notes += [
        "an unlayered mixed step's decode rows run eagerly on the engine (not as their graph); they are costed "
        "at the roofline like any eager row" + (" (with the eager terms)" if cost.eager_compute_efficiency else
                                                ", with no eager launch cost (not measured)"),
        "per-forward host work of a layer group (its step plan, the streamed step opening for every group) and "
        "the streamed prefill's per-round launch cost (ADR 0010 estimates 50-100 us a round)",
        "HTTP: request_overhead_s (fitted on 18-token prompts) delays each send; tokenizing the long prompt and "
        "the client's stream handling are not timed",
    ]
    return notes


@dataclass(frozen=True)
class MixedConfig:
    """One prediction: a plan (hardware, model, deployment, KV) and a calibration."""

    spec: ModelSpec
    model_name: str
    hardware: HardwareProfile
    deployment: Deployment
    cost: CostParams
    kv_tokens: int
    calibration: str
    routing: str = "uniform"
    mixed_prefill_length: int | None = None  # --mixed-prefill-length (None: ft serve's default)
    layer_group_length: int | None = None  # --layer-group-length (None: ft serve's default; a policy's group_tokens wins)
    page_size: int = 16
    # a what-if layering policy (simulator/layering_policy.py; layered prefill on only); None: the domain's
    policy: LayeringPolicy | None = None
    # --layer-short-prompts auto (True; ft serve's default in sessions 28-29) or off (ft serve's default since
    # session 30): with layered prefill, on a plan that leaves experts out, every chunk beside decodes is layered
    # (ADR 0024 "A0"); a what-if policy that layers streamed chunks replaces it
    layer_short_prompts: bool = False


def predict_mixed(cfg: MixedConfig, routing: RoutingModel, scenario: MixedScenario, layered: bool,
                  check: bool = False) -> dict:
    """The mixed scenario on cfg's plan with `--layered-prefill` on or off: a JSON-able dict (fits, reason, plan,
    scheduler budgets, the pooled window/baseline gap figures, TTFT, one point per measured repeat)."""
    scenario.check_valid()
    spec, dep = cfg.spec, cfg.deployment
    max_step = dep.max_prefill_length or DEFAULT_MAX_STEP_TOKENS
    out: dict = {"hardware": cfg.hardware.name, "model": cfg.model_name, "kv_tokens": cfg.kv_tokens,
                 "layered_prefill": layered, "calibration": cfg.calibration, "routing": cfg.routing,
                 "gpu_budget_gib": dep.gpu_budget_bytes / 2**30 if dep.gpu_budget_bytes else None,
                 "scenario": scenario.to_dict(), "fits": False, "reason": None}
    planned = plan_deployment(spec, cfg.hardware, dep.replace(layered_prefill=layered), cfg.kv_tokens,
                              page_size=cfg.page_size)
    if isinstance(planned, str):
        out["reason"] = planned
        return out
    plan = planned.plan
    out.update(fits=True, plan=plan_summary(plan), residency=plan.residency)
    if planned.notes:
        out["plan_notes"] = list(planned.notes)
    needed = scenario.prompt_tokens + scenario.streams * (scenario.stream_prompt_tokens + scenario.stream_tokens)
    if plan.kv_tokens < needed:
        out.update(fits=False, reason=f"a KV pool of {plan.kv_tokens:,} tokens cannot hold the {scenario.prompt_tokens:,}"
                   f"-token prompt beside {scenario.streams} streams of {scenario.stream_prompt_tokens} + "
                   f"{scenario.stream_tokens} tokens ({needed:,}); give --kv of at least that (the benchmark's "
                   "24gib scenario serves 16k)")
        return out
    running = min(dep.state_slots, max(plan.state_slots, 1))
    prefix_cache = dep.simulate_prefix_cache and dep.cache_type == "radix"
    linear = spec.linear_state_bytes_per_sequence() > 0
    mixed = mixed_step_tokens(max_step, running, cfg.mixed_prefill_length)
    group = cfg.policy.group_tokens if cfg.policy is not None and cfg.policy.group_tokens is not None \
        else cfg.layer_group_length
    what_if = layered and cfg.policy is not None and cfg.policy.layer_streamed
    config = SchedulerConfig(max_running=running, max_step_tokens=max_step, mixed_step_tokens=mixed,
                             layer_group_tokens=layer_group_tokens(max_step, mixed, group),
                             page_size=plan.page_size, max_context=spec.max_context, prefix_cache=prefix_cache,
                             snapshot_interval=snapshot_interval(plan.page_size) if prefix_cache else 0,
                             linear_state=linear, layered_prefill=layered, num_layers=spec.num_layers,
                             layer_short_prompts=layered and cfg.layer_short_prompts and not what_if,
                             partial_residency=plan.partial_residency)
    replays = resolve(dep.short_prompt_replays)
    # NOTE: the keys of the server's /v1/stats `scheduler` (ft bench mixed's server_step_budgets) where they match
    out["scheduler"] = {"max_step_tokens": config.max_step_tokens, "mixed_step_tokens": config.mixed_step_tokens,
                        "layer_group_tokens": config.layer_group_tokens,
                        "max_running": config.max_running, "layered_prefill": layered,
                        "layer_short_prompts": config.layer_short_prompts,
                        "partial_residency": config.partial_residency,
                        "num_layers": config.num_layers, "prefix_cache": prefix_cache,
                        "short_prompt_replays": replays}
    snapshots = plan.snapshot_slots if prefix_cache else 0
    if what_if:
        # NOTE: a step streams (DeviceExpertPool.routed) when the plan leaves experts out, has staging rows, and the
        # step's rows route more keys than one device lookup takes; with fewer, or no staging, it faults them through
        # the residency (layer_faulting: any chunk)
        partial = plan.expert_slots < spec.num_layers * spec.num_experts
        streams = partial and cfg.cost.streamed_prefill and plan.staging_experts > 0
        stream_rows = min(plan.expert_slots, cfg.cost.lookup_max_keys) // spec.top_k if streams else None
        if cfg.policy.layer_faulting and partial:
            stream_rows = 0
        scheduler = CandidateScheduler(config, PageAllocator(plan.kv_pages), plan.state_slots, snapshots,
                                       policy=cfg.policy, stream_rows=stream_rows)
        out["scheduler"].update(policy=cfg.policy.to_dict(), stream_rows=stream_rows)
    else:
        scheduler = Scheduler(config, PageAllocator(plan.kv_pages), plan.state_slots, snapshots)
    cost = CostModel(spec, cfg.hardware, cfg.cost)
    executor = SimExecutor(SimHost(), cost, routing, plan.expert_slots, staging_experts=plan.staging_experts,
                           short_prompt_replays=replays)
    loop = _Loop(executor, scheduler, check)
    overhead = cost.request_overhead(executor.via_server)
    points, window, baseline, ttfts, failures = [], [], [], [], []
    for index in range(scenario.warmup_repeats + scenario.repeats):
        recorded = index >= scenario.warmup_repeats
        length = scenario.long_prompt_tokens(index - scenario.warmup_repeats) if recorded else scenario.prompt_tokens
        try:
            got = _repeat(loop, scenario, index, overhead, length)
        except _Broken as exc:
            failures.append({"repeat": index, "warmup": not recorded, "error": str(exc)})
            if recorded:
                points.append({"repeat": index - scenario.warmup_repeats, "ok": False, "error": str(exc)})
            _drain(loop)
            continue
        if not recorded:
            continue
        figures = gap_figures(got["window_gaps_s"])
        points.append({
            "repeat": index - scenario.warmup_repeats, "ok": True, "error": None, "prompt_tokens": got["prompt_tokens"],
            "ttft_s": got["ttft_s"],
            "gaps_in_window": figures["count"], "gap_p50_ms": figures["p50_ms"], "gap_p99_ms": figures["p99_ms"],
            "gap_max_ms": figures["max_ms"], "baseline": gap_figures(got["baseline_gaps_s"]),
            "window_steps": got["steps"], "window_layered_steps": got["layered_steps"],
            "window_streamed_steps": got["streamed_steps"], "window_experts_staged": got["streamed_staged"],
            "window_bytes_staged": got["streamed_staged"] * cost.expert_bytes,
            "window_expert_misses": got["expert_misses"], "stream_tokens_seen": got["stream_tokens_seen"],
            "window_gaps_ms": [round(g * 1e3, 3) for g in got["window_gaps_s"]],
            "window_step_trace": [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                                  for row in got["step_trace"]],
        })
        window += got["window_gaps_s"]
        baseline += got["baseline_gaps_s"]
        ttfts.append(got["ttft_s"])
    pooled = gap_figures(window)
    out.update(points=points, failures=failures, window=pooled, baseline=gap_figures(baseline),
               ttft_s_median=statistics.median(ttfts) if ttfts else None,
               within_target=pooled["p99_ms"] <= TARGET_GAP_P99_MS if pooled["p99_ms"] is not None else None,
               target_gap_p99_ms=TARGET_GAP_P99_MS, not_modelled=not_modelled(cfg.cost),
               simulated_s=executor.host.now())
    return out


def _drain(loop: _Loop) -> None:
    """After a broken repeat: abort what still runs and let the engine go idle, as a fresh repeat expects."""
    for rid in list(loop.tokens):
        if rid not in loop.ended:
            loop.scheduler.abort(rid)
            loop.ended[rid] = "abort"
    loop._arrivals.clear()


def summary_row(result: dict) -> dict:
    """The figures a table shows for one prediction."""
    ok = [p for p in result.get("points", ()) if p.get("ok")]

    def mean(key: str) -> float | None:
        return statistics.fmean(p[key] for p in ok) if ok else None

    staged = mean("window_bytes_staged")
    return {"layered": "on" if result["layered_prefill"] else "off", "fits": result["fits"],
            "reason": result.get("reason"), "expert_slots": (result.get("plan") or {}).get("expert_slots"),
            "residency": result.get("residency"), "gaps": (result.get("window") or {}).get("count"),
            "p50_ms": (result.get("window") or {}).get("p50_ms"), "p99_ms": (result.get("window") or {}).get("p99_ms"),
            "max_ms": (result.get("window") or {}).get("max_ms"),
            "baseline_p99_ms": (result.get("baseline") or {}).get("p99_ms"), "ttft_s": result.get("ttft_s_median"),
            "steps": mean("window_steps"), "gb_staged": staged / GB if staged is not None else None,
            "failures": len(result.get("failures", ()))}
