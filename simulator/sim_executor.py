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

Streamed prefill (CostParams.streamed_prefill, docs/adr/0010-streamed-prefill.md): an uncaptured step whose
layer calls route more pairs than one device lookup takes (CostModel.streams_prefill) and a plan with staging
rows never touches the residency. Its rounds are the engine's (domain.streamed_prefill.plan_rounds over each
layer's non-resident experts, routed or not, in rounds of half the staging rows, halves alternating). One
process copies the rounds in order on the link (the engine's copy lane): round k waits for the compute that
last read its half (round k - 2; k - 1 with a single half) and, unless it is its layer's first round or the
step speculates (speculate_whole_layers), for its layer's router, and then copies only the routed experts
(a masked round); the others copy the whole round. The compute stream runs each layer's token mixer and
router, then its rounds in order, each after its copy: the first with the layer's resident experts. So the
next layer's first round copies while this layer computes. Nothing is stamped, filled or evicted, and the
hit/miss counters do not move (the engine's do not); the copies are counted apart (streamed_* counters).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from domain.ports import SampledToken, SequenceWork, StepBatch
from domain.residency import ExpertResidency
from domain.routing_streams import StreamKeys
from domain.streamed_prefill import plan_rounds, speculate_whole_layers, staging_buffers
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
    bytes_moved: int = 0  # misses' copies (expert_misses x expert bytes)
    # streamed prefill (outside the residency): steps, routed (layer, expert)s not resident, rows copied
    streamed_steps: int = 0
    streamed_not_resident: int = 0
    streamed_staged: int = 0

    def minus(self, other: ExecutorCounters) -> ExecutorCounters:
        return ExecutorCounters(*(getattr(self, f) - getattr(other, f) for f in self.__dataclass_fields__))

    def copy(self) -> ExecutorCounters:
        return ExecutorCounters(**self.__dict__)


class SimExecutor:
    def __init__(self, host: SimHost, cost: CostModel, routing: RoutingModel, expert_slots: int,
                 via_server: bool = True, staging_experts: int = 0) -> None:
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
        if isinstance(staging_experts, bool) or not isinstance(staging_experts, int) or staging_experts < 0:
            raise ValueError(f"staging_experts must be an integer >= 0, got {staging_experts!r}")
        self.staging_experts = staging_experts  # the plan's staging rows (streamed prefill; 0: none)

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
        # NOTE: a first work past position 0 resumes a prefix from the cache (prefix cache on); the domain rule
        # keys it by what it computes and where it starts, so identical requests that resume alike route alike
        if work.request_id not in self._stream_keys and work.start_position != 0 and work.restore_from is None \
                and not work.page_ids:
            raise ValueError(f"{work.request_id}: first work starts at {work.start_position}, not 0, "
                             "and resumes no cached prefix")
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
        pairs = batch.num_tokens * cost.spec.top_k  # keys of every layer call: all of the step's rows
        if not cost.graph_step(len(works), decode_only) and cost.streams_prefill(
                pairs, residency.num_slots, self.staging_experts):
            yield from self._streamed_step(loads, weighted, len(works), sum(1 for w in works if w.sample))
            return
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

    def _streamed_step(self, loads, weighted, rows: int, samples: int):
        """The compute stream of one streamed step (module docstring) beside its copy lane (`_copy_lane`)."""
        host, cost, residency, c = self.host, self.cost, self.residency, self.counters
        spec, env = cost.spec, host.env
        experts = spec.num_experts
        # NOTE: the engine snapshots the residency as the step opens; nothing in the step changes it
        missing = [[e for e in range(experts) if residency.slot_of((layer, e)) is None]
                   for layer in range(spec.num_layers)]
        rounds = plan_rounds(missing, self.staging_experts)
        buffers, _ = staging_buffers(self.staging_experts)
        routed: list[dict[int, int]] = []  # per layer: expert -> tokens routed to it, first-seen order
        for layer in range(spec.num_layers):
            tokens_per_expert: dict[int, int] = {}
            for weight, seq in weighted:
                for token in seq:
                    for e in token[layer]:
                        tokens_per_expert[e] = tokens_per_expert.get(e, 0) + weight
            routed.append(tokens_per_expert)
        pairs = sum(routed[0].values())
        speculate = speculate_whole_layers(pairs, experts)
        per_pair = cost.reads_per_pair(pairs)
        router_done = [env.event() for _ in range(spec.num_layers)]
        copied = [env.event() for _ in rounds]
        computed = [env.event() for _ in rounds]
        c.streamed_steps += 1
        lane = env.process(self._copy_lane(rounds, routed, speculate, buffers, router_done, copied, computed))
        pending = cost.step_overhead(rows)
        k = 0
        for layer in range(spec.num_layers):
            pending += cost.layer_pre_expert(layer, loads)
            yield from host.gpu.use(pending)
            pending = 0.0
            router_done[layer].succeed()
            tokens_per_expert, absent = routed[layer], set(missing[layer])
            c.streamed_not_resident += sum(1 for e in tokens_per_expert if e in absent)
            while k < len(rounds) and rounds[k].layer == layer:
                rnd = rounds[k]
                mine = [tokens_per_expert[e] for e in rnd.experts if e in tokens_per_expert]
                if rnd.first:  # the layer's resident experts compute with its first round
                    mine += [n for e, n in tokens_per_expert.items() if e not in absent]
                yield copied[k]
                yield from host.gpu.use(cost.expert_gemms(mine, per_pair))
                computed[k].succeed()
                k += 1
        yield from host.gpu.use(cost.head(samples))
        yield lane  # the engine drains the lane at the step's end

    def _copy_lane(self, rounds, routed, speculate: bool, buffers: int, router_done, copied, computed):
        """The copy lane of a streamed step: rounds in order on the link, each after the compute that last read
        its staging half and, when masked (not its layer's first round, not speculating), after its layer's
        router, copying then only its routed experts. A round with nothing to stage needs no copy at all."""
        host, cost, c = self.host, self.cost, self.counters
        for k, rnd in enumerate(rounds):
            if not rnd.experts:
                copied[k].succeed()
                continue
            waits = [computed[k - buffers]] if k >= buffers else []
            masked = not rnd.first and not speculate
            if masked:
                waits.append(router_done[rnd.layer])
            if waits:
                yield host.env.all_of(waits)
            rows = sum(1 for e in rnd.experts if e in routed[rnd.layer]) if masked else len(rnd.experts)
            c.streamed_staged += rows
            yield from host.pcie.use(cost.transfer(rows))
            copied[k].succeed()

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
