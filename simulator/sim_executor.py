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

Layered prefill (SequenceWork.layers, docs/adr/0024-layered-prefill.md; docs/simulator.md "Layered prefill"): a
step that carries a layer group (first, end) of a chunk runs as the engine runs it. Its decode rows go first, as
the graph bucket a decode-only step of those rows would replay (padding, lookups through the residency, lm_head
over the bucket); then, uncaptured, the group's layers [first, end) over the chunk's rows (and any other prefill
chunk of the step over every layer): token mixer, router, expert lookups or, when the step streams, the streamed
rounds of those layers only, planned from the residency as the decode graph left it, with a copy lane that starts
there. The chunk's rows route through the same stream positions in every group, so the groups of one chunk look
up, copy or stream exactly the layers the whole chunk would, once each. lm_head runs for the eager rows only in
the group that ends the chunk (it alone may sample). Per step, never per group or layer: the host overhead (over
all the step's rows) and the fixed step overhead (over the graph bucket's rows plus the eager rows), each once.
The chunk's prefill tokens are counted once (StepBatch.num_prefill_tokens: in its first group).

Eager terms (CostParams.eager_layer_s, eager_token_s, eager_compute_efficiency; docs/simulator.md "Prefill compute"):
an uncaptured pass whose largest layer call routes more than lookup_max_keys pairs (a prefill or mixed step, or a layer
group, of more than 32 tokens at top-8: the grouped or streamed path) runs on CostModel.eager_model(): eager_layer_s
more per layer it computes, eager_token_s per token and layer, and its compute-bound kernels at
eager_compute_efficiency. Decode graphs and short uncaptured steps (the prefill graphs) keep the base terms; copies are
the same in both.

Short steps (CostParams.eager_mixer_layer_s; docs/simulator.md "Short steps: h200_records_v7"): an uncaptured step of
at most lookup_max_keys pairs a layer call that is not a captured decode graph (a prompt's tail beside decodes, a short
prompt) runs its token mixers eagerly from Python and each layer's MoE half from a CUDA graph (adapters/cuda_exec/
prefill_graphs.py). The host needs eager_mixer_layer_s a layer to launch them; the GPU runs what was launched, so the
k-th layer's work starts no earlier than k x eager_mixer_layer_s after the step's host overhead, and the step is, layer
by layer, the later of the host's launches and the GPU's work (its copies of misses included, as before): host-bound
when resident, copy-bound when the misses take longer than the launches. Layered steps never take this path (a layer
group never takes the MoE segments).

Preloaded experts (`preload_experts`; Deployment.preload_experts): `ft serve` fills an expert pool that holds every
(layer, expert) key before it serves (ExecutorPools._preload_experts, since 2026-12-05), so its first requests miss
nothing; with the flag set, so does this executor (at construction and after a resize). Off: the pool starts empty (the
servers of every record before then, and every calibration file without the field).

