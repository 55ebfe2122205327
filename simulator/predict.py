"""Predict what a machine will do: plan the pools with the domain budget planner, then run the
customer's benchmark method through the domain scheduler on a simulated host.

One point = (hardware, model, KV pool size, batch size). The workload reproduces SPEC.md's
method: warm-up iterations of `warmup_tokens`, then measured iterations of `measure_tokens`,
`batch` concurrent requests each, greedy, ignore_eos, a short prompt. Aggregate tok/s is
output tokens over the measured wall time; per-request tok/s is each request's output tokens
over its own lifetime, averaged.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from domain.arrival_window import ArrivalWindow
from domain.budget import GpuBudget, PlanRefusal, PoolPlan
from domain.kv_pages import PageAllocator
from domain.model_spec import ModelSpec
from domain.prefix_store import snapshot_interval
from domain.request import Request, SamplingParams
from domain.scheduler import Scheduler, SchedulerConfig
from domain.serve_plan import (
    CACHE_TYPES,
    ServePlan,
    ServePools,
    embedding_on_host,
    plan_serve_pools,
    serve_budget,
)
from domain.step_budget import DEFAULT_MIXED_STEP_TOKENS, reserve_step, serve_step_reserve
from simulator.arrivals import arrival_times, window_close
from simulator.cost_model import CostModel, CostParams
from simulator.hardware import GIB, HardwareProfile
from simulator.host import SimHost
from simulator.params import StrictParams, require_positive
from simulator.routing import RoutingModel
from simulator.short_prompts import resolve
from simulator.sim_executor import SimExecutor


@dataclass(frozen=True)
class Workload(StrictParams):
    prompt_tokens: int = 24  # "Count from 1 to 100." in a chat template
    warmup_iterations: int = 2
    warmup_tokens: int = 64
    measure_iterations: int = 2
    measure_tokens: int = 128
    same_prompt: bool = True  # one prompt for every request (the customer's method)
    max_step_tokens: int = 2048  # the scheduler's budget of a step with no decodes (ft serve --max-prefill-length)
    page_size: int = 16
    ttft_prompt_tokens: int = 0  # > 0: after measuring, time one fresh prompt of this length

    def check_valid(self) -> None:
        require_positive(self, "ttft_prompt_tokens", allow_zero=True)
        require_positive(self, "prompt_tokens", "warmup_tokens", "measure_iterations", "measure_tokens",
                         "max_step_tokens", "page_size")
        require_positive(self, "warmup_iterations", allow_zero=True)


PREFILL_KERNELS = ("reference", "triton")


@dataclass(frozen=True)
class Deployment(StrictParams):
    """How the deployment plans its pools: `ft serve`'s pool flags with `ft serve`'s defaults (planned by
    domain.serve_plan, the code the server plans with), plus how the card's memory is read.

    Budget: pool = int(min(vram, gpu_budget_bytes) * memory_ratio) - the model's dense weights - fixed_bytes,
    as the server computes it, unless pool_bytes gives the pool itself (calibration fits, tests).
    fixed_bytes is 0 for `ft serve`; the reference (rtx3090) calibration sets the other engine's fixed
    caches there. state_slots is `--max-running-requests` (the GDN state slots and the most requests that
    run at once; more concurrent requests queue, as on the server)."""

    memory_ratio: float = 0.9  # --memory-ratio
    fixed_bytes: int = 0  # outside the pools (activations, graph pools of another engine); ft serve: 0
    state_slots: int = 4  # --max-running-requests
    pool_bytes: int | None = None  # the pool budget itself, after weights and fixed caches (overrides the rest)
    expert_slots: int | None = None  # --moe-slots (explicit expert pool, like `ft ctl cache --moe`); None = fill
    gpu_budget_bytes: int | None = None  # --gpu-budget-gib in bytes: a cap on the card's memory
    cache_type: str = "radix"  # --cache-type (radix: 4 state snapshot slots per running request by default)
    snapshot_slots: int | None = None  # --snapshot-slots
    staging_experts: int | None = None  # --staging-experts (None = auto: the geometry's rows with the Triton prefill)
    # the prefill --prefill-kernels resolves to (triton: auto staging rows are planned); ft serve's default auto is
    # triton on a card for bf16, block-FP8 and NVFP4 weights (domain/prefill_choice.py), the calibrations' is reference
    prefill_kernels: str = "reference"
    # --max-prefill-length: its step's bf16 activations are held beside the pools (ADR 0011), as the server
    # does; None: no reserve (the server before that ADR, e.g. the 2026-12-01 H200 records)
    max_prefill_length: int | None = 8192
    # With cache_type radix, the simulated scheduler runs the domain's radix prefix cache over the planned
    # snapshot slots, as `ft serve` does (app/containers.py: SchedulerConfig(prefix_cache=...)): a repeated
    # prompt resumes from its deepest cached snapshot and prefills only the rest. False: every prompt is
    # prefilled from position 0 (the simulator before 2026-12-04 session 21; files without the field).
    simulate_prefix_cache: bool = False
    # --layered-prefill: the scheduler runs a long chunk beside decodes a layer group per step, and the plan holds
    # the chunk's residual stream beside the pools (ADR 0024). ft serve's default is on since 2026-12-05 (session
    # 23); False for files without the field (every calibration so far was measured with it off)
    layered_prefill: bool = False
    # a long prefill chunk's dense projections on cuBLAS over a dequantized copy of the weight, which the plan holds
    # beside the pools (domain/step_budget.dense_scratch_bytes: 48 MiB for Qwen3.6 block FP8). ft serve does this on
    # CUDA since 2026-12-06 (session 30, FLUXTIDE_PREFILL_DEQUANT_ROWS=1024); False for files without the field
    # (every calibration and record so far was measured before)
    dense_copy: bool = False
    # the input embedding in pinned host memory, out of the GPU budget (domain.serve_plan.embedding_on_host): ft serve
    # on CUDA since 2026-12-06 (session 35: the table's 1.02 GB for Qwen3.6 go to the pools); False for files without
    # the field (every calibration and record so far planned the table on the GPU)
    host_embedding: bool = False
    # FLUXTIDE_SHORT_PROMPT_REPLAYS: a step whose prompt chunks are all at most this many tokens runs as replays of
    # the captured decode step, one per token (ADR 0026; SimExecutor "Short prompts as decode replays"); 0 off; None
    # (auto) the server's default since session 32 (2026-12-06), 8 at every plan (short_prompts.resolve). Files
    # without the field get auto, so a prediction is of today's server; a fit or replay of a record served before
    # then passes 0 (simulator/fit_ttft.py, mixed_record.py)
    short_prompt_replays: int | None = None
    # the server fills an expert pool that holds every key before it serves (ExecutorPools._preload_experts, since
    # 2026-12-05; SimExecutor "Preloaded experts"). False for files without the field (their records' servers did not)
    preload_experts: bool = False
    # --arrival-window-ms (ADR 0021; 30 on `ft serve` since 2026-12-03): an idle engine's first step waits for the rest
    # of a burst (simulator/arrivals.py). 0 for files without the field: the first step starts at the first arrival
    arrival_window_ms: float = 0.0

    def check_valid(self) -> None:
        require_positive(self, "memory_ratio", "state_slots")
        require_positive(self, "arrival_window_ms", allow_zero=True)
        for name in ("expert_slots", "pool_bytes", "gpu_budget_bytes", "max_prefill_length"):
            if getattr(self, name) is not None:
                require_positive(self, name)
        for name in ("snapshot_slots", "staging_experts"):
            if getattr(self, name) is not None:
                require_positive(self, name, allow_zero=True)
        require_positive(self, "fixed_bytes", allow_zero=True)
        n = self.short_prompt_replays
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"Deployment.short_prompt_replays must be None (auto) or an integer >= 0 (0: off), "
                             f"got {n!r}")
        if self.cache_type not in CACHE_TYPES:
            raise ValueError(f"Deployment.cache_type must be one of {CACHE_TYPES}, got {self.cache_type!r}")
        for name in ("simulate_prefix_cache", "layered_prefill", "dense_copy", "preload_experts", "host_embedding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Deployment.{name} must be a bool")
        if self.prefill_kernels not in PREFILL_KERNELS:
            raise ValueError(f"Deployment.prefill_kernels must be one of {PREFILL_KERNELS}, "
                             f"got {self.prefill_kernels!r}")

    def to_dict(self) -> dict:
        """StrictParams' dict, less short_prompt_replays where it is the server's default (auto), and preload_experts,
        arrival_window_ms and host_embedding where off: a calibration states them only where they differ, so the files fitted before
        the fields stay what their commands write; from_dict puts the defaults back."""
        out = super().to_dict()
        if out["short_prompt_replays"] is None:
            del out["short_prompt_replays"]
        # stated where on (h100_records_v2; host_embedding: none yet)
        for name, off in (("preload_experts", False), ("arrival_window_ms", 0.0), ("host_embedding", False)):
            if out[name] == off:
                del out[name]
        return out

    def step_budgets(self, default_step: int, mixed_prefill_length: int | None = None) -> tuple[int, int | None]:
        """(max_step_tokens, mixed_step_tokens) of the simulated scheduler, as `ft serve` configures its own
        (app/containers.py `_scheduler_config`, app/settings.py `mixed_step_tokens`): --max-prefill-length for a
        step alone; for a step that carries decodes `mixed_prefill_length` (--mixed-prefill-length, a scheduler
        flag, not a pool flag: the plan does not depend on it), by default min(max, max(512,
        --max-running-requests)). Without max_prefill_length (the customer's engine, the server before ADR 0011)
        one budget: `default_step`, the calibration's workload step, and None (mixed = max). ValueError for a mixed
        budget outside [--max-running-requests, max], as `ft serve` refuses it."""
        if self.max_prefill_length is None:
            if mixed_prefill_length is not None:
                raise ValueError("--mixed-prefill-length needs a deployment with --max-prefill-length (a calibration "
                                 "of the customer's engine runs one step budget)")
            return default_step, None
        mixed = mixed_prefill_length
        if mixed is None:
            mixed = min(self.max_prefill_length, max(DEFAULT_MIXED_STEP_TOKENS, self.state_slots))
        if not self.state_slots <= mixed <= self.max_prefill_length:
            raise ValueError(f"--mixed-prefill-length ({mixed}) must be >= --max-running-requests ({self.state_slots}) "
                             f"and <= --max-prefill-length ({self.max_prefill_length})")
        return self.max_prefill_length, mixed

    def budget(self, spec: ModelSpec, hardware: HardwareProfile) -> GpuBudget:
        """The server's budget: the card's memory (or the cap) less the dense weights, with the largest step's
        activations held beside the pools, with layered_prefill the chunk kept between layer groups too, and with
        dense_copy the dequantized copy of a dense weight."""
        if self.pool_bytes is not None:
            return GpuBudget(total_bytes=self.pool_bytes, memory_ratio=1.0)
        budget = serve_budget(spec, hardware.vram_bytes, self.memory_ratio, self.gpu_budget_bytes, self.fixed_bytes,
                              host_embedding=self.host_embedding and embedding_on_host(spec, gpu=True))
        if self.max_prefill_length is None:
            return budget
        return reserve_step(budget, serve_step_reserve(spec, self.max_prefill_length, self.state_slots,
                                                       layered_prefill=self.layered_prefill,
                                                       dense_copy=self.dense_copy))

    def pools(self, kv_tokens: int, page_size: int = 16, expert_parallel: bool = False) -> ServePools:
        """The server's pool flags for one point. The simulated executor is the CUDA-graph fast path, so
        auto staging follows --prefill-kernels alone; expert parallelism runs the reference executor
        (no staging on auto), as in app/containers.py."""
        return ServePools(kv_tokens=kv_tokens, expert_slots=self.expert_slots, max_running_requests=self.state_slots,
                          cache_type=self.cache_type, snapshot_slots=self.snapshot_slots,
                          staging_experts=self.staging_experts,
                          streams_prefill=self.prefill_kernels == "triton" and not expert_parallel,
                          page_size=page_size)


@dataclass
class PointResult:
    hardware: str
    model: str
    kv_tokens: int
    batch: int
    fits: bool
    reason: str | None = None
    expert_slots: int = 0
    residency: float = 0.0
    state_slots: int = 0
    hit_rate: float | None = None
    decode_tok_s: float | None = None  # aggregate: all measured output tokens / all measured wall time
    # the mean over measured requests of each one's tokens / its time from its round's send to its last token; not
    # aggregate / batch (ft bench's per_request_tok_s) but never below it, and above the aggregate at batch 1 when
    # the measured rounds differ in speed (an average of rates, not a ratio of sums)
    decode_tok_s_per_request: float | None = None
    pcie_utilisation: float | None = None
    gpu_utilisation: float | None = None
    ttft_s: float | None = None
    misses_per_token: float | None = None
    simulated_s: float | None = None
    calibration: str | None = None
    engine: str | None = None  # the engine the calibration predicts: "fluxtide" or "customer-engine"
    # SPEC.md's steady decode: each measured request's tokens after the first over its time after the first, median
    steady_decode_tok_s_per_request: float | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


@dataclass
class RunStats:
    """What a workload run measured (the window is the measured iterations)."""

    seconds: float
    output_tokens: int
    per_request_tok_s: list[float]
    ttfts: list[float]
    hits: int
    misses: int
    bytes_moved: int
    gpu_utilisation: float
    pcie_utilisation: float
    steps: int
    sequence_steps: int
    requests_finished: int
    requests_added: int
    ttft_probe_s: float | None = None
    ttft_probe_refused: str | None = None  # why the TTFT probe's prompt can never run on this point's pools
    # the measured window's streamed prefill (steps, routed experts not resident, rows staged) and the prompt
    # tokens its requests took from the prefix cache
    streamed_steps: int = 0
    streamed_not_resident: int = 0
    streamed_staged: int = 0
    cached_prompt_tokens: int = 0
    steady_tok_s: list[float] = field(default_factory=list)  # per measured request with > 1 token (SPEC.md)
    working_set: int = 0  # distinct (layer, expert) keys the measured window's steps routed to
    # the host lane (ADR 0030): misses computed on the host, their routed pairs, the host kernel's weight passes over
    # them (up to host_lane.ROWS_PER_PASS of a lookup's pairs of one expert a pass), and the lane's utilisation
    host_experts: int = 0
    host_pairs: int = 0
    host_passes: int = 0
    cpu_utilisation: float = 0.0


def plan_deployment(spec: ModelSpec, hardware: HardwareProfile, deployment: Deployment, kv_tokens: int, *,
                    page_size: int = 16) -> ServePlan | str:
    """The server's plan for this point (domain.serve_plan: the defaults it drops and why included), or
    why it cannot run (Deployment.layered_prefill: the kept chunk beside the pools, as `ft serve`'s)."""
    bank = spec.total_experts * spec.expert_bytes()
    if bank > hardware.host_ram_bytes:
        return (f"expert bank needs {bank / GIB:.1f} GiB of host RAM, "
                f"{hardware.name} has {hardware.host_ram_bytes / GIB:.1f} GiB")
    planned = plan_serve_pools(spec, deployment.budget(spec, hardware),
                               deployment.pools(kv_tokens, page_size))
    if isinstance(planned, PlanRefusal):
        return planned.message
    return planned


def plan_point(spec: ModelSpec, hardware: HardwareProfile, deployment: Deployment, kv_tokens: int, *,
               page_size: int = 16) -> PoolPlan | str:
    """The domain planner's plan for this point, or why it cannot run. Any batch fits a plan: requests
    beyond its state slots queue (predict_point says how many)."""
    planned = plan_deployment(spec, hardware, deployment, kv_tokens, page_size=page_size)
    return planned if isinstance(planned, str) else planned.plan


def plan_summary(plan: PoolPlan) -> dict:
    """The pool sizes a prediction reports (what `/v1/stats` shows as `plan` on the server)."""
    return {"kv_pages": plan.kv_pages, "kv_tokens": plan.kv_tokens, "expert_slots": plan.expert_slots,
            "state_slots": plan.state_slots, "snapshot_slots": plan.snapshot_slots,
            "staging_experts": plan.staging_experts, "pool_bytes": plan.pool_bytes, "free_bytes": plan.free_bytes}


def scheduler_config(plan: PoolPlan, workload: Workload, max_context: int, prefix_cache: bool = False,
                     linear_state: bool = True, mixed_step_tokens: int | None = None,
                     layered_prefill: bool = False, num_layers: int = 1) -> SchedulerConfig:
    """The simulated scheduler's configuration, as app/containers.py `_scheduler_config` configures `ft serve`'s:
    at most the plan's state slots run (the rest of a batch queues; the benchmark's per-request time counts from
    the arrival, queueing included), the workload's max_step_tokens for a step alone and `mixed_step_tokens` for
    a step that carries decodes (None: one budget; predict_point passes Deployment.step_budgets), the plan's
    page size. prefix_cache: the radix prefix cache over the plan's snapshot slots (Deployment.
    simulate_prefix_cache; ft serve runs it whenever --cache-type radix). layered_prefill, num_layers: as
    `--layered-prefill on` over the model's layers (Deployment.layered_prefill)."""
    max_step = max(workload.max_step_tokens, plan.state_slots)
    mixed = None if mixed_step_tokens is None else min(max_step, max(mixed_step_tokens, plan.state_slots))
    return SchedulerConfig(max_running=plan.state_slots, max_step_tokens=max_step, mixed_step_tokens=mixed,
                           page_size=plan.page_size, max_context=max_context, prefix_cache=prefix_cache,
                           snapshot_interval=snapshot_interval(plan.page_size) if prefix_cache else 0,
                           linear_state=linear_state, layered_prefill=layered_prefill, num_layers=num_layers)


def run_workload(executor: SimExecutor, plan: PoolPlan, workload: Workload, batch: int,
                 max_context: int, check: bool = False, prefix_cache: bool = False,
                 linear_state: bool = True, mixed_step_tokens: int | None = None, layered_prefill: bool = False,
                 num_layers: int = 1, arrival_window_s: float = 0.0) -> RunStats:
    """Drives the domain scheduler with the simulated executor through the benchmark method.

    prefix_cache: the scheduler runs the radix prefix cache over the plan's snapshot slots (as `ft serve
    --cache-type radix`; linear_state: the model has linear-attention state, so a match needs a snapshot).
    Each round's requests are sent together; served over HTTP, the k-th reaches the scheduler
    CostParams.request_overhead_s + k x request_spacing_s after the send, and an idle engine's first step waits
    by the arrival window of `arrival_window_s` (s; 0: none) (simulator/arrivals.py); their times to first token
    and lifetimes count from the send. layered_prefill, num_layers: as scheduler_config."""
    host = executor.host
    config = scheduler_config(plan, workload, max_context, prefix_cache, linear_state, mixed_step_tokens,
                              layered_prefill, num_layers)
    scheduler = Scheduler(config, PageAllocator(plan.kv_pages), plan.state_slots,
                          plan.snapshot_slots if prefix_cache else 0)
    overhead = executor.cost.request_overhead(executor.via_server)
    spacing = executor.cost.params.request_spacing_s if executor.via_server else 0.0
    window = ArrivalWindow(arrival_window_s)
    cached_tokens = 0
    iterations = ([(workload.warmup_tokens, False)] * workload.warmup_iterations
                  + [(workload.measure_tokens, True)] * workload.measure_iterations)
    window_seconds, output_tokens, per_request, ttfts, steady = 0.0, 0, [], [], []
    start_counters, start_snapshot = None, None
    added = finished = 0
    for index, (max_tokens, measured) in enumerate(iterations):
        if measured and start_counters is None:
            start_counters, start_snapshot = executor.counters.copy(), host.snapshot()
            executor.routed_keys.clear()
        t0 = host.now()
        # NOTE: the burst is sent at t0; its requests reach the engine from the overhead on, `spacing` apart (GPU and
        # link idle until the first step)
        arrivals = arrival_times(t0, overhead, spacing, batch)
        requests = []
        for r in range(batch):
            prompt_seed = 0 if workload.same_prompt else index * batch + r + 1
            prompt = [(prompt_seed * 7919 + i * 31 + 11) % 50000 for i in range(workload.prompt_tokens)]
            requests.append(Request(f"it{index}-r{r}", prompt,
                                    SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                    arrival_time=arrivals[r]))
        added += batch
        first_token: dict[str, float] = {}
        done: dict[str, float] = {}
        queued = 0  # requests[:queued] have reached the scheduler
        while True:
            step = scheduler.schedule()
            if step is None:  # idle: the next arrival wakes the engine, whose first step waits by the window
                if queued == batch:
                    break
                start = window_close(arrivals[queued:], window)
                if start > host.now():
                    host.env.run(until=start)
                queued = _admit(scheduler, requests, arrivals, queued, host.now())
                continue
            sampled = executor.execute(step)
            for event in scheduler.complete(step, sampled):
                first_token.setdefault(event.request_id, host.now())
                if event.finished:
                    done[event.request_id] = host.now()
            if check:
                scheduler.check_valid()
                executor.check_valid()
            queued = _admit(scheduler, requests, arrivals, queued, host.now())  # those that landed join the next step
        finished += len(done)
        if measured:
            window_seconds += host.now() - t0
            cached_tokens += sum(req.num_cached_tokens for req in requests)
            for req in requests:
                output_tokens += len(req.output_token_ids)
                per_request.append(len(req.output_token_ids) / (done[req.request_id] - t0))
                ttfts.append(first_token[req.request_id] - t0)
                if len(req.output_token_ids) > 1 and done[req.request_id] > first_token[req.request_id]:
                    steady.append((len(req.output_token_ids) - 1) / (done[req.request_id] - first_token[req.request_id]))
    c = executor.counters.minus(start_counters)
    end_snapshot = host.snapshot()
    gpu_util, pcie_util = SimHost.utilisation(start_snapshot, end_snapshot)
    stats = RunStats(window_seconds, output_tokens, per_request, ttfts, c.expert_hits, c.expert_misses,
                     c.bytes_moved, gpu_util, pcie_util, c.steps, c.sequence_steps, finished, added,
                     streamed_steps=c.streamed_steps, streamed_not_resident=c.streamed_not_resident,
                     streamed_staged=c.streamed_staged, cached_prompt_tokens=cached_tokens, steady_tok_s=steady,
                     working_set=len(executor.routed_keys), host_experts=c.host_experts, host_pairs=c.host_pairs,
                     host_passes=c.host_passes,
                     cpu_utilisation=SimHost.cpu_utilisation(start_snapshot, end_snapshot))
    if workload.ttft_prompt_tokens:
        probe = _ttft_probe(executor, scheduler, workload.ttft_prompt_tokens)
        if isinstance(probe, str):
            stats.ttft_probe_refused = probe
        else:
            stats.ttft_probe_s = probe
    return stats


def _admit(scheduler: Scheduler, requests: list[Request], arrivals: list[float], queued: int, now: float) -> int:
    """Add requests[queued:] that have arrived by `now` (arrivals ascending); returns how many have been added."""
    while queued < len(requests) and arrivals[queued] <= now:
        scheduler.add(requests[queued])
        queued += 1
    return queued


def _ttft_probe(executor: SimExecutor, scheduler: Scheduler, prompt_tokens: int) -> float | str:
    """Time to first token of one fresh prompt on the warm engine (chunked prefill included), or why the
    prompt can never run on these pools (the point's decode figures stand; only the probe is refused)."""
    prompt = [(i * 7 + 3) % 50000 for i in range(prompt_tokens)]
    request = Request("ttft-probe", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    reason = scheduler.check_request(request)
    if reason is not None:
        return f"TTFT probe of {prompt_tokens} tokens not possible: {reason}"
    scheduler.add(request)
    t0 = executor.host.now()
    while (step := scheduler.schedule()) is not None:
        scheduler.complete(step, executor.execute(step))
    return executor.host.now() - t0


def predict_point(spec: ModelSpec, model_name: str, hardware: HardwareProfile, deployment: Deployment,
                  cost: CostParams, routing: RoutingModel, kv_tokens: int, batch: int,
                  workload: Workload | None = None, calibration: str | None = None,
                  check: bool = False, engine: str | None = None,
                  mixed_prefill_length: int | None = None) -> PointResult:
    """One point. The simulated scheduler's step budgets are the server's (Deployment.step_budgets, with
    `mixed_prefill_length` as --mixed-prefill-length): the workload's max_step_tokens is replaced by the
    deployment's --max-prefill-length when it has one. engine: what the JSON's `engine` says (the engine the
    calibration predicts)."""
    workload = workload or Workload()
    max_step, mixed = deployment.step_budgets(workload.max_step_tokens, mixed_prefill_length)
    workload = workload.replace(max_step_tokens=max_step)
    result = PointResult(hardware.name, model_name, kv_tokens, batch, fits=False, calibration=calibration,
                         engine=engine)
    result.extra["prompt_tokens"] = workload.prompt_tokens  # each request decodes after this much context
    planned = plan_deployment(spec, hardware, deployment, kv_tokens, page_size=workload.page_size)
    if isinstance(planned, str):
        result.reason = planned
        return result
    plan = planned.plan
    result.fits = True
    result.expert_slots, result.residency, result.state_slots = plan.expert_slots, plan.residency, plan.state_slots
    result.extra["plan"] = plan_summary(plan)
    if planned.notes:
        result.extra["plan_notes"] = list(planned.notes)
    if batch > plan.state_slots:
        result.extra["queued"] = batch - plan.state_slots
    streams = 1 if workload.same_prompt else min(batch, plan.state_slots)
    working_set = spec.top_k * spec.num_layers * streams
    if plan.expert_slots < working_set:
        # NOTE: the planner accepts this (its floor is top_k), but a global LRU smaller than one
        # step's experts evicts every key before the next step can reuse it: hit rate ~0.
        result.extra["warning"] = (f"{plan.expert_slots} expert slots < one step's {working_set} experts "
                                   f"(top_k x layers x distinct sequences): the LRU keeps nothing between tokens")
    replays = resolve(deployment.short_prompt_replays)
    executor = SimExecutor(SimHost(), CostModel(spec, hardware, cost), routing, plan.expert_slots,
                           staging_experts=plan.staging_experts, short_prompt_replays=replays,
                           preload_experts=deployment.preload_experts)
    prefix_cache = deployment.simulate_prefix_cache and deployment.cache_type == "radix"
    stats = run_workload(executor, plan, workload, batch, spec.max_context, check=check, prefix_cache=prefix_cache,
                         linear_state=spec.linear_state_bytes_per_sequence() > 0, mixed_step_tokens=mixed,
                         layered_prefill=deployment.layered_prefill, num_layers=spec.num_layers,
                         arrival_window_s=deployment.arrival_window_ms / 1e3)
    lookups = stats.hits + stats.misses
    result.hit_rate = stats.hits / lookups if lookups else 1.0
    result.decode_tok_s = stats.output_tokens / stats.seconds
    result.decode_tok_s_per_request = statistics.fmean(stats.per_request_tok_s)
    result.pcie_utilisation = stats.pcie_utilisation
    result.gpu_utilisation = stats.gpu_utilisation
    result.ttft_s = statistics.median(stats.ttfts)
    if stats.steady_tok_s:
        result.steady_decode_tok_s_per_request = statistics.median(stats.steady_tok_s)
    result.misses_per_token = stats.misses / max(1, stats.output_tokens)
    # NOTE: an expert pool at least this large never evicts an expert the window has touched (an LRU victim is
    # older than every key touched since), so each window miss is a key's first touch in the window and more slots
    # buy little for this workload (docs/simulator.md, "Which engine a prediction is for", finding 3)
    result.extra["working_set"] = stats.working_set
    if stats.ttft_probe_s is not None:
        result.extra["ttft_prompt_tokens"] = workload.ttft_prompt_tokens
        result.extra["ttft_prompt_s"] = stats.ttft_probe_s
        result.extra["prefill_tok_s"] = workload.ttft_prompt_tokens / stats.ttft_probe_s
    elif stats.ttft_probe_refused is not None:
        # NOTE: a point whose pool is too small for the probe still fits and keeps its decode figures (the
        # probe used to raise and lose every point of the sweep)
        result.extra["ttft_prompt_tokens"] = workload.ttft_prompt_tokens
        result.extra["ttft_prompt_s"] = None
        result.extra["ttft_prompt_reason"] = stats.ttft_probe_refused
    result.simulated_s = executor.host.now()
    budgets = scheduler_config(plan, workload, spec.max_context, mixed_step_tokens=mixed,
                               layered_prefill=deployment.layered_prefill, num_layers=spec.num_layers)
    result.extra["scheduler"] = {"max_step_tokens": budgets.max_step_tokens,
                                 "mixed_step_tokens": budgets.mixed_step_tokens,
                                 "layered_prefill": budgets.layered_prefill,
                                 "short_prompt_replays": replays}
    result.extra["window"] = {"seconds": stats.seconds, "steps": stats.steps,
                              "sequence_steps": stats.sequence_steps, "misses": stats.misses,
                              "output_tokens": stats.output_tokens}
    if cost.streamed_prefill:
        result.extra["window"]["prefill_streaming"] = {
            "steps": stats.streamed_steps, "experts_not_resident": stats.streamed_not_resident,
            "experts_staged": stats.streamed_staged}
    if prefix_cache:
        result.extra["window"]["cached_prompt_tokens"] = stats.cached_prompt_tokens
    if cost.host_permille:
        result.extra["host_lane"] = host_lane_summary(cost, stats, spec.expert_bytes())
    return result


def host_lane_summary(cost: CostParams, stats: RunStats, expert_bytes: int) -> dict:
    """The host lane of a point (ADR 0030; only where on): its settings and what the measured window did with them:
    misses computed on the host, their share of the misses, the bytes the link copied and the host read a token
    (once per weight pass: host_lane.weight_passes of each host key's rows in a lookup), and the host lane's
    utilisation."""
    tokens = max(1, stats.output_tokens)
    return {"mode": "host experts (ADR 0030)", "host_expert_gb_s": cost.host_expert_gb_s,
            "host_permille": cost.host_permille, "host_call_s": cost.host_call_s,
            "host_row_factor": cost.host_row_factor, "host_wait_row_s": cost.host_wait_row_s,
            "host_max_rows": cost.host_max_rows, "host_experts": stats.host_experts,
            "host_share_of_misses": stats.host_experts / stats.misses if stats.misses else 0.0,
            "copied_bytes_per_token": stats.bytes_moved / tokens,
            "host_bytes_per_token": stats.host_passes * expert_bytes / tokens, "cpu_utilisation": stats.cpu_utilisation}
