"""Pool budgeting: split the GPU memory left after weights between expert slots, KV pages,
linear-attention state slots, the prefix cache's state snapshot slots and the streamed prefill's
staging rows (MoE first), or refuse and say which pool is short by how much."""

from __future__ import annotations

from dataclasses import dataclass, replace

from domain.model_spec import ModelSpec
from domain.streamed_prefill import default_staging_experts

DEFAULT_STATE_SLOTS = 4
# Prefix-cache state snapshots per running request when the operator does not size the pool (`ft serve`):
# a 16k-token conversation takes 6 at the 4096-token interval (docs/adr/0004-prefix-cache.md).
DEFAULT_SNAPSHOTS_PER_STATE_SLOT = 4
# "activation": the largest step's activations, held beside the pools (domain/step_budget.py)
POOLS = ("kv", "moe", "state", "snapshot", "staging", "budget", "activation")


def working_set_slots(spec: ModelSpec, expert_keys: int | None = None) -> int:
    """Expert slots one decoded token touches (top_k in every MoE layer): the floor of an
    automatically sized expert pool. Below it the LRU cannot keep a single expert from one
    token to the next (every key's reuse distance exceeds the pool), so every lookup misses.
    expert_keys: the keys this pool may hold (an expert-parallel rank's share; default all)."""
    keys = spec.total_experts if expert_keys is None else expert_keys
    return min(spec.top_k * spec.num_layers, keys)


_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int) -> str:
    """A byte count in the binary unit that fits, about 3 significant digits: 512 B, 36.6 MiB, 1.44 GiB, 151 MiB.
    NOTE: a fixed unit printed small pools and shortfalls as "0.00 GiB"."""
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _BYTE_UNITS:
        value /= 1024
        digits = 0 if abs(value) >= 99.5 else 1 if abs(value) >= 9.995 else 2
        # NOTE: judged after rounding: 1,048,575 B is "1.00 MiB", not "1024 KiB"
        if abs(round(value, digits)) < 1024 or unit == _BYTE_UNITS[-1]:
            break
    return f"{value:.{digits}f} {unit}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GpuBudget:
    """GPU memory: pool_bytes = int(total_bytes * memory_ratio) - weights_bytes - fixed_bytes."""

    total_bytes: int
    memory_ratio: float = 0.9
    weights_bytes: int = 0
    fixed_bytes: int = 0

    def __post_init__(self) -> None:
        if self.total_bytes < 0 or self.weights_bytes < 0 or self.fixed_bytes < 0:
            raise ValueError(f"byte counts must be >= 0: {self}")
        if not 0.0 < self.memory_ratio <= 1.0:
            raise ValueError(f"memory_ratio must be in (0, 1], got {self.memory_ratio}")

    @property
    def pool_bytes(self) -> int:
        return int(self.total_bytes * self.memory_ratio) - self.weights_bytes - self.fixed_bytes


@dataclass(frozen=True)
class PoolRequest:
    """What the operator asks for; None = let the planner size that pool."""

    kv_tokens: int | None = None  # rounded down to whole pages
    expert_slots: int | None = None
    state_slots: int | None = None  # None = DEFAULT_STATE_SLOTS
    snapshot_slots: int = 0  # prefix-cache state snapshots (each one state slot's bytes)
    # streamed-prefill staging rows (each one expert's bytes, docs/adr/0010-streamed-prefill.md);
    # None = default_staging_experts of the geometry, or 0 when every expert ends up resident
    staging_experts: int | None = 0
    kv_reserve_tokens: int = 8192  # KV floor when kv_tokens is None (rounded up to whole pages)
    page_size: int = 16

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.kv_reserve_tokens < 0:
            raise ValueError(f"kv_reserve_tokens must be >= 0, got {self.kv_reserve_tokens}")
        if self.kv_tokens is not None and self.kv_tokens < 0:
            raise ValueError(f"kv_tokens must be >= 0, got {self.kv_tokens}")
        if self.expert_slots is not None and self.expert_slots < 0:
            raise ValueError(f"expert_slots must be >= 0, got {self.expert_slots}")
        if self.state_slots is not None and self.state_slots < 1:
            raise ValueError(f"state_slots must be >= 1, got {self.state_slots}")
        if self.snapshot_slots < 0:
            raise ValueError(f"snapshot_slots must be >= 0, got {self.snapshot_slots}")
        if self.staging_experts is not None and self.staging_experts < 0:
            raise ValueError(f"staging_experts must be >= 0, got {self.staging_experts}")


