"""SimExecutor: a domain.ports.ModelExecutor whose steps advance simulated time.

The engine loop (domain scheduler -> executor -> scheduler.complete) is the same one the real
engine runs; this executor only replaces the GPU. For each step it plays a simpy process on
the SimHost: step overhead, then per layer the attention/GDN part, the expert lookups through
the domain's ExpertResidency (the same LRU the GPU runs), the PCIe copies of the misses on the
copy engine, the expert GEMMs, and finally lm_head + sampling.

Routing: a request's tokens route through a RoutingModel stream, keyed by the rule of
domain.routing_streams (shared with `ft serve --routing-replay`): greedy requests (temperature 0)
by their prompt head, so requests with the same prompt produce the same tokens and route
identically (as in the customer's benchmark); sampled requests by seed and prompt head, or a
stream of their own. Sampled token ids are a hash of (stream, position): deterministic.

Expert compute (CostParams.expert_reads): works in lockstep are looked up and copied once, but with
per-pair reads each of them still streams its pairs' expert weights (the fast engine's decode GEMVs).

Step terms (cost_model docstring): every step first spends the host overhead outside the graph
(GPU and link idle); a decode-only step runs as its graph bucket, the padded rows paying dense and
lm_head compute and skipping the experts (with padding_fetches they route through streams of their own
and their misses are copied); prefill or mixed steps run uncaptured at their real row count.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from domain.ports import SampledToken, SequenceWork, StepBatch
from domain.residency import ExpertResidency
from domain.routing_streams import StreamKeys
from simulator.cost_model import CostModel, SequenceLoad
from simulator.host import SimHost
from simulator.routing import RoutingModel


@dataclass
class ExecutorCounters:
    steps: int = 0
    sequence_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    bytes_moved: int = 0

    def minus(self, other: ExecutorCounters) -> ExecutorCounters:
        return ExecutorCounters(*(getattr(self, f) - getattr(other, f) for f in self.__dataclass_fields__))

    def copy(self) -> ExecutorCounters:
        return ExecutorCounters(**self.__dict__)


class SimExecutor:
    def __init__(self, host: SimHost, cost: CostModel, routing: RoutingModel, expert_slots: int,
                 via_server: bool = True) -> None:
        spec = cost.spec
        if (routing.num_layers, routing.top_k) != (spec.num_layers, spec.top_k) or routing.num_experts > spec.num_experts:
            raise ValueError(
                f"routing geometry L={routing.num_layers} E={routing.num_experts} K={routing.top_k} does not "
                f"match the model (L={spec.num_layers} E={spec.num_experts} K={spec.top_k})"
            )
        self.host, self.cost, self.routing = host, cost, routing
        self.residency = ExpertResidency(expert_slots)
        self.counters = ExecutorCounters()
        self._stream_keys = StreamKeys()
        self._in_step = False
        self.via_server = via_server  # steps are served over HTTP (predict's benchmark): server_step_s applies
        self._padding_position = 0  # next position of the padding-row streams (padding_fetches)

    # ---- ModelExecutor ---------------------------------------------------------------------

    def execute(self, batch: StepBatch) -> dict[str, SampledToken]:
        if self._in_step:
            raise RuntimeError("execute() re-entered while a step is in flight")
        if not batch.works:
            raise ValueError("empty StepBatch")
        self._in_step = True
        try:
            process = self.host.env.process(self._step(batch))
            self.host.env.run(until=process)
        finally:
            self._in_step = False
        return {w.request_id: self._sample(w) for w in batch.works if w.sample}

    def resize_pools(self, plan) -> None:
        """Expert slots come back cold, as on the device; KV/state need no simulation."""
        self.residency.resize(plan.expert_slots)

    # ---- one step -----------------------------------------------------------------------------

    def _routes(self, works) -> dict[tuple[str, int, int], list]:
        """(stream, start, T_i) -> [weight, [T_i][L][K] expert ids] for a step's works. Works that replay
        the same stream positions (identical greedy requests) route identically; they are counted once
        with a weight, which keeps first-seen order."""
        routes: dict[tuple[str, int, int], list] = {}
        for w in works:
            key = (self._stream_key(w), w.start_position, len(w.token_ids))
            if key in routes:
                routes[key][0] += 1
            else:
                routes[key] = [1, self.routing.stream(key[0]).tokens(w.start_position, len(w.token_ids))]
        return routes

    def _stream_key(self, work: SequenceWork) -> str:
        if work.request_id not in self._stream_keys and work.start_position != 0:
            raise ValueError(f"{work.request_id}: first work starts at {work.start_position}, not 0")
        return self._stream_keys.key_for(work)

    def _sample(self, work: SequenceWork) -> SampledToken:
        key = self._stream_keys.key_for(work)
        token = zlib.crc32(f"{key}@{work.end_position}".encode()) % self.cost.spec.vocab_size
        return SampledToken(work.request_id, token)

    def _step(self, batch: StepBatch):
        host, cost, residency, c = self.host, self.cost, self.residency, self.counters
        works = batch.works
        routes = self._routes(works)
        loads = [SequenceLoad(len(w.token_ids), w.end_position) for w in works]
        decode_only = batch.num_prefill_tokens == 0 and all(len(w.token_ids) == 1 for w in works)
        padding = cost.padded_rows(len(works)) - len(works) if decode_only else 0
        loads += [SequenceLoad(1, 1)] * padding  # a padded row attends over nothing
        if padding and cost.params.padding_fetches:
            # NOTE: stale inputs route somewhere else than the real rows: one stream per padded slot.
            for i in range(padding):
                routes[(f"padding-row-{i}", self._padding_position, 1)] = [
                    1, self.routing.stream(f"padding-row-{i}").tokens(self._padding_position, 1)]
            self._padding_position += 1
        # NOTE: otherwise padded rows skip every expert (their lookup key is -1, as in
        # adapters/cuda_exec/expert_pool.py): no lookups, no misses, no routed FLOPs.
        weighted = list(routes.values())
        c.steps += 1
        c.sequence_steps += len(works)
        c.prefill_tokens += batch.num_prefill_tokens
        c.decode_tokens += batch.num_decode_tokens
        # NOTE: the GPU stream has one user (this step), so back-to-back kernels are merged into
        # one busy period and handed to simpy only where the copy engine must synchronise with
        # it. Same timeline as one event per kernel, far fewer events.
        host_s = cost.host_overhead(len(works), self.via_server)
        if host_s:
            yield host.env.timeout(host_s)  # outside the graph: neither the GPU nor the link works
        pending = cost.step_overhead(len(works) + padding)
        for layer in range(cost.spec.num_layers):
            pending += cost.layer_pre_expert(layer, loads)
            tokens_per_expert: dict[int, int] = {}  # expert -> tokens routed to it, first-seen order
            for weight, seq in weighted:
                for token in seq:
                    for e in token[layer]:
                        tokens_per_expert[e] = tokens_per_expert.get(e, 0) + weight
            keys = [(layer, e) for e in tokens_per_expert]
            # NOTE: the engine picks per-pair GEMVs or grouped GEMMs from the layer call's pair count (lockstep
            # rows included: each streams its pairs), never from the pool size or the lookup groups below.
            per_pair = cost.reads_per_pair(sum(tokens_per_expert.values()))
            group = max(1, residency.num_slots)
            for start in range(0, len(keys), group):
                pending = yield from self._expert_group(keys[start : start + group], tokens_per_expert, pending,
                                                        per_pair)
        pending += cost.head(sum(1 for w in works if w.sample) + padding)
        yield from host.gpu.use(pending)

    def _expert_group(self, keys, tokens_per_expert: dict[int, int], pending: float, per_pair: bool = False):
        """Looks the group up, copies its misses (once per distinct expert) and queues its GEMMs (weights
        read per routed pair with `per_pair`); returns GPU time still pending (not yet handed to simpy)."""
        host, cost, residency, c = self.host, self.cost, self.residency, self.counters
        lookup = residency.lookup(keys)
        misses = len(lookup.fills)
        c.expert_hits += len(lookup.hits)
        c.expert_misses += misses
        c.bytes_moved += misses * cost.expert_bytes
        hit_tokens = [tokens_per_expert[e] for _, e in lookup.hits]
        miss_tokens = [tokens_per_expert[e] for (_, e), _slot in lookup.fills]
        if not misses:
            residency.release()
            return pending + cost.expert_gemms(hit_tokens, per_pair)
        # The router's output is needed before the copies can start: flush the GPU up to here.
        yield from host.gpu.use(pending)
        copies = host.env.process(host.pcie.use(cost.transfer(misses)))
        if cost.params.overlap_copy_compute:
            yield from host.gpu.use(cost.expert_gemms(hit_tokens, per_pair))
            yield copies
            gemms = cost.expert_gemms(miss_tokens, per_pair)
        else:
            yield copies
            gemms = cost.expert_gemms(hit_tokens + miss_tokens, per_pair)
        # NOTE: this group holds the only pins, so release-all equals release(keys) without
        # validating every key again. The GEMMs are queued; nothing looks up before they run.
        residency.release()
        return gemms

    def check_valid(self) -> None:
        self.residency.check_valid()
        self.host.check_valid()
        c = self.counters
        assert c.bytes_moved == c.expert_misses * self.cost.expert_bytes, "bytes moved != misses x expert bytes"
        assert (c.expert_hits, c.expert_misses) == (self.residency.hits, self.residency.misses), (
            "executor and residency disagree on hits/misses"
        )
