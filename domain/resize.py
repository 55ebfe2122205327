"""Resize planning: check a new pool size against the budget and order the frees and allocations
so that an old and a new copy of a pool never coexist in GPU memory."""

from __future__ import annotations

from dataclasses import dataclass

from domain.budget import GpuBudget, PlanRefusal, PoolPlan, PoolRequest, plan_pools
from domain.model_spec import ModelSpec

# Pool sizes are counted in tokens for "kv" and in slots for "moe", "state" and "snapshot".
# NOTE: the streamed prefill's staging rows are not resized live: a resize keeps plan.staging_experts
# (and its bytes) as they are, so the steps below never touch them.
POOL_ORDER = ("kv", "moe", "state", "snapshot")


def pool_sizes(plan: PoolPlan) -> dict[str, int]:
    return {"kv": plan.kv_tokens, "moe": plan.expert_slots, "state": plan.state_slots,
            "snapshot": plan.snapshot_slots}


def pool_bytes(plan: PoolPlan) -> dict[str, int]:
    return {"kv": plan.kv_bytes, "moe": plan.expert_bytes, "state": plan.state_bytes,
            "snapshot": plan.snapshot_bytes}


@dataclass(frozen=True)
class ResizeStep:
    """Free a whole pool (size_from -> 0) or allocate a whole new one (0 -> size_to)."""

    pool: str  # "kv" | "moe" | "state" | "snapshot"
    action: str  # "free" | "allocate"
    size_from: int
    size_to: int
    bytes: int  # released by a free, claimed by an allocate

    def __post_init__(self) -> None:
        if self.pool not in POOL_ORDER:
            raise ValueError(f"pool must be one of {POOL_ORDER}, got {self.pool!r}")
        if self.action not in ("free", "allocate"):
            raise ValueError(f"action must be 'free' or 'allocate', got {self.action!r}")
        if min(self.size_from, self.size_to, self.bytes) < 0:
            raise ValueError(f"negative size in {self}")


@dataclass(frozen=True)
class ResizePlan:
    current: PoolPlan
    target: PoolPlan
    steps: tuple[ResizeStep, ...]
    peak_bytes: int  # most bytes held at any point: the start, or after any step
    experts_kept: bool  # False when the expert pool is rebuilt (its slots start cold)

    def __post_init__(self) -> None:
        self.check_valid()

    @property
    def needs_idle(self) -> bool:
        """KV pages, state and snapshot slots belong to running sequences (and the prefix cache):
        rebuilding them needs an idle scheduler. An expert-pool rebuild only costs cold slots and
        can happen between steps."""
        return any(step.pool in ("kv", "state", "snapshot") for step in self.steps)

    @property
    def clears_prefix_cache(self) -> bool:
        """A rebuilt KV or snapshot pool loses what the prefix cache points at: the cache is cleared."""
        return any(step.pool in ("kv", "snapshot") for step in self.steps)

    def check_valid(self) -> None:
        if (self.current.staging_experts, self.current.staging_bytes) != (
                self.target.staging_experts, self.target.staging_bytes):
            raise ValueError("a resize keeps the staging rows as they are")
        sizes, held = pool_sizes(self.current), self.current.used_bytes
        peak, allocating = held, False
        for step in self.steps:
            if step.action == "free":
                if allocating:
                    raise ValueError(f"free after an allocation in {self.steps}")
                if step.size_from != sizes[step.pool] or step.size_to != 0:
                    raise ValueError(f"{step} does not free the {step.pool} pool of size {sizes[step.pool]}")
                sizes[step.pool], held = 0, held - step.bytes
            else:
                allocating = True
                if sizes[step.pool] != 0 or step.size_from != 0:
                    raise ValueError(f"{step} allocates over a live {step.pool} pool")
                sizes[step.pool], held = step.size_to, held + step.bytes
            peak = max(peak, held)
        if sizes != pool_sizes(self.target) or held != self.target.used_bytes:
            raise ValueError(f"steps end at {sizes} / {held} bytes, not at the target plan")
        if peak != self.peak_bytes or peak > self.target.pool_bytes:
            raise ValueError(f"peak {self.peak_bytes} (replayed {peak}) vs budget {self.target.pool_bytes}")
        if self.experts_kept != (self.current.expert_slots == self.target.expert_slots):
            raise ValueError("experts_kept must be False exactly when the expert slot count changes")