@dataclass(frozen=True)
class PoolPlan:
    """Sizes of the GPU pools and their bytes; used_bytes <= pool_bytes always."""

    page_size: int
    kv_pages: int
    kv_tokens: int  # kv_pages * page_size
    expert_slots: int
    state_slots: int
    kv_bytes: int
    expert_bytes: int
    state_bytes: int
    pool_bytes: int  # the budget the plan was made for
    used_bytes: int
    free_bytes: int
    residency: float  # expert_slots / total experts, 0..1
    snapshot_slots: int = 0  # prefix-cache snapshots of the linear-attention state
    snapshot_bytes: int = 0
    staging_experts: int = 0  # streamed-prefill staging rows, outside the residency's slots
    staging_bytes: int = 0

    def __post_init__(self) -> None:
        self.check_valid()

    @property
    def partial_residency(self) -> bool:
        """The expert pool leaves some of its (layer, expert) keys out (residency < 1): a prefill step copies
        experts over the link (SchedulerConfig.partial_residency)."""
        return self.residency < 1.0

    def check_valid(self) -> None:
        sizes = (self.page_size, self.kv_pages, self.expert_slots, self.state_slots, self.kv_bytes,
                 self.expert_bytes, self.state_bytes, self.free_bytes, self.snapshot_slots, self.snapshot_bytes,
                 self.staging_experts, self.staging_bytes)
        if min(sizes) < 0 or self.page_size < 1:
            raise ValueError(f"negative size in {self}")
        if self.kv_tokens != self.kv_pages * self.page_size:
            raise ValueError(f"kv_tokens {self.kv_tokens} != kv_pages * page_size in {self}")
        if self.used_bytes != (self.kv_bytes + self.expert_bytes + self.state_bytes + self.snapshot_bytes
                               + self.staging_bytes):
            raise ValueError(f"used_bytes is not the sum of the pools in {self}")
        if self.used_bytes + self.free_bytes != self.pool_bytes:
            raise ValueError(f"used + free != pool_bytes in {self}")
        if not 0.0 <= self.residency <= 1.0:
            raise ValueError(f"residency {self.residency} outside 0..1")


@dataclass(frozen=True)
class PlanRefusal:
    """The request does not fit. shortfall_bytes is exactly what is missing: a budget that many
    bytes larger fits the same request. 0 means no amount of memory helps (e.g. slots < top_k)."""

    pool: str  # "kv" | "moe" | "state" | "snapshot" | "staging" | "budget" | "activation"
    shortfall_bytes: int
    message: str

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.shortfall_bytes < 0:
            raise ValueError(f"shortfall_bytes must be >= 0, got {self.shortfall_bytes}")


