"""Expert parallelism for one model over N GPUs: which GPU (rank) owns each (layer, expert) key, and the
pools of every rank checked against its own budget ([adr/0008](../docs/adr/0008-expert-parallel.md)).

Every rank runs the dense layers (attention, Gated DeltaNet, router, shared expert) on the same tokens, so
each holds the dense weights, the KV pages and the linear-attention state slots of every sequence (the one
scheduler's pages and slots, the same on all ranks). Only the routed experts are split: a rank's expert
cache holds at most the keys it owns and fetches its own misses over its own PCIe link.

Shape legend: L layers, E experts per layer, N ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from domain.budget import GpuBudget, PlanRefusal, PoolPlan, PoolRequest, plan_pools
from domain.model_spec import ModelSpec
from domain.resize import ResizePlan, plan_resize, unusable_size

ExpertKey = tuple[int, int]  # (layer, expert)
PARTITION_RULES = ("modulo", "balanced")


@dataclass(frozen=True)
class ExpertPartition:
    """owner[layer][expert] = the rank whose expert cache may hold that key.

    Invariants (check_valid): every key has exactly one owner in 0..N-1, and in every layer each rank owns
    floor(E/N) or ceil(E/N) experts, so every rank's share of the bank (and of its cache) is the same to
    within one expert per layer.
    """

    num_ranks: int
    owner: tuple[tuple[int, ...], ...]  # [L][E] rank

    def __post_init__(self) -> None:
        self.check_valid()

    @property
    def num_layers(self) -> int:
        return len(self.owner)

    @property
    def num_experts(self) -> int:
        return len(self.owner[0])

    @classmethod
    def modulo(cls, num_layers: int, num_experts: int, num_ranks: int) -> ExpertPartition:
        """Expert e of layer l goes to rank (e + l) mod N: no statistics needed, the same on every host, and
        the rotation by layer spreads the remainder experts (E mod N) over the ranks instead of piling them
        on the low ranks."""
        _check_geometry(num_layers, num_experts, num_ranks)
        return cls(num_ranks, tuple(tuple((e + layer) % num_ranks for e in range(num_experts))
                                    for layer in range(num_layers)))

    @classmethod
    def balanced(cls, counts: Sequence[Sequence[float]], num_ranks: int) -> ExpertPartition:
        """A partition that balances routing load per layer: counts[l][e] is how often expert e of layer l
        was routed to (a routing trace's histogram). Longest-processing-time first: experts by descending
        count (ties: lower id first) each go to the rank with the least load so far among the ranks that
        still have room (ceil(E/N) experts; ties: lowest rank). Deterministic for the same counts."""
        if not counts or not counts[0]:
            raise ValueError("routing counts must be a non-empty [layers][experts] table")
        num_layers, num_experts = len(counts), len(counts[0])
        _check_geometry(num_layers, num_experts, num_ranks)
        cap = -(-num_experts // num_ranks)
        floor, extra = divmod(num_experts, num_ranks)
        owner: list[tuple[int, ...]] = []
        for layer, row in enumerate(counts):
            if len(row) != num_experts:
                raise ValueError(f"routing counts: layer {layer} has {len(row)} experts, layer 0 has {num_experts}")
            if any(not isinstance(c, int | float) or isinstance(c, bool) or c < 0 or c != c for c in row):
                raise ValueError(f"routing counts of layer {layer} must be numbers >= 0")
            load, size, mine = [0.0] * num_ranks, [0] * num_ranks, [0] * num_experts
            # NOTE: at most `extra` ranks may take ceil(E/N); the rest stop at floor(E/N), so the shares
            # differ by at most one expert whatever the counts.
            big_left = extra
            for e in sorted(range(num_experts), key=lambda e: (-row[e], e)):
                open_ranks = [r for r in range(num_ranks)
                              if size[r] < floor or (size[r] < cap and big_left > 0)]
                r = min(open_ranks, key=lambda r: (load[r], r))
                if size[r] == floor:
                    big_left -= 1
                load[r] += row[e]
                size[r] += 1
                mine[e] = r
            owner.append(tuple(mine))
        return cls(num_ranks, tuple(owner))

    @classmethod
    def build(cls, rule: str, spec: ModelSpec, num_ranks: int,
              counts: Sequence[Sequence[float]] | None = None) -> ExpertPartition:
        """The partition `rule` names ("modulo", or "balanced" from routing counts) for `spec`."""
        if rule == "modulo":
            return cls.modulo(spec.num_layers, spec.num_experts, num_ranks)
        if rule == "balanced":
            if counts is None:
                raise ValueError("the balanced partition needs routing counts (a routing trace)")
            if (len(counts), len(counts[0]) if counts else 0) != (spec.num_layers, spec.num_experts):
                raise ValueError(f"routing counts are [{len(counts)}][{len(counts[0]) if counts else 0}], the "
                                 f"model has [{spec.num_layers}][{spec.num_experts}]")
            return cls.balanced(counts, num_ranks)
        raise ValueError(f"partition rule must be one of {PARTITION_RULES}, got {rule!r}")

    # ---- queries ------------------------------------------------------------------------------------
    def owner_of(self, key: ExpertKey) -> int:
        layer, expert = key
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise ValueError(f"expert key {key} outside [{self.num_layers}] x [{self.num_experts}]")
        return self.owner[layer][expert]

    def owns(self, rank: int, key: ExpertKey) -> bool:
        return self.owner_of(key) == rank

    def experts_of(self, rank: int, layer: int) -> tuple[int, ...]:
        """The experts of `layer` that `rank` owns, ascending."""
        self._check_rank(rank)
        return tuple(e for e, r in enumerate(self.owner[layer]) if r == rank)

    def keys_of(self, rank: int) -> int:
        """How many (layer, expert) keys `rank` owns: the most its expert cache can ever hold."""
        self._check_rank(rank)
        return sum(row.count(rank) for row in self.owner)

    def split(self, keys: Sequence[ExpertKey]) -> list[list[ExpertKey]]:
        """keys by owner: result[r] are the keys of rank r, each list in the order given."""
        out: list[list[ExpertKey]] = [[] for _ in range(self.num_ranks)]
        for key in keys:
            out[self.owner_of(key)].append(key)
        return out

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside 0..{self.num_ranks - 1}")

    def check_valid(self) -> None:
        if not self.owner or not self.owner[0]:
            raise ValueError("a partition needs at least one layer and one expert")
        _check_geometry(len(self.owner), len(self.owner[0]), self.num_ranks)
        floor, cap = self.num_experts // self.num_ranks, -(-self.num_experts // self.num_ranks)
        for layer, row in enumerate(self.owner):
            if len(row) != self.num_experts:
                raise ValueError(f"partition layer {layer} has {len(row)} experts, layer 0 has {self.num_experts}")
            if any(not isinstance(r, int) or not 0 <= r < self.num_ranks for r in row):
                raise ValueError(f"partition layer {layer} names a rank outside 0..{self.num_ranks - 1}")
            sizes = [row.count(r) for r in range(self.num_ranks)]
            if min(sizes) < floor or max(sizes) > cap:
                raise ValueError(f"partition layer {layer} is unbalanced: experts per rank {sizes} "
                                 f"(each must own {floor}..{cap})")


def _check_geometry(num_layers: int, num_experts: int, num_ranks: int) -> None:
    if num_layers < 1 or num_experts < 1:
        raise ValueError(f"need at least one layer and one expert, got {num_layers} x {num_experts}")
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"the number of ranks must be an int >= 1, got {num_ranks!r}")
    if num_ranks > num_experts:
        raise ValueError(f"{num_ranks} ranks for {num_experts} experts per layer: a rank would own none")


# ---- the pools of every rank ------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertParallelPlan:
    """One PoolPlan per rank. KV pages, state slots and snapshot slots are the same on every rank (the one
    scheduler's pages and slots are used on all of them); expert slots are per rank, at most the keys the
    rank owns."""

    partition: ExpertPartition
    ranks: tuple[PoolPlan, ...]  # [N]

    def __post_init__(self) -> None:
        self.check_valid()

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def shared(self) -> PoolPlan:
        """Rank 0's plan: what the scheduler sizes itself by (KV pages, state slots, page size)."""
        return self.ranks[0]

    @property
    def expert_slots(self) -> int:
        """Expert slots over all ranks."""
        return sum(p.expert_slots for p in self.ranks)

    @property
    def residency(self) -> float:
        """Share of every (layer, expert) key that some rank can keep resident, 0..1."""
        return self.expert_slots / (self.partition.num_layers * self.partition.num_experts)

    def check_valid(self) -> None:
        if len(self.ranks) != self.partition.num_ranks:
            raise ValueError(f"{len(self.ranks)} rank plans for a partition over {self.partition.num_ranks} ranks")
        first = self.ranks[0]
        for r, plan in enumerate(self.ranks):
            plan.check_valid()
            same = (plan.page_size, plan.kv_pages, plan.state_slots, plan.snapshot_slots)
            if same != (first.page_size, first.kv_pages, first.state_slots, first.snapshot_slots):
                raise ValueError(f"rank {r}'s KV/state/snapshot pools {same} differ from rank 0's: the one "
                                 "scheduler's pages and slots must exist on every rank")
            if plan.expert_slots > self.partition.keys_of(r):
                raise ValueError(f"rank {r} has {plan.expert_slots} expert slots for {self.partition.keys_of(r)} keys")


def _refusal(rank: int, refusal: PlanRefusal) -> PlanRefusal:
    return PlanRefusal(refusal.pool, refusal.shortfall_bytes, f"rank {rank}: {refusal.message}")


def plan_expert_parallel(spec: ModelSpec, budget: GpuBudget, request: PoolRequest,
                         partition: ExpertPartition) -> ExpertParallelPlan | PlanRefusal:
    """Plan every rank's pools with plan_pools against the same per-GPU `budget` (each rank holds the dense
    weights: weights_bytes is the whole dense model on every rank).

    request.expert_slots is per rank (None: each rank fills its budget, at most the keys it owns). KV
    tokens left to the planner become the smallest any rank gets, so every rank holds the same pages.
    A refusal is the first rank's (by rank order) that does not fit, its message prefixed by the rank.
    """
    if (partition.num_layers, partition.num_experts) != (spec.num_layers, spec.num_experts):
        raise ValueError(f"partition is [{partition.num_layers}][{partition.num_experts}], the model "
                         f"[{spec.num_layers}][{spec.num_experts}]")
    plans: list[PoolPlan] = []
    for r in range(partition.num_ranks):
        plan = plan_pools(spec, budget, request, expert_keys=partition.keys_of(r))
        if isinstance(plan, PlanRefusal):
            return _refusal(r, plan)
        plans.append(plan)
    kv_tokens = min(p.kv_tokens for p in plans)
    if any(p.kv_tokens != kv_tokens for p in plans):
        # NOTE: only an unsized KV pool can differ (it takes the leftover once a rank's experts are all
        # resident); pinning it to the smallest keeps each rank's expert slots as they were.
        fixed = replace(request, kv_tokens=kv_tokens, expert_slots=request.expert_slots)
        plans = []
        for r in range(partition.num_ranks):
            plan = plan_pools(spec, budget, fixed, expert_keys=partition.keys_of(r))
            if isinstance(plan, PlanRefusal):  # pragma: no cover - a smaller KV pool always fits
                return _refusal(r, plan)
            plans.append(plan)
    return ExpertParallelPlan(partition, tuple(plans))


@dataclass(frozen=True)
class ExpertParallelResize:
    """Every rank's ResizePlan; applied on all ranks or on none."""

    ranks: tuple[ResizePlan, ...]  # [N]

    @property
    def target(self) -> tuple[PoolPlan, ...]:
        return tuple(p.target for p in self.ranks)

    @property
    def needs_idle(self) -> bool:
        return any(p.needs_idle for p in self.ranks)

    @property
    def experts_kept(self) -> bool:
        return all(p.experts_kept for p in self.ranks)


def plan_resize_expert_parallel(spec: ModelSpec, budget: GpuBudget, current: ExpertParallelPlan, *,
                                kv_tokens: int | None = None, expert_slots: int | None = None,
                                state_slots: int | None = None, snapshot_slots: int | None = None
                                ) -> ExpertParallelResize | PlanRefusal:
    """A live resize of every rank (domain.resize.plan_resize per rank): the shared pools change alike on
    all ranks; expert_slots is per rank. Refused (nothing applied anywhere) when any rank refuses, naming
    that rank; a rank asked for more expert slots than keys it owns is refused (pool "moe", 0 bytes)."""
    unusable = unusable_size(kv_tokens, expert_slots, state_slots, snapshot_slots)
    if unusable is not None:
        return unusable
    steps = []
    for r, plan in enumerate(current.ranks):
        owned = current.partition.keys_of(r)
        if expert_slots is not None and expert_slots > owned:
            return PlanRefusal("moe", 0, f"rank {r}: expert_slots {expert_slots} exceeds the {owned} keys it owns")
        step = plan_resize(spec, budget, plan, kv_tokens=kv_tokens, expert_slots=expert_slots,
                           state_slots=state_slots, snapshot_slots=snapshot_slots, expert_keys=owned)
        if isinstance(step, PlanRefusal):
            return _refusal(r, step)
        steps.append(step)
    ExpertParallelPlan(current.partition, tuple(s.target for s in steps))  # NOTE: validates the targets agree
    return ExpertParallelResize(tuple(steps))
