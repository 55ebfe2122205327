"""Expert parallelism on N GPUs of one host, simulated: every rank runs the dense part of each layer on the
same tokens, looks up the keys it owns (domain.expert_parallel.ExpertPartition) in its own LRU (the domain's
ExpertResidency), copies its own misses over its own PCIe link from the shared pinned host bank, computes
its experts, and then the ranks exchange the MoE partials (one collective per MoE layer) before the next
layer can start. The layer's time is therefore the slowest rank's plus the exchange.

Exchange model (ExchangeParams): a ring all-reduce of the [T, K+1, H] fp32 partials (the exact exchange,
docs/adr/0008-expert-parallel.md), latency + 2(N-1)/N x bytes / link bandwidth. Host memory may cap the
links together: with `host_bytes_per_s` set, k ranks copying at once get min(link, host / k) each.

Shape legend: T tokens of a step, K top-k, H hidden, N ranks.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import simpy

from domain.budget import PlanRefusal
from domain.expert_parallel import ExpertParallelPlan, ExpertPartition, plan_expert_parallel
from domain.model_spec import LayerKind, ModelSpec, WeightFormat
from domain.ports import StepBatch
from domain.residency import ExpertResidency
from domain.serve_plan import plan_serve_pools
from simulator.cost_model import CostModel, SequenceLoad
from simulator.hardware import GB, HardwareProfile
from simulator.host import HostSnapshot, TimedResource
from simulator.params import StrictParams, require_positive
from simulator.predict import Deployment, PointResult, Workload, run_workload
from simulator.routing import RoutingModel
from simulator.sim_executor import SimExecutor


@dataclass(frozen=True)
class ExchangeParams(StrictParams):
    """The per-MoE-layer collective. Defaults: NVLink between H200s, uncalibrated (no multi-GPU record
    yet): ~20 us for a small all-reduce launched inside a CUDA graph (NCCL's LL protocol is quoted at
    single-digit to ~20 us on one NVLink host), 150 GB/s of bus bandwidth for the small messages of decode."""

    latency_s: float = 20e-6
    link_bytes_per_s: float = 150 * GB
    partial_bytes: int = 4  # fp32 partials (exact); 2 = bf16
    rows_per_token: str = "partials"  # "partials": [T, K+1, H] (exact, any reduction order); "sum": [T, H]
    host_bytes_per_s: float = 0.0  # all links together from host memory; 0 = no cap beyond each link

    def check_valid(self) -> None:
        require_positive(self, "latency_s", "host_bytes_per_s", allow_zero=True)
        require_positive(self, "link_bytes_per_s", "partial_bytes")
        if self.rows_per_token not in ("partials", "sum"):
            raise ValueError(f"ExchangeParams.rows_per_token must be 'partials' or 'sum', got {self.rows_per_token!r}")

    def seconds(self, spec: ModelSpec, tokens: int, ranks: int) -> float:
        """One MoE layer's exchange for `tokens` rows on `ranks` GPUs (0 on one GPU)."""
        if ranks <= 1 or tokens <= 0:
            return 0.0
        rows = spec.top_k + (spec.shared_expert_intermediate > 0) if self.rows_per_token == "partials" else 1
        nbytes = tokens * rows * spec.hidden_size * self.partial_bytes
        return self.latency_s + 2 * (ranks - 1) / ranks * nbytes / self.link_bytes_per_s


class MultiGpuHost:
    """N GPU streams and N host->device links on one simpy clock (the SimHost interface run_workload uses:
    now, snapshot, utilisation averaged over the ranks)."""

    def __init__(self, ranks: int) -> None:
        self.env = simpy.Environment()
        self.gpus = [TimedResource(self.env, f"gpu{r}") for r in range(ranks)]
        self.links = [TimedResource(self.env, f"pcie{r}") for r in range(ranks)]

    def now(self) -> float:
        return float(self.env.now)

    def snapshot(self) -> HostSnapshot:
        n = len(self.gpus)
        return HostSnapshot(self.now(), sum(g.busy_at() for g in self.gpus) / n, sum(p.busy_at() for p in self.links) / n)

    def check_valid(self) -> None:
        for resource in (*self.gpus, *self.links):
            resource.check_valid()


