"""Per-operation cost model: seconds for each piece of one step, from geometry and hardware.

Shape legend: T tokens in a step, B sequences in a step, L layers, H hidden, I expert
intermediate, E experts per layer, V vocab.

Every GPU operation is costed with a roofline, max(bytes / bandwidth, flops / throughput),
so small batches are weight-read bound (GEMV) and large prefill chunks compute bound (GEMM).
What the roofline cannot know (Python dispatch, kernel launches or graph replay, sampling,
per-expert copy set-up) lives in CostParams, which a calibration fits per machine and engine.

Three named terms describe how a step's pieces line up in time (docs/simulator.md, "Step terms"):
- fetch/compute overlap per layer (`layer_expert_time`): a layer's misses can be fetched only once
  its router has run, so the link idles during the layer's attention/GDN, shared expert and router,
  and at best hides behind the GEMMs of that layer's resident experts. A step is the sum of its
  layers, never max(total compute, total copy);
- graph bucket padding (`padded_rows`): a graph-captured decode step of B rows runs as the smallest
  captured bucket >= B; the padded rows pay the dense compute and lm_head; they skip the experts
  (no misses) unless padding_fetches says the engine routes them;
- host overhead outside the graph (`host_overhead`): per step and per real row, during which the
  GPU and the link are both idle;
- the eager terms (`eager_terms`, `eager_model`): an uncaptured pass of more than lookup_max_keys pairs a layer
  call (long prefill chunks, mixed steps, layer groups) pays eager_layer_s per layer, eager_token_s per token and
  layer, and computes at eager_compute_efficiency (docs/simulator.md, "Prefill compute", "Short steps");
- the short step's eager token mixers (`short_step`): an uncaptured step of at most lookup_max_keys pairs a layer
  call (a prompt's tail beside decodes, a short prompt: the prefill graphs' steps) launches each layer's token mixer
  from Python, eager_mixer_layer_s of host time a layer, before that layer's GPU work can start (docs/simulator.md,
  "Short steps: h200_records_v7");
- the split-K dense projections (`splitk`): a layer call of 3 to 32 rows pays splitk_layer_s beside its roofline;
- the per-pair GEMV call (`expert_call`, `expert_read(..., per_pair=True)`): a layer call of per-pair GEMVs costs
  pair_call_s once plus its pairs' bytes at pair_read_efficiency (docs/simulator.md, "Held out on an H100: session 33,
  refitted"); with pair_reread_s set, only the first pair of each distinct expert of the call reads it at that rate,
  and every other pair routed to the same expert (re-read from L2) costs pair_reread_s (docs/simulator.md, "Held out
  on an H100: sessions 34-35");
- the host lane (`host_compute`, host_lane.py, ADR 0030): with host_permille set, the last share of each decode
  lookup's misses is computed on the host CPU beside the link's copies of the rest, a weight pass over a host key's
  expert serving up to host_lane.ROWS_PER_PASS of its rows; the layer's miss GEMMs wait for both lanes
  (docs/simulator.md, "The host lane").

How a layer's routed-expert GEMMs read weights is a property of the engine (`expert_reads`): "distinct"
reads each distinct expert of the step once (grouped GEMMs, an engine that deduplicates: the reference
engine's reading, and every calibration written before the field existed); "pairs" streams the expert of
every routed (token, top-k) pair, shared or not, in calls of up to `pair_gemv_max_pairs` pairs (our fast
engine's per-pair decode GEMVs), and reads distinct experts above that (the grouped prefill GEMMs). Copies
of misses are per distinct expert either way: a miss is copied once, whatever rows route to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from domain.model_spec import LayerKind, ModelSpec
from simulator.hardware import HardwareProfile
from simulator.host_lane import check_host_params, host_keys_at, host_seconds, miss_points, passes_per_key
from simulator.params import StrictParams, require_positive

EXPERT_READS = ("distinct", "pairs")  # CostParams.expert_reads
OFF_WHEN_ZERO = ("pair_call_s", "pair_read_efficiency", "request_spacing_s", "pair_reread_s", "splitk_layer_s",
                 "host_row_factor", "host_wait_row_s", "host_max_rows")
# NOTE: adapters/cuda_exec/prefill_linear.py use_splitk (SPLITK_GEMV_MAX_ROWS + 1 .. SPLITK_MAX_ROWS): the rows a
# layer's dense projections run as split-K GEMMs; fewer run the GEMV (the simulator may not import adapters)
SPLITK_ROWS = (3, 32)  # left out of to_dict() at 0
# the host lane's fields (ADR 0030), left out of to_dict() at these values: files written before it stay as they are
HOST_LANE_DEFAULTS = {"host_expert_gb_s": 0.0, "host_permille": 0, "host_call_s": 20e-6}


@dataclass(frozen=True)
class CostParams(StrictParams):
    """Engine-and-machine parameters. Defaults are uncalibrated physics-only guesses."""

    step_overhead_s: float = 0.0  # per step: launches / graph replay, sampling, host work
    sequence_overhead_s: float = 0.0  # per sequence in the step (per-request host work)
    transfer_latency_s: float = 0.0  # per expert copy, on top of bytes / bandwidth
    # Per copy call (one gather launch per layer group with misses), on top of the per-expert
    # cost: the fast path gathers a layer's misses in one UVA kernel whose start-up is measured.
    transfer_setup_s: float = 0.0
    # Eager kernel launches per layer and step; 0 when the step is graph-captured (the replay
    # cost is then part of step_overhead_s). Not fitted by the v1 calibration.
    layer_overhead_s: float = 0.0
    memory_efficiency: float = 0.8  # share of memory bandwidth a weight/KV read achieves
    compute_efficiency: float = 0.5  # share of dense bf16 throughput a GEMM achieves
    h2d_efficiency: float = 1.0  # share of the profile's pinned H2D bandwidth per copy
    overlap_copy_compute: bool = False  # hit-expert GEMMs run while misses are copied
    kv_dtype_bytes: int = 2
    # Graph batch buckets of decode steps ([1, 2, 4, 8, 16] on our fast executor): B decode rows run
    # as the smallest bucket >= B; () = no padding (eager engines, and the older calibrations).
    graph_buckets: tuple[int, ...] = ()
    # Padded rows route (their stale inputs pick experts) and their misses are fetched: an engine that
    # does not mask padding. Off for our executor (it masks the padded rows' lookups).
    padding_fetches: bool = False
    # Host work outside the graph, per step and per real row (scheduler, sampling bookkeeping, result
    # copy-back): GPU and link both idle. bench_decode measures it as execute - graph replay.
    host_step_s: float = 0.0
    host_row_s: float = 0.0
    # Per step of a server measured through HTTP (ft bench): streaming, detokenising, the engine loop's
    # Python. Not part of an execute() step; predict's workload is the HTTP benchmark, so it applies there.
    server_step_s: float = 0.0
    # How the routed-expert GEMMs of one layer call read weights (module docstring). "distinct": each distinct
    # expert once per step, however many rows route to it (grouped GEMMs; the reference engine's reading and the
    # default of files without the field). "pairs": one GEMV per routed (token, top-k) pair, each streaming its
    # expert's weights whether or not other rows share it (our fast engine's decode, adapters/kernels/
    # moe_gate_up.py and moe_down.py; DEDUP_MIN_PAIRS and grouped decode are off), for calls of at most
    # pair_gemv_max_pairs pairs; larger calls (prefill chunks) run grouped GEMMs, each distinct expert read once
    # (adapters/cuda_exec/expert_pool.py GEMV_MAX_PAIRS).
    expert_reads: str = "distinct"
    pair_gemv_max_pairs: int = 512
    # A layer call of per-pair GEMVs (reads_per_pair) costs pair_call_s (s, once a call: the kernels' fixed launch,
    # ramp and tail) + each pair's expert bytes at pair_read_efficiency of memory bandwidth (0: memory_efficiency).
    # The kernels stream a pair faster than one efficiency for every byte says: an expert shared by several rows is
    # re-read from L2, and more pairs keep more loads in flight (docs/simulator.md, "Held out on an H100: session
    # 33, refitted"; simulator/fit_pair_gemv.py fits both on a bench_decode kernel profile). 0 and 0.0: files before
    # h100_records_v2, whose per-pair reads run at memory_efficiency.
    pair_call_s: float = 0.0
    pair_read_efficiency: float = 0.0
    # A per-pair GEMV call's pair whose expert an earlier pair of the same call reads (rows routed to one expert: the
    # HTTP ladder's identical greedy rows, 16 pairs an expert at c16) re-reads it from L2: pair_reread_s (s) a such
    # pair instead of the expert's bytes at pair_read_efficiency. Fitted on session 34's H100 records, where the
    # ladder's lockstep c16 step is 0.55 ms shorter than bench_decode's bs16 replay of distinct rows on the same
    # kernels (simulator/fit_resident_h100.py). 0: off, every pair reads at the pair rate (files before
    # h100_records_v3).
    pair_reread_s: float = 0.0
    # A layer call of SPLITK_ROWS rows (3 to 32: the decode buckets 4, 8, 16 and short steps) runs its dense
    # projections as split-K GEMMs (adapters/cuda_exec/prefill_linear.py use_splitk), which read the weights slower
    # than the one-row GEMVs whose bytes the roofline costs: this much more a layer (s). Fitted on session 34's H100
    # kernel profile, split-K at bs16 less the GEMVs at bs1 (simulator/fit_resident_h100.py). 0: off (files before
    # h100_records_v3).
    splitk_layer_s: float = 0.0
    # The streamed prefill (docs/adr/0010-streamed-prefill.md): an uncaptured step (prefill or mixed) whose layer
    # calls route more than min(expert slots, lookup_max_keys) (token, top-k) pairs reads the resident experts in
    # place and copies the layer's non-resident ones through the plan's staging rows, in rounds that alternate
    # between two halves, overlapped with compute; the LRU is neither stamped nor filled (SimExecutor docstring).
    # Smaller calls take the device lookup and go through the residency as before. Needs staging rows in the plan
    # (`ft serve --staging-experts`, auto with the Triton prefill); False: every prefill goes through the LRU
    # (the simulator before 2026-12-04, and every calibration file without the field).
    streamed_prefill: bool = False
    # The most keys one layer call looks up on the device without streaming: MAX_KEYS in
    # adapters/kernels/residency_lookup.py (256: a 32-token step at top-8).
    lookup_max_keys: int = 256
    # Per request served over HTTP, before the engine sees it: the client's send, the server's parse, chat
    # template and tokenizer, the arrival window's quiet gap (ADR 0021), and the first token's way back. The
    # requests of one burst pay it side by side (they are admitted together after it); GPU and link idle.
    request_overhead_s: float = 0.0
    # Between consecutive requests of a burst, on their way to the engine (s): the server parses, renders and
    # tokenizes one request at a time, so the k-th of a burst sent together reaches the engine k x this after the
    # first; the arrival window (Deployment.arrival_window_ms) decides which of them the first step takes
    # (predict.run_workload). 0: a burst arrives at one instant (files before h100_records_v2).
    request_spacing_s: float = 0.0
    # An uncaptured step whose layer calls route more than lookup_max_keys pairs (a prefill or mixed step of more
    # than 32 tokens at top-8: the grouped or streamed path; shorter steps replay the prefill graphs) pays, per layer
    # it computes, eager_layer_s (launches, host work, the grouped path's lookup and alignment: the eager forward's
    # fixed cost, ADR 0011's c spread pro rata over the layers), and its compute-bound kernels run at
    # eager_compute_efficiency of dense bf16 throughput (the prefill kernels: GEMMs, attention, and what the roofline
    # does not see, such as the GDN recurrence). 0 and 0.0: the step is costed as every other (files without the
    # fields). Fitted on bench_prefill's resident prompts (simulator/fit_prefill.py); decode graphs never pay them.
    eager_layer_s: float = 0.0
    eager_compute_efficiency: float = 0.0  # 0: compute_efficiency
    # Per token and layer such a pass computes, on top of its roofline (what scales with the chunk's tokens and the
    # roofline does not count: the GDN recurrence, routing, elementwise kernels). 0: none (files before
    # h200_records_v7, whose eager_layer_s carried it; simulator/fit_short_steps.py splits the two).
    eager_token_s: float = 0.0
    # A short uncaptured step (at most lookup_max_keys pairs a layer call, not a captured decode graph: a prompt's
    # tail beside decodes, a short prompt) runs each layer's token mixer eagerly from Python and only the layer's MoE
    # half from a CUDA graph (adapters/cuda_exec/prefill_graphs.py): the host spends this long a layer launching
    # them, and a layer's GPU work starts no earlier than its launches end (host and GPU pipelined: the step is the
    # later of the two, layer by layer). 0: the step is costed as a graph replay (files before h200_records_v7).
    eager_mixer_layer_s: float = 0.0
    # The host lane (ADR 0030; simulator/host_lane.py): of each decode lookup's m misses the last ones within
    # host_key_count(m, host_permille) weight passes (domain.residency.host_split) are computed on the host CPU
    # while the link copies the rest; the host reads their expert bytes once per weight pass (a pass serves up to
    # host_lane.ROWS_PER_PASS rows routed to the key: the kernel's MAX_VECTORS) at host_expert_gb_s (GB/s of expert
    # weight bytes), plus host_call_s (s) per lookup with any host keys (the GPU hands the rows over and waits for the
    # partial sum). 0 and 0: off
    # (every calibration file; to_dict leaves the three out at their defaults, and host_row_factor at 0).
    host_expert_gb_s: float = 0.0
    host_permille: int = 0
    host_call_s: float = 20e-6
    # A weight pass serving n rows routed alike costs (1 + host_row_factor x (n - 1)) x a 1-row pass: the kernel
    # converts the expert's weights once but multiplies and sums n rows (host_compute's `pairs`). 0: every pass costs
    # a 1-row pass, as before the field (docs/simulator.md, "The host lane's request cost refit on the host-kernel
    # file (session 42)"; host_lane.H100_HOST_REQUEST_S41 is the fit).
    host_row_factor: float = 0.0
    # The hand-off's GPU side (docs/simulator.md, "The host lane's hand-off on the GPU (session 43)"): a lookup with
    # host keys keeps the GPU this long per row it routes past both lanes (the wait kernel after the layer's expert
    # GEMMs), serial, never hidden behind the copies as the host's own time is. bench_decode's profiles put ~17.3 µs
    # a row past the host's imbalance with the GPU's work (host_lane.fit_host_wait, H100_HOST_WAIT_S43). 0: off, as
    # before the field (left out of to_dict). decode_step counts it in the exposed part, not in the expert GEMMs.
    host_wait_row_s: float = 0.0
    # The largest decode call, in rows (the graph's padded bucket), that sends the host anything: a larger one copies
    # every miss, as the engine's lane serves calls of up to FLUXTIDE_HOST_LANE_ROWS rows (domain.residency.
    # HOST_LANE_MAX_ROWS, 8, since session 44). 0: every call, as the engine before it (left out of to_dict).
    host_max_rows: int = 0

    def check_valid(self) -> None:
        if isinstance(self.graph_buckets, list):  # from JSON
            object.__setattr__(self, "graph_buckets", tuple(self.graph_buckets))
        require_positive(self, "step_overhead_s", "sequence_overhead_s", "transfer_latency_s", "transfer_setup_s",
                         "layer_overhead_s", "host_step_s", "host_row_s", "server_step_s", "request_overhead_s",
                         "eager_layer_s", "eager_compute_efficiency", "eager_token_s", "eager_mixer_layer_s",
                         "pair_call_s", "pair_read_efficiency", "request_spacing_s", "pair_reread_s",
                         "splitk_layer_s", allow_zero=True)
        buckets = self.graph_buckets
        if not isinstance(buckets, tuple) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                                 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"CostParams.graph_buckets must be strictly increasing integers >= 1, got {buckets!r}")
        if not isinstance(self.padding_fetches, bool):
            raise ValueError("CostParams.padding_fetches must be a bool")
        require_positive(self, "memory_efficiency", "compute_efficiency", "h2d_efficiency", "kv_dtype_bytes")
        for name in ("memory_efficiency", "compute_efficiency", "h2d_efficiency", "eager_compute_efficiency",
                     "pair_read_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"CostParams.{name} must be <= 1, got {getattr(self, name)}")
        if not isinstance(self.overlap_copy_compute, bool):
            raise ValueError("CostParams.overlap_copy_compute must be a bool")
        if self.expert_reads not in EXPERT_READS:
            raise ValueError(f"CostParams.expert_reads must be one of {EXPERT_READS}, got {self.expert_reads!r}")
        for name in ("pair_gemv_max_pairs", "lookup_max_keys"):
            m = getattr(self, name)
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"CostParams.{name} must be an integer >= 1, got {m!r}")
        if not isinstance(self.streamed_prefill, bool):
            raise ValueError("CostParams.streamed_prefill must be a bool")
        check_host_params(self)

    def to_dict(self) -> dict:
        """StrictParams' dict, less the fields of h100_records_v2 (pair_call_s, pair_read_efficiency,
        request_spacing_s), v3 (pair_reread_s, splitk_layer_s), the host request refit (host_row_factor) and the
        hand-off's GPU side (host_wait_row_s) where they are 0: the files fitted before them stay what their commands
        write."""
        out = super().to_dict()
        for name in OFF_WHEN_ZERO:
            if out[name] == 0:
                del out[name]
        for name, default in HOST_LANE_DEFAULTS.items():
            if out[name] == default:
                del out[name]
        return out


@dataclass(frozen=True)
class SequenceLoad:
    """What one sequence contributes to a step: tokens computed and context they attend over."""

    num_tokens: int
    context_end: int  # positions in the KV cache after this step


class CostModel:
    def __init__(self, spec: ModelSpec, hardware: HardwareProfile, params: CostParams) -> None:
        params.check_valid()
        self.spec, self.hardware, self.params = spec, hardware, params
        h = spec.hidden_size
        self.head_bytes = spec.vocab_size * h * 2  # lm_head stays bf16
        embed_bytes = spec.vocab_size * h * 2
        # NOTE: the embedding table is only gathered from (T rows), never streamed whole.
        self.layer_dense_bytes = (spec.dense_weight_bytes() - self.head_bytes - embed_bytes) / spec.num_layers
        self.expert_bytes = spec.expert_bytes()
        self.kv_bytes_per_token_layer = spec.num_kv_heads * spec.head_dim * 2 * params.kv_dtype_bytes
        n_lin = spec.num_linear_attention_layers
        self.state_bytes_layer = spec.linear_state_bytes_per_sequence() / n_lin if n_lin else 0.0
        # Parameters one token multiplies through in a layer outside the routed experts.
        self.layer_dense_params = self.layer_dense_bytes / _bytes_per_param(spec)
        self.expert_flops_per_token = 2 * 3 * h * spec.expert_intermediate
        # per token a layer's token mixer computes, outside the roofline: eager_token_s in the eager model only
        self.layer_token_s = 0.0
        self._mem = hardware.memory_bytes_per_s * params.memory_efficiency
        self._pair_mem = hardware.memory_bytes_per_s * (params.pair_read_efficiency or params.memory_efficiency)
        self._flops = hardware.bf16_flops * params.compute_efficiency
        self._h2d = hardware.h2d_bytes_per_s * params.h2d_efficiency

    def _roofline(self, nbytes: float, flops: float, mem: float | None = None) -> float:
        """The slower of reading nbytes at `mem` bytes/s (None: the memory efficiency's rate) and flops."""
        return max(nbytes / (self._mem if mem is None else mem), flops / self._flops)

    @property
    def has_eager_terms(self) -> bool:
        p = self.params
        return bool(p.eager_layer_s or p.eager_compute_efficiency or p.eager_token_s)

    def eager_terms(self, pairs: int) -> bool:
        """Whether an uncaptured step whose largest layer call routes `pairs` (token, top-k) pairs pays the eager
        terms (eager_layer_s, eager_compute_efficiency): more pairs than one device lookup takes (lookup_max_keys),
        the grouped or streamed prefill path. Shorter steps run the MoE half from the prefill graphs."""
        if pairs < 0:
            raise ValueError(f"negative pairs {pairs}")
        return self.has_eager_terms and pairs > self.params.lookup_max_keys

    def short_step(self, pairs: int) -> bool:
        """Whether an uncaptured step whose largest layer call routes `pairs` pairs launches its token mixers eagerly
        layer by layer (eager_mixer_layer_s set and at most lookup_max_keys pairs: the prefill graphs' steps)."""
        if pairs < 0:
            raise ValueError(f"negative pairs {pairs}")
        return self.params.eager_mixer_layer_s > 0 and pairs <= self.params.lookup_max_keys

    def eager_model(self) -> CostModel:
        """This model with the eager terms in place: layer_overhead_s + eager_layer_s per layer, eager_token_s per
        token and layer, and compute at eager_compute_efficiency (when set). Everything else (memory, copies, step
        overheads) is this model's."""
        from dataclasses import replace

        p = self.params
        model = CostModel(self.spec, self.hardware, replace(
            p, layer_overhead_s=p.layer_overhead_s + p.eager_layer_s,
            compute_efficiency=p.eager_compute_efficiency or p.compute_efficiency, eager_layer_s=0.0,
            eager_compute_efficiency=0.0, eager_token_s=0.0))
        model.layer_token_s = p.eager_token_s
        return model

    def step_overhead(self, num_sequences: int) -> float:
        return self.params.step_overhead_s + self.params.sequence_overhead_s * num_sequences

    def padded_rows(self, rows: int) -> int:
        """Rows a graph-captured decode step of `rows` real rows computes: the smallest graph bucket
        >= rows; `rows` itself without buckets or above the largest (that step runs uncaptured)."""
        if rows < 1:
            raise ValueError(f"a step has at least one row, got {rows}")
        return next((b for b in self.params.graph_buckets if b >= rows), rows)

    def graph_step(self, rows: int, decode_only: bool) -> bool:
        """Whether a step of `rows` rows replays a captured decode graph: decode-only and no larger than the
        largest graph bucket (without buckets no step is captured). Every other step runs eagerly."""
        buckets = self.params.graph_buckets
        return decode_only and bool(buckets) and rows <= buckets[-1]

    def streams_prefill(self, pairs: int, expert_slots: int, staging_rows: int) -> bool:
        """Whether an eager step whose layer calls route `pairs` (token, top-k) pairs each streams its experts
        through `staging_rows` staging rows (streamed_prefill, docs/adr/0010-streamed-prefill.md) instead of
        looking them up in the residency: as DeviceExpertPool.routed decides, when there are staging rows and
        the call has more keys than one device lookup takes, min(expert_slots, lookup_max_keys)."""
        if pairs < 0 or expert_slots < 0 or staging_rows < 0:
            raise ValueError(f"negative counts: {pairs} pairs, {expert_slots} slots, {staging_rows} staging rows")
        p = self.params
        return p.streamed_prefill and staging_rows > 0 and pairs > min(expert_slots, p.lookup_max_keys)

    def request_overhead(self, via_server: bool = True) -> float:
        """Seconds before the engine sees a request served over HTTP (request_overhead_s); 0 otherwise."""
        return self.params.request_overhead_s if via_server else 0.0

    def host_overhead(self, rows: int, via_server: bool = True) -> float:
        """Seconds of host work outside the graph for a step of `rows` real rows (GPU and link idle):
        host_step_s + host_row_s * rows, plus server_step_s when the step is served over HTTP."""
        if rows < 0:
            raise ValueError(f"negative rows {rows}")
        p = self.params
        return p.host_step_s + p.host_row_s * rows + (p.server_step_s if via_server else 0.0)

    def layer_expert_time(self, copy_s: float, hit_gemm_s: float, miss_gemm_s: float, host_s: float = 0.0) -> float:
        """Seconds from a layer's router output to its expert outputs, given the copy time of its
        misses and the GEMM times of its resident and missed experts. The copy cannot start before
        the router (it needs the routing); with overlap_copy_compute it hides behind the resident
        experts' GEMMs, max(copy, hit) + miss, else copy + hit + miss (the gather runs first).
        host_s: the host lane's time for the layer's host keys (host_compute), beside the copy: the
        miss GEMMs wait for both, so copy above reads max(copy, host)."""
        if min(copy_s, hit_gemm_s, miss_gemm_s, host_s) < 0:
            raise ValueError(f"negative times {copy_s}, {hit_gemm_s}, {miss_gemm_s}, {host_s}")
        lanes = max(copy_s, host_s) if host_s else copy_s
        if self.params.overlap_copy_compute:
            return max(lanes, hit_gemm_s) + miss_gemm_s
        return lanes + hit_gemm_s + miss_gemm_s

    def layer_pre_expert(self, layer: int, loads: Sequence[SequenceLoad]) -> float:
        """Attention or GDN, shared expert and router of one layer, for every sequence."""
        spec = self.spec
        tokens = sum(s.num_tokens for s in loads)
        launch = self.params.layer_overhead_s + self.layer_token_s * tokens + self.splitk(tokens)
        nbytes = self.layer_dense_bytes
        flops = 2.0 * self.layer_dense_params * tokens
        if spec.layer_kinds[layer] is LayerKind.FULL_ATTENTION:
            # Each new token reads K,V of every earlier position (and writes its own).
            nbytes += sum(s.context_end for s in loads) * self.kv_bytes_per_token_layer
            q_dim = spec.num_attention_heads * spec.head_dim
            flops += sum(4.0 * q_dim * s.num_tokens * (s.context_end - s.num_tokens / 2) for s in loads)
        else:
            nbytes += 2 * self.state_bytes_layer * len(loads)  # read and write the recurrent state
        return launch + self._roofline(nbytes, flops)

    def splitk(self, rows: int) -> float:
        """Seconds a layer's dense projections over `rows` rows take beyond their roofline: splitk_layer_s where
        the engine runs them as split-K GEMMs (SPLITK_ROWS), else 0."""
        return self.params.splitk_layer_s if SPLITK_ROWS[0] <= rows <= SPLITK_ROWS[1] else 0.0

    def reads_per_pair(self, pairs: float) -> bool:
        """Whether a layer call of `pairs` routed (token, top-k) pairs streams an expert's weights per pair
        (per-pair GEMVs: expert_reads "pairs", at most pair_gemv_max_pairs pairs) rather than once per
        distinct expert. Like the engine's choice, it depends on the call's pair count only."""
        p = self.params
        return p.expert_reads == "pairs" and pairs <= p.pair_gemv_max_pairs

    def expert_gemms(self, tokens_per_expert: Sequence[int], per_pair: bool = False) -> float:
        """The routed-expert GEMMs of the given experts over the tokens routed to each: each expert's
        weights read once (grouped GEMMs), or once per routed pair with `per_pair` (per-pair GEMVs; see
        reads_per_pair, decided on the whole layer call's pairs)."""
        if not tokens_per_expert:
            return 0.0
        routed, distinct = sum(tokens_per_expert), len(tokens_per_expert)
        if per_pair and self.params.pair_reread_s:  # NOTE: each expert's first pair reads it, the rest re-read L2
            return self.expert_read(distinct, routed, per_pair, rereads=routed - distinct)
        return self.expert_read(routed if per_pair else distinct, routed, per_pair)

    def expert_read(self, weight_reads: float, routed_tokens: float, per_pair: bool = False,
                    rereads: float = 0.0) -> float:
        """Seconds for routed-expert GEMMs that read `weight_reads` experts' weights (distinct experts for
        grouped GEMMs, routed pairs for per-pair GEMVs: then at pair_read_efficiency) over `routed_tokens`
        (token, expert) pairs, plus `rereads` per-pair reads of an expert the same call already read, at
        pair_reread_s each (their FLOPs are in routed_tokens); fractional counts allowed (expected values). The
        call's fixed part is expert_call."""
        if weight_reads < 0 or routed_tokens < 0 or rereads < 0:
            raise ValueError(f"negative expert counts: {weight_reads}, {routed_tokens}, {rereads}")
        if rereads and not (per_pair and self.params.pair_reread_s):
            raise ValueError("re-reads are priced only for per-pair reads with pair_reread_s set")
        return self._roofline(weight_reads * self.expert_bytes, self.expert_flops_per_token * routed_tokens,
                              self._pair_mem if per_pair else None) + rereads * self.params.pair_reread_s

    def expert_call(self, pairs: float) -> float:
        """Seconds a layer call of `pairs` routed pairs costs once, beside its reads: pair_call_s when it runs
        per-pair GEMVs (reads_per_pair) and routes any pair, else 0."""
        if pairs < 0:
            raise ValueError(f"negative pairs {pairs}")
        return self.params.pair_call_s if pairs and self.reads_per_pair(pairs) else 0.0

    def host_compute(self, passes: float, calls: float = 1.0, pairs: float | None = None) -> float:
        """Seconds the host lane (host_lane.py) takes for `passes` weight passes over host keys' experts, serving
        `pairs` routed (row, key) pairs in all (default: `passes`, a row a pass), handed over in `calls` lookups:
        calls × host_call_s + (passes + host_row_factor × (pairs − passes)) × expert bytes / host_expert_gb_s,
        a pass of n rows costing (1 + host_row_factor × (n − 1)) 1-row passes (0 passes cost nothing). A host key
        routed by n rows in a lookup takes host_lane.weight_passes(n) = ceil(n / ROWS_PER_PASS) passes: the host
        kernel converts an expert's weights once for up to that many of its rows."""
        if passes < 0 or calls < 0:
            raise ValueError(f"negative host passes {passes} or calls {calls}")
        pairs = passes if pairs is None else pairs
        if pairs < passes - 1e-9:
            raise ValueError(f"host pairs {pairs} fewer than passes {passes} (a pass serves at least one row)")
        if not passes:
            return 0.0
        p = self.params
        if not p.host_expert_gb_s:
            raise ValueError("host passes need CostParams.host_expert_gb_s > 0")
        return host_seconds(passes, pairs, calls, self.expert_bytes, p.host_call_s, p.host_expert_gb_s,
                            p.host_row_factor)

    def host_permille_at(self, rows: int) -> int:
        """The host lane's share for a decode call of `rows` rows (the graph's padded bucket): host_permille, or 0
        past host_max_rows (the engine's lane serves calls of up to that many rows)."""
        cap = self.params.host_max_rows
        return 0 if cap and rows > cap else self.params.host_permille

    def host_wait(self, rows: float) -> float:
        """GPU seconds a lookup with host keys over `rows` routed rows spends on the hand-off past both lanes
        (host_wait_row_s a row: the wait kernel after the expert GEMMs, serial on the GPU)."""
        if rows < 0:
            raise ValueError(f"negative rows {rows}")
        return rows * self.params.host_wait_row_s

    def transfer(self, num_experts: float, calls: float = 1.0) -> float:
        """Host->device copy of num_experts expert rows on the copy engine, issued as `calls`
        copy calls (0 experts cost nothing)."""
        if num_experts <= 0:
            return 0.0
        return calls * self.params.transfer_setup_s + num_experts * (
            self.params.transfer_latency_s + self.expert_bytes / self._h2d)

    def head(self, num_samples: int) -> float:
        """Final norm + lm_head for the sampled positions, then sampling."""
        if num_samples == 0:
            return 0.0
        return self._roofline(self.head_bytes, 2.0 * self.head_bytes / 2 * num_samples)


def _bytes_per_param(spec: ModelSpec) -> float:
    # Dense projections in FP8/INT8 formats are ~1 byte a parameter, bf16 2, 4-bit ~0.56.
    from domain.model_spec import matrix_bytes

    return matrix_bytes(spec.dense_format, 1024, 1024) / (1024 * 1024)


@dataclass(frozen=True)
class StepBreakdown:
    """One decode step's time by named term (seconds); total = host + graph."""

    rows: int  # real rows B
    padded_rows: int  # rows computed (graph bucket)
    host_s: float  # outside the graph: GPU and link idle
    fixed_s: float  # in-graph fixed + per computed row (step_overhead_s, sequence_overhead_s)
    dense_s: float  # attention/GDN, shared expert, router, lm_head of the computed rows
    expert_s: float  # routed-expert GEMMs (resident and missed experts)
    copy_s: float  # misses' host->device copies (link busy); with a host lane the fills' only
    exposed_copy_s: float  # part of the copies (or of the host lane, where longer) not hidden behind resident GEMMs
    total_s: float
    host_lane_s: float = 0.0  # host keys computed on the host CPU (ADR 0030), beside the copies

    @property
    def graph_s(self) -> float:
        return self.total_s - self.host_s

    @property
    def link_idle_s(self) -> float:
        """Time in the step during which the link copies nothing (host work, dense compute,
        GEMMs that wait for or follow their layer's copy)."""
        return self.total_s - self.copy_s


def decode_step(model: CostModel, rows: int, context: int, distinct_per_layer: float,
                misses_per_step: float = 0.0, layers_with_misses: float | None = None,
                via_server: bool = False) -> StepBreakdown:
    """Closed-form time of one decode step of `rows` real rows at `context` KV positions each.

    distinct_per_layer: expected distinct routed experts one layer looks up for the real rows (<= E);
    misses_per_step: non-resident experts looked up in the step (over all layers), spread evenly over
    `layers_with_misses` layers (default: every layer when there are misses); all are copied unless the host lane
    (CostParams.host_permille, host_lane.py) computes its share of each layer's misses on the host, beside the
    copies. The expert GEMMs read
    each distinct expert once, or, where the model reads per pair (CostModel.reads_per_pair of the
    rows x top-k pairs), every routed pair's expert: then rows in lockstep (distinct_per_layer ~ top-k)
    share the misses but not the compute (with pair_reread_s, a distinct expert's pairs after its first cost that
    each: they re-read it from L2). The padded rows of
    the graph bucket pay dense compute and lm_head and skip the experts (no misses). Per layer:
    pre-expert + layer_expert_time(copy, hit GEMMs, miss GEMMs) + the call's fixed part (expert_call), summed
    over layers (never a per-step max of compute and copy); with a host lane the copy there is max(the fills' copy,
    the host keys' host_compute), the miss GEMMs are the fills', and a layer is costed at the whole miss counts around
    its average (host_lane.miss_points). The host keys' weight passes assume each key is routed by routed / distinct
    pairs, spread as evenly as that average allows (host_lane.passes_per_key): a pass a pair where rows never share a
    key (as before passes were counted), ceil(rows / ROWS_PER_PASS) a key for lockstep rows (one prompt), a pass a key
    for distinct rows on uniform routing. ValueError on counts out of range.
    """
    spec = model.spec
    if rows < 1 or context < 1:
        raise ValueError(f"rows and context must be >= 1, got {rows}, {context}")
    if not 0 <= distinct_per_layer <= spec.num_experts:
        raise ValueError(f"distinct_per_layer {distinct_per_layer} outside [0, {spec.num_experts}]")
    layers = spec.num_layers
    if misses_per_step < 0 or misses_per_step / layers > distinct_per_layer + 1e-9:
        raise ValueError(f"misses_per_step {misses_per_step} must be in [0, layers x distinct_per_layer]")
    if layers_with_misses is None:
        layers_with_misses = float(layers) if misses_per_step > 0 else 0.0
    if not 0 <= layers_with_misses <= layers:
        raise ValueError(f"layers_with_misses {layers_with_misses} outside [0, {layers}]")
    padded = model.padded_rows(rows)
    loads = [SequenceLoad(1, context)] * rows + [SequenceLoad(1, 1)] * (padded - rows)
    routed = rows * spec.top_k
    miss_l = misses_per_step / layers
    hit_l = distinct_per_layer - miss_l
    share = miss_l / distinct_per_layer if distinct_per_layer else 0.0
    # NOTE: per pair, a distinct expert is read once per pair routed to it (routed / distinct on average);
    # the copies below stay per distinct miss.
    per_pair = model.reads_per_pair(routed)
    rereads = per_pair and bool(model.params.pair_reread_s)  # each distinct expert's first pair reads it, the rest
    again = max(0.0, routed - distinct_per_layer)  # re-read it from L2
    reads_hit = routed * (1 - share) if per_pair and not rereads else hit_l
    hit_gemm = model.expert_read(reads_hit, routed * (1 - share), per_pair, again * (1 - share) if rereads else 0.0)
    call = model.expert_call(routed)  # the layer call's fixed part (pair_call_s), after its copies as in SimExecutor
    # NOTE: the host lane (host_lane.py) takes the last misses that fit host_key_count(m, host_permille) weight passes
    # (host_keys_at: the domain's host_split with every key alike) of a layer's m misses off the link
    # and the GPU, so a layer is costed at whole miss counts (miss_points); off, at the average itself, as before.
    permille = model.host_permille_at(padded)
    key_pairs = routed / distinct_per_layer if permille else 0.0  # a host key's rows, and its weight passes
    passes = passes_per_key(key_pairs) if permille else 0.0
    phase = copy_l = gemms = lane = 0.0
    for weight, misses in miss_points(miss_l, permille):
        on_host = host_keys_at(misses, permille, passes) if permille else 0
        fill = misses - on_host
        fill_share = fill / distinct_per_layer if distinct_per_layer else 0.0
        reads_miss = routed * fill_share if per_pair and not rereads else fill
        miss_gemm = model.expert_read(reads_miss, routed * fill_share, per_pair, again * fill_share if rereads else 0.0)
        copy_w = model.transfer(fill, layers_with_misses / layers) if misses_per_step else 0.0
        # the host reads each host key once per weight pass over the rows routed to it (routed / distinct on average)
        host_w = model.host_compute(on_host * passes, pairs=on_host * key_pairs) if on_host else 0.0
        # the hand-off's GPU side (host_wait_row_s), past both lanes; nothing where it is 0 (the same sums as before)
        wait = model.host_wait(rows) if on_host and model.params.host_wait_row_s else 0.0
        phase += weight * (model.layer_expert_time(copy_w, hit_gemm, miss_gemm, host_w) + call + wait)
        copy_l += weight * copy_w
        gemms += weight * (hit_gemm + miss_gemm + call)
        lane += weight * host_w
    dense = sum(model.layer_pre_expert(layer, loads) for layer in range(layers)) + model.head(padded)
    expert_phase = layers * phase
    copy = layers * copy_l
    expert = layers * gemms
    host = model.host_overhead(rows, via_server)
    fixed = model.step_overhead(padded)
    total = host + fixed + dense + expert_phase
    return StepBreakdown(rows, padded, host, fixed, dense, expert, copy, expert_phase - expert, total, layers * lane)