def unusable_size(kv_tokens: int | None, expert_slots: int | None, state_slots: int | None,
                  snapshot_slots: int | None = None) -> PlanRefusal | None:
    """Sizes no budget can make work (an operator's typo, not a shortage): refused, never raised."""
    for pool, size, least, what in (("kv", kv_tokens, 0, "kv_tokens"), ("moe", expert_slots, 0, "expert_slots"),
                                    ("state", state_slots, 1, "state_slots"),
                                    ("snapshot", snapshot_slots, 0, "snapshot_slots")):
        if size is not None and size < least:
            why = " (every running sequence needs one)" if pool == "state" else ""
            return PlanRefusal(pool, 0, f"{what} must be >= {least}{why}, got {size}")
    return None


def plan_resize(spec: ModelSpec, budget: GpuBudget, current: PoolPlan, *, kv_tokens: int | None = None,
                expert_slots: int | None = None, state_slots: int | None = None,
                snapshot_slots: int | None = None, expert_keys: int | None = None) -> ResizePlan | PlanRefusal:
    """Plan a change of pool sizes; pools not given keep their current size.
    expert_keys: as plan_pools' (an expert-parallel rank's share of the keys; default every key).

    Every pool whose size changes is rebuilt: freed whole, then allocated whole, all frees
    before any allocation. A refusal leaves `current` as it is (plans are immutable).
    """
    per = {"kv": spec.kv_bytes_per_token(), "moe": spec.expert_bytes(),
           "state": spec.linear_state_bytes_per_sequence(), "snapshot": spec.linear_state_bytes_per_sequence()}
    for name in POOL_ORDER:
        if pool_bytes(current)[name] != pool_sizes(current)[name] * per[name]:
            raise ValueError(f"current plan's {name} pool was not sized for {spec.name}")
    if current.staging_bytes != current.staging_experts * per["moe"]:
        raise ValueError(f"current plan's staging rows were not sized for {spec.name}")
    if current.used_bytes > budget.pool_bytes:
        raise ValueError(f"current plan uses {current.used_bytes} bytes, more than the budget's "
                         f"{budget.pool_bytes}: it was made for another budget")
    unusable = unusable_size(kv_tokens, expert_slots, state_slots, snapshot_slots)
    if unusable is not None:
        return unusable
    request = PoolRequest(
        kv_tokens=current.kv_tokens if kv_tokens is None else kv_tokens,
        expert_slots=current.expert_slots if expert_slots is None else expert_slots,
        state_slots=current.state_slots if state_slots is None else state_slots,
        snapshot_slots=current.snapshot_slots if snapshot_slots is None else snapshot_slots,
        staging_experts=current.staging_experts,
        page_size=current.page_size,
    )
    target = plan_pools(spec, budget, request, expert_keys=expert_keys)
    if isinstance(target, PlanRefusal):
        return target

    old, new = pool_sizes(current), pool_sizes(target)
    changed = [name for name in POOL_ORDER if old[name] != new[name]]
    frees = [ResizeStep(name, "free", old[name], 0, pool_bytes(current)[name]) for name in changed]
    allocations = [ResizeStep(name, "allocate", 0, new[name], pool_bytes(target)[name]) for name in changed]
    # NOTE: with every free first, the held bytes fall then rise monotonically, so the peak is
    # the larger of the start and the end, both of which fit the budget.
    peak = max(current.used_bytes, target.used_bytes)
    return ResizePlan(current=current, target=target, steps=tuple(frees + allocations), peak_bytes=peak,
                      experts_kept="moe" not in changed)
