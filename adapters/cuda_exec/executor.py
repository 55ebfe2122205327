"""CudaGraphExecutor: the fast path of the ModelExecutor port. Decode-only steps replay a CUDA graph
captured per batch bucket (the whole step: embedding, every layer with its expert lookups and miss
gathers, final norm and LM head); prefill and mixed steps run eagerly through the same expert pool.

Shape legend: B padded decode rows (a bucket), W pages per row, V vocab.

The reference TorchExecutor stays the numerical oracle and the CPU path; this executor runs on CUDA
(and, without graphs, in Triton's interpreter on the CPU for the parity tests).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from adapters.checkpoint.loader import LoadedCheckpoint
from adapters.cuda_exec import short_prompts
from adapters.cuda_exec.decode_inputs import DecodeInputs
from adapters.cuda_exec.expert_pool import DeviceExpertPool
from adapters.cuda_exec.fast_decoder import FastDecoder
from adapters.cuda_exec.prefill_graphs import MoeSegments
from adapters.cuda_exec.prefill_linear import a8_weight
from adapters.cuda_exec.prefill_warmup import WarmupReport, plan_warmup, warm_prefill_kernels
from adapters.cuda_exec.routing_replay import DeviceRoutingTable
from adapters.cuda_exec.step_profiler import StepProfiler
from adapters.kernels.dequant_tile import W_LHS_TUNING
from adapters.kernels.grouped_moe import takes_a8
from adapters.kernels.tuned_tiles import tuned_tiles, w_lhs_wins
from adapters.torch_exec import qwen3_5_moe, qwen3_moe
from adapters.torch_exec.executor_pools import ExecutorPools
from adapters.torch_exec.gated_deltanet import LinearStatePool
from adapters.torch_exec.paged_attention import PagedKVCache
from adapters.torch_exec.routing_replay import RoutingReplayer
from adapters.torch_exec.sampler import Sampler
from adapters.torch_exec.step_inputs import check_batch, flatten, upload
from domain.ports import SampledToken, StepBatch
from domain.residency import HOST_LANE_MAX_ROWS, balanced_host_permille, host_key_count
from domain.streamed_prefill import LINK_BYTES_PER_S, pcie_bound_s

if TYPE_CHECKING:
    from adapters.host_kernels.host_lane import HostLane
    from domain.budget import PoolPlan

log = logging.getLogger(__name__)
OPTIONS = {qwen3_5_moe.ARCHITECTURE: qwen3_5_moe.options, qwen3_moe.ARCHITECTURE: qwen3_moe.options}
SCRATCH_PAGES = 1  # padded decode rows write their K/V here (20 KiB x page size for Qwen3.6)


def decode_buckets(max_rows: int) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: powers of two up to max_rows, and max_rows itself."""
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b *= 2
    return (*sizes, max_rows)


def check_fp8_activations(checkpoint: LoadedCheckpoint, prefill_kernels: bool) -> None:
    """Raises ValueError unless --prefill-fp8-activations can apply: the Triton prefill is on and some weight
    (a dense projection or the routed experts) is FP8 with block, tensor or channel scales (ADR 0018)."""
    if not prefill_kernels:
        raise ValueError("FP8 activations are a mode of the Triton prefill: use --prefill-kernels triton with it")
    if not (takes_a8(checkpoint.experts.layout) or any(a8_weight(w) for w in checkpoint.dense.values())):
        raise ValueError(f"FP8 activations need FP8 weights (block, tensor or channel scales); this checkpoint's "
                         f"experts are {checkpoint.experts.layout.fmt.value} and no dense weight is FP8")