class ExpertParallelSimExecutor(SimExecutor):
    """SimExecutor over N ranks: one ExpertResidency per rank holding only its own keys."""

    def __init__(self, cost: CostModel, routing: RoutingModel, plan: ExpertParallelPlan,
                 exchange: ExchangeParams) -> None:
        super().__init__(MultiGpuHost(plan.num_ranks), cost, routing, plan.ranks[0].expert_slots)
        exchange.check_valid()
        self.partition, self.exchange = plan.partition, exchange
        self.ranks = [ExpertResidency(p.expert_slots) for p in plan.ranks]
        self.exchange_seconds = 0.0

    @property
    def residency_hits_misses(self) -> tuple[int, int]:
        return sum(r.hits for r in self.ranks), sum(r.misses for r in self.ranks)

    def resize_pools(self, plan) -> None:
        for residency, p in zip(self.ranks, plan.ranks, strict=True):
            residency.resize(p.expert_slots)

    def _step(self, batch: StepBatch):
        host, cost = self.host, self.cost
        works, n = batch.works, len(self.ranks)
        self._count(batch)
        # NOTE: the reference executor captures nothing: a layer group (layered prefill) runs beside the decode
        # rows in the one eager pass, computing only its layers; a layer no row computes costs nothing
        spans = [w.layers or (0, cost.spec.num_layers) for w in works]
        by_set: dict[tuple[int, ...], tuple] = {}
        dense = cost.step_overhead(len(works))
        for layer in range(cost.spec.num_layers):
            active = tuple(i for i, (first, end) in enumerate(spans) if first <= layer < end)
            if not active:
                continue
            if active not in by_set:
                rows = [works[i] for i in active]
                by_set[active] = (self._routes(rows),  # identical greedy streams route once, weighted
                                  [SequenceLoad(len(w.token_ids), w.end_position) for w in rows],
                                  self.exchange.seconds(cost.spec, sum(len(w.token_ids) for w in rows), n))
            routes, loads, exchange = by_set[active]
            dense += cost.layer_pre_expert(layer, loads)
            tokens_per_expert: dict[int, int] = {}
            for weight, seq in routes.values():
                for token in seq:
                    for e in token[layer]:
                        tokens_per_expert[e] = tokens_per_expert.get(e, 0) + weight
            self.routed_keys.update((layer, e) for e in tokens_per_expert)
            # NOTE: ascending keys, the order the executors look them up in
            shares = self.partition.split([(layer, e) for e in sorted(tokens_per_expert)])
            per_pair = cost.reads_per_pair(sum(tokens_per_expert.values()))  # the layer call's pairs, as SimExecutor
            plans = [self._rank_work(r, keys, tokens_per_expert, per_pair) for r, keys in enumerate(shares)]
            for r, keys in enumerate(shares):  # a rank's per-pair call of its own pairs pays its fixed part
                if per_pair and keys:
                    plans[r][2][-1] += cost.params.pair_call_s
            copying = sum(1 for misses, _, _ in plans if misses)
            procs = [host.env.process(self._rank_layer(r, dense, *plans[r], copying)) for r in range(n)]
            yield simpy.AllOf(host.env, procs)
            dense = 0.0
            if exchange:
                self.exchange_seconds += exchange
                yield simpy.AllOf(host.env, [host.env.process(g.use(exchange)) for g in host.gpus])
        yield simpy.AllOf(host.env, [host.env.process(g.use(cost.head(sum(1 for w in works if w.sample))))
                                     for g in host.gpus])  # a group that does not end its chunk samples nothing

    def _rank_work(self, rank: int, keys, tokens_per_expert: dict[int, int],
                   per_pair: bool = False) -> tuple[int, int, list[float]]:
        """(misses, copy calls, [seconds of GEMMs before each group's copies, ..., after the last]) of one
        rank's keys of one layer, looked up in groups of its slots (as the executors do)."""
        residency, c, cost = self.ranks[rank], self.counters, self.cost
        misses = calls = 0
        gemms = [0.0]
        group = max(1, residency.num_slots)
        for start in range(0, len(keys), group):
            lookup = residency.lookup(keys[start:start + group])
            residency.release()
            c.expert_hits += len(lookup.hits)
            c.expert_misses += len(lookup.fills)
            c.bytes_moved += len(lookup.fills) * cost.expert_bytes
            work = cost.expert_gemms([tokens_per_expert[e] for _, e in (*lookup.hits, *(k for k, _ in lookup.fills))],
                                     per_pair)
            if lookup.fills:
                misses += len(lookup.fills)
                calls += 1
                gemms.append(work)
            else:
                gemms[-1] += work
        return misses, calls, gemms

    def _rank_layer(self, rank: int, dense: float, misses: int, calls: int, gemms: list[float], copying: int):
        gpu, link, cost = self.host.gpus[rank], self.host.links[rank], self.cost
        yield from gpu.use(dense + gemms[0])
        if not misses:
            return
        bandwidth = cost.hardware.h2d_bytes_per_s * cost.params.h2d_efficiency
        if self.exchange.host_bytes_per_s:
            bandwidth = min(bandwidth, self.exchange.host_bytes_per_s / copying)
        per_call = misses / calls
        for work in gemms[1:]:  # each group: its copies, then its GEMMs (copies not overlapped: the fast path)
            yield from link.use(cost.params.transfer_setup_s
                                + per_call * (cost.params.transfer_latency_s + cost.expert_bytes / bandwidth))
            yield from gpu.use(work)

    def check_valid(self) -> None:
        for rank, residency in enumerate(self.ranks):
            residency.check_valid()
            assert all(self.partition.owns(rank, key) for key in residency.lru_order()), \
                f"rank {rank} holds a key it does not own"
        self.host.check_valid()
        c = self.counters
        assert c.bytes_moved == c.expert_misses * self.cost.expert_bytes, "bytes moved != misses x expert bytes"
        assert (c.expert_hits, c.expert_misses) == self.residency_hits_misses, "executor and ranks disagree"


