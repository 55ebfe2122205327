"""The pool plan of one `ft serve` deployment: its flags -> the budget, the planner's request, the
defaults that are dropped when they do not fit, and the KV cap.

app/containers.py plans the server's pools through here and the simulator plans its predictions
through here, so a prediction sizes exactly the pools the server would (issue 10: the two had drifted:
another budget reading, no snapshot pool, no staging rows, other state slots). Units: bytes, tokens,
slots; `gpu_budget_gib` is GiB (2**30 bytes) as `ft serve --gpu-budget-gib` takes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from domain.budget import DEFAULT_SNAPSHOTS_PER_STATE_SLOT, GpuBudget, PlanRefusal, PoolRequest, plan_pools
from domain.model_spec import ModelSpec

GIB = 1024**3
CACHE_TYPES = ("radix", "none")
# planner(spec, budget, request) -> a plan (PoolPlan, or domain.expert_parallel's plan of every rank) or
# a PlanRefusal; plan_pools by default.
Planner = Callable[[ModelSpec, GpuBudget, PoolRequest], Any]


def cap_bytes(gpu_budget_gib: float | None) -> int | None:
    """`--gpu-budget-gib` in bytes (int(gib * 2**30), the rounding the server applies); None stays None.
    Raises ValueError for a cap that is not positive."""
    if gpu_budget_gib is None:
        return None
    if not 0 < gpu_budget_gib < float("inf"):  # NOTE: inf overflowed int() below
        raise ValueError(f"--gpu-budget-gib must be a positive number of GiB, got {gpu_budget_gib}")
    return int(gpu_budget_gib * GIB)


def gathers_embedding_rows(hidden_size: int) -> bool:
    """Whether embedding rows of `hidden_size` suit the gather that reads them one per token from host memory:
    H a multiple of 8, rows of a multiple of 16 bytes in bf16 (adapters/kernels/embedding_gather.py). The one rule
    the plan (embedding_on_host) and the loader (adapters.checkpoint.loader.hosts_embedding) both apply."""
    return hidden_size % 8 == 0


def embedding_on_host(spec: ModelSpec, gpu: bool) -> bool:
    """Whether a deployment keeps the input embedding in host memory, out of the GPU budget: on a GPU, where the
    table's rows suit the gather (gathers_embedding_rows; the loader's and the decoder's rule too:
    adapters.checkpoint.loader.hosts_embedding; a tied checkpoint keeps its table on the GPU as the head's weight,
    which dense_weight_bytes() counts once more, so the plan holds it)."""
    return gpu and gathers_embedding_rows(spec.hidden_size)


def serve_budget(spec: ModelSpec, device_total_bytes: int, memory_ratio: float = 0.9,
                 gpu_budget_bytes: int | None = None, fixed_bytes: int = 0, host_embedding: bool = False) -> GpuBudget:
    """The server's budget: total = the device's memory (what the driver reports), capped at
    gpu_budget_bytes when given; pool = int(total * memory_ratio) - the dense weights of `spec` on the GPU
    (spec.dense_weight_bytes(): what the loader puts there besides the experts, less spec.embedding_bytes() when
    host_embedding (embedding_on_host): a CUDA deployment's decoder reads the input embedding from pinned host
    memory, one row per token, so its VRAM goes to the pools) - fixed_bytes
    (0 for `ft serve`; a simulator calibration of another engine may set aside its fixed caches).
    Raises ValueError on negative sizes or a ratio outside (0, 1]."""
    if device_total_bytes <= 0:
        raise ValueError(f"device_total_bytes must be > 0, got {device_total_bytes}")
    if gpu_budget_bytes is not None and gpu_budget_bytes <= 0:
        raise ValueError(f"gpu_budget_bytes must be > 0, got {gpu_budget_bytes}")
    total = device_total_bytes if gpu_budget_bytes is None else min(device_total_bytes, gpu_budget_bytes)
    weights = spec.dense_weight_bytes() - (spec.embedding_bytes() if host_embedding else 0)
    return GpuBudget(total_bytes=total, memory_ratio=memory_ratio, weights_bytes=weights, fixed_bytes=fixed_bytes)


@dataclass(frozen=True)
class ServePools:
    """The `ft serve` flags that size the pools, with `ft serve`'s defaults (tests/simulator/test_serve_plan.py
    holds them equal to app.settings.ServeSettings').

    staging_experts None is `--staging-experts auto`: the geometry's default rows where the deployment's
    prefill streams experts (`streams_prefill`: the CUDA-graph fast path with the Triton prefill, i.e.
    `--prefill-kernels triton` or auto resolved to it (domain/prefill_choice.py), one GPU, a pinned bank), else 0
    (prefill goes through the expert cache)."""

    kv_tokens: int | None = None  # --kv-tokens (None: fill, at least kv_reserve_tokens)
    expert_slots: int | None = None  # --moe-slots (None: fill the budget)
    max_running_requests: int = 4  # --max-running-requests: also the GDN state slots
    kv_reserve_tokens: int = 8192  # --kv-reserve-tokens
    cache_type: str = "radix"  # --cache-type
    snapshot_slots: int | None = None  # --snapshot-slots (None: 4 per running request with radix, 0 with none)
    staging_experts: int | None = None  # --staging-experts (None: auto, see the class docstring)
    streams_prefill: bool = False
    page_size: int = 16

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.cache_type not in CACHE_TYPES:
            raise ValueError(f"--cache-type must be one of {CACHE_TYPES}, got {self.cache_type!r}")
        for name in ("snapshot_slots", "staging_experts", "expert_slots", "kv_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.kv_reserve_tokens < 0 or self.page_size < 1:
            raise ValueError(f"kv_reserve_tokens must be >= 0 and page_size >= 1, got "
                             f"{self.kv_reserve_tokens}, {self.page_size}")

    @property
    def resolved_snapshot_slots(self) -> int:
        """The snapshot slots asked for: 0 without the prefix cache, else as given or 4 per running request."""
        if self.cache_type == "none":
            return 0
        if self.snapshot_slots is not None:
            return self.snapshot_slots
        return DEFAULT_SNAPSHOTS_PER_STATE_SLOT * self.max_running_requests

    def request(self) -> PoolRequest:
        """The planner's request before any default is dropped."""
        staging = self.staging_experts
        if staging is None:
            staging = None if self.streams_prefill else 0  # None: plan_pools sizes it from the geometry
        return PoolRequest(kv_tokens=self.kv_tokens, expert_slots=self.expert_slots,
                           state_slots=self.max_running_requests, snapshot_slots=self.resolved_snapshot_slots,
                           staging_experts=staging, kv_reserve_tokens=self.kv_reserve_tokens,
                           page_size=self.page_size)