Short prompts as decode replays (`short_prompt_replays`, ADR 0026; docs/simulator.md, "Held out on an H100: short-prompt
replays"): with N > 0, a step that domain.short_prompt_replays.unroll(works, N, largest graph bucket) accepts (every chunk
at most N tokens, one of 2 or more, decodes beside them, no layer group) runs as the server runs it: one decode replay
per token of its longest chunk, each costed as a decode-only step of its rows (host overhead, graph bucket and padding,
lookups and copies through the residency, lm_head over the bucket); server_step_s once for the step. It never pays the
short step's eager mixers. 0 (the default here): every such step is an uncaptured one, as before. predict and mixed
pass `Deployment.short_prompt_replays` resolved (short_prompts.resolve: auto, the server's default, is 8).

The host lane (CostParams.host_permille, host_expert_gb_s, host_call_s; ADR 0030, simulator/host_lane.py): a decode
graph's lookups (decode-only steps, replays, a layered step's decode rows; never an uncaptured pass) pass the share to
ExpertResidency.lookup, whose host keys take no slot and are not copied. Their work runs on the host's `cpu` lane
(host_call_s + their weight passes x expert bytes / host_expert_gb_s; a key routed by n of the lookup's rows takes
host_lane.weight_passes(n) = ceil(n / 4) passes, the host kernel serving up to 4 rows a pass, each pass of r rows
costing 1 + host_row_factor x (r - 1) one-row passes: CostModel.host_compute's pairs) beside the link's copies
of the fills; the GPU computes the hits as before (overlap_copy_compute included), then waits for both lanes before
the fills' GEMMs. The host keys' GEMMs never run on the GPU. A layer looked up in several groups (a pool smaller than
its keys) sends nothing to the host, as the engine, whose lane rides only the one-launch lookup. With host_wait_row_s,
a lookup with host keys then keeps the GPU host_wait_row_s x the layer call's routed rows past both lanes (the
hand-off's GPU side: the wait kernel).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from domain.ports import SampledToken, SequenceWork, StepBatch, layer_group_problem
from domain.residency import ExpertResidency
from domain.routing_streams import StreamKeys
from domain.short_prompt_replays import unroll
from domain.streamed_prefill import plan_rounds, speculate_whole_layers, staging_buffers
from simulator.cost_model import CostModel, SequenceLoad
from simulator.host import SimHost
from simulator.host_lane import weight_passes
from simulator.routing import RoutingModel


@dataclass
class ExecutorCounters:
    steps: int = 0
    sequence_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    bytes_moved: int = 0  # misses' copies ((expert_misses - host_experts) x expert bytes)
    # streamed prefill (outside the residency): steps, routed (layer, expert)s not resident, rows copied
    streamed_steps: int = 0
    streamed_not_resident: int = 0
    streamed_staged: int = 0
    # layered prefill: steps that carried a layer group, and the layers those groups computed
    layered_steps: int = 0
    layered_layers: int = 0
    # short prompts as decode replays: steps run so, and the replays they took
    replayed_steps: int = 0
    replays: int = 0
    # the host lane (ADR 0030): misses computed on the host (counted in expert_misses too, never in bytes_moved),
    # the (token, expert) pairs routed to them, and the host kernel's weight passes over them (it reads an expert's
    # bytes once a pass, a pass serving up to host_lane.ROWS_PER_PASS of a lookup's pairs of that expert)
    host_experts: int = 0
    host_pairs: int = 0
    host_passes: int = 0

    def minus(self, other: ExecutorCounters) -> ExecutorCounters:
        return ExecutorCounters(*(getattr(self, f) - getattr(other, f) for f in self.__dataclass_fields__))

    def copy(self) -> ExecutorCounters:
        return ExecutorCounters(**self.__dict__)


class SimExecutor:
    def __init__(self, host: SimHost, cost: CostModel, routing: RoutingModel, expert_slots: int,
                 via_server: bool = True, staging_experts: int = 0, short_prompt_replays: int = 0,
                 preload_experts: bool = False) -> None:
        spec = cost.spec
        if (routing.num_layers, routing.top_k) != (spec.num_layers, spec.top_k) or routing.num_experts > spec.num_experts:
            raise ValueError(
                f"routing geometry L={routing.num_layers} E={routing.num_experts} K={routing.top_k} does not "
                f"match the model (L={spec.num_layers} E={spec.num_experts} K={spec.top_k})"
            )
        self.host, self.cost, self.routing = host, cost, routing
        # the cost of an uncaptured pass of more than lookup_max_keys pairs (CostParams.eager_layer_s and
        # eager_compute_efficiency; the model itself when the profile has neither)
        self._eager_cost = cost.eager_model() if cost.has_eager_terms else cost
        self.residency = ExpertResidency(expert_slots)
        self.preload_experts = preload_experts  # a pool that holds every key starts full (module docstring)
        self._preload()
        self.counters = ExecutorCounters()
        self._stream_keys = StreamKeys()
        self._in_step = False
        self.via_server = via_server  # steps are served over HTTP (predict's benchmark): server_step_s applies
        self._padding_position = 0  # next position of the padding-row streams (padding_fetches)
        if isinstance(staging_experts, bool) or not isinstance(staging_experts, int) or staging_experts < 0:
            raise ValueError(f"staging_experts must be an integer >= 0, got {staging_experts!r}")
        self.staging_experts = staging_experts  # the plan's staging rows (streamed prefill; 0: none)
        if isinstance(short_prompt_replays, bool) or not isinstance(short_prompt_replays, int) \
                or short_prompt_replays < 0:
            raise ValueError(f"short_prompt_replays must be an integer >= 0, got {short_prompt_replays!r}")
        # chunks of at most this many tokens run as decode replays (FLUXTIDE_SHORT_PROMPT_REPLAYS; 0: off)
        self.short_prompt_replays = short_prompt_replays
        # the layered chunk part-way (SequenceWork.layers): (request id, start, tokens, layers computed)
        self._kept: tuple[str, int, int, int] | None = None
        # (layer, expert) keys the steps routed to since the caller last cleared it (looked up or streamed): the
        # working set of a measured window (run_workload), which an expert pool at least this large holds whole
        self.routed_keys: set[tuple[int, int]] = set()

    # ---- ModelExecutor ---------------------------------------------------------------------

    def execute(self, batch: StepBatch) -> dict[str, SampledToken]:
        if self._in_step:
            raise RuntimeError("execute() re-entered while a step is in flight")
        if not batch.works:
            raise ValueError("empty StepBatch")
        self._check_layers(batch)
        self._in_step = True
        try:
            process = self.host.env.process(self._step(batch))
            self.host.env.run(until=process)
        finally:
            self._in_step = False
        return {w.request_id: self._sample(w) for w in batch.works if w.sample}

    def resize_pools(self, plan) -> None:
        """Expert slots come back cold, as on the device, and full again where they hold every key and the
        executor preloads; KV/state need no simulation."""
        self.residency.resize(plan.expert_slots)
        self._preload()
        self._kept = None

    def _preload(self) -> None:
        """With preload_experts, a pool whose slots hold every (layer, expert) key is filled as `ft serve` fills
        it before serving (ExecutorPools._preload_experts): one lookup of every key, ascending, released; the
        LRU then holds them oldest first in that order. Not counted as hits, misses or bytes (nor by the
        server); no simulated time passes (it runs before the server is ready)."""
        spec, r = self.cost.spec, self.residency
        keys = [(layer, e) for layer in range(spec.num_layers) for e in range(spec.num_experts)]
        if not self.preload_experts or r.num_slots < len(keys):
            return
        counted = r.hits, r.misses, r.evictions
        r.lookup(keys)
        r.release(keys)
        r.hits, r.misses, r.evictions = counted

    def _check_layers(self, batch: StepBatch) -> None:
        """SequenceWork.layers' contract (ValueError, before the step runs); keeps track of the chunk part-way."""
        w = batch.layered
        if w is None:
            return
        num_layers = self.cost.spec.num_layers
        reason = layer_group_problem(batch.works, num_layers)
        if reason is not None:
            raise ValueError(reason)
        first, end = w.layers
        chunk = (w.request_id, w.start_position, len(w.token_ids))
        if first > 0 and self._kept != (*chunk, first):
            raise ValueError(f"{w.request_id}: group {w.layers} at {w.start_position}+{len(w.token_ids)} "
                             f"continues no kept chunk (kept: {self._kept})")
        self._kept = None if end == num_layers else (*chunk, end)

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
        if batch.layered is not None:
            yield from self._layered_step(batch)
            return
        host, cost, residency = self.host, self.cost, self.residency
        works = batch.works
        if self.short_prompt_replays:
            buckets = cost.params.graph_buckets  # the largest captured bucket bounds a replay's rows (none: no graphs)
            replays = unroll(works, self.short_prompt_replays, buckets[-1] if buckets else 0)
            if replays is not None:
                yield from self._replay_step(batch, [[row.work for row in rows] for rows in replays])
                return
        routes = self._routes(works)
        loads = [SequenceLoad(len(w.token_ids), w.end_position) for w in works]
        decode_only = batch.num_prefill_tokens == 0 and all(len(w.token_ids) == 1 for w in works)
        padding = cost.padded_rows(len(works)) - len(works) if decode_only else 0
        loads += [SequenceLoad(1, 1)] * padding  # a padded row attends over nothing
        self._route_padding(routes, padding)
        weighted = list(routes.values())
        self._count(batch)
        # NOTE: the GPU stream has one user (this step), so back-to-back kernels are merged into
        # one busy period and handed to simpy only where the copy engine must synchronise with
        # it. Same timeline as one event per kernel, far fewer events.
        host_s = cost.host_overhead(len(works), self.via_server)
        if host_s:
            yield host.env.timeout(host_s)  # outside the graph: neither the GPU nor the link works
        pairs = batch.num_tokens * cost.spec.top_k  # keys of every layer call: all of the step's rows
        segment = [(layer, loads, weighted) for layer in range(cost.spec.num_layers)]
        samples = sum(1 for w in works if w.sample)
        graph = cost.graph_step(len(works), decode_only)
        run = self._eager_cost if not graph and cost.eager_terms(pairs) else cost  # the pass's kernels
        if not graph and cost.streams_prefill(pairs, residency.num_slots, self.staging_experts):
            yield from self._streamed_pass(segment, cost.step_overhead(len(works)), samples, run)
            return
        # a short uncaptured step launches its token mixers from Python, layer by layer (module docstring)
        launch = cost.params.eager_mixer_layer_s if not graph and cost.short_step(pairs) else 0.0
        yield from self._lookup_pass(segment, cost.step_overhead(len(works) + padding), samples + padding, run,
                                     launch, cost.host_permille_at(len(works) + padding) if graph else 0)

    def _replay_step(self, batch: StepBatch, replays: list[list[SequenceWork]]):
        """A step of short chunks as decode replays (module docstring): each replay a decode-only step of its rows."""
        cost = self.cost
        for w in batch.works:  # NOTE: a request's stream is keyed by its first work (its prompt head), never by a row
            self._stream_key(w)
        self._count(batch)
        self.counters.replayed_steps += 1
        self.counters.replays += len(replays)
        for i, rows in enumerate(replays):
            # NOTE: every replay restages its rows and launches its graph from the host, as a decode step does; the
            # server's per-step HTTP work (server_step_s) is the engine step's, paid once
            host_s = cost.host_overhead(len(rows), self.via_server and i == 0)
            if host_s:
                yield self.host.env.timeout(host_s)
            padding = cost.padded_rows(len(rows)) - len(rows)
            routes = self._routes(rows)  # row r of a chunk routes through its stream's position start + r
            self._route_padding(routes, padding)
            loads = [SequenceLoad(1, w.end_position) for w in rows] + [SequenceLoad(1, 1)] * padding
            weighted = list(routes.values())
            yield from self._lookup_pass([(layer, loads, weighted) for layer in range(cost.spec.num_layers)],
                                         cost.step_overhead(len(rows) + padding), len(rows) + padding,
                                         host_permille=cost.host_permille_at(len(rows) + padding))

    def _count(self, batch: StepBatch) -> None:
        c = self.counters
        c.steps += 1
        c.sequence_steps += len(batch.works)
        c.prefill_tokens += batch.num_prefill_tokens  # a layered chunk's tokens once, in its first group
        c.decode_tokens += batch.num_decode_tokens
        if batch.layered is not None:
            c.layered_steps += 1
            c.layered_layers += batch.layered.layers[1] - batch.layered.layers[0]

    def _route_padding(self, routes: dict, padding: int) -> None:
        if padding and self.cost.params.padding_fetches:
            # NOTE: stale inputs route somewhere else than the real rows: one stream per padded slot.
            for i in range(padding):
                routes[(f"padding-row-{i}", self._padding_position, 1)] = [
                    1, self.routing.stream(f"padding-row-{i}").tokens(self._padding_position, 1)]
            self._padding_position += 1
        # NOTE: otherwise padded rows skip every expert (their lookup key is -1, as in
        # adapters/cuda_exec/expert_pool.py): no lookups, no misses, no routed FLOPs.

    def _layered_step(self, batch: StepBatch):
        """A step that carries a layer group (module docstring, "Layered prefill"): the decode rows as their graph
        bucket, then the eager rows (the group over its layers, any other prefill chunk over every layer)."""
        host, cost = self.host, self.cost
        works, num_layers = batch.works, cost.spec.num_layers
        decodes = [w for w in works if _is_decode_row(w)]
        graph = decodes if decodes and cost.graph_step(len(decodes), True) else []
        in_graph = {id(w) for w in graph}
        eager = [w for w in works if id(w) not in in_graph]  # the group first: prefill chunks come first
        padding = cost.padded_rows(len(graph)) - len(graph) if graph else 0
        self._count(batch)
        host_s = cost.host_overhead(len(works), self.via_server)  # once per step, however it is split
        if host_s:
            yield host.env.timeout(host_s)
        # NOTE: the step's fixed cost once, over the rows it computes (graph bucket + eager rows), as a whole step
        pending = cost.step_overhead(len(graph) + padding + len(eager))
        if graph:
            routes = self._routes(graph)
            self._route_padding(routes, padding)
            loads = [SequenceLoad(1, w.end_position) for w in graph] + [SequenceLoad(1, 1)] * padding
            weighted = list(routes.values())
            yield from self._lookup_pass([(layer, loads, weighted) for layer in range(num_layers)], pending,
                                         len(graph) + padding,  # every graph row runs the head, padded ones too
                                         host_permille=cost.host_permille_at(len(graph) + padding))
            pending = 0.0
        ranged = []  # (first, end, load, work): the layers each eager row computes
        for w in eager:
            first, end = w.layers if w.layers is not None else (0, num_layers)
            ranged.append((first, end, SequenceLoad(len(w.token_ids), w.end_position), w))
        segment, pairs, by_set = [], 0, {}
        for layer in range(num_layers):
            active = tuple(i for i, (first, end, _, _) in enumerate(ranged) if first <= layer < end)
            if not active:
                continue
            if active not in by_set:  # the chunk's rows route through its stream positions, as unlayered
                routes = self._routes([ranged[i][3] for i in active])
                by_set[active] = ([ranged[i][2] for i in active], list(routes.values()))
                pairs = max(pairs, sum(ranged[i][2].num_tokens for i in active) * cost.spec.top_k)
            segment.append((layer, *by_set[active]))
        samples = sum(1 for w in eager if w.sample)  # only the group that ends its chunk may sample
        # NOTE: a step streams or not as a whole, on its largest layer call (the group's: every layer of it routes
        # the chunk's rows); the decode graph never streams
        run = self._eager_cost if cost.eager_terms(pairs) else cost
        if cost.streams_prefill(pairs, self.residency.num_slots, self.staging_experts):
            yield from self._streamed_pass(segment, pending, samples, run)
        else:
            yield from self._lookup_pass(segment, pending, samples, run)

    def _lookup_pass(self, segment, pending: float, head_rows: int, cost: CostModel | None = None,
                     launch_s: float = 0.0, host_permille: int = 0):
        """Layers through the residency: segment = [(layer, loads, weighted routes)] in layer order; `pending` GPU
        time queued before the first layer; the head over `head_rows` rows after the last. `cost`: the model of
        the pass's kernels (the eager one for a long uncaptured pass; default self.cost). `launch_s`: host time a
        layer's launches take (a short step's eager token mixers): the k-th layer's GPU work starts no earlier than
        k x launch_s after the pass opens, the GPU idling until then. `host_permille`: the host lane's share of each
        lookup's misses (a decode graph's pass: CostParams.host_permille; 0 elsewhere)."""
        host, residency = self.host, self.residency
        cost = cost or self.cost
        opened = host.env.now
        for k, (layer, loads, weighted) in enumerate(segment, 1):
            idle = opened + k * launch_s - (host.env.now + pending) if launch_s else 0.0
            if idle > 0:  # NOTE: the GPU runs what is queued, then idles (not busy) until this layer is launched
                yield from host.gpu.use(pending)
                yield host.env.timeout(idle)
                pending = 0.0
            pending += cost.layer_pre_expert(layer, loads)
            tokens_per_expert: dict[int, int] = {}  # expert -> tokens routed to it, first-seen order
            for weight, seq in weighted:
                for token in seq:
                    for e in token[layer]:
                        tokens_per_expert[e] = tokens_per_expert.get(e, 0) + weight
            keys = [(layer, e) for e in tokens_per_expert]
            if host_permille:  # the engine's decode lookups take a layer's keys ascending: their "last" misses
                keys.sort()   # are the host's (host_split's order decides how many, not only which)
            self.routed_keys.update(keys)
            # NOTE: the engine picks per-pair GEMVs or grouped GEMMs from the layer call's pair count (lockstep
            # rows included: each streams its pairs), never from the pool size or the lookup groups below.
            pairs = sum(tokens_per_expert.values())
            per_pair = cost.reads_per_pair(pairs)
            group = max(1, residency.num_slots)
            # NOTE: the engine's host lane rides only the one-launch decode lookup, which needs the layer's keys to
            # fit the pool: a layer looked up in several groups sends nothing to the host (and pays no hand-off)
            lane_permille = host_permille if len(keys) <= group else 0
            rows = sum(weight * len(seq) for weight, seq in weighted) if lane_permille else 0  # the hand-off's rows
            for start in range(0, len(keys), group):
                pending = yield from self._expert_group(keys[start : start + group], tokens_per_expert, pending,
                                                        per_pair, cost, lane_permille, rows)
            pending += cost.expert_call(pairs)  # once a layer call, after its copies (CostParams.pair_call_s)
        pending += cost.head(head_rows)
        yield from host.gpu.use(pending)

    def _streamed_pass(self, segment, pending: float, samples: int, cost: CostModel | None = None):
        """The compute stream of one streamed step (module docstring) over segment = [(layer, loads, weighted
        routes)] beside its copy lane (`_copy_lane`); `pending` GPU time queued before the first layer; `cost` as
        in _lookup_pass (copies are the same in either model)."""
        host, residency, c = self.host, self.residency, self.counters
        cost = cost or self.cost
        spec, env = cost.spec, host.env
        experts = spec.num_experts
        # NOTE: the engine snapshots the residency as the step opens; nothing in the step changes it. Rounds are
        # planned over the segment's layers only (a layer group copies its own layers' rounds); indices below
        # (rounds[k].layer included) are positions in the segment.
        missing = [[e for e in range(experts) if residency.slot_of((layer, e)) is None] for layer, _, _ in segment]
        rounds = plan_rounds(missing, self.staging_experts)
        buffers, _ = staging_buffers(self.staging_experts)
        routed: list[dict[int, int]] = []  # per layer: expert -> tokens routed to it, first-seen order
        for layer, _, weighted in segment:
            tokens_per_expert: dict[int, int] = {}
            for weight, seq in weighted:
                for token in seq:
                    for e in token[layer]:
                        tokens_per_expert[e] = tokens_per_expert.get(e, 0) + weight
            routed.append(tokens_per_expert)
            self.routed_keys.update((layer, e) for e in tokens_per_expert)
        pairs = max(sum(r.values()) for r in routed)
        speculate = speculate_whole_layers(pairs, experts)
        router_done = [env.event() for _ in segment]
        copied = [env.event() for _ in rounds]
        computed = [env.event() for _ in rounds]
        c.streamed_steps += 1
        lane = env.process(self._copy_lane(rounds, routed, speculate, buffers, router_done, copied, computed))
        k = 0
        for i, (layer, loads, _) in enumerate(segment):
            pending += cost.layer_pre_expert(layer, loads)
            yield from host.gpu.use(pending)
            pending = 0.0
            router_done[i].succeed()
            tokens_per_expert, absent = routed[i], set(missing[i])
            per_pair = cost.reads_per_pair(sum(tokens_per_expert.values()))
            c.streamed_not_resident += sum(1 for e in tokens_per_expert if e in absent)
            call = cost.expert_call(sum(tokens_per_expert.values()))  # with the layer's first round
            while k < len(rounds) and rounds[k].layer == i:
                rnd = rounds[k]
                mine = [tokens_per_expert[e] for e in rnd.experts if e in tokens_per_expert]
                if rnd.first:  # the layer's resident experts compute with its first round
                    mine += [n for e, n in tokens_per_expert.items() if e not in absent]
                yield copied[k]
                yield from host.gpu.use(cost.expert_gemms(mine, per_pair) + (call if rnd.first else 0.0))
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

    def _expert_group(self, keys, tokens_per_expert: dict[int, int], pending: float, per_pair: bool = False,
                      cost: CostModel | None = None, host_permille: int = 0, rows: int = 0):
        """Looks the group up, copies its fills (once per distinct expert) and, with `host_permille`, computes its
        host keys on the host lane beside the copies (module docstring), then queues the GPU's GEMMs (weights read
        per routed pair with `per_pair`) and, where it sent the host keys, the hand-off's GPU side for the layer
        call's `rows` routed rows (CostModel.host_wait); returns GPU time still pending (not yet handed to simpy)."""
        host, residency, c = self.host, self.residency, self.counters
        cost = cost or self.cost
        if host_permille:  # the domain weighs a host key by its rows: a key once per pair routed to it
            keys = [key for key in keys for _ in range(tokens_per_expert[key[1]])]
        lookup = residency.lookup(keys, host_permille=host_permille)
        misses, on_host = len(lookup.fills), len(lookup.host)
        host_pairs = sum(tokens_per_expert[e] for _, e in lookup.host)
        host_passes = sum(weight_passes(tokens_per_expert[e]) for _, e in lookup.host)
        c.expert_hits += len(lookup.hits)
        c.expert_misses += misses + on_host
        c.bytes_moved += misses * cost.expert_bytes
        c.host_experts += on_host
        c.host_pairs += host_pairs
        c.host_passes += host_passes
        hit_tokens = [tokens_per_expert[e] for _, e in lookup.hits]
        miss_tokens = [tokens_per_expert[e] for (_, e), _slot in lookup.fills]
        if not misses and not on_host:
            residency.release()
            return pending + cost.expert_gemms(hit_tokens, per_pair)
        # The router's output is needed before the copies (and the host's work) can start: flush the GPU up to here.
        yield from host.gpu.use(pending)
        lanes = [host.env.process(host.pcie.use(cost.transfer(misses)))] if misses else []
        if on_host:
            lanes.append(host.env.process(host.cpu.use(cost.host_compute(host_passes, pairs=host_pairs))))
        # NOTE: one lane is waited on as itself, as before the host lane: the same events, the same timeline
        done = lanes[0] if len(lanes) == 1 else host.env.all_of(lanes)
        if cost.params.overlap_copy_compute:
            yield from host.gpu.use(cost.expert_gemms(hit_tokens, per_pair))
            yield done
            gemms = cost.expert_gemms(miss_tokens, per_pair)
        else:
            yield done
            gemms = cost.expert_gemms(hit_tokens + miss_tokens, per_pair)
        if on_host and cost.params.host_wait_row_s:  # the wait kernel, after the GEMMs: serial on the GPU
            gemms += cost.host_wait(rows)
        # NOTE: this group holds the only pins, so release-all equals release(keys) without
        # validating every key again. The GEMMs are queued; nothing looks up before they run.
        residency.release()
        return gemms

    def check_valid(self) -> None:
        self.residency.check_valid()
        self.host.check_valid()
        c = self.counters
        # NOTE: host keys are misses that are never copied (ADR 0030)
        assert c.bytes_moved == (c.expert_misses - c.host_experts) * self.cost.expert_bytes, (
            "bytes moved != (misses - host experts) x expert bytes")
        assert (c.expert_hits, c.expert_misses, c.host_experts) == (
            self.residency.hits, self.residency.misses, self.residency.host_computed), (
            "executor and residency disagree on hits/misses/host experts"
        )
        assert c.host_experts <= c.host_passes <= c.host_pairs, "a host expert without a pass, or a pass without a pair"


def _is_decode_row(work: SequenceWork) -> bool:
    """A row the decode graph runs: StepBatch's decode rule (domain.ports), never a layer group."""
    return work.layers is None and StepBatch((work,)).num_decode_tokens == 1