def predict_expert_parallel(spec: ModelSpec, model_name: str, hardware: HardwareProfile, deployment: Deployment,
                            cost, routing: RoutingModel, ranks: int, exchange: ExchangeParams | None = None,
                            kv_tokens: int = 8192, batch: int = 1, workload: Workload | None = None,
                            partition: ExpertPartition | None = None, check: bool = False) -> PointResult:
    """One point on `ranks` GPUs, each with the deployment's budget (dense weights on every rank). With
    ranks=1 this is the one-GPU prediction (the same numbers as predict.predict_point)."""
    workload = workload or Workload()
    max_step, mixed = deployment.step_budgets(workload.max_step_tokens)  # the server's budgets, as predict_point
    workload = workload.replace(max_step_tokens=max_step)
    exchange = exchange or ExchangeParams()
    result = PointResult(hardware.name, model_name, kv_tokens, batch, fits=False)
    result.extra["ranks"] = ranks
    partition = partition or ExpertPartition.modulo(spec.num_layers, spec.num_experts, ranks)
    # NOTE: planned as `ft serve --expert-parallel N` plans (app/containers.py), through the same function.
    planned = plan_serve_pools(spec, deployment.budget(spec, hardware),
                               deployment.pools(kv_tokens, workload.page_size, expert_parallel=ranks > 1),
                               lambda s, b, r: plan_expert_parallel(s, b, r, partition))
    if isinstance(planned, PlanRefusal):
        result.reason = planned.message
        return result
    plan = planned.plan
    result.fits = True
    if planned.notes:
        result.extra["plan_notes"] = list(planned.notes)
    if batch > plan.shared.state_slots:
        result.extra["queued"] = batch - plan.shared.state_slots
    result.expert_slots, result.residency, result.state_slots = plan.expert_slots, plan.residency, plan.shared.state_slots
    executor = ExpertParallelSimExecutor(CostModel(spec, hardware, cost), routing, plan, exchange)
    stats = run_workload(executor, plan.shared, workload, batch, spec.max_context, check=check,
                         mixed_step_tokens=mixed, layered_prefill=deployment.layered_prefill,
                         num_layers=spec.num_layers)
    lookups = stats.hits + stats.misses
    result.hit_rate = stats.hits / lookups if lookups else 1.0
    result.decode_tok_s = stats.output_tokens / stats.seconds
    result.decode_tok_s_per_request = statistics.fmean(stats.per_request_tok_s)
    result.pcie_utilisation, result.gpu_utilisation = stats.pcie_utilisation, stats.gpu_utilisation
    result.ttft_s = statistics.median(stats.ttfts)
    result.misses_per_token = stats.misses / max(1, stats.output_tokens)
    result.simulated_s = executor.host.now()
    result.extra["exchange_share"] = executor.exchange_seconds / max(executor.host.now(), 1e-12)
    result.extra["expert_slots_per_rank"] = [p.expert_slots for p in plan.ranks]
    return result


def large_synthetic(expert_format: WeightFormat = WeightFormat.FP8_BLOCK) -> ModelSpec:
    """A geometry whose experts do not fit one GPU's budget even at 141 GB: 48 layers (3 GDN : 1 attention)
    of 256 experts, top-8, H 4096, expert intermediate 1024 (≈12.6 MB an expert in block FP8, 155 GB in
    all) — in size between Qwen3-235B-A22B and the 400B-class models the customer runs. `ft synth` makes
    it from this config (docs/adr/0008-expert-parallel.md)."""
    kinds = ((LayerKind.LINEAR_ATTENTION,) * 3 + (LayerKind.FULL_ATTENTION,)) * 12
    return ModelSpec(
        name="synthetic-moe-155b", architecture="qwen3_5_moe", hidden_size=4096, layer_kinds=kinds,
        num_experts=256, top_k=8, expert_intermediate=1024, shared_expert_intermediate=1024,
        num_attention_heads=32, num_kv_heads=4, head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4,
        vocab_size=248320, max_context=262144, expert_format=expert_format, dense_format=expert_format)