def plan_pools(spec: ModelSpec, budget: GpuBudget, request: PoolRequest, *,
               expert_keys: int | None = None) -> PoolPlan | PlanRefusal:
    """Size the pools MoE-first, honouring every explicit size exactly (KV to whole pages).

    expert_keys: how many (layer, expert) keys this GPU's expert pool may ever hold (default every key;
    an expert-parallel rank passes the keys it owns, domain/expert_parallel.py): the cap of the expert
    slots, of the automatic floor, and the denominator of `residency`.

    Order of claims: state slots; then the floors of unsized pools (one token's working set of
    expert slots, see working_set_slots; the KV reserve); then explicit sizes, experts before KV; then
    the streamed prefill's staging rows; last the prefix cache's snapshot slots (staging and snapshots
    are optimisations: a refusal they cause names them, not a pool the model needs). A refusal names
    the first claim that does not fit. Leftover memory goes to expert slots (up to every expert), and
    to KV only when experts are explicit or all resident. staging_experts None: the geometry's default
    (default_staging_experts), unless the plan without staging holds every expert (then 0: nothing
    would ever stream).
    """
    keys = spec.total_experts if expert_keys is None else expert_keys
    if not isinstance(keys, int) or isinstance(keys, bool) or not 1 <= keys <= spec.total_experts:
        raise ValueError(f"expert_keys must be an int in 1..{spec.total_experts}, got {expert_keys!r}")
    if request.staging_experts is None:
        bare = plan_pools(spec, budget, replace(request, staging_experts=0), expert_keys=expert_keys)
        if isinstance(bare, PlanRefusal) or bare.expert_slots == keys:
            return bare
        staging = default_staging_experts(spec.expert_bytes(), spec.num_experts)
        return plan_pools(spec, budget, replace(request, staging_experts=staging), expert_keys=expert_keys)
    pool = budget.pool_bytes
    per_slot = spec.expert_bytes()
    per_state = spec.linear_state_bytes_per_sequence()
    per_page = request.page_size * spec.kv_bytes_per_token()
    state_slots = DEFAULT_STATE_SLOTS if request.state_slots is None else request.state_slots
    slots_explicit = request.expert_slots is not None
    kv_explicit = request.kv_tokens is not None

    if kv_explicit and request.kv_tokens < request.page_size:
        # NOTE: rounded down to whole pages this is an empty KV pool: no sequence could ever run.
        return PlanRefusal("kv", 0, f"kv_tokens {request.kv_tokens} is below one page ({request.page_size} "
                                    f"tokens): a KV pool needs at least one page")
    if slots_explicit and not min(spec.top_k, keys) <= request.expert_slots <= keys:
        what = "total experts" if expert_keys is None else "keys this rank owns"
        return PlanRefusal("moe", 0, f"expert_slots {request.expert_slots} outside "
                                     f"[top_k {min(spec.top_k, keys)}, {what} {keys}]")
    # NOTE: an explicit size only needs top_k (an operator may choose to thrash, e.g. in tests);
    # an automatic one must at least hold one token's working set or it is no cache at all.
    min_slots = request.expert_slots if slots_explicit else working_set_slots(spec, keys)
    kv_pages = (request.kv_tokens // request.page_size if kv_explicit
                else _ceil_div(request.kv_reserve_tokens, request.page_size))

    slots_what = "expert slots" if slots_explicit else "expert slots (one token's working set)"
    kv_what = "KV tokens" if kv_explicit else "KV tokens (reserve floor)"
    state_claim = ("state", state_slots * per_state, f"{state_slots} state slots")
    # NOTE: a model without linear-attention layers has no state to snapshot (0 bytes, 0 slots).
    snapshot_slots = request.snapshot_slots if per_state else 0
    snapshot_claim = ("snapshot", snapshot_slots * per_state, f"{snapshot_slots} state snapshot slots")
    staging = request.staging_experts
    staging_claim = ("staging", staging * per_slot, f"{staging} prefill staging experts")
    moe_claim = ("moe", min_slots * per_slot, f"{min_slots} {slots_what}")
    kv_size = f"{kv_pages * request.page_size} {kv_what}"
    if kv_explicit and kv_pages * request.page_size != request.kv_tokens:  # the planned size is not the one asked
        kv_size += f" ({request.kv_tokens} rounded down to whole {request.page_size}-token pages)"
    kv_claim = ("kv", kv_pages * per_page, kv_size)
    sized = ((moe_claim, slots_explicit), (kv_claim, kv_explicit))
    claims = [state_claim, *(c for c, explicit in sized if not explicit), *(c for c, explicit in sized if explicit),
              staging_claim, snapshot_claim]
    needed = sum(size for _, size, _ in claims)
    if pool <= 0:
        return PlanRefusal("budget", needed - pool, f"no memory left for pools: pool budget is {pool} bytes "
                                                    f"after weights and fixed caches; need {needed}")
    if needed > pool:
        breakdown = " + ".join(f"{what} ({format_bytes(size)})" for _, size, what in claims)
        claimed = 0
        for name, size, _ in claims:
            claimed += size
            if claimed > pool:
                return PlanRefusal(name, needed - pool,
                                   f"{name} pool does not fit: {breakdown} need {needed} bytes, "
                                   f"budget is {pool}, short by {needed - pool} ({format_bytes(needed - pool)})")

    free = pool - needed
    expert_slots = min_slots
    if not slots_explicit:
        extra = min(keys - min_slots, free // per_slot)
        expert_slots += extra
        free -= extra * per_slot
    # NOTE: while experts are unsized and not all resident, the sub-slot remainder stays free:
    # handing it to KV would make KV tokens saw-tooth down as memory grows (not monotone).
    if not kv_explicit and per_page and (slots_explicit or expert_slots == keys):
        extra_pages = free // per_page
        kv_pages += extra_pages
        free -= extra_pages * per_page

    kv_bytes = kv_pages * per_page
    expert_bytes = expert_slots * per_slot
    state_bytes = state_slots * per_state
    snapshot_bytes = snapshot_slots * per_state
    staging_bytes = staging * per_slot
    used = kv_bytes + expert_bytes + state_bytes + snapshot_bytes + staging_bytes
    return PoolPlan(
        page_size=request.page_size,
        kv_pages=kv_pages,
        kv_tokens=kv_pages * request.page_size,
        expert_slots=expert_slots,
        state_slots=state_slots,
        kv_bytes=kv_bytes,
        expert_bytes=expert_bytes,
        state_bytes=state_bytes,
        pool_bytes=pool,
        used_bytes=used,
        free_bytes=pool - used,
        residency=expert_slots / keys,
        snapshot_slots=snapshot_slots,
        snapshot_bytes=snapshot_bytes,
        staging_experts=staging,
        staging_bytes=staging_bytes,
    )