@dataclass(frozen=True)
class ServePlan:
    """A deployment's plan, the request that produced it and, in order, the defaults that were dropped
    because they did not fit (each a sentence the server logs as a warning and a prediction reports)."""

    plan: Any  # PoolPlan, or ExpertParallelPlan with an expert-parallel planner
    request: PoolRequest
    notes: tuple[str, ...] = ()


def plan_serve_pools(spec: ModelSpec, budget: GpuBudget, pools: ServePools,
                     planner: Planner | None = None) -> ServePlan | PlanRefusal:
    """Plan as `ft serve` does: the request of `pools`; while the planner refuses the default staging rows
    (auto), plan again without them (prefill then goes through the expert cache); while it refuses the
    default snapshot pool, plan again without it (a hybrid model then resumes no prefix); explicit sizes are
    never dropped. Last, KV left unsized is capped at max_running_requests * max_context (KV beyond every
    running sequence at full context is never used; the cap goes back to the experts).
    Returns the PlanRefusal of the last attempt when nothing fits."""
    planner = planner or plan_pools
    request = pools.request()
    notes: list[str] = []
    plan = planner(spec, budget, request)
    # NOTE: a loop, not one check per pool: with auto staging the planner tries the plan without staging
    # first, so the snapshot pool can be refused before the staging rows are; once it is dropped, the staging
    # rows may be the next refusal. Each default is dropped at most once, so this ends.
    while isinstance(plan, PlanRefusal):
        if plan.pool == "staging" and pools.staging_experts is None and request.staging_experts != 0:
            notes.append(f"the default prefill staging rows do not fit ({plan.message}); prefill goes through "
                         f"the expert cache")
            request = replace(request, staging_experts=0)
        elif plan.pool == "snapshot" and pools.snapshot_slots is None and request.snapshot_slots:
            notes.append(f"the default {request.snapshot_slots} state snapshot slots do not fit ({plan.message}); "
                         f"serving without them")
            request = replace(request, snapshot_slots=0)
        else:
            return plan
        plan = planner(spec, budget, request)
    useful = pools.max_running_requests * spec.max_context
    kv_tokens = getattr(plan, "shared", plan).kv_tokens
    if pools.kv_tokens is None and kv_tokens > useful:
        capped = planner(spec, budget, replace(request, kv_tokens=useful))
        if not isinstance(capped, PlanRefusal):
            plan, request = capped, replace(request, kv_tokens=useful)
    plan.check_valid()
    return ServePlan(plan, request, tuple(notes))