class CudaGraphExecutor(ExecutorPools):
    """Implements domain.ports.ModelExecutor (see TorchExecutor for the pools' semantics)."""

    link_bytes_per_s = LINK_BYTES_PER_S  # the host link rate prefill_stats' PCIe bound divides by
    capture_error_mode = "global"  # torch.cuda.graph's: any thread's unsafe CUDA call fails the capture
    # ModelExecutor's launch hook (set by the engine): called once per execute() where the host starts waiting
    on_launched: Callable[[], None] | None = None
    step_profiler: StepProfiler | None = None  # FLUXTIDE_PROFILE_DIR: profiles the steps it picks (step_profiler.py)

    def __init__(self, checkpoint: LoadedCheckpoint, plan: PoolPlan, device: torch.device | str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, sampler_seed: int = 0, max_decode_rows: int = 4,
                 max_context: int | None = None, use_graphs: bool | None = None,
                 on_phase: Callable[[str], None] | None = None, prefill_kernels: bool = False,
                 routing_replay: RoutingReplayer | None = None, max_step_tokens: int = 2048,
                 warm_prefill: bool = False, fp8_activations: bool = False, prefill_graphs: bool = False,
                 step_profiler: StepProfiler | None = None, host_experts: int | str = 0):
        """on_phase(name): told when the first graph capture and the prefill warm-up start and end (start-up
        milestones).
        prefill_kernels: prefill and mixed steps through the Triton prefill kernels (FastDecoder's hooks);
        False keeps the reference token mixers there (--prefill-kernels reference, and what auto picks for weight
        formats the kernels have not been GPU-validated with: domain/prefill_choice.py, ADR 0020).
        routing_replay: replace the routers' top-k choice (benchmark-only; adapters/cuda_exec/routing_replay.py).
        max_step_tokens: the most tokens one step carries (the scheduler's max_step_tokens, --max-prefill-length);
        the prefill warm-up tunes every kernel key a step up to that size can produce.
        warm_prefill: with prefill_kernels on CUDA, tune and compile the Triton prefill at start-up
        (prefill_warmup.py) so no request pays for it (the server asks for it); False leaves that to the
        first steps that need each key (tests, benchmarks with their own warm-up).
        fp8_activations: the Triton prefill's FP8 projections and grouped MoE GEMMs take e4m3 activations per
        128 columns (ADR 0018, --prefill-fp8-activations); needs prefill_kernels and FP8 weights (block,
        tensor or channel scales), else ValueError. Captured decode steps keep bf16 activations.
        prefill_graphs: prefill and mixed steps of up to prefill_graphs.BUCKETS[-1] tokens replay each layer's MoE
        half from a CUDA graph per token bucket, the token mixers eager between them (prefill_graphs.py,
        --prefill-graphs); needs prefill_kernels, else ValueError. Off CUDA (use_graphs False) the same padded
        buffers run eagerly (tests).
        step_profiler: execute() runs the steps it picks under torch.profiler, each leaving a trace and a summary
        (step_profiler.py, FLUXTIDE_PROFILE_DIR); None (the default) costs nothing.
        host_experts: the per mille (0..1000) of each decode lookup's misses computed on the host CPU while the
        link copies the rest (docs/adr/0030-host-expert-compute.md, --host-experts), or "auto": the host's and
        the link's rates measured here and balanced; 0 (the default): off. Needs block-FP8 experts and a C++
        compiler (the host kernel builds at start-up); ValueError otherwise. Outputs are then within fp32 1e-4
        of the other paths, not bitwise (the host sums in its own order)."""
        arch = checkpoint.spec.architecture
        if arch not in OPTIONS:
            raise ValueError(f"architecture {arch!r} is not supported (known: {sorted(OPTIONS)})")
        self.spec = checkpoint.spec
        self._checked_pages: dict = {}  # check_batch's memo of the page tables it found in range
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = FastDecoder(checkpoint.dense, OPTIONS[arch](checkpoint.text_config), dtype, self.device)
        self.model.prepare_fast_path()
        # NOTE: the Triton prefill (mixers, tensor-core projections and grouped MoE GEMMs) runs where the server's
        # --prefill-kernels resolves to it (auto: only the formats GPU runs have validated, ADR 0020); off, every
        # step runs the reference kernels
        self.prefill_kernels = self.model.prefill_kernels = prefill_kernels
        if fp8_activations:
            check_fp8_activations(checkpoint, prefill_kernels)
        self.fp8_activations = self.model.fp8_activations = fp8_activations
        if prefill_graphs and not prefill_kernels:
            raise ValueError("prefill graphs are a mode of the Triton prefill: use --prefill-kernels triton with them")
        self.prefill_graphs = prefill_graphs
        self._segments_ready = False  # set once the prefill kernels are tuned: a capture cannot autotune
        self.bank = checkpoint.experts
        # host copy: a resize rebuilds the pool, and the dense copies are gone from the model
        self.shared_rows = self.model.pack_shared_experts(self.bank.layout)
        self.sampler = Sampler(sampler_seed)
        self.max_decode_rows = max_decode_rows
        # short prompt chunks as decode replays (domain/short_prompt_replays.py, ADR 0026): chunks of up to this many
        # tokens (FLUXTIDE_SHORT_PROMPT_REPLAYS); 0 off
        self.short_prompt_tokens: int = short_prompts.MAX_TOKENS
        self.max_context = max_context or self.spec.max_context
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if routing_replay is not None and (routing_replay.num_layers, routing_replay.top_k) != (
                len(self.model.mixers), self.model.opts.top_k):
            raise ValueError(f"routing replay for L={routing_replay.num_layers} K={routing_replay.top_k}, the model "
                             f"routes top-{self.model.opts.top_k} in {len(self.model.mixers)} layers")
        self.routing_replay = routing_replay
        self.replay_table: DeviceRoutingTable | None = None
        self.kv: PagedKVCache | None = None
        self.state: LinearStatePool | None = None
        self.experts: DeviceExpertPool | None = None
        self.plan: PoolPlan | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self._side_stream = None  # the captures' warm-up stream (_warmup_stream), made on first use
        # (hits, misses) as of the end of the last step: a captured step reads them back with its tokens
        self._host_counters: tuple[int, int] | None = None
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {max_step_tokens}")
        self.max_step_tokens = max_step_tokens
        self.warmup: WarmupReport | None = None
        self.step_profiler = step_profiler
        self._on_phase = on_phase
        self.host_lane: HostLane | None = self._start_host_lane(host_experts)  # before the pools: they take it
        self.resize_pools(plan)
        if warm_prefill:
            self._warm_prefill()
        self._segments_ready = True
        self._build_segments()
        self._on_phase = None  # later captures (after a resize) are not start-up phases

    # ---- pools -------------------------------------------------------------------------------------
    def resize_pools(self, plan: PoolPlan) -> None:
        """As TorchExecutor.resize_pools (frees before it allocates; a rebuilt expert pool that holds every key
        is filled from the host bank before anything else runs: ExecutorPools._preload_experts), the graphs
        dropped first (they hold the step's activations), then the decode inputs sized and the graphs captured
        again."""
        self.graphs = {}
        self.model.segments = None  # its graphs hold activations and read the old pools: dropped first too
        self.model._chunk_plan = None  # a layered chunk's tables: the chunk goes with the pools (_swap_pools)
        self.inputs = None
        self._host_counters = None
        self._swap_pools(plan)
        self.decode_rows = self._decode_rows(plan)
        # the decode buckets' projections through the tensor-core GEMM from a few rows up (FastDecoder)
        self.model.decode_gemm_rows = self.decode_rows if self.device.type == "cuda" else 0
        pages_per_row = -(-min(self.max_context, plan.kv_pages * plan.page_size) // plan.page_size)
        self.model.decode_pages = pages_per_row  # mixed steps' one-token rows: the graphs' page-table width
        self.inputs = DecodeInputs(max(self.decode_rows, 1), pages_per_row, plan.page_size,
                                   scratch_row=plan.kv_pages * plan.page_size, device=self.device)
        if self.routing_replay is not None:
            self.replay_table = DeviceRoutingTable(self.inputs.rows, len(self.model.mixers), self.model.opts.top_k,
                                                   self.device)
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """The decode graphs and the prefill MoE segments captured again over the pools as they are (the old ones
        dropped by the caller): after a resize, and after the host lane is turned off."""
        if self.use_graphs and self.decode_rows > 0:
            self._capture()
        if self._segments_ready:
            self._build_segments()

    def _build_segments(self) -> None:
        """The MoE segments of short prefill steps (prefill_graphs.py), captured on CUDA; none without
        prefill_graphs, with routing replay (it rewrites ids between router and lookup) or an expert shard."""
        if not self.prefill_graphs or self.routing_replay is not None or self.experts.shard is not None:
            return
        segments = MoeSegments(self.model, self.experts, use_graphs=self.use_graphs)
        if self.use_graphs and segments.buckets:
            start = time.perf_counter()
            segments.capture(self._warmup_stream())
            log.info("captured prefill MoE graphs for token buckets %s x %d layers in %.1f s", segments.buckets,
                     len(self.model.mixers), time.perf_counter() - start)
        self.model.segments = segments

    def _decode_rows(self, plan: PoolPlan) -> int:
        """The largest decode batch a graph is captured for: every row's top-k fits the pool at once (the
        one-launch lookup's bound) and has a state slot."""
        return min(self.max_decode_rows, self.experts.num_slots // self.model.opts.top_k,
                   plan.state_slots if self.state is not None else self.max_decode_rows)

    def _kv_pool_pages(self, plan: PoolPlan) -> int:
        return plan.kv_pages + SCRATCH_PAGES

    def _new_kv(self, plan: PoolPlan) -> PagedKVCache:
        attn = self.model.opts.attention
        return PagedKVCache(len(self.model.full_layers), self._kv_pool_pages(plan), plan.page_size,
                            attn.num_kv_heads, attn.head_dim, self.dtype, self.device)

    def _new_state(self, plan: PoolPlan) -> LinearStatePool:
        return LinearStatePool(len(self.model.linear_layers), plan.state_slots, self.model.opts.gdn, self.dtype,
                               self.device)

    def _staging_slots(self, plan: PoolPlan) -> int:
        return plan.staging_experts

    def _new_experts(self, plan: PoolPlan) -> DeviceExpertPool:
        pool = DeviceExpertPool(self.bank, self._expert_slots(plan), self.device, self.shared_rows,
                                grouped=self.prefill_kernels, staging_slots=self._staging_slots(plan),
                                fp8_activations=self.fp8_activations)
        pool.use_host_lane(self.host_lane)
        return pool

    # ---- the host lane (docs/adr/0030-host-expert-compute.md) --------------------------------------------
    def _start_host_lane(self, host_experts: int | str) -> HostLane | None:
        """The started host lane of --host-experts PERMILLE|auto, or None for 0. Raises ValueError for another
        value, experts that are not block FP8, a bank without rows in memory, or a host kernel that does not build."""
        self.host_lane_rates: dict | None = None  # what auto measured (GB/s), for records and logs
        self._auto_host_gb_s: float | None = None  # auto: the lane's rate, until the link's is measured
        if host_experts != "auto":
            host_key_count(0, host_experts)  # an int in 0..1000, else ValueError
            if not host_experts:
                return None
        from adapters.host_kernels import host_lane

        if self.bank.rows is None:
            raise ValueError("--host-experts computes experts from the host bank's rows; --mmap-experts has none")
        built, why = host_lane.available()
        if not built:
            raise ValueError(f"--host-experts: the host expert kernel does not build here ({why})")
        keys = self.bank.num_layers * self.bank.num_experts
        row_of_key = torch.arange(keys) if self.bank.row_of_key is None else torch.tensor(self.bank.row_of_key)
        threads, rows = self._host_lane_threads(), self._host_lane_rows()
        try:
            lane = host_lane.HostLane(self.bank.rows, self.bank.layout, row_of_key, self.model.opts.top_k,
                                      min(rows, self.max_decode_rows), self.device, threads=threads,
                                      team=self._host_lane_team(), share=1000 if host_experts == "auto" else host_experts)
        except ValueError as exc:
            raise ValueError(f"--host-experts: {exc}") from exc
        lane.start()
        if host_experts == "auto":  # the share follows once a pool has measured the link (_measure_expert_gather)
            lane.warm_up(requests=400)  # ~0.2 s at the H100 machine's rate
            self._auto_host_gb_s = lane.measure()
        return lane

    def _measure_expert_gather(self) -> None:
        """ExecutorPools' measure of a fresh pool's gather rates, then --host-experts auto's share from the two
        lanes' rates: the gather kernel's (how the decode step's misses land; measured here off CUDA too, where the
        base class leaves it) and the host lane's. Runs before the pool's graphs are captured, at every rebuild."""
        super()._measure_expert_gather()
        lane, host_gb_s = self.host_lane, self._auto_host_gb_s
        if lane is None or host_gb_s is None:
            return
        link_gb_s = (self.expert_gather or self.experts.gather_rate())["kernel_gb_s"]
        lane.share = balanced_host_permille(host_gb_s, link_gb_s)
        self.host_lane_rates = {"host_gb_s": round(host_gb_s, 2), "link_gb_s": link_gb_s, "threads": lane.threads}
        log.info("--host-experts auto: the host computes experts at %.1f GB/s with %d threads, the gather kernel "
                 "copies %.1f GB/s: %d per mille of the misses go to the host", host_gb_s, lane.threads, link_gb_s,
                 lane.share)

    @property
    def host_share(self) -> int:
        """The per mille of decode lookups' misses the host lane computes (0: no lane, or turned off)."""
        return 0 if self.host_lane is None else self.host_lane.share

    @staticmethod
    def _host_lane_threads() -> int:
        """The host lane's team: FLUXTIDE_HOST_LANE_THREADS, else every core but one (the engine's thread keeps one).
        With the spin team 15 and 12 threads of the H100 machine's 16 gave the same bs1 step (9.40 / 9.52 ms, p90
        10.3 / 10.0; docs/fast-decode.md, session 39); session 38's stalls at 15 were OpenMP's team."""
        cores = len(os.sched_getaffinity(0))
        value = os.environ.get("FLUXTIDE_HOST_LANE_THREADS")
        if value is None:
            return max(1, cores - 1)
        if not value.isdecimal() or not 1 <= int(value) <= cores:
            raise ValueError(f"FLUXTIDE_HOST_LANE_THREADS must be a thread count in 1..{cores}, got {value!r}")
        return int(value)

    @staticmethod
    def _host_lane_rows() -> int:
        """The largest decode call (rows, a graph's bucket) the host lane serves: FLUXTIDE_HOST_LANE_ROWS, else
        domain.residency.HOST_LANE_MAX_ROWS; the lane's mailbox holds that many rows (at most max_decode_rows), so the
        pool copies every miss of a larger call (DeviceExpertPool._host_lane_for)."""
        value = os.environ.get("FLUXTIDE_HOST_LANE_ROWS")
        if value is None:
            return HOST_LANE_MAX_ROWS
        if not value.isdecimal() or int(value) < 1:
            raise ValueError(f"FLUXTIDE_HOST_LANE_ROWS must be a positive row count, got {value!r}")
        return int(value)

    @staticmethod
    def _host_lane_team() -> str:
        """The host lane's kind of team: FLUXTIDE_HOST_LANE_TEAM, spin (the default: workers that poll between a step's
        layers) or openmp (ATen's parallel_for, whose workers sleep between requests when threads outnumber cores). On
        the H100 machine at 24 GiB, 423 per mille, bs1: spin 9.40 ms a step, openmp 13.54, no lane 11.45 (ADR 0030,
        "Session 39")."""
        from adapters.host_kernels.host_lane import TEAMS

        value = os.environ.get("FLUXTIDE_HOST_LANE_TEAM", "spin")
        if value not in TEAMS:
            raise ValueError(f"FLUXTIDE_HOST_LANE_TEAM must be one of {', '.join(TEAMS)}, got {value!r}")
        return value

    def _lane_error(self) -> torch.Tensor:
        """int64 [1], the host lane's device error word, to read back with a step's tokens; [0] without a lane."""
        if self.host_lane is None:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self.host_lane.state[2:3]

    def _check_host_lane(self, error_words: list[int] | None = None) -> None:
        """After a step: where the host lane failed it (a wait gave up or the host refused a request), the lane
        is turned off (the graphs captured again without it) and RuntimeError fails the step's requests; the
        next steps copy every miss. error_words: the `_lane_error` read back with the step's tokens (None: read
        it now, a host sync)."""
        lane = self.host_lane
        if lane is None:
            return
        words = self._lane_error().tolist() if error_words is None else error_words
        if not words or not words[0]:
            return
        device_error, host_error = lane.device_error(), lane.host_error()
        lane.stop()
        self.host_lane = None
        self.experts.use_host_lane(None)
        self.graphs = {}
        self.model.segments = None
        self._capture_graphs()
        log.error("the host expert lane failed (%s, host: %s): --host-experts is off from now on",
                  device_error, host_error)
        raise RuntimeError(f"the host expert lane failed this step ({device_error[0].name}, host "
                           f"{host_error[0].name}); it is off from now on, later steps copy every miss")

    def _capture(self) -> None:
        """One graph per bucket, captured on all-padded rows (nothing routes, no pool is written)."""
        start = time.perf_counter()
        buckets = decode_buckets(self.decode_rows)
        if self._on_phase is not None:
            self._on_phase(f"capturing decode graphs for batch sizes {', '.join(map(str, buckets))}")
        with torch.inference_mode():
            self.experts.tune(torch.randn(1, self.model.opts.hidden, dtype=self.dtype, device=self.device),
                              self.model.opts.top_k, rows=buckets)
        stream = self._warmup_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            # warm-up: compiles the Triton kernels, creates cuBLAS handles, and tunes the kernels autotuned
            # per row count (rms_norm_router, the decode buckets' dense_gemm) at every bucket's T, since no
            # capture may measure (rms_norm_router would fall back to its default tile inside one)
            for b in buckets:
                self._set_replay_rows(b)
                self.model.decode_step(self.inputs.view(b), self.kv, self.state, self.experts)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._before_capture()
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(buckets, reverse=True):  # largest first: smaller graphs reuse its memory pool
            graph = torch.cuda.CUDAGraph()
            self._set_replay_rows(b)
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode), \
                    torch.inference_mode():
                logits, tokens = self.model.decode_step(self.inputs.view(b), self.kv, self.state, self.experts)
            self.graphs[b] = (graph, logits, tokens)
        self.model.replay_ids = None
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured decode graphs for batch sizes %s in %.1f s", buckets, self.capture_seconds)
        if self._on_phase is not None:
            self._on_phase(f"decode graphs captured in {self.capture_seconds:.1f} s")

    def _warmup_stream(self) -> torch.cuda.Stream:
        """The side stream every capture's eager warm-up runs on, made once per executor.
        NOTE: cuBLAS keeps a workspace (32 MiB on Hopper) per (handle, stream) for the life of the process; a
        fresh stream per capture left one more behind at every resize's recapture (decode graphs and prefill
        segments: a resize's peak 32-64 MiB over its planned ceiling in tests/app/test_gpu_serve.py, H200)."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    def _before_capture(self) -> None:
        """Hook between the eager warm-up steps (kernels compiled and tuned) and the capture; nothing here."""

    def _warm_prefill(self) -> None:
        """Tune and compile every Triton prefill kernel key a step can produce (prefill_warmup.py), timed
        and reported like the graph capture. Runs once, at start-up: a resize changes no key (slot counts are
        not specialized on), except that a pool of fewer than MAX_KEYS slots that grows lets bigger chunks
        take the one-launch lookup, whose new block sizes then compile on first use."""
        if not self.prefill_kernels or self.device.type != "cuda":
            why = "the reference prefill runs (--prefill-kernels reference)" if not self.prefill_kernels else \
                f"{self.device.type} runs the kernels without autotuning or compiling ahead"
            log.info("prefill kernel warm-up skipped: %s", why)
            return
        # the most sequences a step can carry (the scheduler's max_running): decode rows of a mixed step
        running = min(self.max_decode_rows, self.plan.state_slots) if self.state is not None else self.max_decode_rows
        if running < 1:
            log.info("prefill kernel warm-up skipped: the pools admit no sequence")
            return
        plan = plan_warmup(self.model, self.experts, self.max_step_tokens, running)
        if self._on_phase is not None:
            self._on_phase(f"tuning prefill kernels: {len(plan.items())} keys for steps of up to "
                           f"{self.max_step_tokens} tokens")
        self.warmup = warm_prefill_kernels(self.model, self.experts, plan, page_size=self.plan.page_size,
                                           dtype=self.dtype, device=self.device)
        log.info("prefill kernels tuned in %.1f s (%d dense GEMM, %d GEMV, %d grouped MoE keys, %d scratch steps"
                 "%s)", self.warmup.seconds, len(plan.gemm), len(plan.gemv), len(plan.grouped), len(plan.forwards),
                 f"; out of memory: {', '.join(self.warmup.skipped)}" if self.warmup.skipped else "")
        if W_LHS_TUNING:  # the log says where the weight-as-left tiles won (FLUXTIDE_PREFILL_W_LHS=0: not tried)
            # NOTE: after the decode graphs' capture, whose split-K keys were tuned before it: both are counted
            log.info("W_LHS tiles chosen for %d of %d tuned GEMM keys (prefill and decode)",
                     *w_lhs_wins(tuned_tiles()))
        if self._on_phase is not None:
            self._on_phase(f"prefill kernels tuned in {self.warmup.seconds:.1f} s")

    # ---- execution ---------------------------------------------------------------------------------
    def can_execute(self, batch: StepBatch) -> str | None:
        slots = self.state.num_slots if self.state is not None else None
        reason = check_batch(batch, self.plan.page_size, self.plan.kv_pages, slots, self._snapshot_slots(),
                             self._checked_pages, num_layers=len(self.model.mixers))
        return reason if reason is not None else self._chunk_reason(batch)

    def _decode(self, works) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits [n, V], greedy tokens [n]) of n single-token works, by graph replay (or eagerly)."""
        n = len(works)
        self._prepare_states(works)  # prefix cache: reset, or restore a snapshot (ExecutorPools)
        self.inputs.stage(works, self.state is not None)
        if self.replay_table is not None:
            self.replay_table.stage(self.routing_replay.step_table(works), n)
        if self.graphs:
            bucket = next(b for b in sorted(self.graphs) if b >= n)
            graph, logits, tokens = self.graphs[bucket]
            graph.replay()
            self._take_end_snapshots(works)  # prefix cache: eager copies after the replay, same stream
            return logits[:n], tokens[:n]
        self._set_replay_rows(n)
        try:
            with torch.inference_mode():
                logits, tokens = self.model.decode_step(self.inputs.view(n), self.kv, self.state, self.experts)
        finally:
            self.model.replay_ids = None
        self._take_end_snapshots(works)
        return logits, tokens

    def _set_replay_rows(self, n: int) -> None:
        """decode_step's replacement ids: the static table's first n rows (a graph captures that storage)."""
        self.model.replay_ids = self.replay_table.view(n) if self.replay_table is not None else None

    def _is_graph_works(self, works) -> bool:
        """Whether `works` run as one decode step (`_decode`: a captured graph on CUDA): one sampled token each,
        no more than the largest bucket, no layer group."""
        return 0 < len(works) <= self.decode_rows and all(
            len(w.token_ids) == 1 and w.sample and w.layers is None for w in works)

    @torch.inference_mode()
    def compute_logits(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        """fp32 logits [1, V] for the last token of each work with sample=True. A layered work runs as a forward
        of its own over its layer group, after the other works (a decode step, or one forward over every layer)."""
        reason = self.can_execute(batch)
        if reason is not None:
            raise ValueError(f"cannot execute step: {reason}")
        self._host_counters = None  # this step moves them: read from the device when next asked for
        group, works = self._split_layered(batch)
        out = {}
        replays = self._replays(works) if group is None else None
        if replays is not None:
            finals, rows, _ = self._replay_rows(replays)
            out = {w.request_id: rows[i:i + 1] for i, w in enumerate(finals)}
        elif self._is_graph_works(works):
            logits, _ = self._decode(works)
            # NOTE: a graph's logits live in its static output, which the next replay overwrites
            out = {w.request_id: logits[i:i + 1].clone() for i, w in enumerate(works)}
        elif works:
            out = self._forward_logits(works)
        if group is not None:
            out.update(self._group_logits(group))
        return out

    def _forward_logits(self, works) -> dict[str, torch.Tensor]:
        """compute_logits for works without a layer group, eagerly: one forward over every layer."""
        inp = flatten(StepBatch(works), self.device)
        self._prepare_states(works)  # prefix cache (ExecutorPools)
        self.model.replay_ids = self._replay_ids(works)
        try:
            with self.experts.streamed_step():  # prefill chunks stream experts past the LRU (ADR 0010)
                hidden = self.model.forward(inp, self.kv, self.state, self.experts, self.snapshots)  # [T, H]
        finally:
            self.model.replay_ids = None
        self._take_end_snapshots(works)
        wanted = [s for s in inp.spans if s.work.sample]
        if not wanted:
            return {}
        rows = upload(torch.tensor([s.offset + s.length - 1 for s in wanted]), self.device)
        logits = self.model.logits(hidden[rows])  # [n, V]
        return {s.work.request_id: logits[i:i + 1] for i, s in enumerate(wanted)}

    def _group_logits(self, group) -> dict[str, torch.Tensor]:
        """A layer group's forward (ExecutorPools._run_group): {rid: fp32 [1, V]} when it ends its chunk and
        samples, else {}."""
        hidden = self._run_group(group)  # [T, H] after the chunk's last group, else None
        if hidden is None or not group.sample:
            return {}
        return {group.request_id: self.model.logits(hidden[-1:])}

    def _group_forward(self, chunk, layers: tuple[int, int]) -> torch.Tensor:
        """ExecutorPools._group_forward in a streamed step of its own: the group's non-resident experts are
        staged past the LRU (ADR 0010), whatever the other works of the step did to the residency."""
        with self.experts.streamed_step(layers):  # rounds for the group's layers only: none prefetched past it
            return super()._group_forward(chunk, layers)

    def execute(self, batch: StepBatch) -> dict[str, SampledToken]:
        profiler = self.step_profiler
        if profiler is not None and profiler.wants(batch):  # NOTE: the whole step, a layer group's included
            return profiler.profile(batch, self._execute, self)
        return self._execute(batch)

    def _execute(self, batch: StepBatch) -> dict[str, SampledToken]:
        works = {w.request_id: w for w in batch.works}
        out: dict[str, SampledToken] = {}
        group = batch.layered
        if self._is_graph_works(batch.works if group is None else [w for w in batch.works if w is not group]):
            return self._execute_decodes(batch)
        replays = self._replays(batch.works) if group is None else None
        if replays is not None:
            return self._execute_replays(batch, replays)
        if self.on_launched is not None:  # an eager step launches and waits as it goes
            self.on_launched()
        logits = self.compute_logits(batch)
        self._check_host_lane()  # an eager step's layers may have used it too (a host sync: eager steps wait anyway)
        wanted = [works[rid] for rid in logits if works[rid].sample]
        if not wanted:
            return out
        # NOTE: every sampled row's token in one batch and one device->host read, as the graph step does:
        # drawn row by row, a step of N prompts waited N times on the device (one argmax and .item() each)
        rows = torch.cat([logits[w.request_id] for w in wanted]).float()  # [n, V]
        return self._sampled(wanted, rows, self._draw(wanted, rows, torch.argmax(rows, dim=-1)).tolist())

    def _execute_decodes(self, batch: StepBatch) -> dict[str, SampledToken]:
        """execute() for a step whose works (but its layered one, if any) are one decode step: the captured graph
        is launched, the engine's launch hook runs while the device computes, then the layer group (if any) runs
        eagerly after it, and every token and the expert counters come back in one device->host copy."""
        reason = self.can_execute(batch)
        if reason is not None:
            raise ValueError(f"cannot execute step: {reason}")
        self._host_counters = None
        group, decodes = self._split_layered(batch)
        with torch.inference_mode():
            logits_rows, tokens = self._decode(decodes)
            tokens = self._draw(decodes, logits_rows, tokens)
        if self.on_launched is not None:  # the engine streams the last step's tokens while this one runs
            self.on_launched()
        done = [*decodes]
        if group is not None:
            with torch.inference_mode():
                sampled = self._group_logits(group)  # {rid: [1, V]} when it ends its chunk and samples
            if sampled:  # the chunk's token drawn with the decodes' (one read-back)
                row = sampled[group.request_id].float()
                logits_rows = torch.cat((logits_rows, row))  # [n + 1, V]
                tokens = torch.cat((tokens, self._draw([group], row, torch.argmax(row, dim=-1))))
                done.append(group)
        # every row's token and the expert cache's counters in one device->host copy (a second read would
        # cost a second wait on the engine's path between two steps); log-probabilities only where asked for
        n = len(tokens)
        drawn = torch.cat((tokens, self.experts.residency.counters_tensor[:2], self._lane_error())).tolist()
        self._host_counters = (drawn[n], drawn[n + 1])
        self._check_host_lane(drawn[n + 2:])
        return self._sampled(done, logits_rows, drawn[:n])

    def short_prompt_limit(self) -> int:
        """The longest prompt chunk (tokens) a step runs as decode replays; 0: none (ADR 0026). The same at every
        pool plan: where the choice followed the plan, output differed between expert-slot counts.
        NOTE: 0 with a routing replay or expert parallelism, as the prefill graphs are (`_build_segments`):
        neither has been made to follow a step's rows replay by replay (with a routing replay the fast path's
        tokens left the reference's: tests/adapters/test_routing_replay.py)."""
        if self.routing_replay is not None or (self.experts is not None and self.experts.shard is not None):
            return 0
        return self.short_prompt_tokens

    def _replays(self, works) -> list[list[short_prompts.Row]] | None:
        """The decode replays that compute `works` (short_prompts.unroll), or None where the step is not for them."""
        return short_prompts.unroll(works, self.short_prompt_limit(), self.decode_rows)

    def _replay_rows(self, replays: list[list[short_prompts.Row]],
                     launched: Callable[[], None] | None = None) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Run the replays in order: (the works whose last row samples, their fp32 logits [n, V], tokens [n]).
        launched: called once the first replay is launched (the engine's launch hook)."""
        finals, logits, tokens = [], [], []
        for r, rows in enumerate(replays):
            step_logits, step_tokens = self._decode([row.work for row in rows])
            if r == 0 and launched is not None:
                # NOTE: here, not after the last replay: restaging a row whose pages changed waits for the replay
                # before it (a blocking page-table copy), so a hook run after the last launch streamed the step
                # before's tokens only once nearly every replay had run (session 32, 24 GiB: the streams' gap
                # around a 4-token tail's ~88 ms step was ~132 ms, the next one ~30)
                launched()
            for i, row in enumerate(rows):
                if row.last and row.source.sample:
                    # NOTE: copies: a graph's outputs are static buffers the next replay overwrites
                    finals.append(row.source)
                    logits.append(step_logits[i:i + 1].clone())
                    tokens.append(step_tokens[i:i + 1].clone())
        if not finals:
            return [], torch.empty(0), torch.empty(0, dtype=torch.int64)
        return finals, torch.cat(logits), torch.cat(tokens)

    def _execute_replays(self, batch: StepBatch, replays) -> dict[str, SampledToken]:
        """execute() for a step of short prompt chunks (and decodes) as decode replays (ADR 0026): every sampled
        token and the expert counters come back in one device->host copy, as a decode step's."""
        reason = self.can_execute(batch)
        if reason is not None:
            raise ValueError(f"cannot execute step: {reason}")
        self._host_counters = None
        with torch.inference_mode():
            # the engine streams the last step's tokens once the first replay runs, as after a decode step's launch
            finals, logits_rows, tokens = self._replay_rows(replays, self.on_launched)
            if finals:
                tokens = self._draw(finals, logits_rows, tokens)
        if not finals:  # no chunk ends here (no row samples): the counters are read when asked for
            self._check_host_lane()
            return {}
        n = len(finals)
        drawn = torch.cat((tokens, self.experts.residency.counters_tensor[:2], self._lane_error())).tolist()
        self._host_counters = (drawn[n], drawn[n + 1])
        self._check_host_lane(drawn[n + 2:])
        return self._sampled(finals, logits_rows, drawn[:n])

    def _sampled(self, works, logits_rows: torch.Tensor, drawn: list[int]) -> dict[str, SampledToken]:
        """Each work's SampledToken from the step's drawn tokens (drawn[i] for logits_rows [n, V] row i);
        a row asking for log-probabilities, or whose batched draw failed (-1), is sampled alone (its error
        stays its own)."""
        out = {}
        for i, w in enumerate(works):
            p = w.sampling
            if drawn[i] >= 0 and not (p.logprobs or p.top_logprobs):
                out[w.request_id] = SampledToken(w.request_id, drawn[i])
            else:
                out[w.request_id] = self._sample(w.request_id, logits_rows[i], w, drawn[i] if drawn[i] >= 0 else None)
        return out

    def expert_counters(self) -> tuple[int, int]:
        """Cumulative (expert hits, expert misses) as of the last step's end: from the captured step's
        read-back, else one device read (after an eager step, a resize, or before any step)."""
        if self._host_counters is None:
            self._host_counters = self.experts.counters()
        return self._host_counters

    def prefill_stats(self) -> dict:
        """The streamed prefill's cumulative counts (DeviceExpertPool.streaming_stats) and its PCIe bound:
        bytes of routed experts that were not resident / `link_bytes_per_s` (seconds). One device read."""
        stats = self.experts.streaming_stats()
        return {**stats, "link_bytes_per_s": self.link_bytes_per_s,
                "pcie_bound_s": pcie_bound_s(stats["bytes_not_resident"], self.link_bytes_per_s)}

    def _draw(self, works, logits_rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n] with the non-greedy rows drawn on the device in one batch (Sampler.sample_batch);
        the greedy rows keep the graph's argmax. A failed draw marks its rows -1."""
        rows = [i for i, w in enumerate(works) if not _greedy(w.sampling)]
        if not rows:
            return tokens
        tokens = tokens.clone()
        idx = torch.tensor(rows, device=tokens.device)
        try:
            tokens[idx] = self.sampler.sample_batch(logits_rows[idx], [works[i].sampling for i in rows],
                                                    [works[i].output_index for i in rows])
        except Exception:  # NOTE: confined: those rows go through the per-row path, which reports errors
            tokens[idx] = -1
        return tokens

    def check_valid(self) -> None:
        self._check_pools()
        if self.routing_replay is not None:
            self.routing_replay.check_valid()

def _greedy(p) -> bool:
    return p.temperature == 0.0 or p.top_k == 1

